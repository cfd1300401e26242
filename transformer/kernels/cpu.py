"""The CPU kernels as module replacements (docs/performance.md, "CPU kernels"), each computing the
same function as the module it replaces, with the same parameters:

- `nn.Linear` -> `OneDNNLinear`, `FeedForward` -> `OneDNNFeedForward`: float32 products on oneDNN (or
  8-bit ones, precision=int8);
- `nn.Dropout` -> `NoiseDropout`: the mask drawn from uniform noise;
- `MultiHeadAttention` -> `ShortAttention`: short attention written out instead of the fused kernel
  (in float32 training only with narrow heads).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from transformer.attention import MultiHeadAttention, reference_attention
from transformer.kernels.onednn import Products
from transformer.layers import FeedForward

# written out instead of the fused kernel: at inference, attention over at most SHORT_KEYS keys or of at
# most FEW_QUERIES queries per row (a decoding step); in training, over at most SHORT_KEYS keys in bf16
# (or fp16), and in float32 with queries and keys of at most NARROW_HEAD dimensions (d_k)
SHORT_KEYS = 64
FEW_QUERIES = 16
NARROW_HEAD = 32


class OneDNNLinear(nn.Linear):
    """`nn.Linear` (the same parameters) computed by `products`: on oneDNN, or with 8-bit packed weights."""

    products: Products

    def forward(self, x: Tensor) -> Tensor:
        return self.products(x, self.weight, self.bias)


class OneDNNFeedForward(FeedForward):
    """`FeedForward` with max(0, x W_1 + b_1) in one product."""

    products: Products

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.products(x, self.w_1.weight, self.w_1.bias, relu=True))


class NoiseDropout(nn.Dropout):
    """Dropout with the mask drawn as uniform noise u, kept where u >= p: the same distribution as
    `nn.Dropout`'s Bernoulli draws."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        with torch.no_grad():  # the mask: 1 / (1 - p) where u >= p, else 0
            noise = torch.rand(x.shape, device=x.device)  # float32: bf16 has 8 bits, too few to hold p
            mask = noise.ge_(self.p).to(x.dtype).mul_(1.0 / (1.0 - self.p))
        return x * mask


class ShortAttention(MultiHeadAttention):
    """`MultiHeadAttention` with short attention written out (`reference_attention`) where that wins:
    at inference, and in training in half precision or with narrow heads; compiled code keeps the fused
    kernel."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        if torch.compiler.is_compiling():  # sizes read only outside compiled code
            return super().attend(q, k, v, mask, causal)
        grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if grads:
            half = q.dtype in (torch.bfloat16, torch.float16)
            short = k.size(2) <= SHORT_KEYS and (half or q.size(-1) <= NARROW_HEAD)
        else:
            short = k.size(2) <= SHORT_KEYS or q.size(2) <= FEW_QUERIES
        if not short:
            return super().attend(q, k, v, mask, causal)
        return reference_attention(q, k, v, mask, causal, self.dropout if self.training else 0.0)[0]
