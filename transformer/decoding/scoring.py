"""The next-token distribution a search chooses from (§6.1), for one model or an ensemble, and the
draws of sampling.

- `best_next_tokens`: the n most probable next tokens of one model, its vocabulary projected a chunk at
  a time on a CPU;
- `next_log_probs`: every next token's log-probability, of one model or of an `Ensemble` (the weighted
  average of its models' probabilities, as fairseq, OpenNMT-py and Marian combine them);
- `sample_tokens`: a draw from a distribution narrowed by temperature, top-k and top-p, with the uniform
  numbers of `uniform_draws`, which depend on (seed, sentence, sample, step) only: the same seed gives the
  same samples whatever the batches;
- `Shortlist`: the output vocabulary narrowed to a batch's candidates (a vocabulary map's), the
  distribution normalized over them;
- `Repeats`: repetition control, CTranslate2's semantics (Hugging Face's in greedy search and sampling):
  `repetition_penalty` p scales the logit of every token already in the hypothesis (z / p where z > 0,
  z * p where z < 0; Keskar et al. 2019) before the softmax, and `no_repeat_ngram_size` n forbids a token
  that would complete an n-gram the hypothesis already holds. A search ranks by the penalised
  distribution; each token's recorded log-probability stays the model's own.

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
TOP_N_SEGMENTS = 8  # `top_n`: a row of C entries seen as 8 segments of C / 8
TOP_N_MIN = 4096  # `top_n` takes Tensor.topk itself on rows of fewer entries, where its calls cost more
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


@dataclass
class Shortlist:
    """A search's output vocabulary narrowed to the pieces `ids` (K,), ascending, every special symbol
    among them (`inference/vocabulary_map.py`): each model projects onto those rows of its output
    matrix only (`weights`, (K, d_model) each, in the models' order), and the next-token
    distribution is normalized over them."""

    ids: Tensor
    weights: list[Tensor]

    @classmethod
    def of(cls, model: Transformer | Ensemble, ids: Tensor) -> Shortlist:
        specials, vocab = torch.arange(EOS_ID + 1), members(model)[0].embed.weight.size(0)
        if ids.numel() <= EOS_ID or not torch.equal(ids[: EOS_ID + 1].cpu(), specials):
            raise ValueError(f"a shortlist starts with every special symbol, ids {specials.tolist()}")
        if not bool((ids[1:] > ids[:-1]).all()) or int(ids[-1]) >= vocab:
            raise ValueError(f"a shortlist's ids ascend, each once, below the vocabulary's {vocab}")
        weights = [m.embed.weight.index_select(0, ids.to(m.embed.weight.device)) for m in members(model)]
        return cls(ids.to(weights[0].device), weights)

    def chunks(self) -> list[Tensor]:
        """Every member's rows a chunk at a time, as the search projects them (`projection_chunks`):
        the weights to pack for the batch."""
        return [chunk for weight in self.weights for chunk in projection_chunks(weight)]

    def widen(self, logits: Tensor, vocab: int) -> Tensor:
        """logits (R, K) over the shortlist -> (R, vocab), -inf for the pieces outside it."""
        return logits.new_full((logits.size(0), vocab), NEG_INF).index_copy_(1, self.ids, logits)


def projection_chunks(weight: Tensor) -> list[Tensor]:
    """The output matrix (V, d_model) a chunk at a time as the search projects it (`vocab_chunks`)."""
    return [weight[start:end] for start, end in vocab_chunks(weight.size(0), weight.device)]


def vocab_chunks(vocab: int, device: torch.device) -> list[tuple[int, int]]:
    """[start, end) of about VOCAB_CHUNK entries each on a CPU (each chunk's logits used while they are
    still in cache), the whole vocabulary elsewhere."""
    if device.type != "cpu":
        return [(0, vocab)]
    size = -(-vocab // -(-vocab // VOCAB_CHUNK))
    return [(start, min(start + size, vocab)) for start in range(0, vocab, size)]


def top_n(x: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """x.topk(n) along the last dimension of x (R, C): the n largest entries of each row, best first, and
    their indices. A row is seen as TOP_N_SEGMENTS segments laid over each other, and an entry among the
    row's n largest lies in one of the n columns with the largest maxima (were its column not among
    them, n other columns would each hold a larger entry), so only those columns' entries are ranked.
    The values are topk's; among exactly equal entries the indices taken may differ."""
    r, c = x.shape
    width = c // TOP_N_SEGMENTS
    if c < TOP_N_MIN or width < n or not x.is_cpu:  # never by the rows: a row's result is its own
        return x.topk(n, dim=-1)
    whole = width * TOP_N_SEGMENTS
    column_max = x[:, :whole].view(r, TOP_N_SEGMENTS, width).amax(dim=1)  # (R, width)
    columns = column_max.topk(n, dim=1)[1]  # (R, n)
    starts = torch.arange(0, whole, width, device=x.device)  # (segments,)
    index = (starts[None, :, None] + columns[:, None, :]).view(r, -1)  # (R, segments * n)
    if whole < c:  # the entries past the last whole segment are candidates too
        index = torch.cat([index, torch.arange(whole, c, device=x.device).expand(r, -1)], dim=1)
    top, pick = x.gather(1, index).topk(n, dim=1)  # (R, n)
    return top, index.gather(1, pick)


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
        top, index = top_n(log_probs, min(n, end - start))  # (R, n), best first
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
    chunks = projection_chunks(weight)
    if len(chunks) == 1:
        return linear(states, weight)
    return torch.cat([linear(states, chunk) for chunk in chunks], dim=-1)


