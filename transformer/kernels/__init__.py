"""Speed machinery, handed in from outside the paper's modules (docs/performance.md).

An entry point chooses its `Kernels` for the device (training by the CPU's instruction set,
`Kernels.choose`; decoding by timing them on this machine, `timing.decoding_kernels`;
`cpu_kernels=on|off` forces them) and hands them on, in the order build -> to(device) -> kernels ->
compile -> DDP: `kernels.apply(model)` gives the model with the CPU kernels' modules in place of the
plain ones, or the plain ones in place of other kernels' (the same parameters, state_dict keys and
functions);
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
from transformer.kernels.replace import replaced, shallow_copy
from transformer.layers import FeedForward
from transformer.utils.devices import CpuFeatures, cpu_features

M = TypeVar("M", bound=nn.Module)


class Kernels:
    """Which CPU kernels a model runs with: float32 products on oneDNN (`onednn`), decoding's weights
    packed for oneDNN (`packed`; default: as `onednn`), dropout masks drawn from noise
    (`noise_dropout`), short attention written out (`short_attention`); with `int8` (decoding's
    precision=int8, whatever the kernels) every linear map multiplies through `products`, whose 8-bit
    packed weights it then uses."""

    def __init__(
        self,
        onednn: bool = False,
        noise_dropout: bool = False,
        short_attention: bool = False,
        int8: bool = False,
        packed: bool | None = None,
    ):
        self.onednn, self.noise_dropout, self.short_attention = onednn, noise_dropout, short_attention
        self.int8, self.packed = int8, onednn if packed is None else packed
        self.products = Products(onednn, self.packed)

    @classmethod
    def choose(
        cls, device: torch.device, setting: str = "auto", cpu: CpuFeatures | None = None, int8: bool = False
    ) -> Kernels:
        """The kernels for a device: none off a CPU or with setting "off", all with "on"; with "auto",
        by the CPU's instruction set, each where it was measured to win (docs/performance.md, "Which
        kernel where"): oneDNN products on AVX-512, noise dropout and short attention on any x86 CPU,
        nothing on others. `int8` for 8-bit products, with any setting."""
        if device.type != "cpu":
            return cls()
        if setting == "off":
            return cls(int8=int8)
        if setting == "on":
            return cls(onednn=True, noise_dropout=True, short_attention=True, int8=int8)
        cpu = cpu_features() if cpu is None else cpu
        avx512 = cpu.x86 and cpu.capability.startswith("AVX512") and torch.backends.mkldnn.is_available()
        return cls(onednn=avx512, noise_dropout=cpu.x86, short_attention=cpu.x86, int8=int8)

    def record(self) -> dict[str, bool]:
        """The choice as a checkpoint keeps it (a resumed run takes the same kernels: the noise dropout
        draws another random stream than nn.Dropout)."""
        return {
            "onednn": self.onednn,
            "noise_dropout": self.noise_dropout,
            "short_attention": self.short_attention,
        }

    def describe(self) -> str:
        on = [name for name, used in self.record().items() if used]
        if self.packed != self.onednn:  # decoding's weights packed for oneDNN, or not, unlike the rest
            on.append("packed" if self.packed else "unpacked")
        return ", ".join(on) if on else "none"

    def apply(self, model: M) -> M:
        """A copy of the model (the same parameters) with these kernels' modules in place: each module a
        kernel can replace becomes this choice's (a kernel's subclass, or the plain class)."""
        return replaced(model, self._replacement)

    def _replacement(self, module: nn.Module) -> nn.Module | None:
        through_products = self.onednn or self.packed or self.int8
        for plain, kernel, used in (
            (nn.Linear, OneDNNLinear, through_products),
            (FeedForward, OneDNNFeedForward, through_products),
            (nn.Dropout, NoiseDropout, self.noise_dropout),
            (MultiHeadAttention, ShortAttention, self.short_attention),
        ):
            if isinstance(module, plain):
                chosen = kernel if used else plain
                copy = shallow_copy(module, chosen)
                if chosen in (OneDNNLinear, OneDNNFeedForward):
                    copy.products = self.products
                elif "products" in copy.__dict__:  # back to the plain class: no products of another choice
                    del copy.__dict__["products"]
                return copy
        return None


__all__ = ["Kernels", "Products", "cache_onednn_kernels", "keep_freed_memory"]
