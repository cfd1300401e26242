"""The Transformer (§3, Figure 1): an encoder stack and a decoder stack of N layers each, with one
shared embedding matrix for source tokens, target tokens and the pre-softmax projection (§3.4).

    memory = model.encode(src, src_mask)                # (B, S, d_model)
    states = model.decode(tgt_in, memory, src_mask)     # (B, T, d_model), teacher forcing
    logits = model.project(states)                      # (B, T, vocab)
    logits = model(src, tgt_in)                         # all three

Training (`training/loss.py`) and decoding (`decoding/`) run the same `decode`: the loss makes the
projection itself; decoding passes a cache of keys and values and feeds one token at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer.attention import LayerCache, MultiHeadAttention
from transformer.config import ModelConfig
from transformer.layers import DecoderLayer, Embeddings, EncoderLayer, FeedForward, Routing
from transformer.moe import MixtureOfExperts
from transformer.vocab import PAD_ID


def mixture_of_experts(cfg: ModelConfig) -> MixtureOfExperts:
    """A layer's position-wise network with `model.moe_experts` (a deviation, transformer/moe.py)."""
    return MixtureOfExperts(cfg.d_model, cfg.d_ff, cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity)


class DecoderCache(Protocol):
    """What `Transformer.decode` asks of a cache in incremental decoding (the implementation:
    transformer/decoding/cache.py)."""

    layers: Sequence[LayerCache]  # one per decoder layer

    def positions(self, t: int) -> Tensor:
        """(T,) the positions of the next t tokens."""
        ...

    def advance(self, t: int) -> None:
        """Count t more positions as held."""
        ...


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embeddings(cfg)  # shared by encoder input, decoder input and output (§3.4)
        feed_forward = mixture_of_experts if cfg.moe_experts else None  # None: Eq. (2), the paper
        self.encoder = nn.ModuleList(EncoderLayer(cfg, feed_forward) for _ in range(cfg.n_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg, feed_forward) for _ in range(cfg.n_layers))
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

    def encode(self, src: Tensor, src_mask: Tensor | None = None, routing: Routing | None = None) -> Tensor:
        """src (B, S) token ids -> memory (B, S, d_model); routing: a mixture of experts' in training."""
        src_mask = self.src_mask(src) if src_mask is None else src_mask
        x = self.embed(src)
        for layer in self.encoder:
            x = layer(x, src_mask, routing)
        return self.encoder_norm(x)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor | None = None,
        src_mask: Tensor | None = None,
        cache: DecoderCache | None = None,
        routing: Routing | None = None,
    ) -> Tensor:
        """tgt (B, T) decoder inputs ([BOS] + y_<t) -> final decoder states (B, T, d_model).

        Incremental decoding: with a `cache`, tgt are the tokens after the positions the cache holds,
        whose keys and values it keeps; the encoder's side comes from the cache (memory and src_mask
        unused). The states are those a decode of the whole prefix gives at these positions."""
        positions = None if cache is None else cache.positions(tgt.size(1))
        y = self.embed(tgt, positions)
        for i, layer in enumerate(self.decoder):
            y = layer(y, memory, src_mask, None if cache is None else cache.layers[i], routing)
        if cache is not None:
            cache.advance(tgt.size(1))
        return self.decoder_norm(y)

    def project(self, states: Tensor) -> Tensor:
        """The pre-softmax linear transformation, with the shared embedding matrix: (B, T, d) -> (B, T, V)."""
        return F.linear(states, self.embed.weight)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """src (B, S), tgt (B, T) decoder inputs -> logits (B, T, V): Figure 1 whole."""
        src_mask = self.src_mask(src)
        return self.project(self.decode(tgt, self.encode(src, src_mask), src_mask))

    def num_parameters(self) -> int:
        """Distinct parameters (the shared embedding counted once)."""
        return sum(p.numel() for p in self.parameters())
