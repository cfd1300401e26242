"""What users of fairseq, OpenNMT-py and Marian reach for, through translate.py and the Python API:
n-best lists with scores in fairseq's and JSON lines' formats, scoring given translations (against the
model's own teacher-forced loss), sampling that does not depend on the batches, line-by-line
interactive translation through a pipe, and ensembles of checkpoints."""

from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_translate_cli import translate

from transformer.checkpoint import load_checkpoint, model_from_checkpoint, write_checkpoint
from transformer.config import ConfigError, SearchConfig, TranslateConfig
from transformer.data.tokenizer import Tokenizer
from transformer.decoding import length_penalty
from transformer.inference.translation import Translator
from transformer.training.loss import smoothed_cross_entropy
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")
LINES = [
    "Today the dog sees the cat.",
    "",
    "The woman knows that the old man has seen the small bird.",
    "Yesterday the children bought a red car.",
]
TRAINED = ROOT / "tests" / "data" / "checkpoint_2b99159.pt"  # a small model trained on the toy corpus


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A small trained model (its outputs end in EOS and differ from line to line)."""
    path = tmp_path_factory.mktemp("trained") / "trained.pt"
    write_checkpoint(load_checkpoint(TRAINED), path)
    return path


@pytest.fixture(scope="module")
def partner(tmp_path_factory) -> Path:
    """Another model with the same tokenizer: the trained one's weights, perturbed."""
    ckpt = load_checkpoint(TRAINED)
    g = torch.Generator().manual_seed(0)
    ckpt["model"] = {
        k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 else v
        for k, v in ckpt["model"].items()
    }
    path = tmp_path_factory.mktemp("partner") / "partner.pt"
    write_checkpoint(ckpt, path)
    return path


def test_jsonl_n_best_lists_carry_scores_pieces_and_their_log_probabilities(trained):
    done = translate(
        f"checkpoint={trained}", "nbest=3", "output_format=jsonl", stdin="\n".join(LINES).encode()
    )
    assert done.returncode == 0, done.stderr.decode()
    entries = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert [e["line"] for e in entries] == [0, 1, 2, 3] and [e["source"] for e in entries] == LINES
    assert entries[1]["hypotheses"] == []  # an empty line: an entry, no hypothesis
    translator = Translator.from_checkpoint(trained, nbest=3, device="cpu")
    compared = 0
    for entry in (entries[0], entries[2], entries[3]):
        hypotheses = entry["hypotheses"]
        assert len(hypotheses) == 3 and len({h["text"] for h in hypotheses}) == 3
        assert [h["score"] for h in hypotheses] == sorted((h["score"] for h in hypotheses), reverse=True)
        for h in hypotheses:
            assert len(h["pieces"]) == len(h["token_log_probs"]) and h["pieces"][-1] == "</s>"
            assert h["log_prob"] == pytest.approx(sum(h["token_log_probs"]), abs=1e-6)
            assert h["score"] == pytest.approx(  # the search divides in float32
                h["log_prob"] / length_penalty(len(h["pieces"]), 0.6), rel=1e-6, abs=1e-6
            )
            # the search's own log-probabilities are those of teacher forcing the output it found
            scored = translator.score([entry["source"]], [h["text"]])[0]
            if scored.pieces == h["pieces"]:  # (detokenizing and encoding again may split differently)
                assert scored.token_log_probs == pytest.approx(h["token_log_probs"], abs=1e-4)
                compared += 1
    assert compared >= 6
    assert entries[0]["hypotheses"][0]["text"] == translator.translate([LINES[0]])[0]


def test_fairseq_lines_are_fairseqs_in_base_2(trained):
    done = translate(f"checkpoint={trained}", "nbest=2", "output_format=fairseq", stdin=LINES[0].encode())
    assert done.returncode == 0, done.stderr.decode()
    lines = done.stdout.decode().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["S-0", "H-0", "D-0", "P-0", "H-0", "D-0", "P-0"]
    translator = Translator.from_checkpoint(trained, nbest=2, device="cpu")
    best = translator.translate_nbest([LINES[0]])[0][0]
    _, score, pieces = lines[1].split("\t")
    assert float(score) == pytest.approx(best.score / math.log(2), abs=1e-6)
    assert pieces.split() == best.pieces[:-1]
    assert lines[2].split("\t")[2] == best.text
    positional = [float(p) for p in lines[3].split("\t")[1].split()]
    assert positional == pytest.approx([p / math.log(2) for p in best.token_log_probs], abs=1e-4)
    # a source line holding a carriage return or U+2028 still gives one S- line
    done = translate(
        f"checkpoint={trained}", "output_format=fairseq", stdin="The owls\rhave\u2028jumped.".encode()
    )
    lines = done.stdout.decode().splitlines()
    assert done.returncode == 0 and lines[0] == "S-0\tThe owls have jumped." and lines[1].startswith("H-0\t")


