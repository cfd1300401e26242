"""The cache of incremental decoding: `Transformer.decode` run on the newest tokens only, with the
keys and values of the positions before them kept here; it gives the states a decode of the whole
prefix gives.

Per decoder layer (`LayerCache`), the self-attention keys and values live in buffers with room for a
search's `limit` positions, written in place, and the encoder-decoder attention's keys and values are
computed once per source. Two layouts, one interface:

- dynamic: attention reads the positions written so far; sentences may leave the batch (`reorder`);
- static: every step has the same shapes and memory, as CUDA graphs need: attention reads all `limit`
  positions, a mask hides those not yet written, and the position is a device tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from transformer.layers import DecoderLayer
from transformer.model import Transformer


class DecoderCache:
    """Keys and values for decoding N sentences in rows of N x k (k beams each, sentence-major)."""

    def __init__(
        self,
        model: Transformer,
        memory: Tensor,
        src_mask: Tensor,
        rows: int,
        limit: int,
        static: bool,
        first: int | None = None,
    ):
        """memory (N, S, d_model), src_mask (N, S): the sources; at most `rows` hypotheses decode at
        once, `first` of them (default all) at the first step."""
        self.src_mask, self.static, self.length = src_mask, static, 0  # positions written (dynamic)
        self.position = torch.zeros((), dtype=torch.long, device=memory.device)  # the same, on the device
        self.key_positions = torch.arange(limit, device=memory.device)[None]  # (1, L)
        self.key_mask = torch.zeros(1, limit, dtype=torch.bool, device=memory.device)  # written (static)
        self.layers = [LayerCache(self, layer, memory, rows, limit, first or rows) for layer in model.decoder]

    def positions(self, t: int) -> Tensor:
        """(T,) the positions of the next T tokens; marks them as written for the static layout."""
        if self.static:
            torch.le(self.key_positions, self.position, out=self.key_mask)
            return self.position.view(1)
        return torch.arange(self.length, self.length + t, device=self.position.device)

    def advance(self, t: int) -> None:
        self.length += t
        self.position += t

    def reorder(self, rows: Tensor, sentences: Tensor | None = None) -> None:
        """Row i becomes row rows[i] (R',), a row may repeat (the beams of one hypothesis); `sentences`
        (N',), where some leave the batch (dynamic layout), are those kept of the encoder-decoder keys
        and values. The static layout copies at once; the dynamic one when each layer next extends."""
        if not self.static:
            rows = rows.clone()  # the caller may reuse its tensor before the layers carry this out
        for layer in self.layers:
            layer.reorder(rows, sentences)
        if sentences is not None:
            self.src_mask = self.src_mask.index_select(0, sentences)


class LayerCache:
    """One decoder layer's keys and values (`attention.LayerCache`)."""

    def __init__(
        self, cache: DecoderCache, layer: DecoderLayer, memory: Tensor, rows: int, limit: int, first: int
    ):
        self.cache = cache
        # (N, H_kv, S, d), contiguous: every step reads them; the beams of a sentence share them
        self.cross = tuple(x.contiguous() for x in layer.cross_attn.project_kv(memory))
        # (rows, H_kv, L, d), in the dtype the projections give, and the targets of a reorder; the
        # static layout reads unwritten positions (masked), which must hold numbers, the dynamic one never
        k, attn = self.cross[0], layer.self_attn
        new = k.new_zeros if cache.static else k.new_empty
        self.buffers = (
            new(rows, attn.n_kv_heads, limit, attn.d_k),
            new(rows, attn.n_kv_heads, limit, attn.d_v),
        )
        # the static layout's reorder copies every row into a second pair of buffers, the dynamic one
        # only the rows that change, in place
        self.spare = (
            (torch.empty_like(self.buffers[0]), torch.empty_like(self.buffers[1])) if cache.static else None
        )
        self.keys, self.values = _first(self.buffers[0], first), _first(self.buffers[1], first)
        self.pending: Tensor | None = None  # a reorder not carried out yet (dynamic layout)

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Write k, v (rows, H_kv, T, d) after the positions held; returns every position's keys and
        values so far and the mask of the new queries over them (None: all visible)."""
        t, cache = k.size(2), self.cache
        if cache.static:  # at the device position; the unwritten positions masked
            if t != 1:
                raise ValueError(f"the static layout decodes one token per step, not {t}")
            at = cache.position.view(1)
            self.keys.index_copy_(2, at, k)
            self.values.index_copy_(2, at, v)
            return self.keys, self.values, cache.key_mask[:, None, None, :]
        start = cache.length
        if self.pending is not None:  # right before attention reads them: still in cache then
            self._copy(self.pending, start)
            self.pending = None
        end = start + t
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        mask = None
        if t > 1:  # several new queries: each sees the past and the new positions up to its own
            mask = torch.ones(t, end, dtype=torch.bool, device=k.device).tril(diagonal=start)
        return self.keys[:, :, :end], self.values[:, :, :end], mask

    def memory(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.cross[0], self.cross[1], self.cache.src_mask[:, None, None, :]

    def reorder(self, rows: Tensor, sentences: Tensor | None) -> None:
        """As `DecoderCache.reorder`, for this layer."""
        if self.cache.static:
            self._move(rows, self.keys.size(2))
        else:
            self.pending = rows if self.pending is None else self.pending[rows]
        if sentences is not None:
            self.cross = (self.cross[0].index_select(0, sentences), self.cross[1].index_select(0, sentences))

    def _copy(self, rows: Tensor, end: int) -> None:
        """The dynamic layout's reorder of the first `end` positions, in place: only the rows that
        change, their sources gathered first (one may be another's target)."""
        changed = (rows != torch.arange(rows.size(0), device=rows.device)).nonzero().squeeze(1)
        keys, values = _first(self.buffers[0], rows.size(0)), _first(self.buffers[1], rows.size(0))
        if changed.numel():
            sources = rows[changed]
            keys[:, :, :end].index_copy_(0, changed, self.keys[:, :, :end].index_select(0, sources))
            values[:, :, :end].index_copy_(0, changed, self.values[:, :, :end].index_select(0, sources))
        self.keys, self.values = keys, values

    def _move(self, rows: Tensor, end: int) -> None:
        """The static layout's reorder: one copy of the first `end` positions of the rows `rows` into
        the spare buffers, which then trade places with the layer's."""
        spare_k, spare_v = _first(self.spare[0], rows.size(0)), _first(self.spare[1], rows.size(0))
        torch.index_select(self.keys[:, :, :end], 0, rows, out=spare_k[:, :, :end])
        torch.index_select(self.values[:, :, :end], 0, rows, out=spare_v[:, :, :end])
        self.keys, self.values = spare_k, spare_v
        self.buffers, self.spare = self.spare, self.buffers


def _first(buffer: Tensor, rows: int) -> Tensor:
    """The first `rows` rows of buffer: itself where that is all of them."""
    return buffer if buffer.size(0) == rows else buffer[:rows]
