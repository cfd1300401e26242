"""Repetition control (`no_repeat_ngram_size`, `repetition_penalty`) against a direct computation: the
penalised distribution written out token by token from full decodes, an exhaustive ranking of every
output under it for a beam wide enough never to prune, and sampling's draws against it."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
from conftest import sources, tiny_model

from transformer.config import ConfigError, SearchConfig
from transformer.decoding import Ensemble, beam_search
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def penalised(logits: list[float], before: list[int], penalty: float, n: int) -> list[float]:
    """One step's logits after repetition control, written out: each token of `before` (BOS y_<t) once
    scaled (z / p where z > 0, else z * p), and every token that would end an n-gram already in `before`
    forbidden (PAD and BOS, never output, are forbidden after the softmax: `step_log_probs`)."""
    z = list(logits)
    for token in set(before[1:]):
        z[token] = z[token] / penalty if z[token] > 0 else z[token] * penalty
    if n:
        grams = {tuple(before[i : i + n]) for i in range(len(before) - n + 1)}
        newest = tuple(before[len(before) - n + 1 :])  # the n - 1 newest tokens (none for n = 1)
        for token in range(len(z)):
            if newest + (token,) in grams:
                z[token] = -math.inf
    return z


@torch.no_grad()
def step_log_probs(models, weights, src_row, tokens, penalty=1.0, n=0) -> tuple[list[float], list[float]]:
    """(ranked, own): for each token of `tokens`, log sum_m w_m softmax(penalised logits of m) and the
    same without repetition control, from one full decode per model."""
    src = src_row[None, : int((src_row != PAD_ID).sum())]
    tgt_in = torch.tensor([[BOS_ID] + tokens[:-1]])
    logits = [m(src, tgt_in)[0].double() for m in models]  # (T, V) each
    ranked, own = [], []
    for t, token in enumerate(tokens):
        before = [BOS_ID] + tokens[:t]
        for out, (p, size) in ((ranked, (penalty, n)), (own, (1.0, 0))):
            mixed = sum(
                w * torch.tensor(penalised(z[t].tolist(), before, p, size)).softmax(-1)
                for z, w in zip(logits, weights)
            )
            usable = mixed[token] > 0 and token not in (PAD_ID, BOS_ID)
            out.append(math.log(float(mixed[token])) if usable else -math.inf)
    return ranked, own


BEAM_SEARCHES = pytest.mark.parametrize(
    "search", [beam_search, functools.partial(beam_search, static=True)], ids=["dynamic", "static"]
)
CONTROLS = pytest.mark.parametrize(
    "penalty, n",
    [(1.8, 0), (0.6, 0), (1.0, 2), (1.0, 1), (2.5, 2)],
    ids=["penalty", "encouraged", "no-bigram", "no-token", "both"],
)


@BEAM_SEARCHES
@CONTROLS
@pytest.mark.parametrize("ensemble", [False, True], ids=["one", "ensemble"])
def test_a_wide_beam_finds_the_exhaustive_ranking_under_repetition_control(search, penalty, n, ensemble):
    """A beam as wide as every candidate: its n best are the n best outputs ranked by the penalised
    distribution, each scored by it, each token's recorded log-probability the models' own."""
    vocab, max_len, best, alpha = 6, 4, 6, 0.6
    models = [tiny_model(vocab=vocab, seed=7)] + ([tiny_model(vocab=vocab, seed=8)] if ensemble else [])
    weights = [0.3, 0.7] if ensemble else [1.0]
    model = Ensemble(models, weights) if ensemble else models[0]
    src = sources([2, 5], vocab, seed=4)
    cfg = SearchConfig(
        beam_size=3 ** (max_len - 1) * 4,
        alpha=alpha,
        max_len_a=0.0,
        max_len_b=max_len,
        nbest=best,
        repetition_penalty=penalty,
        no_repeat_ngram_size=n,
    )
    result = search(model, src, cfg)
    content = [t for t in range(vocab) if t not in (PAD_ID, BOS_ID, EOS_ID)]
    outputs = [list(y) + [EOS_ID] for j in range(max_len) for y in itertools.product(content, repeat=j)]
    outputs += [list(y) for y in itertools.product(content, repeat=max_len)]
    for row in range(src.size(0)):
        scored = []
        for y in outputs:
            ranked, own = step_log_probs(models, weights, src[row], y, penalty, n)
            if sum(ranked) > -math.inf:
                scored.append((sum(ranked) / ((5 + len(y)) / 6) ** alpha, y, own))
        scored.sort(key=lambda triple: -triple[0])
        got = result.hypotheses[row]
        assert [h.tokens for h in got] == [[t for t in y if t != EOS_ID] for _, y, _ in scored[:best]]
        assert [h.score for h in got] == pytest.approx([s for s, _, _ in scored[:best]], abs=1e-5)
        for h, (_, _, own) in zip(got, scored):
            assert h.token_log_probs == pytest.approx(own, abs=1e-5)


@BEAM_SEARCHES
def test_no_output_repeats_an_ngram_and_the_control_changes_outputs(search):
    """Beam 4 and greedy search on longer outputs: without control the random model repeats bigrams,
    with no_repeat_ngram_size=2 no hypothesis of the n-best list holds one twice."""
    model = tiny_model(seed=3)
    src = sources([4, 8, 2, 6, 3], 24, seed=2)
    for beam in (1, 4):
        plain = search(model, src, SearchConfig(beam_size=beam, nbest=beam, max_len_b=16))
        controlled = search(
            model, src, SearchConfig(beam_size=beam, nbest=beam, max_len_b=16, no_repeat_ngram_size=2)
        )

        def repeats(tokens):
            grams = list(zip([BOS_ID] + tokens, tokens))
            return len(grams) - len(set(grams))

        assert sum(repeats(h.tokens) for hs in plain.hypotheses for h in hs) > 0
        assert all(repeats(h.tokens) == 0 for hs in controlled.hypotheses for h in hs)


def test_samples_follow_the_penalised_distribution():
    """4,000 two-token samples: the second token after the most frequent first one, against the penalised
    distribution written out (a chi-square test at the 1e-4 level); forbidden tokens are never drawn and
    each sample's log-probability is the model's own."""
    vocab, n, copies, penalty = 12, 1000, 4, 3.0
    model = tiny_model(vocab=vocab, seed=3)
    src = sources([5], vocab, seed=1)
    cfg = SearchConfig(
        sampling=True,
        nbest=n,
        max_len_a=0.0,
        max_len_b=2,
        repetition_penalty=penalty,
        no_repeat_ngram_size=1,
    )
    result = beam_search(model, src.expand(copies, -1), cfg)
    samples = [h for hypotheses in result.hypotheses for h in hypotheses]
    firsts = [h.tokens[0] for h in samples if h.tokens]
    first = max(set(firsts), key=firsts.count)
    seconds = [h.tokens[1] if len(h.tokens) > 1 else EOS_ID for h in samples if h.tokens[:1] == [first]]
    assert len(seconds) >= 200
    ranked = [step_log_probs([model], [1.0], src[0], [first, t], penalty, 1)[0][1] for t in range(vocab)]
    expected = torch.tensor(ranked).exp()
    assert float(expected[first]) == 0.0  # the first token is forbidden now
    counts = torch.bincount(torch.tensor(seconds), minlength=vocab).double()
    assert counts[expected == 0].sum() == 0
    support = expected > 0
    m = len(seconds)
    chi2 = float(((counts[support] - m * expected[support]) ** 2 / (m * expected[support])).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 4.0 * math.sqrt(2 * dof) + 10
    for h in samples[:20]:
        tokens = h.tokens + [EOS_ID] if len(h.token_log_probs) > len(h.tokens) else h.tokens
        own = step_log_probs([model], [1.0], src[0], tokens)[1]
        assert h.token_log_probs == pytest.approx(own, abs=1e-5)


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size=-1 must be >= 0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 must be in"),
    ],
)
def test_bad_repetition_settings_are_refused_in_one_line(setting, message):
    with pytest.raises(ConfigError, match=message):
        SearchConfig(**setting).check()


def test_evaluate_names_a_controlled_search_apart():
    assert SearchConfig().describe() == "beam4.alpha0.6"
    controlled = SearchConfig(no_repeat_ngram_size=3, repetition_penalty=1.2)
    assert controlled.describe() == "beam4.alpha0.6.norepeat3.reppen1.2"