def test_scores_of_given_translations_are_the_models_teacher_forced_loss(trained, tmp_path):
    """score=FILE: per-piece log-probabilities whose negated sum is the NLL the training loss computes
    for that pair (label smoothing 0)."""
    translations = ["Die Katze sieht das Haus.", "", "Ein Hund mag einen roten Ball.", "x"]
    (tmp_path / "hyp").write_text("\n".join(translations) + "\n")
    done = translate(
        f"checkpoint={trained}",
        f"score={tmp_path / 'hyp'}",
        "output_format=jsonl",
        stdin="\n".join(LINES).encode(),
    )
    assert done.returncode == 0, done.stderr.decode()
    entries = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert entries[1]["hypotheses"] == [] and len(entries) == 4
    ckpt = load_checkpoint(trained)
    model, tokenizer = model_from_checkpoint(ckpt).double(), Tokenizer.from_bytes(ckpt["spm_model"])
    for entry, source, target in zip(entries, LINES, translations):
        if not source:
            continue
        src = torch.tensor([tokenizer.encode(source) + [EOS_ID]])
        tgt = tokenizer.encode(target) + [EOS_ID]
        tgt_in = torch.tensor([[BOS_ID] + tgt[:-1]])
        states = model.decode(tgt_in, model.encode(src), model.src_mask(src))[0]
        _, nll = smoothed_cross_entropy(states, model.embed.weight, torch.tensor(tgt), 0.0, PAD_ID)
        (scored,) = entry["hypotheses"]
        assert scored["log_prob"] == pytest.approx(-float(nll), abs=1e-4)
        assert scored["text"] == tokenizer.decode(tgt) and len(scored["token_log_probs"]) == len(tgt)
    score = [f"checkpoint={trained}", f"score={tmp_path / 'hyp'}"]
    text = translate(*score, "output_format=jsonl", stdin=LINES[0].encode())
    assert text.returncode == 2 and "1 input lines but 4 translations to score" in text.stderr.decode()
    text = translate(*score, stdin="\n".join(LINES).encode())  # plain text would print no score
    assert (
        text.returncode == 2
        and "score=FILE writes each translation's log-probabilities" in text.stderr.decode()
    )


def test_samples_do_not_depend_on_the_batches(trained):
    settings = ["sampling=true", "nbest=3", "topp=0.95", "temperature=1.3", "seed=7", "output_format=jsonl"]
    stdin = "\n".join(LINES * 3).encode()
    runs = [
        translate(f"checkpoint={trained}", *settings, *batches, stdin=stdin)
        for batches in ([], ["max_sentences=1"], ["max_tokens=20", "max_sentences=3"])
    ]
    outputs = []
    for done in runs:
        assert done.returncode == 0, done.stderr.decode()
        outputs.append(
            [
                [h["text"] for h in json.loads(line)["hypotheses"]]
                for line in done.stdout.decode().splitlines()
            ]
        )
    assert outputs[0] == outputs[1] == outputs[2]
    assert len({t for line in outputs[0] for t in line}) > 6  # samples, not one search result
    assert outputs[0][0] != outputs[0][4]  # the same sentence on another line draws other samples
    other = translate(f"checkpoint={trained}", *settings[:-2], "seed=8", "output_format=jsonl", stdin=stdin)
    assert [
        [h["text"] for h in json.loads(line)["hypotheses"]] for line in other.stdout.decode().splitlines()
    ] != outputs[0]


def test_samples_are_scored_and_listed_by_their_log_probability(trained):
    """Samples are not searched: their score is log P(Y|X), without the search's length penalty, and the
    list of a line's samples is best first by it."""
    translator = Translator.from_checkpoint(trained, device="cpu", sampling=True, nbest=4, topk=20, seed=3)
    for hypotheses in filter(None, translator.translate_nbest(LINES)):  # (an empty line has none)
        scores = [h.score for h in hypotheses]
        assert scores == pytest.approx([h.log_prob for h in hypotheses], abs=1e-4)
        assert scores == sorted(scores, reverse=True) and len(set(scores)) > 1


