"""The Transformer (§3, Figure 1): an encoder stack and a decoder stack of N layers each, with one
shared embedding matrix for source tokens, target tokens and the pre-softmax projection (§3.4).

    memory = model.encode(src, src_mask)                # (B, S, d_model)
    logits = model.decode(tgt_in, memory, src_mask)     # (B, T, vocab), teacher forcing
    logits = model(src, tgt_in)                         # both

Decoding one token at a time, with cached keys and values, is `transformer.decoding`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer.attention import MultiHeadAttention
from transformer.config import ModelConfig
from transformer.data.tokenizer import PAD_ID
from transformer.layers import DecoderLayer, Embeddings, EncoderLayer, FeedForward
from transformer.moe import use_mixture_of_experts


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embeddings(cfg)  # shared by encoder input, decoder input and output (§3.4)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        # Pre-LN leaves the last residual stream un-normalized; post-LN (the paper) already ends in LayerNorm.
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()
        if cfg.moe_experts:  # a deviation: mixtures of experts for the feed-forward networks
            use_mixture_of_experts(self, cfg)
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
        """src (B, S) token ids -> memory (B, S, d_model)."""
        src_mask = self.src_mask(src) if src_mask is None else src_mask
        x = self.embed(src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.encoder_norm(x)

    def decoder_states(self, tgt: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """Teacher forcing: tgt (B, T) decoder inputs -> final decoder states (B, T, d_model)."""
        y = self.embed(tgt)
        for layer in self.decoder:
            y = layer(y, memory, src_mask)
        return self.decoder_norm(y)

    def project(self, states: Tensor) -> Tensor:
        """The pre-softmax linear transformation, with the shared embedding matrix: (B, T, d) -> (B, T, V)."""
        return F.linear(states, self.embed.weight)

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """tgt (B, T) decoder inputs ([BOS] + y_<t) -> logits (B, T, V) over the next token."""
        return self.project(self.decoder_states(tgt, memory, src_mask))

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Training: src (B, S), tgt (B, T) decoder inputs -> logits (B, T, V)."""
        src_mask = self.src_mask(src)
        return self.decode(tgt, self.encode(src, src_mask), src_mask)

    def num_parameters(self) -> int:
        """Distinct parameters (the shared embedding counted once)."""
        return sum(p.numel() for p in self.parameters())
