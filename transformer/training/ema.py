"""An exponential moving average of the weights (`trainer.ema_decay`; Polyak averaging, as fairseq's
`--store-ema` and Marian's `--exponential-smoothing`; not in the paper): float32 copies of the
parameters, moved towards them after every optimizer step. A checkpoint's `model` holds the average, so
that validation, the best checkpoint, averaging, the finish stage and translation all use it; the
trained weights that resuming needs go beside it (`checkpoint.TRAINED`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn


class EMA:
    """The average of a model's parameters, in float32."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.params = [p for p in model.parameters() if p.is_floating_point()]
        self.average = [p.detach().float().clone() for p in self.params]

    def decay_at(self, step: int) -> float:
        """The decay after optimizer step `step` (1-based): min(decay, (1 + step) / (10 + step)), as
        TensorFlow's ExponentialMovingAverage with num_updates, so early weights do not linger."""
        return min(self.decay, (1 + step) / (10 + step))

    @torch.no_grad()
    def update(self, step: int) -> None:
        """average <- d average + (1 - d) weights, after optimizer step `step`."""
        weights = [p.detach().float() for p in self.params]
        torch._foreach_lerp_(self.average, weights, 1.0 - self.decay_at(step))

    @contextmanager
    @torch.no_grad()
    def swapped(self) -> Iterator[None]:
        """The model holds the average within (validation), its trained weights again after."""
        trained = [p.detach().clone() for p in self.params]
        torch._foreach_copy_(self.params, self.average)
        try:
            yield
        finally:
            torch._foreach_copy_(self.params, trained)

    def state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """The model's state_dict with the average in place of each parameter (cast to its dtype)."""
        average = {id(p): a for p, a in zip(self.params, self.average)}
        return {
            name: average[id(t)].to(t.dtype).clone() if id(t) in average else t.detach().clone()
            for name, t in model.state_dict(keep_vars=True).items()
        }

    def load_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        """The average of a checkpoint's `model` (`state_dict`'s form)."""
        names = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}
        for p, a in zip(self.params, self.average):
            a.copy_(state[names[id(p)]])
