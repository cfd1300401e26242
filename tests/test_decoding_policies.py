"""The search's policies (transformer/decoding/search.py) against independent references: n-best lists
against the exhaustive ranking of every output, each hypothesis's token log-probabilities against one
full decode, ensembles against the mixture of the models' probabilities written out, and sampling's
draws against the model's distribution (narrowed by temperature, top-k and top-p as written out here)."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import replace

import pytest
import torch
from conftest import sources, tiny_model

from transformer.config import ConfigError, SearchConfig
from transformer.decoding import Ensemble, beam_search
from transformer.decoding.scoring import sample_tokens
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BEAM_SEARCHES = pytest.mark.parametrize(
    "search", [beam_search, functools.partial(beam_search, static=True)], ids=["dynamic", "static"]
)


@torch.no_grad()
def token_log_probs(models, weights, src_row, tokens: list[int]) -> list[float]:
    """log of sum_m w_m P_m(y_t | y_<t, X) for each token of `tokens`, from one full decode per model."""
    src = src_row[None, : int((src_row != PAD_ID).sum())]
    tgt_in = torch.tensor([[BOS_ID] + tokens[:-1]])
    mixed = sum(w * m(src, tgt_in)[0].softmax(-1) for m, w in zip(models, weights))  # (T, V)
    return [math.log(float(mixed[i, t])) for i, t in enumerate(tokens)]


def ranked_outputs(models, weights, src_row, max_len: int, alpha: float) -> list[tuple[float, list[int]]]:
    """Every output (y_1..y_j EOS with j + 1 <= max_len, or y_1..y_L cut at the limit), scored
    log P / lp(|Y|) under the mixture, best first."""
    vocab = models[0].cfg.vocab_size
    content = [t for t in range(vocab) if t not in (PAD_ID, BOS_ID, EOS_ID)]
    outputs = [list(y) + [EOS_ID] for j in range(max_len) for y in itertools.product(content, repeat=j)]
    outputs += [list(y) for y in itertools.product(content, repeat=max_len)]
    scored = []
    for y in outputs:
        log_p = sum(token_log_probs(models, weights, src_row, y))
        scored.append((log_p / ((5 + len(y)) / 6) ** alpha, [t for t in y if t != EOS_ID]))
    return sorted(scored, key=lambda pair: -pair[0])


@BEAM_SEARCHES
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_a_wide_beams_n_best_list_is_the_exhaustive_ranking(search, alpha):
    """A beam as wide as every candidate never prunes: its n best are the n best outputs of all."""
    vocab, max_len, n = 6, 3, 5
    model = tiny_model(vocab=vocab, seed=7)
    src = sources([2, 5, 3], vocab, seed=4)
    width = 3 ** (max_len - 1) * 4
    result = search(
        model, src, SearchConfig(beam_size=width, alpha=alpha, max_len_a=0.0, max_len_b=max_len, nbest=n)
    )
    for row in range(src.size(0)):
        expected = ranked_outputs([model], [1.0], src[row], max_len, alpha)[:n]
        got = result.hypotheses[row]
        assert [h.tokens for h in got] == [tokens for _, tokens in expected]
        assert [h.score for h in got] == pytest.approx([score for score, _ in expected], abs=1e-5)
        for h in got:  # each token's log-probability, EOS's too where it ended in one
            ended = len(h.token_log_probs) == len(h.tokens) + 1
            tokens = h.tokens + [EOS_ID] if ended else h.tokens
            assert h.token_log_probs == pytest.approx(
                token_log_probs([model], [1.0], src[row], tokens), abs=1e-5
            )
            assert h.score == pytest.approx(h.log_prob / ((5 + len(tokens)) / 6) ** alpha, abs=1e-5)


@BEAM_SEARCHES
def test_the_n_best_lists_first_hypothesis_is_the_one_best_search(search):
    model = tiny_model(seed=3)
    src = sources([4, 8, 2, 6, 3], 24, seed=2)
    one = search(model, src, SearchConfig(beam_size=4, alpha=0.6, max_len_b=6))
    four = search(model, src, SearchConfig(beam_size=4, alpha=0.6, max_len_b=6, nbest=4))
    assert four.tokens == one.tokens
    torch.testing.assert_close(four.scores, one.scores)
    for hypotheses in four.hypotheses:
        assert len(hypotheses) == 4 and len({tuple(h.tokens) for h in hypotheses}) == 4
        assert [h.score for h in hypotheses] == sorted((h.score for h in hypotheses), reverse=True)


@BEAM_SEARCHES
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_an_ensembles_wide_beam_finds_the_optimum_of_the_mixed_probabilities(search, alpha):
    vocab, max_len = 6, 3
    models = [tiny_model(vocab=vocab, seed=7), tiny_model(vocab=vocab, seed=8)]
    weights = [0.3, 0.7]
    src = sources([2, 5, 3], vocab, seed=4)
    width = 3 ** (max_len - 1) * 4
    ensemble = Ensemble(models, weights)
    result = search(
        ensemble, src, SearchConfig(beam_size=width, alpha=alpha, max_len_a=0.0, max_len_b=max_len, nbest=2)
    )
    alone = [
        search(m, src, SearchConfig(beam_size=width, alpha=alpha, max_len_a=0.0, max_len_b=max_len))
        for m in models
    ]
    assert result.tokens != alone[0].tokens or result.tokens != alone[1].tokens  # the mixture decides
    for row in range(src.size(0)):
        expected = ranked_outputs(models, weights, src[row], max_len, alpha)[:2]
        assert [h.tokens for h in result.hypotheses[row]] == [tokens for _, tokens in expected]
        assert [h.score for h in result.hypotheses[row]] == pytest.approx([s for s, _ in expected], abs=1e-5)


def test_an_ensemble_of_one_model_or_of_the_same_model_twice_is_that_model():
    model = tiny_model(seed=5)
    src = sources([4, 8, 2, 6], 24, seed=6)
    plain = beam_search(model, src, SearchConfig(beam_size=4, max_len_b=6))
    for ensemble in (Ensemble([model], [1.0]), Ensemble([model, model], [2.0, 1.0])):
        mixed = beam_search(ensemble, src, SearchConfig(beam_size=4, max_len_b=6))
        assert mixed.tokens == plain.tokens
        torch.testing.assert_close(mixed.scores, plain.scores, rtol=1e-5, atol=1e-5)


def narrowed(log_probs: torch.Tensor, sampling: SearchConfig) -> torch.Tensor:
    """The distribution sampling draws from, written out: softmax(log_probs / T), its top-k, then the
    most probable tokens until their mass reaches top-p, renormalized."""
    probs = (log_probs / sampling.temperature).softmax(-1).double()
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for rank, token in enumerate(order):
        if (sampling.topk and rank >= sampling.topk) or mass >= sampling.topp or probs[token] == 0:
            break
        kept.append(token)
        mass += float(probs[token])
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


@pytest.mark.parametrize(
    "shape",
    [{}, {"temperature": 0.5}, {"topk": 3}, {"topp": 0.6}, {"topk": 5, "topp": 0.8}],
    ids=["plain", "temperature", "topk", "topp", "both"],
)
def test_samples_follow_the_models_distribution(shape):
    """4,000 one-token samples of one sentence (1,000 for each of 4 copies of it, drawn apart by their
    line numbers): the frequency of each first token against the narrowed distribution of the model's (a
    chi-square test at the 1e-4 level), tokens outside it never drawn."""
    vocab, n, copies = 12, 1000, 4
    model = tiny_model(vocab=vocab, seed=3)
    src = sources([5], vocab, seed=1)
    sampling = SearchConfig(sampling=True, nbest=n, max_len_a=0.0, max_len_b=1, **shape)
    result = beam_search(model, src.expand(copies, -1), sampling)
    first = [h.tokens[0] if h.tokens else EOS_ID for hypotheses in result.hypotheses for h in hypotheses]
    assert len(first) == n * copies
    n *= copies
    with torch.no_grad():
        log_probs = model(src, torch.tensor([[BOS_ID]]))[0, 0].log_softmax(-1)
    log_probs[[PAD_ID, BOS_ID]] = float("-inf")
    expected = narrowed(log_probs.log_softmax(-1), sampling)
    counts = torch.bincount(torch.tensor(first), minlength=vocab).double()
    assert counts[expected == 0].sum() == 0
    support = expected > 0
    assert int(support.sum()) >= 2
    chi2 = float(((counts[support] - n * expected[support]) ** 2 / (n * expected[support])).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 4.0 * math.sqrt(2 * dof) + 10  # far beyond the 1e-4 quantile for these dofs
    # each sample's score is its log-probability under the model (not the narrowed distribution)
    for h in result.hypotheses[0][:20]:
        tokens = h.tokens or [EOS_ID]
        assert h.log_prob == pytest.approx(float(log_probs[tokens[0]]), abs=1e-5)


def test_a_draw_that_rounds_to_the_whole_mass_never_takes_a_token_of_none():
    """Where the last tokens have no probability (the pieces outside a shortlist), the largest draw, which
    float32 rounds to the whole mass, takes the last token of some probability."""
    log_probs = torch.full((2, 100), float("-inf"))
    log_probs[:, :10] = torch.linspace(-1.0, -3.0, 10)
    log_probs[1, 40] = -1.5  # one in the middle, the tail after it of none
    draws = torch.tensor([1 - 2**-53] * 2, dtype=torch.float64)  # the largest uniform_draws gives
    assert sample_tokens(log_probs, SearchConfig(sampling=True), draws)[:, 0].tolist() == [9, 40]


@pytest.mark.parametrize(
    "shape",
    [{}, {"topk": 4}, {"topp": 0.85}, {"topk": 4, "topp": 0.85}],
    ids=["plain", "topk", "topp", "both"],
)
def test_a_draw_stays_where_rounding_ranks_near_equal_probabilities_apart(shape):
    """Two batches may round a distribution apart in its last bits, and two tokens of near-equal
    probability then rank in another order: the same uniform numbers still take the same tokens."""
    log_probs = torch.tensor([0.4, 0.2, 0.2, 0.1, 0.1]).log()
    one, other = log_probs.clone(), log_probs.clone()
    one[1] += 1e-6  # token 1 ranks before token 2
    other[2] += 1e-6  # token 2 before token 1
    draws = (torch.arange(100, dtype=torch.float64) + 0.5) / 100  # none within rounding of a boundary
    settings = SearchConfig(sampling=True, **shape)
    picks = [sample_tokens(x.expand(100, -1), settings, draws)[:, 0].tolist() for x in (one, other)]
    assert picks[0] == picks[1]
    assert {1, 2} <= set(picks[0])  # the draws do fall on both


@pytest.mark.parametrize("static", [False, True])
def test_the_same_seed_samples_the_same_whatever_the_batches(static):
    model = tiny_model(seed=4)
    src = sources([4, 8, 2, 6, 3], 24, seed=2)
    sampling = SearchConfig(sampling=True, nbest=3, topk=10, temperature=1.5, seed=11, max_len_b=8)
    together = beam_search(model, src, sampling, static=static)
    for row in range(src.size(0)):
        one = src[row : row + 1, : int((src[row] != PAD_ID).sum())]
        alone = beam_search(model, one, sampling, static=static, sentence_ids=torch.tensor([row]))
        assert [h.tokens for h in alone.hypotheses[0]] == [h.tokens for h in together.hypotheses[row]]
    other_seed = beam_search(model, src, replace(sampling, seed=12), static=static)
    assert [h.tokens for h in other_seed.hypotheses[0]] != [h.tokens for h in together.hypotheses[0]]
    assert len({tuple(h.tokens) for hs in together.hypotheses for h in hs}) > 5  # samples differ


def test_nbest_beyond_the_beam_is_refused():
    with pytest.raises(ConfigError, match="nbest=5 must be at most beam_size=4"):
        beam_search(tiny_model(), sources([3], 24), SearchConfig(beam_size=4, nbest=5))
