"""Multi-head attention (§3.2), one module for its three uses in the model (§3.2.3):

- encoder self-attention: queries, keys and values from the encoder, padded keys masked;
- decoder self-attention: causal, position i sees positions <= i;
- encoder-decoder attention: queries from the decoder, keys and values from the encoder's output.

Attention(Q, K, V) = softmax(QK^T / sqrt(d_k)) V (Eq. 1) is `attention`, PyTorch's fused kernel;
`reference_attention` writes it out and also returns the weights.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, dropout: float) -> Tensor:
    """Eq. (1). q (B, H, T_q, d_k); k, v (B, H_kv, T_k, d): a group of H / H_kv query heads shares each
    key/value head; mask broadcasts to (B, H, T_q, T_k), True = may attend; causal: query i sees keys
    <= i. Returns (B, H, T_q, d_v)."""
    grouped = k.size(1) != q.size(1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, enable_gqa=grouped
    )


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, dropout: float
) -> tuple[Tensor, Tensor]:
    """Eq. (1) written out, as `attention`; also returns the weights (B, H, T_q, T_k)."""
    group = q.size(1) // k.size(1)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, T_k, d)
    if causal:
        allowed = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril()  # (T_q, T_k)
        mask = allowed if mask is None else mask & allowed
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T_q, T_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    return F.dropout(weights, dropout) @ v, weights


class LayerCache(Protocol):
    """What attention asks of one decoder layer's cache in incremental decoding (the implementation:
    transformer/decoding/cache.py)."""

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Self-attention: keep k, v (B, H_kv, T, d) of the newest positions; returns the keys and
        values of every position so far and the mask of the new queries over them (None: all visible)."""
        ...

    def memory(self) -> tuple[Tensor, Tensor, Tensor]:
        """Encoder-decoder attention: the encoder's keys and values (N, H_kv, S, d) and its key mask
        (N, 1, 1, S), N the sentences of the batch."""
        ...


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    """(B, T, n_heads * d) -> (B, n_heads, T, d)."""
    b, t, _ = x.shape
    return x.view(b, t, n_heads, -1).transpose(1, 2)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)
    (§3.2.2), with no biases, as in the equations.

    As in tensor2tensor, W^Q, W^K, W^V of self-attention are one matrix (`w_qkv`), and W^K, W^V of
    encoder-decoder attention another (`w_kv`): one product instead of three. `n_kv_heads` < `n_heads`
    shares each key/value head among a group of query heads (grouped-query attention, not in the paper).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_k: int,
        d_v: int,
        n_kv_heads: int,
        dropout: float,
        cross: bool = False,
        causal: bool = False,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_k, self.d_v = n_heads, n_kv_heads, d_k, d_v
        self.dropout, self.cross, self.causal = dropout, cross, causal
        self.splits = [n_heads * d_k, n_kv_heads * d_k, n_kv_heads * d_v]  # widths of Q | K | V
        if cross:
            self.w_q = nn.Linear(d_model, self.splits[0], bias=False)
            self.w_kv = nn.Linear(d_model, self.splits[1] + self.splits[2], bias=False)
        else:
            self.w_qkv = nn.Linear(d_model, sum(self.splits), bias=False)
        self.w_o = nn.Linear(n_heads * d_v, d_model, bias=False)

    def reset_parameters(self, qkv_gain: float = 1.0) -> None:
        """Xavier-uniform for each of W^Q, W^K, W^V (with gain `qkv_gain`) and W^O separately, even
        where they are one matrix (`Transformer.reset_parameters`)."""
        with torch.no_grad():
            if self.cross:
                blocks = [self.w_q.weight, *self.w_kv.weight.split(self.splits[1:])]
            else:
                blocks = list(self.w_qkv.weight.split(self.splits))
            for block in blocks:
                nn.init.xavier_uniform_(block, gain=qkv_gain)
            nn.init.xavier_uniform_(self.w_o.weight)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        key_mask: Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """x (B, T, d_model): the queries (and the keys and values of self-attention); memory
        (B, S, d_model): the keys and values of encoder-decoder attention; key_mask (B, T_k), True = a
        real token. Returns (B, T, d_model).

        With a `cache` (incremental decoding, transformer/decoding/cache.py), x holds the newest
        positions only: self-attention adds their keys and values to those of the positions before and
        attends over all of them; encoder-decoder attention takes the encoder's keys and values and
        mask from the cache, projected once per source and shared by the B / N beams of each of its N
        sentences (memory and key_mask unused)."""
        if cache is None:
            q, k, v = self.project(x, memory)
            mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, T_k)
            return self.combine(self.attend(q, k, v, mask, self.causal))
        if not self.cross:
            q, k, v = self.project(x)
            k, v, mask = cache.extend(k, v)  # (B, H_kv, T_k, d): every position so far
            return self.combine(self.attend(q, k, v, mask, causal=False))
        q = self.project_q(x)  # (B, H, T, d_k)
        k, v, mask = cache.memory()  # (N, H_kv, S, d), (N, 1, 1, S)
        (b, h, t, d_k), n = q.shape, k.size(0)
        # the beams of a sentence side by side as one query sequence: its keys and values are not copied
        q = q.view(n, b // n, h, t, d_k).transpose(1, 2).reshape(n, h, -1, d_k)  # (N, H, B / N x T, d_k)
        out = self.attend(q, k, v, mask, causal=False)  # (N, H, B / N x T, d_v)
        return self.combine(out.view(n, h, b // n, t, -1).transpose(1, 2).reshape(b, h, t, -1))

    def project(self, x: Tensor, memory: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The heads' queries (B, H, T, d_k), keys (B, H_kv, T_k, d_k) and values (B, H_kv, T_k, d_v)."""
        if self.cross:
            return self.project_q(x), *self.project_kv(memory)
        q, k, v = self.w_qkv(x).split(self.splits, dim=-1)
        return split_heads(q, self.n_heads), split_heads(k, self.n_kv_heads), split_heads(v, self.n_kv_heads)

    def project_q(self, x: Tensor) -> Tensor:
        """Encoder-decoder attention's queries, (B, H, T, d_k)."""
        return split_heads(self.w_q(x), self.n_heads)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Encoder-decoder attention's keys and values, (B, H_kv, S, d)."""
        k, v = self.w_kv(memory).split(self.splits[1:], dim=-1)
        return split_heads(k, self.n_kv_heads), split_heads(v, self.n_kv_heads)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """Eq. (1) for every head at once (dropout on the weights, `model.attention_dropout`: not in the
        paper, 0 by default)."""
        return attention(q, k, v, mask, causal, self.dropout if self.training else 0.0)

    def combine(self, heads: Tensor) -> Tensor:
        """Concat(head_1, ..., head_h) W^O: (B, H, T, d_v) -> (B, T, d_model)."""
        b, h, t, d = heads.shape
        return self.w_o(heads.transpose(1, 2).reshape(b, t, h * d))
