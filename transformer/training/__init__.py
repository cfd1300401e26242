"""Training (§5): label-smoothed loss, the learning-rate schedule, checkpoints and the train loop."""

from transformer.training.loop import TrainingError, TrainingStopped, train

__all__ = ["TrainingError", "TrainingStopped", "train"]
