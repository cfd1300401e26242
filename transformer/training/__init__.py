"""Training (§5): the train loop, its corpus, state, step and policy; label-smoothed loss, the
learning-rate schedule, devices and data parallelism, monitoring."""

from transformer.training.loop import train
from transformer.training.policy import TrainingError, TrainingStopped

__all__ = ["TrainingError", "TrainingStopped", "train"]
