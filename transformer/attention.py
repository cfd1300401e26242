"""Multi-head attention (§3.2), one module for all three uses in the model (§3.2.3).

- encoder self-attention: queries, keys and values from the encoder; padded keys masked;
- decoder self-attention: causal (position i sees positions <= i), incremental with a K/V cache;
- encoder-decoder (cross) attention: queries from the decoder, keys/values from the encoder output.

Two interchangeable paths compute Attention(Q, K, V) = softmax(QK^T / sqrt(d_k)) V (Eq. 1):
the fast path, `torch.nn.functional.scaled_dot_product_attention` (fused kernels on GPU), and the
reference path, written out explicitly, which also yields the attention weights. Inside
`record_attention()` every call takes the reference path and its weights are collected.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer.linear import Linear


@dataclass
class AttentionRecord:
    """The weights of one attention call: (B, H, T_q, T_k) (cross-attention in a beam search: the k beams'
    queries of a sentence side by side, (N, H, k x T_q, S))."""

    kind: str  # "encoder_self" | "decoder_self" | "cross"
    layer: int
    weights: Tensor


_recorder: list[AttentionRecord] | None = None
# On a CPU these take the written-out path (see MultiHeadAttention._attend): attention over at most
# SHORT_KEYS keys, and at inference that of at most FEW_QUERIES queries per row (a decoding step).
SHORT_KEYS = 64
FEW_QUERIES = 16


@contextmanager
def record_attention() -> Iterator[list[AttentionRecord]]:
    """Run the block with the reference path everywhere, collecting every attention's weights."""
    global _recorder
    previous, _recorder = _recorder, []
    try:
        yield _recorder
    finally:
        _recorder = previous


@dataclass
class KV:
    """Projected keys and values, (B, H_kv, T, d_k) and (B, H_kv, T, d_v)."""

    k: Tensor
    v: Tensor

    def select(self, rows: Tensor) -> KV:
        """Keep rows (B',) of the batch."""
        return KV(self.k.index_select(0, rows), self.v.index_select(0, rows))


class GrowingKV:
    """Decoder self-attention keys and values of the t positions so far, (B, H_kv, t, d), as views into
    buffers with room for more positions.

    A step writes its positions in place instead of copying the whole past (torch.cat); full buffers
    are replaced by ones twice as long (a search reserves room for its output limit at once, so they
    never fill). A beam reorder (`select`) is only noted, and carried out by the next `append`, right
    before that layer's attention reads the keys and values (while they are still in cache): one copy
    into a second buffer, which then swaps roles with the first. So no step allocates memory (on a
    CPU, fresh multi-megabyte tensors cost page faults). A cache is consumed by the call that extends
    or reorders it: the cache returned reuses its buffers.
    """

    key_mask = None  # every position held is attended (unlike StaticKV)

    def __init__(
        self,
        k: Tensor | None = None,
        v: Tensor | None = None,
        length: int = 0,
        spare: tuple[Tensor, Tensor] | None = None,
        reserve: int = 0,
    ) -> None:
        self.k_buf, self.v_buf = k, v  # (B, H_kv, capacity, d); None before the first append
        self.length = length
        self.spare = spare  # the next reorder's buffers: (>= B, H_kv, capacity, d)
        self.rows: Tensor | None = None  # (B',) a pending reorder: row i becomes row rows[i]
        self.reserve = reserve  # positions the first append makes room for (a search's limit L)

    @property
    def capacity(self) -> int:
        return 0 if self.k_buf is None else self.k_buf.size(2)

    @property
    def k(self) -> Tensor:
        return self._reordered().k_buf[:, :, : self.length]  # (B, H_kv, t, d_k)

    @property
    def v(self) -> Tensor:
        return self._reordered().v_buf[:, :, : self.length]  # (B, H_kv, t, d_v)

    def select(self, rows: Tensor) -> GrowingKV:
        """Keep rows (B',) of the batch; a row may repeat (the beams of one hypothesis)."""
        cache = GrowingKV(self.k_buf, self.v_buf, self.length, self.spare)
        cache.rows = rows if self.rows is None else self.rows[rows]
        return cache

    def append(self, k: Tensor, v: Tensor) -> GrowingKV:
        """k (B, H_kv, T, d_k), v (B, H_kv, T, d_v): the next T positions."""
        cache = self._reordered()
        t, end = cache.length, cache.length + k.size(2)
        if end > cache.capacity:  # out of room: move to buffers at least twice as long
            (b, h, _, d_k), d_v = k.shape, v.size(3)
            capacity = max(end, 2 * cache.capacity, cache.reserve)
            grown = GrowingKV(k.new_empty(b, h, capacity, d_k), v.new_empty(b, h, capacity, d_v), t)
            if t > 0:
                grown.k_buf[:, :, :t], grown.v_buf[:, :, :t] = cache.k, cache.v
            cache = grown
        cache.k_buf[:, :, t:end], cache.v_buf[:, :, t:end] = k, v
        return GrowingKV(cache.k_buf, cache.v_buf, end, cache.spare)

    def _reordered(self) -> GrowingKV:
        """Carry out a pending reorder (in place: this cache is consumed anyway)."""
        if self.rows is None or self.k_buf is None:
            return self
        n, t = self.rows.size(0), self.length
        if self.spare is None or self.spare[0].size(0) < n or self.spare[0].size(2) != self.capacity:
            self.spare = tuple(buf.new_empty(n, *buf.shape[1:]) for buf in (self.k_buf, self.v_buf))
        k, v = self.spare[0][:n], self.spare[1][:n]  # (B', H_kv, capacity, d)
        torch.index_select(self.k_buf[:, :, :t], 0, self.rows, out=k[:, :, :t])
        torch.index_select(self.v_buf[:, :, :t], 0, self.rows, out=v[:, :, :t])
        self.k_buf, self.v_buf, self.spare, self.rows = k, v, (self.k_buf, self.v_buf), None
        return self


