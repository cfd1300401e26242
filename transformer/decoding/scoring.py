"""The next-token distribution a search chooses from (§6.1), for one model or an ensemble, and the
draws of sampling.

- `best_next_tokens`: the n most probable next tokens of one model, its vocabulary projected a chunk at
  a time on a CPU;
- `next_log_probs`: every next token's log-probability, of one model or of an `Ensemble` (the weighted
  average of its models' probabilities, as fairseq, OpenNMT-py and Marian combine them);
- `sample_tokens`: a draw from a distribution narrowed by temperature, top-k and top-p, with the uniform
  numbers of `uniform_draws`, which depend on (seed, sentence, sample, step) only: the same seed gives the
  same samples whatever the batches.

PAD and BOS are never generated; EOS is held back while step <= min_len (`mask_specials`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer.config import SearchConfig
from transformer.model import Transformer
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID

NEG_INF = float("-inf")
VOCAB_CHUNK = 8192  # vocabulary entries projected at once on a CPU while choosing the next tokens
Linear = Callable[[Tensor, Tensor], Tensor]  # x (R, d), W (V', d) -> x W^T: F.linear, or kernels.Products


@dataclass
class Ensemble:
    """Several models that decode as one: at each step the weighted average of their next-token
    probabilities; each model has its own cache. `weights` sum to one."""

    models: list[Transformer]
    weights: list[float]

    def __post_init__(self) -> None:
        if len(self.models) != len(self.weights) or not self.models:
            raise ValueError(f"{len(self.models)} models but {len(self.weights)} weights")
        total = sum(self.weights)
        if total <= 0 or any(w < 0 for w in self.weights):
            raise ValueError(f"ensemble weights {self.weights} must be >= 0 and not all 0")
        self.weights = [w / total for w in self.weights]


def members(model: Transformer | Ensemble) -> list[Transformer]:
    return model.models if isinstance(model, Ensemble) else [model]


def vocab_chunks(vocab: int, device: torch.device) -> list[tuple[int, int]]:
    """[start, end) of about VOCAB_CHUNK entries each on a CPU (each chunk's logits used while they are
    still in cache), the whole vocabulary elsewhere."""
    if device.type != "cpu":
        return [(0, vocab)]
    size = -(-vocab // -(-vocab // VOCAB_CHUNK))
    return [(start, min(start + size, vocab)) for start in range(0, vocab, size)]


def mask_specials(log_probs: Tensor, step: Tensor, min_len: int) -> Tensor:
    """In place on log_probs (R, c) whose column 0 is token 0: PAD and BOS never, EOS not while
    step <= min_len. Fills only: no tensor made from host data (CUDA graphs)."""
    log_probs[:, PAD_ID].fill_(NEG_INF)
    log_probs[:, BOS_ID].fill_(NEG_INF)
    log_probs[:, EOS_ID].masked_fill_(step <= min_len, NEG_INF)
    return log_probs


def best_next_tokens(
    states: Tensor, weight: Tensor, step: Tensor, min_len: int, n: int, linear: Linear = F.linear
) -> tuple[Tensor, Tensor]:
    """The n most probable next tokens after each final decoder state of states (R, d_model), projected
    by the output matrix weight (V, d_model), and their float32 log P(y_step | y_<step, X). The
    vocabulary is projected a chunk at a time on a CPU (`vocab_chunks`): no (R, V) tensor is made at
    each step there."""
    chunks = vocab_chunks(weight.size(0), weight.device)
    lses, values, indices = [], [], []
    for start, end in chunks:
        logits = linear(states, weight[start:end])  # (R, c)
        log_probs = logits.log_softmax(dim=-1, dtype=torch.float32)  # (R, c), normalized within the chunk
        if start == 0:
            mask_specials(log_probs, step, min_len)
        top, index = log_probs.topk(min(n, end - start), dim=-1)  # (R, n), best first
        if len(chunks) == 1:
            return top, index
        # the chunk's log-sum-exp, from its best entry (finite even where PAD and BOS are among the n)
        lse = logits.gather(1, index[:, :1]).float() - top[:, :1]  # (R, 1)
        lses.append(lse)
        values.append(top + lse)  # (R, n) their logits, in float32
        indices.append(index + start)
    lse = torch.cat(lses, dim=1).logsumexp(dim=1, keepdim=True)  # (R, 1) over the whole vocabulary
    candidates = torch.cat(values, dim=1)  # (R, chunks * n)
    best, pick = candidates.topk(min(n, candidates.size(1)), dim=-1)  # (R, n), best first
    return best - lse, torch.cat(indices, dim=1).gather(1, pick)


def project(states: Tensor, weight: Tensor, linear: Linear) -> Tensor:
    """The logits (R, V) of states (R, d_model), a vocabulary chunk at a time (`vocab_chunks`: the
    chunks `search_weights` packs)."""
    chunks = vocab_chunks(weight.size(0), weight.device)
    if len(chunks) == 1:
        return linear(states, weight)
    return torch.cat([linear(states, weight[start:end]) for start, end in chunks], dim=-1)


def next_log_probs(
    states: list[Tensor], model: Transformer | Ensemble, step: Tensor, min_len: int, linear: Linear
) -> Tensor:
    """(R, V) float32 log P(y_step | y_<step, X) of every token, from each member's final decoder states
    (R, d_model); an ensemble's is log sum_m w_m P_m."""
    models = members(model)
    weights = model.weights if isinstance(model, Ensemble) else [1.0]
    each = [
        project(h, m.embed.weight, linear).log_softmax(dim=-1, dtype=torch.float32) + math.log(w)
        for h, m, w in zip(states, models, weights)
        if w > 0
    ]
    log_probs = each[0] if len(each) == 1 else torch.stack(each).logsumexp(dim=0)
    return mask_specials(log_probs, step, min_len)


