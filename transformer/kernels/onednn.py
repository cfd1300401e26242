"""The products of linear maps, y = x W^T + b, as the CPU kernels compute them (docs/performance.md,
"CPU kernels"): `Products(onednn=True)` runs float32 on a CPU on oneDNN, forward and both backward
products, equal to `F.linear` up to float32 rounding; anything else (CUDA, other dtypes, autocast,
torch.compile, `torch.backends.mkldnn.enabled = False`, onednn=False) takes `F.linear` itself.

Inside `products.prepacked(weights)`, with `packed` each of those weights is copied into oneDNN's
blocked layout once for the whole block instead of at every call (decoding multiplies the same weights
step after step; the other products still follow `onednn`); with `int8=True`, into fbgemm's 8-bit layout
instead (translate.py precision=int8). The packed copies belong to the `Products` object: one per
model, never shared between threads.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer.utils.devices import has_int8_engine

# fbgemm's int8 products: activations in 7 bits where a CPU without VNNI could saturate 16-bit sums
REDUCE_RANGE = True


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None, relu: bool = False) -> Tensor:
    """x (..., K) @ weight (N, K)^T + bias -> (..., N); strided (e.g. transposed) operands are fine."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "relu" if relu else "none", [], "")


@dataclass
class _Packed:
    """A weight (kept alive with its copy, so its address cannot be taken by another tensor), its version
    when packed, and its packed form: oneDNN's blocked float32 copy, or fbgemm's int8 one with its bias."""

    weight: Tensor
    version: int
    blocked: Tensor | None = None
    int8: Any = None  # torch.ops.quantized.linear_prepack's result
    bias: Tensor | None = None
    bias_version: int = 0

    def current(self) -> bool:
        """Neither the weight nor the packed bias changed in place since packing."""
        return self.weight._version == self.version and (
            self.bias is None or self.bias._version == self.bias_version
        )

    def linear(self, x: Tensor, bias: Tensor | None, relu: bool) -> Tensor:
        if self.int8 is None:
            return _onednn(x, self.blocked, bias, relu)
        if bias is not self.bias:
            raise ValueError("an int8-packed weight was used with another bias than it was packed with")
        product = torch.ops.quantized.linear_relu_dynamic if relu else torch.ops.quantized.linear_dynamic
        return product(x, self.int8, REDUCE_RANGE)


def _int8_pack(weight: Tensor, bias: Tensor | None) -> Any:
    """fbgemm's packed int8 weight: per output row, w ~ scale * q with q in [-127, 127]."""
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # (N,)
    with warnings.catch_warnings():  # PyTorch's quantized tensors warn that torchao will replace them
        warnings.simplefilter("ignore")
        zero = torch.zeros_like(scale, dtype=torch.long)
        q = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach())


def _plain_cpu_float32(x: Tensor, weight: Tensor) -> bool:
    return (
        not torch.compiler.is_compiling()  # inductor picks its own CPU kernels (and first: no graph break)
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")  # autocast multiplies in bf16 (or fp16) instead
        and x.numel() > 0  # oneDNN has no primitive for no rows (an expert no token chose)
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
            grad_w = _onednn_weight_grad(grad_2d, x.reshape(-1, x.size(-1)))  # dL/dW = (dL/dy)^T x: (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_2d.sum(0)  # (N,)
        return grad_x, grad_w, grad_b, None


def _key(weight: Tensor) -> tuple:
    return weight.data_ptr(), tuple(weight.shape), weight.stride()


class Products:
    """y = x W^T + b (or max(0, .) with relu), and the weight gradient grad_y^T x; on oneDNN where
    `onednn` and the operands are plain float32 CPU tensors, and with `prepacked` weights at inference
    where `packed` (default: as `onednn`)."""

    def __init__(self, onednn: bool = True, packed: bool | None = None) -> None:
        self.onednn, self.pack = onednn, onednn if packed is None else packed
        self.packed: dict[tuple, _Packed] = {}  # (data_ptr, shape, stride) of a weight -> its packed form

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, relu: bool = False) -> Tensor:
        """x (..., K), weight (N, K), bias (N,) -> x W^T + b (..., N), or max(0, x W^T + b) with relu."""
        grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
        packed = self.packed.get(_key(weight)) if self.packed and not grads else None
        if packed is not None and packed.current() and _plain_cpu_float32(x, weight):
            return packed.linear(x, bias, relu)
        if not self._use_onednn(x, weight):
            y = F.linear(x, weight, bias)
            return F.relu(y) if relu else y
        if grads:
            return _OneDNNLinear.apply(x, weight, bias, relu)
        return _onednn(x, weight, bias, relu)  # inference: no autograd node, no saved tensors

    def weight_grad(self, grad_y: Tensor, x: Tensor) -> Tensor:
        """grad_y (M, N), x (M, K) -> grad_y^T x (N, K), contiguous: the gradient of a linear map's
        weight; on oneDNN, copying the smaller of the two transposes it needs (docs/performance.md)."""
        if not self._use_onednn(grad_y, x):
            return F.linear(grad_y.t(), x.t())
        return _onednn_weight_grad(grad_y, x)

    @contextmanager
    def prepacked(
        self, weights: Iterable[Tensor | tuple[Tensor, Tensor | None]], int8: bool = False
    ) -> Iterator[None]:
        """Within the block, inference products with these weights use a copy of each packed once on
        entry (float32 CPU ones; others are left out): oneDNN's blocked layout (with `onednn`), or with
        `int8` fbgemm's 8-bit one (weights quantized per output row, symmetric; activations per call)
        with the bias given as (weight, bias). A nested block reuses the copies already made. A weight
        changed in place within the block is used unpacked from then on."""
        outer = self.packed
        self.packed = dict(outer)
        try:
            for item in weights:
                w, b = item if isinstance(item, tuple) else (item, None)
                key = _key(w)
                if key in self.packed and (self.packed[key].int8 is not None) == int8:
                    continue  # packed already, in this precision, by an outer block
                if int8:
                    self.packed[key] = _int8_packed(w, b)
                elif self.pack and _onednn_runs(w, w):
                    blocked = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 128)
                    self.packed[key] = _Packed(w, w._version, blocked=blocked)
            yield
        finally:
            self.packed = outer

    def _use_onednn(self, x: Tensor, weight: Tensor) -> bool:
        return self.onednn and _onednn_runs(x, weight)


def _onednn_runs(x: Tensor, weight: Tensor) -> bool:
    """Whether oneDNN can make this product: plain float32 CPU operands, oneDNN there and enabled."""
    return (
        _plain_cpu_float32(x, weight)
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
    )


def _int8_packed(w: Tensor, b: Tensor | None) -> _Packed:
    if not _plain_cpu_float32(w, w) or not has_int8_engine():
        raise ValueError("int8 products need a float32 CPU weight and PyTorch's fbgemm (x86) engine")
    bias_version = 0 if b is None else b._version
    return _Packed(w, w._version, int8=_int8_pack(w.detach(), b), bias=b, bias_version=bias_version)


def _onednn_weight_grad(grad_y: Tensor, x: Tensor) -> Tensor:
    m, n, k = grad_y.size(0), grad_y.size(1), x.size(1)
    if m * n <= k * (m + n):
        return _onednn(grad_y.t(), x.t())
    return _onednn(x.t(), grad_y.t()).t().contiguous()  # (grad_y^T x)^T = x^T grad_y, (K, N)
