"""The Transformer (§3, Figure 1): an encoder stack and a decoder stack of N layers each, with one
shared embedding matrix for source tokens, target tokens and the pre-softmax projection (§3.4).

    memory = model.encode(src, src_mask)                        # (B, S, d_model)
    logits = model.decode(tgt_in, memory, src_mask)             # (B, T, vocab), teacher forcing
    states, cache = model.decode_step(tokens, memory, src_mask, cache)  # incremental decoding
    logits = model.project(states)                               # (B, t, vocab)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from transformer.attention import KV, GrowingKV, MultiHeadAttention
from transformer.config import ModelConfig
from transformer.data.tokenizer import PAD_ID
from transformer.layers import DecoderLayer, Embeddings, EncoderLayer, FeedForward
from transformer.linear import linear


@dataclass
class DecoderCache:
    """Incremental decoding state, passed in and returned explicitly.

    self_kv: per layer, decoder self-attention keys/values of every position so far, (B, H_kv, t, d);
    cross_kv: per layer, encoder-decoder keys/values, computed once per source, (B, H_kv, S, d).
    """

    self_kv: list[GrowingKV | None] = field(default_factory=list)
    cross_kv: list[KV | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Target positions already decoded."""
        return 0 if not self.self_kv or self.self_kv[0] is None else self.self_kv[0].length

    def select(self, index: Tensor, cross_index: Tensor | None) -> DecoderCache:
        """Keep self-attention rows `index` (B',) and cross-attention rows `cross_index`.

        cross_index=None leaves the cross-attention keys/values as they are: in beam search they
        have one row per sentence, shared by its beams (see `MultiHeadAttention`), so reordering
        beams never copies them; only sentences leaving the batch do. The self-attention reorder is
        carried out by the next `decode_step` (see `GrowingKV`).
        """
        cross = self.cross_kv if cross_index is None else [kv.select(cross_index) for kv in self.cross_kv]
        return DecoderCache([kv.select(index) for kv in self.self_kv], cross)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embeddings(cfg)  # shared by encoder input, decoder input and output (§3.4)
        self.encoder = nn.ModuleList(EncoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        # Pre-LN leaves the last residual stream un-normalized; post-LN (the paper) already ends in LayerNorm.
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise as `cfg.init` says (the paper states none; docs/paper_map.md): embeddings
        N(0, d_model^-0.5) in every scheme, and

        - "t2t": tensor2tensor's transformer_base of 2017, the authors' code: Xavier-uniform (its
          "uniform_unit_scaling", gain 1) on each weight matrix as that code lays it out, W^Q, W^K, W^V
          of self-attention one (3 d_model, d_model) matrix, W^K, W^V of cross-attention one (as here);
          zero biases;
        - "fairseq": fairseq's: Xavier with gain 1/sqrt(2) on each of W^Q, W^K, W^V, Xavier on W^O,
          PyTorch's default `nn.Linear` init (weights and biases) in the feed-forward network, a zero
          padding row;
        - "xavier": Xavier-uniform on each of W^Q, W^K, W^V, W^O and the feed-forward weights; zero biases.
        """
        init = self.cfg.init
        for module in self.modules():  # every matrix whole, fused projections included: "t2t"
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for module in self.modules():
            if isinstance(module, MultiHeadAttention) and init != "t2t":
                module.reset_parameters(qkv_gain=2**-0.5 if init == "fairseq" else 1.0)
            if isinstance(module, FeedForward) and init == "fairseq":
                module.w_1.reset_parameters()
                module.w_2.reset_parameters()
        for embedding in (self.embed.tokens, self.embed.learned):
            if embedding is not None:
                nn.init.normal_(embedding.weight, mean=0.0, std=self.cfg.d_model**-0.5)
        if init == "fairseq":
            with torch.no_grad():
                self.embed.tokens.weight[PAD_ID].zero_()

    def src_mask(self, src: Tensor) -> Tensor:
        """(B, S) bool, True = a real (non-pad) source token."""
        return src != PAD_ID

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """src: (B, S) token ids -> memory (B, S, d_model)."""
        src_mask = self.src_mask(src) if src_mask is None else src_mask
        x = self.embed(src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.encoder_norm(x)

    def decoder_states(self, tgt: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """Teacher forcing: tgt (B, T) decoder inputs -> final decoder states (B, T, d_model)."""
        y = self.embed(tgt)
        for layer in self.decoder:
            y = layer(y, memory, src_mask)[0]
        return self.decoder_norm(y)

    def project(self, states: Tensor, start: int = 0, end: int | None = None) -> Tensor:
        """Pre-softmax linear transformation with the shared embedding matrix: (B, T, d) -> (B, T, V),
        or only the logits of vocabulary entries [start, end)."""
        return linear(states, self.embed.weight[start:end])

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """tgt: (B, T) decoder inputs ([BOS] + y_<t) -> logits (B, T, V) over the next token."""
        return self.project(self.decoder_states(tgt, memory, src_mask))

    @torch.no_grad()
    def decode_step(
        self,
        tokens: Tensor,
        memory: Tensor | None,
        src_mask: Tensor,
        cache: DecoderCache | None = None,
        max_length: int = 0,
    ) -> tuple[Tensor, DecoderCache]:
        """Incremental decoding (inference, no gradients): tokens (B, t) that follow the `cache.length`
        positions already seen.

        Returns the final decoder states (B, t, d_model) (`project` gives the logits) and the grown
        cache; the input cache is consumed. memory may be None once the cache holds the cross-attention
        keys and values. A new cache makes room for `max_length` positions at once (a search's limit).
        """
        cache = cache if cache is not None else DecoderCache()
        n = len(self.decoder)
        self_kv = cache.self_kv or [None] * n
        cross_kv = cache.cross_kv or [None] * n
        y = self.embed(tokens, offset=cache.length)
        new_self, new_cross = [], []
        for layer, past, cross in zip(self.decoder, self_kv, cross_kv):
            if cross is None:  # first step; the cross-attention keys and values are laid out
                # (B, H_kv, S, d) once, as every step's attention reads them
                cross = layer.cross_attn.project_kv(memory)
                cross = KV(cross.k.contiguous(), cross.v.contiguous())
            past = past if past is not None else GrowingKV(reserve=max_length)
            y, past, cross = layer(y, memory, src_mask, self_past=past, cross_kv=cross)
            new_self.append(past)
            new_cross.append(cross)
        return self.decoder_norm(y), DecoderCache(new_self, new_cross)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Training: src (B, S), tgt (B, T) decoder inputs -> logits (B, T, V)."""
        src_mask = self.src_mask(src)
        return self.decode(tgt, self.encode(src, src_mask), src_mask)

    def num_parameters(self) -> int:
        """Distinct parameters (the shared embedding counted once)."""
        return sum(p.numel() for p in self.parameters())
