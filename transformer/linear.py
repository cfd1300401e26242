"""The linear maps of the model, y = x W^T + b, with their float32 CPU matrix multiplies on oneDNN.

PyTorch sends float32 CPU matrix multiplies to MKL, which on non-Intel CPUs (AMD EPYC, for one) runs
a generic path at about half the speed of oneDNN's JIT kernels, also part of every PyTorch build
(`scripts/benchmark.py` times both in its matmul peak). Forward and both backward products go
through oneDNN there; the results equal `F.linear` up to float32 rounding.
Everything else (CUDA, bf16, float64, torch.compile, `torch.backends.mkldnn.enabled = False`) uses
`F.linear` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., K) @ weight (N, K)^T + bias -> (..., N); strided (e.g. transposed) operands are fine."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _use_onednn(x: Tensor, weight: Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and not torch.compiler.is_compiling()  # inductor picks its own CPU kernels
    )


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_2d = grad_y.reshape(-1, grad_y.size(-1))  # (M, N)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad_y, weight.t())  # dL/dx = dL/dy W: (..., K)
        if ctx.needs_input_grad[1]:
            grad_w = _onednn(grad_2d.t(), x.reshape(-1, x.size(-1)).t())  # dL/dW = (dL/dy)^T x: (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_2d.sum(0)  # (N,)
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., K), weight (N, K), bias (N,) -> x W^T + b (..., N)."""
    if not _use_onednn(x, weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _OneDNNLinear.apply(x, weight, bias)
    return _onednn(x, weight, bias)  # inference: no autograd node, no saved tensors


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, initialization and state_dict keys) computed by `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
