"""Training (§5): label-smoothed loss, the learning-rate schedule, checkpoints and the train loop."""

from transformer.training.loop import train
from transformer.training.policy import TrainingError, TrainingStopped

__all__ = ["TrainingError", "TrainingStopped", "train"]
