"""Speed machinery, handed in from outside the paper's modules (docs/performance.md).

An entry point chooses its `Kernels` for the device and hands them on, in the order build ->
to(device) -> kernels -> compile -> DDP: `kernels.apply(model)` gives the model with the CPU kernels'
modules in place of the plain ones (the same parameters, state_dict keys and functions);
`kernels.products` computes the linear maps that the loss and the search make themselves, and packs
the weights decoding multiplies by once for a translation session (in 8 bits for precision=int8).
`keep_freed_memory` and `cache_onednn_kernels` keep a CPU run's memory and oneDNN kernels from one
batch to the next.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from transformer.attention import MultiHeadAttention
from transformer.kernels.cpu import NoiseDropout, OneDNNFeedForward, OneDNNLinear, ShortAttention
from transformer.kernels.memory import cache_onednn_kernels, keep_freed_memory
from transformer.kernels.onednn import Products
from transformer.layers import FeedForward
from transformer.replace import replaced, shallow_copy

M = TypeVar("M", bound=nn.Module)


class Kernels:
    """Which CPU kernels a model runs with: float32 products on oneDNN (`onednn`), dropout masks drawn
    from noise (`noise_dropout`), short attention written out (`short_attention`)."""

    def __init__(self, onednn: bool = False, noise_dropout: bool = False, short_attention: bool = False):
        self.onednn, self.noise_dropout, self.short_attention = onednn, noise_dropout, short_attention
        self.products = Products(onednn)

    @classmethod
    def for_device(cls, device: torch.device) -> Kernels:
        """Every CPU kernel on a CPU; none elsewhere."""
        cpu = device.type == "cpu"
        return cls(onednn=cpu, noise_dropout=cpu, short_attention=cpu)

    def apply(self, model: M) -> M:
        """A copy of the model (the same parameters) with these kernels' modules in place."""
        return replaced(model, self._replacement)

    def _replacement(self, module: nn.Module) -> nn.Module | None:
        kind = type(module)
        if self.onednn and kind is nn.Linear:
            return shallow_copy(module, OneDNNLinear, products=self.products)
        if self.onednn and kind is FeedForward:
            return shallow_copy(module, OneDNNFeedForward, products=self.products)
        if self.noise_dropout and kind is nn.Dropout:
            return shallow_copy(module, NoiseDropout)
        if self.short_attention and kind is MultiHeadAttention:
            return shallow_copy(module, ShortAttention)
        return None


__all__ = ["Kernels", "Products", "cache_onednn_kernels", "keep_freed_memory"]
