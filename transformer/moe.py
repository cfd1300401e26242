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
their sum over the layers joins the training objective (`training/loss.py`).

A training forward hands each stack a `Routing`: the mask of its real tokens goes in, and each
mixture's `RoutingStats` come out in its list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer.layers import FeedForward


@dataclass
class RoutingStats:
    """One mixture's training forward: its load-balancing loss (with its gradient), the assignments
    past capacity and all of them (device scalars)."""

    loss: Tensor
    dropped: Tensor
    assignments: Tensor


class MixtureOfExperts(nn.Module):
    """E feed-forward experts and a router W_r (d_model, E).

    forward(x (B, T, d_model)) -> (B, T, d_model): every assignment kept (decoding);
    route(x, real) -> the same with capacity, and the layer's `RoutingStats` (training)."""

    def __init__(self, d_model: int, d_ff: int, experts: int, top_k: int, capacity_factor: float) -> None:
        super().__init__()
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(d_model, d_ff) for _ in range(experts))
        self.top_k = top_k
        self.capacity_factor = capacity_factor

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.size(-1))  # (N, d_model)
        _, expert, gate = self._choices(tokens)
        return self._combine(tokens, expert, gate, torch.ones_like(expert, dtype=torch.bool)).view_as(x)

    def route(self, x: Tensor, real: Tensor | None) -> tuple[Tensor, RoutingStats]:
        """x (B, T, d_model); real (B, T) bool, True = a real token (None: every position is)."""
        tokens = x.reshape(-1, x.size(-1))  # (N, d_model)
        n, n_experts = tokens.size(0), len(self.experts)
        probs, expert, gate = self._choices(tokens)
        real = probs.new_ones(n) if real is None else real.reshape(n).to(probs.dtype)  # (N,)
        n_real = real.sum()  # a device scalar: no sync
        count = n_real.clamp_min(1)
        capacity = torch.ceil(self.capacity_factor * count * self.top_k / n_experts)
        one_hot = F.one_hot(expert, n_experts) * real.repeat(self.top_k)[:, None].long()  # (k * N, E)
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # place in its expert's queue; pads -1
        keep = (position < capacity) & (position >= 0)
        first = one_hot[:n].sum(0) / count  # f_e, over real tokens (padding rows are zero)
        mean_prob = (probs * real[:, None]).sum(0) / count  # P_e, over real tokens
        assignments = n_real * self.top_k
        stats = RoutingStats(n_experts * (first * mean_prob).sum(), assignments - keep.sum(), assignments)
        return self._combine(tokens, expert, gate, keep).view_as(x), stats

    def _choices(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The router's probabilities (N, E) float32, and the assignments in priority order (every
        token's first choice, then every second choice, ...): expert (k * N,) and gate (k * N,)."""
        probs = F.softmax(self.router(tokens).float(), dim=-1)  # (N, E)
        gate, expert = probs.topk(self.top_k, dim=-1)  # (N, k) each, best first
        if self.top_k > 1:
            gate = gate / gate.sum(-1, keepdim=True)
        return probs, expert.t().reshape(-1), gate.t().reshape(-1)

    def _combine(self, tokens: Tensor, expert: Tensor, gate: Tensor, keep: Tensor) -> Tensor:
        """sum over a token's kept assignments of gate x expert(token): (N, d_model)."""
        token = torch.arange(tokens.size(0), device=tokens.device).repeat(self.top_k)  # (k * N,)
        out = torch.zeros_like(tokens)
        for e, ffn in enumerate(self.experts):
            chosen = ((expert == e) & keep).nonzero().squeeze(-1)  # every expert runs, on no rows if none
            rows = token[chosen]
            out.index_add_(0, rows, ffn(tokens[rows]) * gate[chosen, None].to(tokens.dtype))
        return out


@dataclass
class Routing:
    """One stack's part of a training forward: `real` (B, T), True = a real token of its input, goes in;
    each mixture of the stack appends its statistics to `stats`. Called with a layer's feed-forward
    network, gives it as the layer calls it: a mixture routes with capacity; a dense one is itself."""

    real: Tensor
    stats: list[RoutingStats] = field(default_factory=list)

    def __call__(self, ffn: nn.Module) -> Callable[[Tensor], Tensor]:
        if not isinstance(ffn, MixtureOfExperts):
            return ffn
        return self._routed(ffn)

    def _routed(self, moe: MixtureOfExperts) -> Callable[[Tensor], Tensor]:
        def call(x: Tensor) -> Tensor:
            out, stats = moe.route(x, self.real)
            self.stats.append(stats)
            return out

        return call


def load_balancing_loss(stats: list[RoutingStats]) -> Tensor:
    """The sum of the layers' load-balancing losses."""
    return torch.stack([s.loss for s in stats]).sum()


def dropped_fraction(stats: list[RoutingStats]) -> Tensor:
    """The share of assignments past capacity over every layer: a device scalar."""
    dropped = torch.stack([s.dropped for s in stats]).sum()
    return dropped / torch.stack([s.assignments for s in stats]).sum().clamp_min(1)
