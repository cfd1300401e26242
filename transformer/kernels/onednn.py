"""The linear maps on oneDNN: y = x W^T + b for float32 on a CPU, forward and both backward products
(docs/performance.md, "CPU kernels"). The results equal `F.linear` up to float32 rounding; anything
else (CUDA, other dtypes, autocast, torch.compile, `torch.backends.mkldnn.enabled = False`) takes
`F.linear` itself. `relu=True` applies max(0, .) inside the same call.

Inside `prepacked(weights)`, each of those weights is copied into oneDNN's blocked layout once for
the whole block instead of at every call (decoding multiplies the same weights step after step).
`OneDNNLinear` and `OneDNNFeedForward` are the module swaps of `transformer.kernels.apply_cpu_kernels`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer.layers import FeedForward


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None, relu: bool = False) -> Tensor:
    """x (..., K) @ weight (N, K)^T + bias -> (..., N); strided (e.g. transposed) operands are fine."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "relu" if relu else "none", [], "")


# (data_ptr, shape, stride) of a weight -> (the weight, its version when packed, its packed copy)
_packed: dict[tuple, tuple[Tensor, int, Tensor]] = {}


def _key(weight: Tensor) -> tuple:
    return weight.data_ptr(), tuple(weight.shape), weight.stride()


@contextmanager
def prepacked(weights: Iterable[Tensor]) -> Iterator[None]:
    """Within the block, inference-time `linear` calls use oneDNN's blocked copy of each of these
    weights (float32 CPU ones; others are left out), made once on entry. A nested block reuses the
    copies already made. A weight changed in place within the block is used unpacked from then on."""
    global _packed
    outer = _packed
    _packed = dict(outer)
    try:
        for w in weights:
            key = _key(w)
            if key not in _packed and _use_onednn(w, w):
                # the weight is kept alive with its copy, so its address cannot be taken by another tensor
                _packed[key] = (w, w._version, torch.ops.mkldnn._reorder_linear_weight(w.detach(), 128))
        yield
    finally:
        _packed = outer


def _use_onednn(x: Tensor, weight: Tensor) -> bool:
    return (
        not torch.compiler.is_compiling()  # inductor picks its own CPU kernels (and first: no graph break)
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and not torch.is_autocast_enabled("cpu")  # autocast multiplies in bf16 (or fp16) instead
    )


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool) -> Tensor:
        y = _onednn(x, weight, bias, relu)
        ctx.save_for_backward(x, weight, y if relu else None)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        x, weight, y = ctx.saved_tensors
        if y is not None:  # through the ReLU: zero where it clipped (ReLU's own backward kernel)
            grad_y = torch.ops.aten.threshold_backward(grad_y, y, 0)
        grad_2d = grad_y.reshape(-1, grad_y.size(-1))  # (M, N)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad_y, weight.t())  # dL/dx = dL/dy W: (..., K)
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(grad_2d, x.reshape(-1, x.size(-1)))  # dL/dW = (dL/dy)^T x: (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_2d.sum(0)  # (N,)
        return grad_x, grad_w, grad_b, None


def weight_grad(grad_y: Tensor, x: Tensor) -> Tensor:
    """grad_y (M, N), x (M, K) -> grad_y^T x (N, K), contiguous: the gradient of a linear map's weight,
    copying the smaller of the two transposes oneDNN needs (docs/performance.md)."""
    if not _use_onednn(grad_y, x):
        return F.linear(grad_y.t(), x.t())
    m, n, k = grad_y.size(0), grad_y.size(1), x.size(1)
    if m * n <= k * (m + n):
        return _onednn(grad_y.t(), x.t())
    return _onednn(x.t(), grad_y.t()).t().contiguous()  # (grad_y^T x)^T = x^T grad_y, (K, N)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, relu: bool = False) -> Tensor:
    """x (..., K), weight (N, K), bias (N,) -> x W^T + b (..., N), or max(0, x W^T + b) with relu."""
    if not _use_onednn(x, weight):
        y = F.linear(x, weight, bias)
        return F.relu(y) if relu else y
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _OneDNNLinear.apply(x, weight, bias, relu)
    packed = _packed.get(_key(weight)) if _packed else None
    if packed is not None and packed[0]._version == packed[1]:
        weight = packed[2]
    return _onednn(x, weight, bias, relu)  # inference: no autograd node, no saved tensors


class OneDNNLinear(nn.Linear):
    """`nn.Linear` (the same parameters) computed by `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class OneDNNFeedForward(FeedForward):
    """`FeedForward` with max(0, x W_1 + b_1) in one oneDNN call."""

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(linear(x, self.w_1.weight, self.w_1.bias, relu=True))
