"""Training (§5): a run planned (plan.py), then executed by the loop (loop.py) with its corpus, state,
step and policy; label-smoothed loss, the learning-rate schedule, devices and data parallelism,
monitoring; the finish stage after the last step."""

from transformer.training.loop import Parts, train
from transformer.training.plan import Plan
from transformer.training.policy import TrainingError, TrainingStopped

__all__ = ["Parts", "Plan", "TrainingError", "TrainingStopped", "train"]
