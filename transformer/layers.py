"""The building blocks of the two stacks (§3.1-§3.5, §5.4): dropout, embeddings with positions, the
position-wise feed-forward network, and the encoder and decoder layers."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from transformer.attention import KV, MultiHeadAttention
from transformer.config import ModelConfig
from transformer.linear import Linear, linear


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...) (§3.5). (P, d_model)"""
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]  # (P, 1)
    inv_freq = torch.pow(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table.float()


class Dropout(nn.Dropout):
    """Dropout (§5.4, P_drop): each unit is zeroed with probability p, the others scaled by 1 / (1 - p).

    On a CPU the mask is drawn as uniform noise u, kept where u >= p: the same distribution, but
    `torch.bernoulli_`, which nn.Dropout uses there, runs one element at a time on non-Intel CPUs
    (AMD EPYC: forward and backward 3x slower). Elsewhere it is nn.Dropout (on a GPU: a fused kernel).
    """

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x  # not even a call (a decoding step on a GPU is bound by its calls, not its math)
        if x.device.type != "cpu":
            return super().forward(x)
        with torch.no_grad():  # the noise becomes the mask in place: 1 / (1 - p) where u >= p, else 0
            mask = torch.rand_like(x).ge_(self.p).mul_(1.0 / (1.0 - self.p))
        return x * mask


class Embeddings(nn.Module):
    """Token embedding x sqrt(d_model) (§3.4) + positional encoding (§3.5), then dropout (§5.4).

    One instance serves the source, the target and (through `weight`) the pre-softmax projection:
    the three share one matrix, as in §3.4.
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
        self.dropout = Dropout(cfg.dropout)

    @property
    def weight(self) -> Tensor:
        return self.tokens.weight  # (V, d_model)

    def forward(self, tokens: Tensor, offset: int | Tensor = 0) -> Tensor:
        """tokens: (B, T) ids at positions offset..offset+T-1 -> (B, T, d_model). The offset may be a
        () long device tensor (static-shape decoding: the host never reads it)."""
        t = tokens.size(1)
        table = self.learned.weight if self.learned is not None else self.table  # (P, d_model)
        if isinstance(offset, Tensor):
            positions = table.index_select(0, offset + torch.arange(t, device=offset.device))
        elif offset + t > table.size(0):  # a slice past the table would broadcast or come back empty
            raise ValueError(f"positions {offset}..{offset + t - 1} pass model.max_positions={table.size(0)}")
        else:
            positions = table[offset : offset + t]
        return self.dropout(self.tokens(tokens) * math.sqrt(self.d_model) + positions)


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 (Eq. 2, §3.3)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_1 = Linear(d_model, d_ff)
        self.w_2 = Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        hidden = linear(x, self.w_1.weight, self.w_1.bias, relu=True)  # max(0, x W_1 + b_1), in one call
        return self.w_2(hidden)


class Residual(nn.Module):
    """A sub-layer's residual connection and layer normalization (§3.1, §5.4).

    Post-LN, the paper: LayerNorm(x + Dropout(Sublayer(x))).
    Pre-LN (`norm_first`, a deviation that trains deep stacks more stably):
    x + Dropout(Sublayer(LayerNorm(x))).
    """

    def __init__(self, d_model: int, dropout: float, norm_first: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, sublayer_out: Tensor) -> Tensor:
        """x: the sub-layer's input; sublayer_out: its output (computed on `self.pre(x)`)."""
        if self.norm_first:
            return x + self.dropout(sublayer_out)
        return self.norm(x + self.dropout(sublayer_out))

    def pre(self, x: Tensor) -> Tensor:
        """What the sub-layer sees: x itself (post-LN) or LayerNorm(x) (pre-LN)."""
        return self.norm(x) if self.norm_first else x


def _attention(cfg: ModelConfig, kind: str, layer: int) -> MultiHeadAttention:
    return MultiHeadAttention(
        cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.n_kv_heads, cfg.attention_dropout, kind, layer
    )


class EncoderLayer(nn.Module):
    """Self-attention, then the feed-forward network, each wrapped in `Residual` (§3.1)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = _attention(cfg, "encoder_self", layer)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)
        self.res_attn = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        """x: (B, S, d_model); src_mask: (B, S), True = a real token."""
        x = self.res_attn(x, self.self_attn(self.res_attn.pre(x), key_mask=src_mask)[0])
        return self.res_ffn(x, self.ffn(self.res_ffn.pre(x)))


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, feed-forward network (§3.1)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = _attention(cfg, "decoder_self", layer)
        self.cross_attn = _attention(cfg, "cross", layer)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)
        self.res_self = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.res_cross = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)

    def forward(
        self,
        y: Tensor,
        memory: Tensor | None,
        src_mask: Tensor,
        self_past: KV | None = None,
        cross_kv: KV | None = None,
    ) -> tuple[Tensor, KV | None, KV]:
        """y: (B, T, d_model); memory: (B, S, d_model) (unused once `cross_kv` is known).

        Returns y, the grown self-attention cache (None when not decoding incrementally) and the
        cross-attention keys/values, which stay the same for every step of one source.
        """
        out, self_kv = self.self_attn(self.res_self.pre(y), past=self_past)
        y = self.res_self(y, out)
        out, cross_kv = self.cross_attn(self.res_cross.pre(y), memory, key_mask=src_mask, past=cross_kv)
        y = self.res_cross(y, out)
        return self.res_ffn(y, self.ffn(self.res_ffn.pre(y))), self_kv, cross_kv
