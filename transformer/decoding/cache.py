"""Incremental decoding: the decoder run on the newest tokens only, with the keys and values of the
positions before them kept in a `DecoderCache`.

`decode_step` is `Transformer.decoder_states` (through `DecoderLayer`'s three sub-layers) for tokens
that follow the positions the cache holds; it gives the same states as recomputing the whole prefix.
A cache holds, per layer, the self-attention keys and values in buffers with room for a search's
`limit` positions, written in place, and the encoder-decoder attention's keys and values, computed
once per source. Two layouts, one interface:

- dynamic: attention reads the positions written so far; sentences may leave the batch (`reorder`);
- static: every step has the same shapes and memory, as CUDA graphs need: attention reads all `limit`
  positions, a mask hides those not yet written, and the position is a device tensor.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from transformer.attention import MultiHeadAttention
from transformer.model import Transformer


class DecoderCache:
    """Keys and values for decoding N sentences in rows of N x k (k beams each, sentence-major)."""

    def __init__(
        self, model: Transformer, memory: Tensor, src_mask: Tensor, rows: int, limit: int, static: bool
    ):
        """memory (N, S, d_model), src_mask (N, S): the sources; `rows` hypotheses decode at once."""
        self.src_mask, self.static, self.length = src_mask, static, 0  # positions written (dynamic)
        self.position = torch.zeros((), dtype=torch.long, device=memory.device)  # the same, on the device
        self.key_positions = torch.arange(limit, device=memory.device)[None]  # (1, L)
        self.key_mask = torch.zeros(1, limit, dtype=torch.bool, device=memory.device)  # written (static)
        # (N, H_kv, S, d) per layer, contiguous: every step reads them; the beams of a sentence share them
        self.cross = [
            tuple(x.contiguous() for x in layer.cross_attn.project_kv(memory)) for layer in model.decoder
        ]
        self.keys, self.values, self.spare = [], [], []  # per layer (rows, H_kv, L, d) and its reorder target
        for (k, v), layer in zip(self.cross, model.decoder):  # in the dtype the projections give
            h = layer.self_attn.n_kv_heads
            self.keys.append(k.new_zeros(rows, h, limit, layer.self_attn.d_k))
            self.values.append(v.new_zeros(rows, h, limit, layer.self_attn.d_v))
            self.spare.append((torch.empty_like(self.keys[-1]), torch.empty_like(self.values[-1])))
        self.pending: list[Tensor | None] = [None] * len(self.keys)  # a reorder not carried out yet

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Write k, v (rows, H_kv, T, d) after the positions held; returns every position's keys and
        values so far and the mask of the new queries over them (None: all visible)."""
        t = k.size(2)
        if self.static:  # at the device position; the unwritten positions masked
            if t != 1:
                raise ValueError(f"the static layout decodes one token per step, not {t}")
            at = self.position.view(1)
            self.keys[layer].index_copy_(2, at, k)
            self.values[layer].index_copy_(2, at, v)
            return self.keys[layer], self.values[layer], self.key_mask[:, None, None, :]
        if self.pending[layer] is not None:  # right before attention reads them: still in cache then
            self._reorder(layer, self.pending[layer], self.length)
            self.pending[layer] = None
        end = self.length + t
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        mask = None
        if t > 1:  # several new queries: each sees the past and the new positions up to its own
            mask = torch.ones(t, end, dtype=torch.bool, device=k.device).tril(diagonal=self.length)
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end], mask

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
        if self.static:
            for layer in range(len(self.keys)):
                self._reorder(layer, rows, self.keys[layer].size(2))
        else:
            rows = rows.clone()  # the caller may reuse its tensor before the layers carry this out
            self.pending = [rows if p is None else p[rows] for p in self.pending]
        if sentences is not None:
            self.cross = [(k.index_select(0, sentences), v.index_select(0, sentences)) for k, v in self.cross]
            self.src_mask = self.src_mask.index_select(0, sentences)

    def _reorder(self, layer: int, rows: Tensor, end: int) -> None:
        """One copy of the first `end` positions into the spare buffers, which then trade places with
        the layer's buffers (rows only ever shrink: the spare ones have enough)."""
        k, v = self.keys[layer], self.values[layer]
        spare_k, spare_v = self.spare[layer][0][: rows.size(0)], self.spare[layer][1][: rows.size(0)]
        torch.index_select(k[:, :, :end], 0, rows, out=spare_k[:, :, :end])
        torch.index_select(v[:, :, :end], 0, rows, out=spare_v[:, :, :end])
        self.keys[layer], self.values[layer], self.spare[layer] = spare_k, spare_v, (k, v)


def decode_step(model: Transformer, tokens: Tensor, cache: DecoderCache) -> Tensor:
    """tokens (R, T) after the positions the cache holds -> the final decoder states (R, T, d_model),
    as `Transformer.decoder_states` gives them for the whole prefix; the cache takes their keys and
    values. (`DecoderLayer.forward`, with attention over the cache.)"""
    y = model.embed(tokens, cache.positions(tokens.size(1)))
    for i, layer in enumerate(model.decoder):
        y = layer.res_self(y, partial(_self_attention, layer.self_attn, cache, i))
        y = layer.res_cross(y, partial(_cross_attention, layer.cross_attn, cache, i))
        y = layer.res_ffn(y, layer.ffn)
    cache.advance(tokens.size(1))
    return model.decoder_norm(y)


def _self_attention(attn: MultiHeadAttention, cache: DecoderCache, layer: int, h: Tensor) -> Tensor:
    q, k, v = attn.project(h)  # (R, H, T, d_k), (R, H_kv, T, d) twice
    k, v, mask = cache.extend(layer, k, v)  # (R, H_kv, T_k, d): every position so far
    return attn.combine(attn.attend(q, k, v, mask, causal=False))


def _cross_attention(attn: MultiHeadAttention, cache: DecoderCache, layer: int, h: Tensor) -> Tensor:
    """The k beams of each of N sentences (R = N x k rows) attend over its keys and values, (N, ...):
    their queries go side by side into one attention, so the keys and values are never copied k times."""
    q = attn.project_q(h)  # (R, H, T, d_k)
    k, v = cache.cross[layer]  # (N, H_kv, S, d)
    n, (r, heads, t, d_k) = k.size(0), q.shape
    q = q.view(n, r // n, heads, t, d_k).transpose(1, 2).reshape(n, heads, -1, d_k)  # (N, H, k x T, d_k)
    out = attn.attend(q, k, v, cache.src_mask[:, None, None, :], causal=False)  # (N, H, k x T, d_v)
    return attn.combine(out.view(n, heads, r // n, t, -1).transpose(1, 2).reshape(r, heads, t, -1))
