"""Beam search (§6.1) against a reference written from its rules alone.

`reference_beam_search` decodes one sentence in plain Python: every next-token distribution comes from
a full `decode` of the whole prefix (no cache), every candidate is a Python list, and each rule of the
`decoding` module docstring is one line or two:

- each step ranks all extensions of the live hypotheses and keeps the 2k best;
- one ending in EOS finishes only when it is among the k best, scored log P / lp(|Y|), |Y| counting
  the EOS; the k best not ending in EOS stay live;
- lp(|Y|) = ((5 + |Y|) / 6)^alpha (GNMT);
- L = a * |X| + b output tokens (|X| counting the source's EOS), at most the model's positions; live
  hypotheses still open after L steps finish as they stand, with |Y| = L;
- PAD and BOS are never generated, EOS not before step min_len + 1;
- the search is done once the best finished score is >= max(live log P) / lp(L): log-probabilities
  only fall and lp only grows up to L, so no live hypothesis can do better than that.

Both ways of running `beam_search`, dynamic and in static shapes (`static=True`), must return the reference's
tokens and scores and run as many decoder steps as it does. Three cases pin rules that a search could
break while still returning plausible outputs: an EOS outside the k best, the early-stop bound's lp(L),
and stopping early at all; each first checks, on the reference's trace, that its outcome depends on
the rule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from conftest import sources, tiny_model

from transformer.config import SearchConfig
from transformer.decoding import SearchResult, beam_search
from transformer.model import Transformer
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID

static_beam_search = functools.partial(beam_search, static=True)
BEAM_SEARCHES = pytest.mark.parametrize(
    "beam_search_fn", [beam_search, static_beam_search], ids=["dynamic", "static"]
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 24


# ---------------------------------------------------------------------------------------- the reference


@dataclass
class Step:
    """What the reference saw at one decoder step, for the tests that check why a case matters."""

    candidates: list[tuple[float, list[int]]]  # the 2k best extensions (log P, tokens), best first
    best: float  # the best finished normalized score after the step
    live: list[float]  # log P of the live hypotheses after the step


@dataclass
class Reference:
    tokens: list[int]  # the output, without EOS
    score: float  # log P(Y|X) / lp(Y)
    limit: int  # L
    steps: list[Step] = field(default_factory=list)  # one per decoder step run


@torch.no_grad()
def reference_beam_search(
    model: Transformer, src_row: torch.Tensor, k: int, alpha: float, a: float, b: int, min_len: int = 0
) -> Reference:
    """Beam search over one sentence src_row (pieces + [EOS], maybe padded), from the rules alone."""
    src = src_row[src_row != PAD_ID][None]  # (1, |X|)
    src_mask = model.src_mask(src)
    memory = model.encode(src, src_mask)
    limit = max(1, min(int(a * src.size(1) + b), model.cfg.max_positions))  # L

    def lp(length: int) -> float:
        return ((5 + length) / 6) ** alpha

    live = [(0.0, [])]  # (log P, tokens) of the live hypotheses: at first only [BOS]
    result = Reference(tokens=[], score=float("-inf"), limit=limit)
    for step in range(1, limit + 1):
        # log P(y_step | y_<step, X) of every live prefix, from one full decode of [BOS] + prefix
        prefixes = torch.tensor([[BOS_ID] + tokens for _, tokens in live])
        n = len(live)
        states = model.decode(prefixes, memory.expand(n, -1, -1), src_mask.expand(n, -1))[:, -1]
        logits = model.project(states)  # (n, V)
        log_probs = logits.log_softmax(dim=-1).tolist()
        banned = {PAD_ID, BOS_ID, EOS_ID} if step <= min_len else {PAD_ID, BOS_ID}  # EOS after min_len
        extensions = [
            (s + p, tokens + [t])
            for (s, tokens), row in zip(live, log_probs)
            for t, p in enumerate(row)
            if t not in banned
        ]
        candidates = sorted(extensions, key=lambda c: c[0], reverse=True)[: 2 * k]
        for s, tokens in candidates[:k]:  # EOS finishes a hypothesis only among the k best
            if tokens[-1] == EOS_ID and s / lp(step) > result.score:  # |Y| = step: EOS counts
                result.tokens, result.score = tokens[:-1], s / lp(step)
        live = [c for c in candidates if c[1][-1] != EOS_ID][:k]
        if step == limit:  # still open at L: finished as it stands, |Y| = L
            for s, tokens in live:
                if s / lp(limit) > result.score:
                    result.tokens, result.score = tokens, s / lp(limit)
        result.steps.append(Step(candidates, result.score, [s for s, _ in live]))
        if result.score >= max(s for s, _ in live) / lp(limit):  # done: no live hypothesis can win
            break
    return result


# ------------------------------------------------------------------------------------------ the checks


def decoder_steps(model: Transformer, search: Callable[[], SearchResult]) -> tuple[SearchResult, int]:
    """search()'s result and how many times it ran the decoder (one pass per step, in every search)."""
    calls = []
    hook = model.decoder[0].ffn.register_forward_hook(lambda *_: calls.append(1))
    try:
        return search(), len(calls)
    finally:
        hook.remove()