class StaticKV:
    """Decoder self-attention keys and values in buffers of a fixed length L, (B, H_kv, L, d), written at
    a position held in a device tensor: every decoding step has the same shapes, and every other step
    the same memory, as CUDA graphs need (`static_search`). Attention reads all L positions; `key_mask`
    hides those not written yet. The position and the mask are shared by every layer and advanced by
    the search. A beam reorder copies into a second pair of buffers, which then swap roles with the
    first: one copy instead of a copy out and a copy back.
    """

    def __init__(self, k: Tensor, v: Tensor, position: Tensor, key_mask: Tensor) -> None:
        self.k, self.v = k, v  # (B, H_kv, L, d_k), (B, H_kv, L, d_v)
        self.spare = torch.empty_like(k), torch.empty_like(v)  # the next reorder's target
        self.position = position  # () long: where the next append writes
        self.key_mask = key_mask  # (1, L) bool: True at positions <= position

    @property
    def length(self) -> int:
        """The positions attention reads: all L."""
        return self.k.size(2)

    def append(self, k: Tensor, v: Tensor) -> StaticKV:
        """k (B, H_kv, 1, d_k), v (B, H_kv, 1, d_v): the keys and values at `position`, written in place."""
        at = self.position.view(1)
        self.k.index_copy_(2, at, k)
        self.v.index_copy_(2, at, v)
        return self

    def reorder_(self, rows: Tensor) -> None:
        """Row i becomes row rows[i] (B,); a row may repeat (the beams of one hypothesis)."""
        torch.index_select(self.k, 0, rows, out=self.spare[0])
        torch.index_select(self.v, 0, rows, out=self.spare[1])
        (self.k, self.v), self.spare = self.spare, (self.k, self.v)


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Eq. (1) written out. q: (B, H, T_q, d_k); k, v: (B, H, T_k, d); mask broadcasts to
    (B, H, T_q, T_k), True = may attend. Returns the output (B, H, T_q, d_v) and the weights."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T_q, T_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    return F.dropout(weights, dropout) @ v, weights


