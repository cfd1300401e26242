"""A forced target prefix: every output starts with it and the search goes on after it, against the
exhaustive ranking of every output that starts with it (the forced pieces count in the score and the
length penalty); sampling, ensembles, the static search; through translate.py and the Python API."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import sources, tiny_model
from test_decoding_policies import ranked_outputs
from test_translate_cli import translate
from test_translate_features import LINES, trained  # noqa: F401 (a fixture)

from transformer.config import ConfigError, SearchConfig
from transformer.decoding import Ensemble, beam_search
from transformer.inference.translation import Translator
from transformer.vocab import PAD_ID

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BEAM_SEARCHES = pytest.mark.parametrize(
    "search", [beam_search, functools.partial(beam_search, static=True)], ids=["dynamic", "static"]
)


def padded(prefixes: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(prefixes), max(map(len, prefixes))), PAD_ID)
    for row, prefix in enumerate(prefixes):
        out[row, : len(prefix)] = torch.tensor(prefix, dtype=torch.long)
    return out


@BEAM_SEARCHES
@pytest.mark.parametrize("ensemble", [False, True], ids=["one", "ensemble"])
def test_a_wide_beam_finds_the_best_outputs_that_start_with_the_prefix(search, ensemble):
    vocab, max_len, n, alpha = 6, 4, 4, 0.6
    models = [tiny_model(vocab=vocab, seed=7)] + ([tiny_model(vocab=vocab, seed=8)] if ensemble else [])
    weights = [0.4, 0.6] if ensemble else [1.0]
    model = Ensemble(models, weights) if ensemble else models[0]
    src = sources([2, 5, 3], vocab, seed=4)
    prefixes = [[5], [4, 4], []]  # the last sentence is free
    cfg = SearchConfig(
        beam_size=3 ** (max_len - 1) * 4, alpha=alpha, max_len_a=0.0, max_len_b=max_len, nbest=n
    )
    result = search(model, src, cfg, prefix=padded(prefixes))
    for row, prefix in enumerate(prefixes):
        ranked = ranked_outputs(models, weights, src[row], max_len, alpha)
        expected = [(score, tokens) for score, tokens in ranked if tokens[: len(prefix)] == prefix][:n]
        got = result.hypotheses[row]
        assert [h.tokens for h in got] == [tokens for _, tokens in expected]
        assert [h.score for h in got] == pytest.approx([score for score, _ in expected], abs=1e-5)


@BEAM_SEARCHES
def test_beam_4_greedy_and_samples_start_with_their_prefix(search):
    model = tiny_model(seed=3)
    src = sources([4, 8, 2, 6, 3], 24, seed=2)
    prefixes = [[7, 9, 11], [], [5], [20, 20, 20, 20, 20, 20], [8, 6]]
    for cfg in (
        SearchConfig(beam_size=4, nbest=4, max_len_b=8),
        SearchConfig(beam_size=1, max_len_b=8),
        SearchConfig(sampling=True, nbest=5, topk=10, max_len_b=8),
    ):
        result = search(model, src, cfg, prefix=padded(prefixes))
        for prefix, hypotheses in zip(prefixes, result.hypotheses):
            assert hypotheses and all(h.tokens[: len(prefix)] == prefix for h in hypotheses)
    # a prefix longer than the output limit (a |X| + b = 2 here) still fits: the limit grows to hold it
    short = SearchConfig(beam_size=2, max_len_a=0.0, max_len_b=2)
    result = search(model, src[3:4], short, prefix=padded([prefixes[3]]))
    assert result.hypotheses[0][0].tokens[:6] == prefixes[3] and len(result.hypotheses[0][0].tokens) <= 7


def test_translate_py_and_the_api_start_every_output_with_its_prefix(trained, tmp_path):  # noqa: F811
    lines = [LINES[0], LINES[2], LINES[3]]
    prefixes = ["Heute", "", "Gestern haben die Eltern"]
    (tmp_path / "prefix.de").write_text("\n".join(prefixes) + "\n")
    settings = [f"checkpoint={trained}", f"target_prefix={tmp_path / 'prefix.de'}", "nbest=2"]
    done = translate(*settings, "output_format=jsonl", stdin="\n".join(lines).encode())
    assert done.returncode == 0, done.stderr.decode()
    translator = Translator.from_checkpoint(trained, device="cpu", nbest=2)
    for line, prefix, entry in zip(lines, prefixes, map(json.loads, done.stdout.decode().splitlines())):
        pieces = translator.tokenizer.pieces(translator.tokenizer.encode(prefix)) if prefix else []
        for h in entry["hypotheses"]:
            assert h["pieces"][: len(pieces)] == pieces and h["text"].startswith(prefix)
            # the forced pieces count: log_prob is the whole output's, by teacher forcing
            scored = translator.score(line, h["text"])
            if scored.pieces == h["pieces"]:
                assert h["log_prob"] == pytest.approx(scored.log_prob, abs=1e-4)
    api = translator.translate(lines, target_prefix=prefixes)
    assert api == [json.loads(e)["hypotheses"][0]["text"] for e in done.stdout.decode().splitlines()]
    assert api[2] != translator.translate(lines[2])  # the model's own choice starts otherwise
    short = translate(
        *settings, "output_format=jsonl", "checkpoint=missing.pt", stdin="\n".join(lines[:2]).encode()
    )
    assert short.returncode == 2 and "prefix.de has 3 lines for 2 input lines" in short.stderr.decode()
    scoring = translate(*settings, f"score={tmp_path / 'prefix.de'}", "output_format=jsonl", stdin=b"a\n")
    assert scoring.returncode == 2 and "not with target_prefix=FILE" in scoring.stderr.decode()
    with pytest.raises(ConfigError, match="3 input lines but 1 target prefixes"):
        translator.translate(lines, target_prefix=["x"])


@BEAM_SEARCHES
def test_a_prefix_that_repeats_itself_is_forced_whatever_the_repetition_control(search):
    """The forced pieces are the user's: neither banned nor penalised, their own log-probabilities in
    the score; the control acts on what follows."""
    model = tiny_model(seed=3)
    src = sources([4, 6], 24, seed=2)
    prefix = padded([[5, 6, 5, 6], [9, 9]])
    for cfg in (
        SearchConfig(beam_size=4, max_len_b=10, no_repeat_ngram_size=1, repetition_penalty=2.0),
        SearchConfig(sampling=True, nbest=3, max_len_b=10, no_repeat_ngram_size=2),
    ):
        result = search(model, src, cfg, prefix=prefix)
        plain = search(model, src, SearchConfig(beam_size=1, max_len_a=0.0, max_len_b=4), prefix=prefix)
        for row, forced in enumerate(([5, 6, 5, 6], [9, 9])):
            for h in result.hypotheses[row]:
                assert h.tokens[: len(forced)] == forced and h.score > float("-inf")
                after = h.tokens[len(forced) :]
                if cfg.no_repeat_ngram_size == 1:
                    assert not set(after) & set(h.tokens[: len(forced)]) and len(set(after)) == len(after)
                own = plain.hypotheses[row][0].token_log_probs[: len(forced)]
                assert h.token_log_probs[: len(forced)] == pytest.approx(own, abs=1e-6)