def next_log_probs(
    states: list[Tensor],
    model: Transformer | Ensemble,
    step: Tensor,
    min_len: int,
    linear: Linear,
    repeats: Repeats | None = None,
    shortlist: Shortlist | None = None,
) -> tuple[Tensor, Tensor]:
    """(ranked, own), each (R, V) float32: own = log P(y_step | y_<step, X) of every token, from each
    member's final decoder states (R, d_model), an ensemble's log sum_m w_m P_m; ranked = the same with
    `repeats` acting on each member's logits (own itself without). With a shortlist, each member's
    distribution is over its pieces only (-inf elsewhere)."""
    models = members(model)
    weights = model.weights if isinstance(model, Ensemble) else [1.0]
    vocab = models[0].embed.weight.size(0)
    outputs = [m.embed.weight for m in models] if shortlist is None else shortlist.weights
    logits = [(project(h, out, linear), w) for h, out, w in zip(states, outputs, weights) if w > 0]
    if shortlist is not None:
        logits = [(shortlist.widen(z, vocab), w) for z, w in logits]

    def mixture(each: list[tuple[Tensor, float]]) -> Tensor:
        log_probs = [z.log_softmax(dim=-1, dtype=torch.float32) + math.log(w) for z, w in each]
        log_probs = log_probs[0] if len(log_probs) == 1 else torch.stack(log_probs).logsumexp(dim=0)
        return mask_specials(log_probs, step, min_len)

    own = mixture(logits)
    return (own, own) if repeats is None else (mixture([(repeats(z), w) for z, w in logits]), own)


@dataclass
class Repeats:
    """One step's repetition control (see the module docstring) over rows whose tokens so far are the
    first step - 1 of history (R, L): which tokens each row holds (`seen`) and which would repeat an
    n-gram (`banned`), both (R, V) bool or None when off. Reads nothing on the host (CUDA graphs)."""

    penalty: float
    seen: Tensor | None
    banned: Tensor | None

    @classmethod
    def of(cls, history: Tensor, step: Tensor, vocab: int, search: SearchConfig) -> Repeats | None:
        if search.repetition_penalty == 1.0 and not search.no_repeat_ngram_size:
            return None
        valid = torch.arange(history.size(1), device=history.device) < step - 1  # (L,) the tokens so far
        seen = banned = None
        if search.repetition_penalty != 1.0:
            seen = _mark(torch.where(valid, history, vocab), vocab)
        if search.no_repeat_ngram_size:
            banned = _ngram_completions(history, step, vocab, search.no_repeat_ngram_size)
        return cls(search.repetition_penalty, seen, banned)

    def __call__(self, logits: Tensor) -> Tensor:
        """logits (R, c) of the vocabulary's first c tokens, penalised and banned (a new tensor)."""
        if self.seen is not None:
            scaled = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
            logits = torch.where(self.seen, scaled, logits)
        if self.banned is not None:
            logits = logits.masked_fill(self.banned, NEG_INF)
        return logits


