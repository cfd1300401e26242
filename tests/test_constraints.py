"""Hard lexical constraints (decoding/constraints.py): a beam wide enough never to prune finds the best
output that contains every phrase, against the exhaustive ranking of every output; at beam 4 every
hypothesis contains them; one model and an ensemble; through translate.py (a file, or fairseq's inline
form) and the Python API."""

from __future__ import annotations

import json

import pytest
from conftest import sources, tiny_model
from test_decoding_policies import ranked_outputs
from test_translate_cli import translate
from test_translate_features import LINES, trained  # noqa: F401 (a fixture)

from transformer.config import ConfigError, SearchConfig, TranslateConfig
from transformer.decoding import Ensemble, beam_search
from transformer.inference.translation import Translator, padded

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def contains(tokens: list[int], phrase: list[int]) -> bool:
    return any(tokens[i : i + len(phrase)] == phrase for i in range(len(tokens) - len(phrase) + 1))


@pytest.mark.parametrize("ensemble", [False, True], ids=["one", "ensemble"])
def test_a_wide_beam_finds_the_best_outputs_that_contain_every_phrase(ensemble):
    vocab, max_len, n, alpha = 6, 2, 3, 0.6
    models = [tiny_model(vocab=vocab, seed=7)] + ([tiny_model(vocab=vocab, seed=8)] if ensemble else [])
    weights = [0.4, 0.6] if ensemble else [1.0]
    model = Ensemble(models, weights) if ensemble else models[0]
    src = sources([2, 5, 3, 4], vocab, seed=4)
    phrases = [[[5]], [[4, 5]], [], [[1], [4]]]
    cfg = SearchConfig(beam_size=4 * 3**4, alpha=alpha, max_len_a=0.0, max_len_b=max_len, nbest=n)
    result = beam_search(model, src, cfg, constraints=phrases)
    for row, wanted in enumerate(phrases):
        limit = max_len + sum(map(len, wanted))  # the output limit grows to hold the phrases
        ranked = ranked_outputs(models, weights, src[row], limit, alpha)
        expected = [(s, t) for s, t in ranked if all(contains(t, p) for p in wanted)][:n]
        got = result.hypotheses[row]
        assert [h.tokens for h in got] == [tokens for _, tokens in expected]
        assert [h.score for h in got] == pytest.approx([score for score, _ in expected], abs=1e-5)


def test_at_beam_4_every_hypothesis_contains_its_phrases():
    model = tiny_model(seed=3)
    src = sources([4, 8, 2, 6, 3], 24, seed=2)
    phrases = [[[7, 9]], [[5], [11, 12, 13]], [], [[20], [21], [22]], [[8, 6, 4]]]
    for cfg in (SearchConfig(beam_size=4, nbest=4, max_len_b=8), SearchConfig(beam_size=1, max_len_b=8)):
        result = beam_search(model, src, cfg, constraints=phrases)
        plain = beam_search(model, src, cfg)
        for wanted, hypotheses, free in zip(phrases, result.hypotheses, plain.hypotheses):
            assert hypotheses and all(all(contains(h.tokens, p) for p in wanted) for h in hypotheses)
            if not wanted:
                assert [h.tokens for h in hypotheses] == [h.tokens for h in free]


def test_a_prefix_and_phrases_together_give_the_best_outputs_that_start_with_it_and_hold_them():
    """With a target prefix and constraints at once, a beam wide enough never to prune finds the best
    outputs that start with the prefix and contain every phrase (the exhaustive ranking); at beam 1
    and 4 every hypothesis does: a phrase's first piece never takes a prefix's place."""
    vocab, max_len, n, alpha = 6, 2, 3, 0.6
    model = tiny_model(vocab=vocab, seed=7)
    src = sources([2, 5, 3], vocab, seed=4)
    prefixes, phrases = [[4], [5], []], [[[5]], [[1, 4]], [[4]]]  # (3 is EOS)
    wide = SearchConfig(beam_size=4 * 3**4, alpha=alpha, max_len_a=0.0, max_len_b=max_len, nbest=n)
    result = beam_search(model, src, wide, prefix=padded(prefixes), constraints=phrases)
    for row, (start, wanted) in enumerate(zip(prefixes, phrases)):
        ranked = ranked_outputs([model], [1.0], src[row], max_len + sum(map(len, wanted)), alpha)
        expected = [
            (s, t) for s, t in ranked if t[: len(start)] == start and all(contains(t, p) for p in wanted)
        ]
        got = result.hypotheses[row]
        assert [h.tokens for h in got] == [tokens for _, tokens in expected[:n]]
        assert [h.score for h in got] == pytest.approx([score for score, _ in expected[:n]], abs=1e-5)
    model, src = tiny_model(seed=3), sources([4, 8, 2], 24, seed=2)
    prefixes, phrases = [[9, 10], [5], [7, 7, 7]], [[[7, 9]], [[5], [11, 12]], [[20]]]
    for cfg in (SearchConfig(beam_size=4, nbest=4, max_len_b=8), SearchConfig(beam_size=1, max_len_b=8)):
        result = beam_search(model, src, cfg, prefix=padded(prefixes), constraints=phrases)
        for start, wanted, hypotheses in zip(prefixes, phrases, result.hypotheses):
            assert hypotheses
            for h in hypotheses:
                assert h.tokens[: len(start)] == start and all(contains(h.tokens, p) for p in wanted)


