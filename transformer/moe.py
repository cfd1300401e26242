"""A mixture-of-experts feed-forward network: a deviation, `model.moe_experts` (the paper has none).

Each layer's FFN (Eq. 2) becomes E experts of the same shape and a learned router, as GShard (Lepikhin
et al., 2020) and the Switch Transformer (Fedus et al., 2021) introduced for translation: each token goes
to its top-k experts, weighted by the router's softmax (renormalised over the k when k > 1); in training
each expert takes at most C = ceil(capacity_factor * tokens * k / E) assignments, first choices of every
token before second choices, and the rest are dropped (the residual connection carries the token on).
Decoding has no capacity limit, so a sentence's translation never depends on its batch. In training,
padding is not a token: it takes no assignment and no place in a queue, and `tokens` in C and the
load-balancing figures count real tokens only, so padding a batch further changes nothing.

The load-balancing loss of each layer, E * sum_e f_e * P_e (f_e: the fraction of tokens whose first
choice is e; P_e: the router's mean probability of e), is 1 when the load is even; `moe_aux_loss` times
their sum over the layers joins the training objective (`auxiliary_loss`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer.config import ModelConfig
from transformer.data.tokenizer import PAD_ID
from transformer.layers import FeedForward


class MixtureOfExperts(nn.Module):
    """E feed-forward experts and a router W_r (d_model, E); forward(x (B, T, d_model)) -> (B, T, d_model).

    `real` (B, T) bool, True = a real token, marks the padding of the next training forward (None:
    every position is real); `use_mixture_of_experts` sets it from the token ids of each stack's input.
    After a forward in training mode, `aux_loss` holds the layer's load-balancing loss (a scalar with
    its gradient), `dropped` the number of assignments past capacity and `assignments` the number of
    all of them (device scalars).
    """

    def __init__(self, d_model: int, d_ff: int, experts: int, top_k: int, capacity_factor: float) -> None:
        super().__init__()
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(d_model, d_ff) for _ in range(experts))
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.real: Tensor | None = None
        self.aux_loss: Tensor | None = None
        self.dropped: Tensor | None = None
        self.assignments: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.size(-1))  # (N, d_model)
        n, n_experts = tokens.size(0), len(self.experts)
        probs = F.softmax(self.router(tokens).float(), dim=-1)  # (N, E)
        gate, expert = probs.topk(self.top_k, dim=-1)  # (N, k) each, best first
        if self.top_k > 1:
            gate = gate / gate.sum(-1, keepdim=True)
        # assignments in priority order: every token's first choice, then every second choice, ...
        expert, gate = expert.t().reshape(-1), gate.t().reshape(-1)  # (k * N,)
        token = torch.arange(n, device=x.device).repeat(self.top_k)  # (k * N,)
        keep = torch.ones_like(expert, dtype=torch.bool)
        if self.training:
            real = probs.new_ones(n) if self.real is None else self.real.reshape(n).to(probs.dtype)  # (N,)
            n_real = real.sum()  # a device scalar: no sync
            count = n_real.clamp_min(1)
            capacity = torch.ceil(self.capacity_factor * count * self.top_k / n_experts)
            one_hot = F.one_hot(expert, n_experts) * real.repeat(self.top_k)[:, None].long()  # (k * N, E)
            position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # place in its expert's queue; pads -1
            keep = (position < capacity) & (position >= 0)
            first = one_hot[:n].sum(0) / count  # f_e, over real tokens (padding rows are zero)
            mean_prob = (probs * real[:, None]).sum(0) / count  # P_e, over real tokens
            self.aux_loss = n_experts * (first * mean_prob).sum()
            self.assignments = n_real * self.top_k
            self.dropped = self.assignments - keep.sum()
        else:
            self.aux_loss = None
        out = torch.zeros_like(tokens)
        for e, ffn in enumerate(self.experts):
            chosen = ((expert == e) & keep).nonzero().squeeze(-1)  # every expert runs, on no rows if none
            rows = token[chosen]
            out.index_add_(0, rows, ffn(tokens[rows]) * gate[chosen, None].to(tokens.dtype))
        return out.view_as(x)


def use_mixture_of_experts(model: nn.Module, cfg: ModelConfig) -> None:
    """Replace the feed-forward network of every encoder and decoder layer with a mixture of experts,
    and show them the padding of each stack's input: the shared embedding sees the source before the
    encoder runs and the target before the decoder runs."""
    for layer in [*model.encoder, *model.decoder]:
        layer.ffn = MixtureOfExperts(cfg.d_model, cfg.d_ff, cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity)
    mixtures = [layer.ffn for layer in [*model.encoder, *model.decoder]]
    model.embed.register_forward_pre_hook(partial(_mark_padding, mixtures))  # a copy of the model maps it


def _mark_padding(mixtures: list[MixtureOfExperts], embed: nn.Module, args: tuple) -> None:
    real = args[0] != PAD_ID if embed.training else None  # (B, T); decoding routes without capacity
    for moe in mixtures:
        moe.real = real


def dropped_fraction(model: nn.Module) -> Tensor:
    """The share of assignments past capacity in the last training forward, over every layer: a device
    scalar, read with the step's other figures."""
    mixtures = [m for m in model.modules() if isinstance(m, MixtureOfExperts) and m.dropped is not None]
    dropped = torch.stack([m.dropped for m in mixtures]).sum()
    return dropped / torch.stack([m.assignments for m in mixtures]).sum().clamp_min(1)


def auxiliary_loss(model: nn.Module) -> Tensor | None:
    """The sum of the layers' load-balancing losses of the last training forward; None without experts."""
    mixtures = [m for m in model.modules() if isinstance(m, MixtureOfExperts)]
    losses = [m.aux_loss for m in mixtures if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