def force_prefix(log_probs: Tensor, own: Tensor, prefix: Tensor, step: Tensor, k: int) -> Tensor:
    """log_probs (N * k, V) where a row's sentence has a prefix (N, P) (padded with PAD_ID) this long: every
    token but the prefix's at `step` impossible, the forced one with the model's own log-probability of
    own (N * k, V) (it counts in the score; no repetition control bans or penalises it). Reads nothing
    on the host."""
    if prefix.size(1) == 0:
        return log_probs
    at = (step - 1).clamp(max=prefix.size(1) - 1).view(1)
    forced = prefix.index_select(1, at).repeat_interleave(k, dim=0)  # (N * k, 1)
    active = (forced != PAD_ID) & (step <= prefix.size(1))  # (N * k, 1)
    others = torch.arange(log_probs.size(1), device=log_probs.device) != forced  # (N * k, V)
    return torch.where(active, own.masked_fill(others, NEG_INF), log_probs)


def _ngram_completions(history: Tensor, step: Tensor, vocab: int, n: int) -> Tensor:
    """(R, V) bool: the tokens that would make y_<step + [token] end in an n-gram already in BOS y_<step
    (history (R, L) holds y_1.. in its first step - 1 columns)."""
    rows = history.size(0)
    seq = torch.cat([history.new_full((rows, 1), BOS_ID), history], dim=1)  # (R, L + 1): seq[i] = y_i
    if seq.size(1) < n:
        return torch.zeros(rows, vocab, dtype=torch.bool, device=history.device)  # no n-gram fits
    windows = seq.unfold(1, n, 1)  # (R, W, n): window j is y_j .. y_j+n-1
    at = (step - n + 1 + torch.arange(n - 1, device=seq.device)).clamp(min=0)  # (n - 1,) the newest tokens
    newest = seq.index_select(1, at)  # (R, n - 1)
    complete = torch.arange(windows.size(1), device=seq.device) <= step - n  # (W,) within y_<step
    match = (windows[:, :, :-1] == newest[:, None]).all(dim=-1) & complete  # (R, W)
    return _mark(torch.where(match, windows[:, :, -1], vocab), vocab)


def _mark(tokens: Tensor, vocab: int) -> Tensor:
    """(R, V) bool: True at the tokens (R, m) of each row; the index V stands for none. Every write is
    True, so a token given twice is harmless."""
    marked = torch.zeros(tokens.size(0), vocab + 1, dtype=torch.bool, device=tokens.device)
    return marked.scatter_(1, tokens, True)[:, :vocab]


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
    (R,) over the tokens kept in vocabulary order: near-equal probabilities that rounding ranks in
    another order in another batch move no draw. With top-k only the k best are summed; plain sampling
    sums the whole vocabulary in float32, top-p in float64; a draw that rounding pushes to the sum takes
    the last entry of some probability (never one of none, as the pieces outside a shortlist)."""
    index = None  # the vocabulary ids of the columns kept, when not all of them
    logits = log_probs
    if 0 < sampling.topk < log_probs.size(-1):
        logits, index = log_probs.topk(sampling.topk, dim=-1)  # (R, k), best first
        index, order = index.sort(dim=-1)  # (R, k) in vocabulary order
        logits = logits.gather(1, order)
    precise = torch.float64 if index is not None or sampling.topp < 1.0 else torch.float32
    probs = (logits / sampling.temperature).softmax(dim=-1, dtype=precise)  # (R, k or V)
    if sampling.topp < 1.0:
        ranked, order = probs.sort(dim=-1, descending=True, stable=True)
        # dropped: the tokens whose more probable ones reach topp (the first always stays)
        beyond = ranked.cumsum(dim=-1) - ranked >= sampling.topp
        probs = probs.masked_fill(torch.empty_like(beyond).scatter_(1, order, beyond), 0.0)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]  # (R, 1) the kept mass
    target = torch.minimum(
        (draws[:, None] * total.double()).to(cdf.dtype), total.nextafter(total.new_zeros(()))
    )
    pick = torch.searchsorted(cdf, target, right=True).clamp(max=probs.size(-1) - 1)  # (R, 1)
    return pick if index is None else index.gather(1, pick)