def check_against_reference(
    beam_search_fn, model: Transformer, src: torch.Tensor, k: int, alpha: float, a: float, b: int, min_len=0
) -> tuple[list[Reference], int]:
    """The batch's tokens and scores are the reference's, sentence by sentence, and it runs as many
    decoder steps as its slowest sentence needs (done sentences leave the batch or stay frozen in it).
    Returns the references and the steps run."""
    search = SearchConfig(beam_size=k, alpha=alpha, max_len_a=a, max_len_b=b)
    result, steps = decoder_steps(model, lambda: beam_search_fn(model, src, search, min_len))
    references = [reference_beam_search(model, row, k, alpha, a, b, min_len) for row in src]
    for row, ref in enumerate(references):
        assert result.tokens[row] == ref.tokens, f"sentence {row}"
        assert float(result.scores[row]) == pytest.approx(ref.score, rel=1e-5, abs=1e-5), f"sentence {row}"
    assert steps == max(len(ref.steps) for ref in references)
    return references, steps


# (beam size, alpha, max_len_a, max_len_b, min_len): beams 2-5, alpha 0-2, limits from |X| or fixed
SETTINGS = [
    (2, 0.0, 1.0, 6, 0),
    (3, 0.6, 1.0, 6, 0),
    (4, 1.0, 0.5, 8, 0),
    (5, 1.5, 1.0, 6, 0),
    (3, 2.0, 1.0, 6, 0),
    (2, 2.0, 0.0, 12, 0),
    (4, 0.6, 1.0, 4, 3),
]


@BEAM_SEARCHES
@pytest.mark.parametrize("seed", [2, 3, 6, 9])
def test_search_equals_the_reference(beam_search_fn, seed):
    """Batches of five sentences under every setting: outputs end in EOS, are cut at L, or stop early."""
    model = tiny_model(VOCAB, seed)
    stopped_early = 0
    for i, (k, alpha, a, b, min_len) in enumerate(SETTINGS):
        src = sources([2, 5, 8, 3, 1], VOCAB, seed=10 * seed + i)
        references, _ = check_against_reference(beam_search_fn, model, src, k, alpha, a, b, min_len)
        stopped_early += sum(len(ref.steps) < ref.limit for ref in references)
    assert stopped_early > 0


@BEAM_SEARCHES
def test_limit_is_capped_at_the_models_positions(beam_search_fn):
    """L = |X| + 50 would pass the 7 positions of this model: every sentence's limit is 7."""
    model = tiny_model(VOCAB, 6, max_positions=7)
    src = sources([2, 5, 6, 3, 1], VOCAB, seed=61)
    references, _ = check_against_reference(beam_search_fn, model, src, 3, 0.6, 1.0, 50)
    assert all(ref.limit == 7 for ref in references)
    assert any(len(ref.tokens) == 7 for ref in references)  # an output cut at the limit


@BEAM_SEARCHES
def test_eos_finishes_a_hypothesis_only_among_the_k_best(beam_search_fn):
    """Here an EOS extension ranked among the 2k best but not the k best would outscore the result: it
    must not finish (nor is it kept live)."""
    model, k, alpha = tiny_model(VOCAB, 2), 2, 0.0
    src = sources([2, 5, 8, 3], VOCAB, seed=22)
    ref = reference_beam_search(model, src[2], k, alpha, 1.0, 6)
    assert any(
        tokens[-1] == EOS_ID and s / ((5 + step) / 6) ** alpha > ref.score
        for step, record in enumerate(ref.steps, start=1)
        for s, tokens in record.candidates[k:]
    )
    check_against_reference(beam_search_fn, model, src, k, alpha, 1.0, 6)


@BEAM_SEARCHES
def test_early_stop_bound_divides_by_the_penalty_at_the_limit(beam_search_fn):
    """With alpha = 2 the penalty grows fast with length: a live hypothesis whose log P / lp(step) is
    below the best finished score can still beat it at a later step. Here stopping at the first step
    where the best finished score reaches max(live log P) / lp(step) would return a worse result: the
    bound must divide by lp(L), as max(live log P) / lp(L) is the most a live hypothesis can reach."""
    model, k, alpha = tiny_model(VOCAB, 2), 2, 2.0
    src = sources([2, 5, 8, 3], VOCAB, seed=22)
    ref = reference_beam_search(model, src[2], k, alpha, 1.0, 6)
    stop_at_lp_step = next(
        record
        for step, record in enumerate(ref.steps, start=1)
        if record.best >= max(record.live) / ((5 + step) / 6) ** alpha
    )
    assert stop_at_lp_step.best < ref.score
    check_against_reference(beam_search_fn, model, src, k, alpha, 1.0, 6)


@BEAM_SEARCHES
def test_search_stops_before_the_limit_when_no_live_hypothesis_can_win(beam_search_fn):
    """A sentence with the limit L = 15 whose result is certain after a few steps: the search must stop
    there (§6.1: "terminate early when possible"), not decode on to L."""
    model, k, alpha = tiny_model(VOCAB, 2), 2, 0.6
    src = sources([2, 5, 8, 3], VOCAB, seed=22)[2:3]
    (ref,), steps = check_against_reference(beam_search_fn, model, src, k, alpha, 1.0, 6)
    assert ref.limit == 15
    assert steps == len(ref.steps) < ref.limit