def test_a_pipe_with_buffer_size_1_is_answered_line_by_line(trained, tmp_path):
    """A client writes one line, waits for its translation, then writes the next: each is answered
    before the next is sent (the process would wait forever for input otherwise)."""
    expected = Translator.from_checkpoint(trained, device="cpu").translate(LINES)
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "translate.py"), f"checkpoint={trained}", "buffer_size=1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        for line, translation in zip(LINES, expected):
            process.stdin.write(line.encode() + b"\n")
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], 120)
            assert ready, f"no answer to {line!r} while the input stays open"
            assert process.stdout.readline().decode().rstrip("\n") == translation
        process.stdin.close()
        assert process.wait(timeout=60) == 0 and process.stdout.read() == b""
    finally:
        process.kill()
    # output=FILE stays atomic: written once, at the end
    out = tmp_path / "out.txt"
    done = translate(
        f"checkpoint={trained}", "buffer_size=2", f"output={out}", stdin="\n".join(LINES).encode()
    )
    assert done.returncode == 0 and done.stdout == b"" and out.read_text().splitlines() == expected


def test_an_ensemble_translates_and_a_different_vocabulary_is_refused(trained, partner, tiny_checkpoint):
    both = f"checkpoint=[{trained},{partner}]"
    done = translate(both, "weights=[0.7,0.3]", "output_format=jsonl", stdin="\n".join(LINES).encode())
    assert done.returncode == 0, done.stderr.decode()
    ensemble = Translator.from_checkpoint([str(trained), str(partner)], weights=[0.7, 0.3], device="cpu")
    found = ensemble.translate_nbest(LINES)
    entries = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert [[h["text"] for h in e["hypotheses"]] for e in entries] == [[t.text for t in h] for h in found]
    alone = [
        Translator.from_checkpoint(path, device="cpu").translate_nbest(LINES) for path in (trained, partner)
    ]
    scores = [[h[0].score for h in found if h] for found in (found, *alone)]
    assert scores[0] != pytest.approx(scores[1]) and scores[0] != pytest.approx(scores[2])  # both count
    other = tiny_checkpoint  # another corpus' vocabulary
    refused = translate(f"checkpoint=[{trained},{other}]", stdin=b"x")
    assert refused.returncode == 2
    assert refused.stderr.decode().strip() == (
        f"error: {trained} and {other} have different tokenizers: an ensemble needs one vocabulary"
    )
    weights = translate(both, "weights=[1.0]", stdin=b"x")
    assert (
        weights.returncode == 2
        and "weights=[1.0] must have one weight per checkpoint (2)" in weights.stderr.decode()
    )


def test_an_ensemble_takes_the_positions_of_its_shortest_member(trained, tmp_path):
    """Members with other max_positions: sources and outputs fit the smallest, whatever the order of
    the checkpoints (an over-long line is cut with a warning, never a crash)."""
    ckpt = load_checkpoint(trained)
    short = tmp_path / "short.pt"
    write_checkpoint({**ckpt, "model_config": {**ckpt["model_config"], "max_positions": 64}}, short)
    line = " ".join(["the dog sees the cat"] * 30)  # more pieces than 64 positions hold
    found = [
        Translator.from_checkpoint(paths, device="cpu").translate([line, LINES[0]])
        for paths in ([str(trained), str(short)], [str(short), str(trained)])
    ]
    assert found[0] == found[1] and all(found[0])


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"nbest": 2}, "output_format=text writes one translation per line: with nbest=2 choose"),
        ({"nbest": 5, "output_format": "jsonl"}, "nbest=5 must be at most beam_size=4"),
        ({"topk": 5}, "topk, topp and temperature shape sampling: add sampling=true"),
        ({"sampling": True, "topp": 0.0}, "topp=0.0 must be in (0, 1]"),
        ({"sampling": True, "temperature": 0.0}, "temperature=0.0 must be in [0.01, 100.0]"),
        ({"alpha": 50}, "alpha=50.0 must be in [0, 10.0]"),
        ({"no_repeat_ngram_size": -2}, "no_repeat_ngram_size=-2 must be >= 0 (0 = off)"),
        ({"repetition_penalty": 1000}, "repetition_penalty=1000.0 must be in [0.01, 100.0]"),
        ({"alpha": float("inf")}, "alpha=inf must be a finite number"),
        ({"beam_size": "4"}, "beam_size='4' must be a whole number"),
        ({"output_format": "xml"}, "output_format='xml' must be one of 'text', 'fairseq' or 'jsonl'"),
        ({"buffer_size": 0}, "buffer_size=0 must be at least 1"),
        (
            {"score": "x.txt", "sampling": True, "output_format": "jsonl"},
            "score=FILE scores the translations given: not with sampling",
        ),
        (
            {"checkpoint": ["a.pt", "b.pt"], "weights": [1.0]},
            "weights=[1.0] must have one weight per checkpoint",
        ),
    ],
)
def test_mistakes_in_the_new_settings_are_named_before_any_work(settings, message):
    with pytest.raises(ConfigError) as refused:
        TranslateConfig(**{"checkpoint": "x.pt", **settings})
    assert message in str(refused.value)


