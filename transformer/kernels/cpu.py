"""The CPU kernels as module swaps (docs/performance.md, "CPU kernels"):

- `nn.Linear` -> `OneDNNLinear`, `FeedForward` -> `OneDNNFeedForward`: float32 products on oneDNN;
- `nn.Dropout` -> `NoiseDropout`: the mask drawn from uniform noise;
- `MultiHeadAttention` -> `ShortAttention`: short attention written out instead of the fused kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from transformer.attention import MultiHeadAttention, reference_attention
from transformer.kernels.onednn import OneDNNFeedForward, OneDNNLinear
from transformer.layers import FeedForward

# attention over at most SHORT_KEYS keys, and at inference that of at most FEW_QUERIES queries per row
# (a decoding step), is written out
SHORT_KEYS = 64
FEW_QUERIES = 16


class NoiseDropout(nn.Dropout):
    """Dropout with the mask drawn as uniform noise u, kept where u >= p: the same distribution as
    `nn.Dropout`'s Bernoulli draws."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        with torch.no_grad():  # the noise becomes the mask in place: 1 / (1 - p) where u >= p, else 0
            mask = torch.rand_like(x).ge_(self.p).mul_(1.0 / (1.0 - self.p))
        return x * mask


class ShortAttention(MultiHeadAttention):
    """`MultiHeadAttention` with short attention written out (`reference_attention`); compiled code
    keeps the fused kernel."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        short = not torch.compiler.is_compiling() and (  # sizes read only outside compiled code
            k.size(2) <= SHORT_KEYS or (q.size(2) <= FEW_QUERIES and not torch.is_grad_enabled())
        )
        if not short:
            return super().attend(q, k, v, mask, causal)
        return reference_attention(q, k, v, mask, causal, self.dropout if self.training else 0.0)[0]


SWAPS = {
    nn.Linear: OneDNNLinear,
    FeedForward: OneDNNFeedForward,
    nn.Dropout: NoiseDropout,
    MultiHeadAttention: ShortAttention,
}


def apply_cpu_kernels(model: nn.Module) -> nn.Module:
    """Swap in the CPU kernels, in place, for every module of a CPU model; returns the model."""
    for module in model.modules():
        module.__class__ = SWAPS.get(type(module), type(module))
    return model