def test_constraints_refuse_the_static_search_and_sampling():
    model, src = tiny_model(), sources([3], 24)
    with pytest.raises(ValueError, match="constraints take the search in dynamic shapes"):
        beam_search(model, src, SearchConfig(), static=True, constraints=[[[5]]])
    with pytest.raises(ValueError, match="constraints take the search in dynamic shapes"):
        beam_search(model, src, SearchConfig(sampling=True), constraints=[[[5]]])


def test_translate_py_and_the_api_keep_every_phrase(trained, tmp_path):  # noqa: F811
    lines = [LINES[0], LINES[2], LINES[3]]
    phrases = [["Katze", "Hund"], [], ["roten Ball", "Mutter"]]
    (tmp_path / "terms.de").write_text("".join("\t".join(p) + "\n" for p in phrases))
    settings = [f"checkpoint={trained}", "nbest=2", "output_format=jsonl"]
    from_file = translate(*settings, f"constraints={tmp_path / 'terms.de'}", stdin="\n".join(lines).encode())
    inline = "\n".join("\t".join([line, *p]) for line, p in zip(lines, phrases)).encode()
    from_inline = translate(*settings, "constraints_inline=true", stdin=inline)
    assert from_file.returncode == from_inline.returncode == 0, from_file.stderr.decode()
    entries = [json.loads(line) for line in from_file.stdout.decode().splitlines()]
    translator = Translator.from_checkpoint(trained, device="cpu", nbest=2)
    plain = translator.translate(lines)
    for entry, wanted, free in zip(entries, phrases, plain):
        assert entry["hypotheses"] and all(all(p in h["text"] for p in wanted) for h in entry["hypotheses"])
        if not wanted:
            assert entry["hypotheses"][0]["text"] == free
    inline_texts = [
        [h["text"] for h in json.loads(e)["hypotheses"]] for e in from_inline.stdout.decode().splitlines()
    ]
    assert inline_texts == [[h["text"] for h in e["hypotheses"]] for e in entries]
    assert translator.translate(lines, constraints=phrases) == [e["hypotheses"][0]["text"] for e in entries]
    assert all(p in translator.translate(lines[2], constraints=phrases[2]) for p in phrases[2])  # one line
    one_each = translator.translate(lines[:2], constraints=["Katze", "Hund"])  # a string: one phrase
    assert one_each == translator.translate(lines[:2], constraints=[["Katze"], ["Hund"]])
    assert "Katze" in one_each[0] and "Hund" in one_each[1]
    with pytest.raises(
        ConfigError, match=r"line 1: its target prefix and constraints take \d+ pieces; an output"
    ):
        translator.translate(lines[:1], constraints=[["Katze " * 600]])  # more than 1,023 positions hold
    with pytest.raises(ConfigError, match="3 input lines but 1 lines of constraints"):
        translator.translate(lines, constraints=[["Katze"]])
    sampled = Translator.from_checkpoint(trained, device="cpu", sampling=True)
    with pytest.raises(ConfigError, match="constraints shape a search: not with sampling=true"):
        sampled.translate(lines[:1], constraints=[["Katze"]])
    int8_settings = [*settings, "precision=int8", "no_repeat_ngram_size=1"]
    int8 = translate(*int8_settings, f"constraints={tmp_path / 'terms.de'}", stdin="\n".join(lines).encode())
    assert int8.returncode == 0, int8.stderr.decode()
    for line, wanted in zip(int8.stdout.decode().splitlines(), phrases):
        assert all(all(p in h["text"] for p in wanted) for h in json.loads(line)["hypotheses"])
    short = translate(
        *settings, f"constraints={tmp_path / 'terms.de'}", "checkpoint=missing.pt", stdin=b"a\n"
    )
    assert short.returncode == 2 and "terms.de has 3 lines for 1 input lines" in short.stderr.decode()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"constraints": "t.de", "constraints_inline": True}, "the phrases come from one of them"),
        ({"constraints": "t.de", "sampling": True}, "constraints shape a search: not with sampling=true"),
        ({"constraints_inline": True, "score": "x.de", "output_format": "jsonl"}, "or score=FILE"),
    ],
)
def test_bad_constraint_settings_are_one_line(settings, message):
    with pytest.raises(ConfigError, match=message):
        TranslateConfig(checkpoint="x.pt", **settings)