def test_the_python_api_takes_a_path_and_options(trained):
    translator = Translator.from_checkpoint(trained, beam_size=5, nbest=2, device="cpu")
    (first, second), none, *_ = translator.translate_nbest(LINES)
    assert none == [] and first.score >= second.score and first.text != second.text
    assert first.log_prob == pytest.approx(sum(first.token_log_probs))
    assert translator.translate(LINES)[0] == first.text
    with pytest.raises(ConfigError, match="nbest=3 must be at most beam_size=2"):
        Translator.from_checkpoint(trained, beam_size=2, nbest=3)
    started = time.perf_counter()
    assert Translator.from_checkpoint(trained, device="cpu").cfg.beam_size == 4  # the defaults
    assert time.perf_counter() - started < 60
    with pytest.raises(ConfigError, match="alpha=50.0 must be in"):  # the same checks as the CLI's
        Translator.from_checkpoint(trained, alpha=50)


def test_one_line_as_a_string_is_one_line_and_a_search_per_call_overrides_the_settings(trained):
    """translate("a sentence") translates the sentence, not each of its characters; every method takes
    the search of one call (a server request's) over the translator's own."""
    translator = Translator.from_checkpoint(trained, device="cpu")
    line = LINES[0]
    assert translator.translate(line) == translator.translate([line])[0] != ""
    assert translator.translate_nbest(line)[0].text == translator.translate(line)
    assert translator.score(line, "x").log_prob == translator.score([line], ["x"])[0].log_prob
    with pytest.raises(TypeError, match="lines must be a list of strings"):
        translator.translate([line, 3])
    wide = SearchConfig(beam_size=5, nbest=3)
    per_call = translator.translate_nbest([line], search=wide)[0]
    assert len(per_call) == 3 and translator.cfg.nbest == 1
    assert [t.text for t in per_call] == [
        t.text
        for t in Translator.from_checkpoint(trained, device="cpu", beam_size=5, nbest=3).translate_nbest(line)
    ]


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_repetition_control_through_translate_py(trained, precision):
    """no_repeat_ngram_size=1 in the CLI: no hypothesis holds a piece twice, where the plain search
    does; each token's log-probability stays the model's own (teacher forcing the same output), while
    the score ranks by the penalised ones."""
    settings = [f"checkpoint={trained}", f"precision={precision}", "output_format=jsonl", "nbest=2"]
    stdin = "\n".join(LINES * 2).encode()
    plain = translate(*settings, stdin=stdin)
    controlled = translate(*settings, "no_repeat_ngram_size=1", "repetition_penalty=1.3", stdin=stdin)
    assert plain.returncode == controlled.returncode == 0, controlled.stderr.decode()

    def hypotheses(done):
        return [h for line in done.stdout.decode().splitlines() for h in json.loads(line)["hypotheses"]]

    def twice(h):
        return len(h["pieces"]) - len(set(h["pieces"]))

    assert sum(twice(h) for h in hypotheses(plain)) > 0
    assert all(twice(h) == 0 for h in hypotheses(controlled)) and hypotheses(controlled)
    if precision == "int8":
        return  # (8-bit products quantize a batch's activations together: teacher forcing differs)
    translator = Translator.from_checkpoint(trained, device="cpu")
    compared = 0
    for line, h in zip([x for x in LINES * 2 if x], hypotheses(controlled)[::2]):
        scored = translator.score(line, h["text"])
        if scored.pieces == h["pieces"]:  # (detokenizing and encoding again may split differently)
            assert scored.token_log_probs == pytest.approx(h["token_log_probs"], abs=1e-4)
            compared += 1
        if len(h["pieces"]) > 2:  # the score ranks by the penalised probabilities, not log_prob / lp
            lp = length_penalty(len(h["pieces"]), 0.6)
            assert h["score"] != pytest.approx(h["log_prob"] / lp, abs=1e-3)
    assert compared >= 3


def test_a_length_penalty_out_of_range_is_one_line_before_the_checkpoint_loads(tmp_path):
    done = translate("checkpoint=missing.pt", "alpha=50", stdin=b"a\n")
    assert done.returncode == 2 and done.stderr.decode().strip() == "error: alpha=50.0 must be in [0, 10.0]"
