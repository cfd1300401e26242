"""Vocabulary maps (`vocabulary_map=FILE`, transformer/inference/vocabulary_map.py): the map built from a
corpus against counts written out, the file in CTranslate2's format, and a search over a shortlist
against the exhaustive ranking of every output under the distribution narrowed to it."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import sources, tiny_model
from test_serve import CHECKPOINT, Running
from test_training_run import WORDS, compose_config, corpus, overrides  # noqa: F401 (corpus: a fixture)
from test_translate_cli import translate
from test_translate_features import LINES, trained  # noqa: F401 (a fixture)

from transformer.config import ConfigError, SearchConfig
from transformer.data.prepare import prepare
from transformer.data.tokenizer import Tokenizer
from transformer.decoding import Ensemble, Shortlist, beam_search
from transformer.inference import vocabulary_map
from transformer.inference.translation import Translator
from transformer.inference.vocabulary_map import VocabularyMap
from transformer.kernels import Products
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vocabulary_map.py"


def test_the_map_holds_the_most_frequent_pieces_and_each_source_pieces_likeliest_partners():
    generator = np.random.default_rng(0)
    vocab = 30
    pairs = [
        (
            generator.integers(4, vocab, generator.integers(1, 8)),
            generator.integers(4, vocab, generator.integers(1, 8)),
        )
        for _ in range(300)
    ]
    frequent, rules = vocabulary_map.build(iter(pairs), vocab, always=5, per_source=4)
    in_pairs = Counter(t for _, tgt in pairs for t in set(tgt.tolist()))
    expected = sorted(in_pairs, key=lambda t: (-in_pairs[t], t))[:5]
    assert frequent == expected
    together = Counter((s, t) for src, tgt in pairs for s in set(src.tolist()) for t in set(tgt.tolist()))
    for s in range(4, vocab):
        partners = [t for (s2, t) in together if s2 == s and t not in expected]
        best = sorted(partners, key=lambda t: (-together[s, t], t))[:4]
        assert rules.get(s, []) == best, s


@pytest.fixture(scope="module")
def tokenizer(trained) -> Tokenizer:  # noqa: F811 (the fixture)
    return Translator.from_checkpoint(str(trained), device="cpu").tokenizer


def test_a_map_file_reads_as_written_in_ctranslate2s_format(tmp_path, tokenizer):
    the, dog, der, hund = 10, 11, 12, 13
    pieces = dict(zip((the, dog, der, hund), tokenizer.pieces([the, dog, der, hund])))
    path = tmp_path / "vmap.txt"
    vocabulary_map.write(path, tokenizer, [der], {dog: [hund]})
    assert path.read_text(encoding="utf-8") == f"\t{pieces[der]}\n{pieces[dog]}\t{pieces[hund]}\n"
    with open(path, "a", encoding="utf-8") as f:  # a bigram, and a piece the vocabulary lacks
        f.write(f"{pieces[the]} {pieces[dog]}\t{pieces[hund]} no_such_piece\n")
    read = VocabularyMap.load(path, tokenizer)
    specials = {PAD_ID, BOS_ID, EOS_ID, 1}
    assert read.candidates([[]]).tolist() == sorted(specials | {der})
    assert read.candidates([[dog, EOS_ID]]).tolist() == sorted(specials | {der, hund})
    assert read.candidates([[the, dog]], forced=[7]).tolist() == sorted(specials | {der, hund, 7})
    assert read.candidates([[the]]).tolist() == sorted(specials | {der})
    with open(path, "a", encoding="utf-8") as f:  # blank lines are skipped
        f.write("\n  \n")
    assert VocabularyMap.load(path, tokenizer).candidates([[dog]]).tolist() == sorted(specials | {der, hund})
    bad = tmp_path / "bad.txt"
    bad.write_text(f"\t{pieces[der]}\n{pieces[dog]} {pieces[hund]}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad.txt, line 2: no tab"):
        VocabularyMap.read(bad)
    bad.write_bytes(f"\t{pieces[der]}\n".encode() + b"\xff\tabc\n")
    with pytest.raises(ConfigError, match=r"bad.txt, line 2: not UTF-8 text"):
        VocabularyMap.read(bad)
    bad.write_text("\tno_such_piece\nnor_this\tnor_that\n", encoding="utf-8")  # another model's pieces
    with pytest.raises(ConfigError, match=r"none of the vocabulary map's 2 target pieces is in this model's"):
        VocabularyMap.load(bad, tokenizer)


def test_the_script_maps_each_english_word_to_its_german_words_pieces(corpus, tmp_path):  # noqa: F811
    """scripts/vocabulary_map.py on a prepared corpus of English words and their German ones (reversed):
    the candidates of each English word hold its German word's pieces and few others; the file reads back
    with the corpus's tokenizer. A directory that is no prepared corpus is a one-line error."""
    data = prepare(compose_config(overrides(corpus, tmp_path)).data)
    output = tmp_path / "vmap.txt"
    command = [
        sys.executable,
        SCRIPT,
        str(data),
        "--output",
        str(output),
        "--always",
        "5",
        "--per-source",
        "4",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "from 300 pairs" in done.stdout
    tokenizer = Tokenizer.from_file(data / "spm.model")
    read = VocabularyMap.load(output, tokenizer)
    for english, german in WORDS.items():
        candidates = set(read.candidates([tokenizer.encode(english)]).tolist())
        assert set(tokenizer.encode(german)) <= candidates, english
        assert len(candidates) < tokenizer.vocab_size / 2
    command[2] = str(tmp_path)
    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "is not a prepared corpus (no spm.model)" in refused.stderr


@torch.no_grad()
def narrowed_log_probs(models, weights, src_row, tokens: list[int], allowed: list[int]) -> list[float]:
    """log sum_m w_m P_m(y_t | y_<t, X) with each model's softmax over the `allowed` pieces only, from
    one full decode per model."""
    src = src_row[None, : int((src_row != PAD_ID).sum())]
    tgt_in = torch.tensor([[BOS_ID] + tokens[:-1]])
    outside = torch.ones(models[0].cfg.vocab_size, dtype=torch.bool)
    outside[allowed] = False
    mixed = sum(
        w * m(src, tgt_in)[0].masked_fill(outside, -math.inf).softmax(-1) for m, w in zip(models, weights)
    )
    return [math.log(float(mixed[i, t])) for i, t in enumerate(tokens)]


def ranked_in(models, weights, src_row, allowed: list[int], max_len: int, alpha: float):
    """Every output of the allowed pieces, scored log P / lp(|Y|) under the narrowed mixture, best first."""
    content = [t for t in allowed if t not in (PAD_ID, BOS_ID, EOS_ID)]
    outputs = [list(y) + [EOS_ID] for j in range(max_len) for y in itertools.product(content, repeat=j)]
    outputs += [list(y) for y in itertools.product(content, repeat=max_len)]
    scored = []
    for y in outputs:
        log_p = sum(narrowed_log_probs(models, weights, src_row, y, allowed))
        scored.append((log_p / ((5 + len(y)) / 6) ** alpha, [t for t in y if t != EOS_ID]))
    return sorted(scored, key=lambda pair: -pair[0])


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("members", [1, 2], ids=["one model", "ensemble"])
def test_a_wide_beam_over_a_shortlist_is_the_exhaustive_ranking_of_its_outputs(static, members):
    """The search projects onto the shortlist's pieces only and normalizes over them, as the
    exhaustive ranking under the narrowed distribution: one model (the fast path) and an ensemble."""
    vocab, max_len, n, alpha = 9, 3, 4, 0.6
    models = [tiny_model(vocab=vocab, seed=7 + i) for i in range(members)]
    weights = [1.0 / members] * members
    model = models[0] if members == 1 else Ensemble(models, weights)
    allowed = [0, 1, 2, 3, 5, 8]  # the specials, UNK among them, and two pieces
    shortlist = Shortlist.of(model, torch.tensor(allowed))
    src = sources([2, 5], vocab, seed=4)
    search = SearchConfig(
        beam_size=4 ** (max_len - 1), alpha=alpha, max_len_a=0.0, max_len_b=max_len, nbest=n
    )
    result = beam_search(model, src, search, static=static, shortlist=shortlist)
    for row in range(src.size(0)):
        expected = ranked_in(models, weights, src[row], allowed, max_len, alpha)[:n]
        got = result.hypotheses[row]
        assert [h.tokens for h in got] == [tokens for _, tokens in expected]
        assert [h.score for h in got] == pytest.approx([score for score, _ in expected], abs=1e-5)


def test_a_shortlist_of_every_piece_decodes_as_the_whole_vocabulary():
    model = tiny_model(vocab=40, seed=3)
    src = sources([3, 7, 5], 40)
    for search in (SearchConfig(beam_size=4, nbest=2), SearchConfig(beam_size=1)):
        whole = beam_search(model, src, search)
        every = beam_search(model, src, search, shortlist=Shortlist.of(model, torch.arange(40)))
        assert [[h.tokens for h in hs] for hs in every.hypotheses] == [
            [h.tokens for h in hs] for hs in whole.hypotheses
        ]
        torch.testing.assert_close(every.scores, whole.scores, rtol=1e-6, atol=1e-6)


def test_a_shortlist_of_other_ids_for_other_models_or_without_a_forced_piece_is_refused():
    model = tiny_model(vocab=12, seed=0)
    with pytest.raises(ValueError, match="every special symbol"):
        Shortlist.of(model, torch.tensor([0, 2, 3, 5]))
    for ids in ([0, 1, 2, 3, 5, 5], [0, 1, 2, 3, 7, 5], [0, 1, 2, 3, 12]):  # twice, not ascending, no piece
        with pytest.raises(ValueError, match="ascend, each once, below the vocabulary's 12"):
            Shortlist.of(model, torch.tensor(ids))
    shortlist, src = Shortlist.of(model, torch.tensor([0, 1, 2, 3, 5])), sources([3], 12)
    with pytest.raises(ValueError, match="made for 1 models, used with 2"):
        beam_search(Ensemble([model, model], [0.5, 0.5]), src, shortlist=shortlist)
    with pytest.raises(ValueError, match=r"pieces \[7\] are forced"):
        beam_search(model, src, shortlist=shortlist, prefix=torch.tensor([[5, 7]]))
    with pytest.raises(ValueError, match=r"pieces \[9\] are forced"):
        beam_search(model, src, shortlist=shortlist, constraints=[[[5], [9]]])


@pytest.fixture(scope="module")
def mapped(trained, tmp_path_factory):  # noqa: F811 (the fixture)
    """A map that allows few target pieces: those of a few German words, whatever the source."""
    tokenizer = Translator.from_checkpoint(str(trained), device="cpu").tokenizer
    words = "Heute sieht der Hund die Katze . Gestern"
    allowed = sorted(set(tokenizer.encode(words)))
    path = tmp_path_factory.mktemp("vmap") / "vmap.txt"
    vocabulary_map.write(path, tokenizer, allowed, {})
    return path, allowed


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_translate_py_outputs_only_the_pieces_a_map_allows(trained, mapped, tmp_path, precision, monkeypatch):  # noqa: F811
    path, allowed = mapped
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    done = translate(
        f"checkpoint={trained}", f"input={source}", f"vocabulary_map={path}", "output_format=jsonl",
        f"precision={precision}", "device=cpu",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    rows = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert len(rows) == len(LINES)
    api = Translator.from_checkpoint(
        str(trained), device="cpu", precision=precision, vocabulary_map=str(path)
    )
    packed, prepacked = [], Products.prepacked  # each batch's shortlist is packed in the search's precision

    def recording(products, weights, int8=False):
        weights = list(weights)
        packed.extend((tuple((w[0] if isinstance(w, tuple) else w).shape), int8) for w in weights)
        return prepacked(products, weights, int8)

    monkeypatch.setattr(Products, "prepacked", recording)
    narrowed = api.translate(LINES)
    candidates = len(set(allowed) | {0, 1, 2, 3})  # what the map allows, and the special symbols
    assert ((candidates, api.model.cfg.d_model), precision == "int8") in packed
    for row, line, expected in zip(rows, LINES, narrowed):
        best = row["hypotheses"][0] if row["hypotheses"] else {"text": "", "pieces": []}
        assert best["text"] == expected
        pieces = [p for p in best["pieces"] if p != "</s>"]
        assert {api.tokenizer.piece_id(p) for p in pieces} <= set(allowed), line
    plain = Translator.from_checkpoint(str(trained), device="cpu", precision=precision).translate(LINES)
    assert plain != narrowed  # the map took something away


def test_a_missing_map_is_refused_before_the_model_loads(trained, tmp_path):  # noqa: F811
    done = translate(f"checkpoint={trained}", "text=Hello", f"vocabulary_map={tmp_path}/none.txt")
    assert done.returncode != 0
    assert f"vocabulary_map={tmp_path}/none.txt is not a file" in done.stderr.decode()


def test_the_server_draws_every_answer_from_its_map(trained, mapped):  # noqa: F811
    """serve.py vocabulary_map=FILE: a real client's answers are the narrowed search's."""
    path, allowed = mapped
    running = Running(f"vocabulary_map={path}", "device=cpu")
    try:
        status, answer = running.translate({"text": LINES[:1] + LINES[2:]})
    finally:
        running.process.kill()
    assert status == 200
    expected = Translator.from_checkpoint(CHECKPOINT, device="cpu", vocabulary_map=str(path))
    texts = [t["hypotheses"][0]["text"] for t in answer["translations"]]
    assert texts == expected.translate(LINES[:1] + LINES[2:])


def test_a_prefix_a_constraint_and_samples_keep_to_the_map_and_what_they_force(trained, mapped):  # noqa: F811
    """A forced piece outside the map joins the batch's candidates; samples draw from the map's."""
    path, allowed = mapped
    api = Translator.from_checkpoint(str(trained), device="cpu", vocabulary_map=str(path))

    def output(**guide) -> tuple[str, set[str]]:
        """The best output's text, and the pieces the search gave (not the text encoded again)."""
        best = api.translate_nbest(LINES[0], **guide)[0]
        return best.text, set(best.pieces) - {"</s>"}

    def pieces(text: str) -> set[str]:
        return set(api.tokenizer.pieces(allowed + api.tokenizer.encode(text)))

    prefixed, given = output(target_prefix="Morgen")
    assert prefixed.startswith("Morgen") and given <= pieces("Morgen")
    constrained, given = output(constraints=["Maus"])
    assert "Maus" in constrained and given <= pieces("Maus")
    search = SearchConfig(sampling=True, nbest=3, topk=0, seed=1)
    for hypothesis in api.translate_nbest(LINES[0], search=search):
        assert set(hypothesis.pieces) - {"</s>"} <= set(api.tokenizer.pieces(allowed))
