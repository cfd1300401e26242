"""Training (§5): label-smoothed loss, the learning-rate schedule, checkpoints and the train loop."""

from transformer.training.loop import TrainingError, train

__all__ = ["TrainingError", "train"]
