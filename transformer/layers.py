"""The building blocks of the two stacks (§3.1-§3.5, §5.4): positional encoding, embeddings, the
position-wise feed-forward network, the residual connection around each sub-layer, and the encoder
and decoder layers."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from transformer.attention import LayerCache, MultiHeadAttention
from transformer.config import ModelConfig

# A mixture of experts' training call: the feed-forward network as the layer calls it (transformer/moe.py).
Routing = Callable[[nn.Module], Callable[[Tensor], Tensor]]
FeedForwardBuilder = Callable[[ModelConfig], nn.Module]


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...) (§3.5). (P, d_model)"""
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]  # (P, 1)
    inv_freq = torch.pow(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table.float()


class Embeddings(nn.Module):
    """Token embedding x sqrt(d_model) (§3.4) + positional encoding (§3.5), then dropout (§5.4).

    One instance serves the source, the target and, through `weight`, the pre-softmax projection: the
    three share one matrix (§3.4).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.d_model = cfg.d_model
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.positional == "learned":  # Table 3, row (E)
            self.learned = nn.Embedding(cfg.max_positions, cfg.d_model)
        else:
            self.learned = None
            self.register_buffer("table", sinusoidal_table(cfg.max_positions, cfg.d_model), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)

    @property
    def weight(self) -> Tensor:
        return self.tokens.weight  # (V, d_model)

    def forward(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """tokens (B, T) at `positions` (T,) (default 0, ..., T - 1) -> (B, T, d_model)."""
        table = self.learned.weight if self.learned is not None else self.table  # (P, d_model)
        if positions is None:
            if tokens.size(1) > table.size(0):  # a slice past the table would come back short
                raise ValueError(f"{tokens.size(1)} positions pass model.max_positions={table.size(0)}")
            encoding = table[: tokens.size(1)]
        else:
            encoding = table.index_select(0, positions)
        return self.dropout(self.tokens(tokens) * math.sqrt(self.d_model) + encoding)


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 (Eq. 2, §3.3)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(torch.relu(self.w_1(x)))


class Residual(nn.Module):
    """The residual connection and layer normalization around a sub-layer (§3.1), with dropout on the
    sub-layer's output (§5.4).

    Post-LN, the paper: LayerNorm(x + Dropout(Sublayer(x))).
    Pre-LN (`model.norm_first`, a deviation): x + Dropout(Sublayer(LayerNorm(x))).
    """

    def __init__(self, d_model: int, dropout: float, norm_first: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


def _attention(cfg: ModelConfig, cross: bool = False, causal: bool = False) -> MultiHeadAttention:
    return MultiHeadAttention(
        cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.n_kv_heads, cfg.attention_dropout, cross, causal
    )


class EncoderLayer(nn.Module):
    """Self-attention, then the feed-forward network, each inside a `Residual` (§3.1). `feed_forward(cfg)`
    builds another position-wise network than `FeedForward` (a mixture of experts)."""

    def __init__(self, cfg: ModelConfig, feed_forward: FeedForwardBuilder | None = None) -> None:
        super().__init__()
        self.self_attn = _attention(cfg)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff) if feed_forward is None else feed_forward(cfg)
        self.res_self = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)

    def forward(self, x: Tensor, src_mask: Tensor, routing: Routing | None = None) -> Tensor:
        """x (B, S, d_model); src_mask (B, S), True = a real token; routing: how a mixture of experts
        is called in training (transformer/moe.py)."""
        x = self.res_self(x, lambda h: self.self_attn(h, key_mask=src_mask))
        return self.res_ffn(x, self.ffn if routing is None else routing(self.ffn))


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, then the feed-forward network (§3.1);
    `feed_forward` as in `EncoderLayer`."""

    def __init__(self, cfg: ModelConfig, feed_forward: FeedForwardBuilder | None = None) -> None:
        super().__init__()
        self.self_attn = _attention(cfg, causal=True)
        self.cross_attn = _attention(cfg, cross=True)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff) if feed_forward is None else feed_forward(cfg)
        self.res_self = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.res_cross = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)

    def forward(
        self,
        y: Tensor,
        memory: Tensor | None,
        src_mask: Tensor | None,
        cache: LayerCache | None = None,
        routing: Routing | None = None,
    ) -> Tensor:
        """y (B, T, d_model); memory (B, S, d_model), the encoder's output; src_mask (B, S); cache: this
        layer's keys and values in incremental decoding (y the newest positions; memory and src_mask
        come from the cache); routing as in `EncoderLayer`."""
        y = self.res_self(y, lambda h: self.self_attn(h, cache=cache))
        y = self.res_cross(y, lambda h: self.cross_attn(h, memory, src_mask, cache=cache))
        return self.res_ffn(y, self.ffn if routing is None else routing(self.ffn))