def uniform_draws(keys: Tensor, step: Tensor) -> Tensor:
    """(R,) float64 uniform numbers in [0, 1), one per row, a hash (splitmix64) of the row's key (R,)
    int64 and the step: independent of the batch a row is decoded in."""
    z = keys * 1_000_003 + step  # (R,) int64; products wrap around, as the hash expects
    z = z + -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
    z = (z ^ _shift(z, 30)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    z = (z ^ _shift(z, 27)) * -7723592293110705685  # 0x94D049BB133111EB
    z = z ^ _shift(z, 31)
    return _shift(z, 11).double() / 2.0**53  # the top 53 bits


def _shift(z: Tensor, bits: int) -> Tensor:
    """A logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def sample_keys(seed: int, sentences: Tensor, samples: int) -> Tensor:
    """(N * samples,) int64: the key of each (sentence, sample) row, sentence-major, for `uniform_draws`."""
    sample = torch.arange(samples, device=sentences.device)
    return ((seed * 1_000_003 + sentences[:, None]) * 65_537 + sample).view(-1)


def sample_tokens(log_probs: Tensor, sampling: SearchConfig, draws: Tensor) -> Tensor:
    """(R, 1) tokens drawn from the distribution of log_probs (R, V) that ancestral sampling narrows
    (`SearchConfig`: softmax(logits / temperature), the `topk` most probable (0 = all), the smallest set
    whose probability reaches `topp` (1.0 = all)), by inverse transform with the uniform numbers draws
    (R,). With top-k only the k best are ranked and summed; plain sampling sums the whole vocabulary
    in float32 (its last entry, a real piece, takes a draw that rounding pushes past the sum), top-p
    in float64."""
    index = None  # the vocabulary ids of the columns kept, when not all of them
    logits = log_probs
    if 0 < sampling.topk < log_probs.size(-1):
        logits, index = log_probs.topk(sampling.topk, dim=-1)  # (R, k), best first
    precise = torch.float64 if index is not None or sampling.topp < 1.0 else torch.float32
    probs = (logits / sampling.temperature).softmax(dim=-1, dtype=precise)  # (R, k or V)
    if sampling.topp < 1.0:
        if index is None:
            probs, index = probs.sort(dim=-1, descending=True)
        before = probs.cumsum(dim=-1) - probs  # mass of the more probable tokens
        probs = probs.masked_fill(before >= sampling.topp, 0.0)  # the first always stays
    cdf = probs.cumsum(dim=-1)
    target = (draws[:, None] * cdf[:, -1:].double()).to(cdf.dtype)  # (R, 1), within the kept mass
    pick = torch.searchsorted(cdf, target, right=True).clamp(max=probs.size(-1) - 1)  # (R, 1)
    return pick if index is None else index.gather(1, pick)
