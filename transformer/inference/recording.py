"""Attention weights recorded from a model's own forward pass: the heatmaps of visualize.py and the
hard alignments of alignment.py read them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from torch import Tensor, nn

from transformer.attention import MultiHeadAttention, reference_attention
from transformer.kernels.replace import replaced, shallow_copy

M = TypeVar("M", bound=nn.Module)


@dataclass
class AttentionRecord:
    """The weights of one attention call, (B, H, T_q, T_k)."""

    kind: str  # "encoder_self" | "decoder_self" | "cross"
    layer: int
    weights: Tensor


class _Recording(MultiHeadAttention):
    """`MultiHeadAttention` through `reference_attention`, keeping its weights in `records`."""

    kind: str
    layer: int
    records: list[AttentionRecord]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        out, weights = reference_attention(q, k, v, mask, causal, self.dropout if self.training else 0.0)
        self.records.append(AttentionRecord(self.kind, self.layer, weights.detach()))
        return out


def recording(model: M, keep: Callable[[str, int], bool] | None = None) -> tuple[M, list[AttentionRecord]]:
    """A copy of `model` (the same parameters; the model itself untouched) whose every attention (or
    those of the kinds and layers `keep(kind, layer)` accepts) takes the written-out path and appends
    its weights to the list returned with it."""
    records: list[AttentionRecord] = []
    names = {module: name for name, module in model.named_modules()}

    def replace(module: nn.Module) -> nn.Module | None:
        if not isinstance(module, MultiHeadAttention):
            return None
        parts = names[module].split(".")  # e.g. "decoder.3.cross_attn"
        layer = int(parts[-2]) if len(parts) > 1 and parts[-2].isdigit() else 0
        kind = "cross" if module.cross else "decoder_self" if module.causal else "encoder_self"
        if keep is not None and not keep(kind, layer):
            return None
        return shallow_copy(module, _Recording, kind=kind, layer=layer, records=records)

    return replaced(model, replace), records