def causal_mask(t_q: int, t_k: int, device: torch.device) -> Tensor:
    """(T_q, T_k) bool, True = may attend; the queries are the last T_q of T_k positions."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The projections have no bias, as in §3.2.2. For self-attention the three input projections are
    one matrix (one matmul instead of three). `n_kv_heads < n_heads` shares each key/value head
    among a group of query heads (grouped-query attention; not in the paper, which has n_kv_heads = h).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_k: int,
        d_v: int,
        n_kv_heads: int,
        dropout: float,
        kind: str,
        layer: int = 0,
    ) -> None:
        super().__init__()
        assert kind in ("encoder_self", "decoder_self", "cross")
        self.n_heads, self.n_kv_heads, self.d_k, self.d_v = n_heads, n_kv_heads, d_k, d_v
        self.dropout, self.kind, self.layer = dropout, kind, layer
        self.splits = [n_heads * d_k, n_kv_heads * d_k, n_kv_heads * d_v]  # Q | K | V output widths
        if kind == "cross":
            self.w_q = Linear(d_model, self.splits[0], bias=False)
            self.w_kv = Linear(d_model, self.splits[1] + self.splits[2], bias=False)
        else:
            self.w_qkv = Linear(d_model, sum(self.splits), bias=False)
        self.w_o = Linear(n_heads * d_v, d_model, bias=False)

    def reset_parameters(self, qkv_gain: float = 1.0) -> None:
        """Xavier-uniform for each of W^Q, W^K, W^V (with gain `qkv_gain`) and W^O separately, even
        where they are fused."""
        with torch.no_grad():
            if self.kind == "cross":
                blocks = [self.w_q.weight, *self.w_kv.weight.split(self.splits[1:])]
            else:
                blocks = list(self.w_qkv.weight.split(self.splits))
            for block in blocks:
                nn.init.xavier_uniform_(block, gain=qkv_gain)
            nn.init.xavier_uniform_(self.w_o.weight)

    def _heads(self, x: Tensor, n_heads: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n_heads, -1).transpose(1, 2)  # (B, H, T, d)

    def project_kv(self, memory: Tensor) -> KV:
        """Keys and values of cross-attention, computed once per source sentence."""
        k, v = self.w_kv(memory).split(self.splits[1:], dim=-1)
        return KV(self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads))

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        key_mask: Tensor | None = None,
        past: KV | GrowingKV | StaticKV | None = None,
    ) -> tuple[Tensor, KV | GrowingKV | StaticKV | None]:
        """x: (B, T_q, d_model) queries (and keys/values for self-attention).

        memory: (B, T_k, d_model) encoder output (cross-attention), or a ready `past` KV for it.
        key_mask: (B, T_k) bool, True = a real token (keys at False are never attended to).
        past: decoder self-attention cache (GrowingKV or StaticKV); the new keys/values are appended and
            the grown cache returned.
        """
        cached = 0  # keys of earlier decoding steps, before those of these queries
        if self.kind == "cross":
            q = self._heads(self.w_q(x), self.n_heads)  # (B, H, T_q, d_k)
            kv = past if past is not None else self.project_kv(memory)
        else:
            q, k, v = self.w_qkv(x).split(self.splits, dim=-1)
            q = self._heads(q, self.n_heads)  # (B, H, T_q, d_k)
            kv = KV(self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads))  # (B, H_kv, T, d)
            if past is not None:
                cached, key_mask = past.length, past.key_mask
                kv = past.append(kv.k, kv.v)
        if kv.k.size(0) != q.size(0):  # beam search: the beams of a sentence share its cross K/V
            out = self._attend_beams(q, kv, key_mask)  # (B, H, T_q, d_v)
        else:
            out = self._attend(q, kv, key_mask, cached)  # (B, H, T_q, d_v)
        b, _, t_q, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t_q, self.n_heads * self.d_v)  # (B, T_q, H * d_v)
        keep = self.kind == "cross" or past is not None
        return self.w_o(out), kv if keep else None

    def _attend_beams(self, q: Tensor, kv: KV, key_mask: Tensor | None) -> Tensor:
        """Cross-attention of q (N * k, H, T_q, d_k) over keys/values (N, H_kv, S, d) of N sentences:
        each sentence's k beams become k x T_q queries of one attention, so K/V are never copied k times."""
        n, (nk, h, t_q, d_k) = kv.k.size(0), q.shape
        k = nk // n
        q = q.view(n, k, h, t_q, d_k).transpose(1, 2).reshape(n, h, k * t_q, d_k)  # (N, H, k * T_q, d_k)
        out = self._attend(q, kv, key_mask)  # (N, H, k * T_q, d_v)
        return out.view(n, h, k, t_q, -1).transpose(1, 2).reshape(nk, h, t_q, -1)  # (N * k, H, T_q, d_v)

    def _attend(self, q: Tensor, kv: KV, key_mask: Tensor | None, cached: int = 0) -> Tensor:
        """q (B, H, T_q, d_k) over kv; `cached` of the T_k keys come before the queries' positions.

        Only Python values decide the path (sizes may be symbolic under torch.compile's dynamic shapes).
        """
        causal = self.kind == "decoder_self"
        p = self.dropout if self.training else 0.0
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, T_k)
        # On a CPU, short attention (at most SHORT_KEYS keys, or a decoding step's few queries) is faster
        # written out than through the fused kernel, whose fixed cost per (row, head) dominates at these
        # sizes: 1.4-3x forward and backward at 16-48 tokens. Compiled code keeps the fused kernel.
        written_out = (
            q.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and (kv.k.size(2) <= SHORT_KEYS or (q.size(2) <= FEW_QUERIES and not torch.is_grad_enabled()))
        )
        if _recorder is not None or written_out or (causal and cached > 0 and q.size(2) > 1):
            t_q, t_k = q.size(2), kv.k.size(2)
            if causal and t_q > 1:
                cm = causal_mask(t_q, t_k, q.device)
                mask = cm if mask is None else mask & cm
            k, v, group = kv.k, kv.v, self.n_heads // self.n_kv_heads
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out, weights = reference_attention(q, k, v, mask, p)
            if _recorder is not None:
                _recorder.append(AttentionRecord(self.kind, self.layer, weights.detach()))
            return out
        # Without earlier keys the queries and keys are the same positions: causal. One new query
        # after earlier keys may see them all.
        return F.scaled_dot_product_attention(
            q,
            kv.k,
            kv.v,
            attn_mask=mask,
            dropout_p=p,
            is_causal=causal and cached == 0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
