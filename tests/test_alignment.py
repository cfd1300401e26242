"""Hard word alignments (`alignment=true`): the argmax of the last decoder layer's head-averaged
encoder-decoder attention, written out here from the model's own projections; pieces merged into
words; fairseq's A- lines and the JSON lines' fields of translate.py; the alignment error rate, by hand
and as scripts/alignment_error.py reports it for translate.py's force-decoded references."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import subprocess
import sys

import pytest
import torch
from test_translate_cli import translate
from test_translate_features import LINES, ROOT, trained  # noqa: F401 (a fixture)

from transformer.checkpoint import load_checkpoint, model_from_checkpoint
from transformer.config import ConfigError, TranslateConfig
from transformer.data.tokenizer import Tokenizer
from transformer.data.toy import generate_alignments, generate_pairs
from transformer.inference.alignment import alignment_error_rate, from_links, parse_gold
from transformer.inference.translation import Translator
from transformer.vocab import BOS_ID, EOS_ID

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SENTENCES = [line for line in LINES if line]


def argmax_links(model, src_ids: list[int], out_ids: list[int], layer: int) -> list[tuple[int, int]]:
    """(source piece, target piece) pairs from decoder layer `layer`'s cross-attention, Eq. (1) written
    out from its W^Q and W^K on the inputs it is called with, the heads averaged, EOS left out."""
    if not out_ids:
        return []
    calls = []
    attention = model.decoder[layer].cross_attn
    hook = attention.register_forward_hook(lambda module, args, out: calls.append(args))
    with torch.no_grad():
        model(torch.tensor([src_ids]), torch.tensor([[BOS_ID] + out_ids[:-1]]))
    hook.remove()
    queries, memory = calls[0][0], calls[0][1]  # (1, T, d_model), (1, S, d_model)
    heads, d_k = attention.n_heads, attention.d_k
    q = attention.w_q(queries)[0].view(len(out_ids), heads, d_k).transpose(0, 1)  # (H, T, d_k)
    k = attention.w_kv(memory)[0, :, : heads * d_k].view(len(src_ids), heads, d_k).transpose(0, 1)
    weights = (q @ k.transpose(1, 2) / math.sqrt(d_k)).softmax(dim=-1).mean(dim=0)  # (T, S)
    return [(int(weights[j, :-1].argmax()), j) for j in range(len(out_ids))]  # the last key is EOS


def test_piece_links_are_the_argmax_of_the_last_layers_head_averaged_cross_attention(trained):  # noqa: F811
    translator = Translator.from_checkpoint(trained, device="cpu", nbest=2, alignment=True)
    ckpt = load_checkpoint(trained)
    model, tokenizer = model_from_checkpoint(ckpt).eval(), Tokenizer.from_bytes(ckpt["spm_model"])
    first_layer_differs = 0
    for line, hypotheses in zip(SENTENCES, translator.translate_nbest(SENTENCES)):
        src = tokenizer.encode(line) + [EOS_ID]
        for h in hypotheses:
            out = [tokenizer.piece_id(piece) for piece in h.pieces if piece != "</s>"]
            assert h.alignment.pieces == argmax_links(model, src, out, layer=-1)
            first_layer_differs += h.alignment.pieces != argmax_links(model, src, out, layer=0)
            assert h.alignment.piece_counts == (len(src) - 1, len(out))
    assert first_layer_differs > 0  # the layer matters: another would be caught
    without = dataclasses.replace(translator.cfg.search, alignment=False)
    assert all(t.alignment is None for t in translator.translate_nbest(SENTENCES[0], search=without))


def test_pieces_merge_into_words_where_any_of_their_pieces_link():
    source = ["▁The", "▁black", "bird", "▁sing", "s", "."]  # words: The | blackbird | sings.
    target = ["▁Die", "▁Am", "sel", "▁sing", "t", "."]  # words: Die | Amsel | singt.
    alignment = from_links([0, 1, 2, 3, 3, 5], source, target)
    assert alignment.pieces == [(0, 0), (1, 1), (2, 2), (3, 3), (3, 4), (5, 5)]
    assert alignment.words == [(0, 0), (1, 1), (2, 2)]
    assert (alignment.piece_counts, alignment.word_counts) == ((6, 6), (3, 3))
    crossing = from_links([2, 0, 4, 4, 1, 0], source, target)  # a word linked from two: one link each
    assert crossing.words == [(1, 0), (0, 1), (2, 1), (0, 2), (1, 2), (2, 2)]  # by target, then source


def test_translate_py_writes_fairseqs_a_lines_and_jsonl_fields(trained):  # noqa: F811
    translator = Translator.from_checkpoint(trained, device="cpu", nbest=2, alignment=True)
    expected = translator.translate_nbest(LINES)
    stdin = "\n".join(LINES).encode()
    done = translate(
        f"checkpoint={trained}", "nbest=2", "alignment=true", "output_format=fairseq", stdin=stdin
    )
    assert done.returncode == 0, done.stderr.decode()
    lines = done.stdout.decode().splitlines()
    assert [line.split("\t")[0] for line in lines[:9]] == ["S-0", *["H-0", "D-0", "P-0", "A-0"] * 2]
    a_lines = [line.split("\t") for line in lines if line.startswith("A-")]
    want = [
        (f"A-{n}", " ".join(f"{i}-{j}" for i, j in h.alignment.pieces))
        for n, hs in enumerate(expected)
        for h in hs
    ]
    assert [tuple(a) for a in a_lines] == want and all(
        re.fullmatch(r"(\d+-\d+( \d+-\d+)*)?", a) for _, a in a_lines
    )
    done = translate(f"checkpoint={trained}", "nbest=2", "alignment=true", "output_format=jsonl", stdin=stdin)
    entries = [json.loads(line) for line in done.stdout.decode().splitlines()]
    for entry, hypotheses in zip(entries, expected):
        assert [h["alignment"] for h in entry["hypotheses"]] == [
            [list(w) for w in h.alignment.words] for h in hypotheses
        ]
        assert [h["piece_alignment"] for h in entry["hypotheses"]] == [
            [list(p) for p in h.alignment.pieces] for h in hypotheses
        ]
    plain = translate(f"checkpoint={trained}", "output_format=jsonl", stdin=stdin)
    assert "alignment" not in plain.stdout.decode()  # only when asked
    # refused before the input file is looked at, let alone the checkpoint loaded
    refused = translate(f"checkpoint={trained}", "alignment=true", f"input={ROOT / 'missing.txt'}")
    assert refused.returncode == 2 and refused.stderr.decode().strip().splitlines() == [
        "error: alignment=true writes each translation's alignment: choose output_format=jsonl or "
        "output_format=fairseq"
    ]


def test_alignment_error_rate_by_hand():
    sure, possible = parse_gold("0-0 1-1 1p2 2p2")
    assert sure == {(0, 0), (1, 1)} and possible == {(0, 0), (1, 1), (1, 2), (2, 2)}
    found = {(0, 0), (1, 2), (0, 2)}
    # |A & S| = 1, |A & P| = 2, |A| = 3, |S| = 2: 1 - 3 / 5
    assert alignment_error_rate([found], [sure], [possible]) == pytest.approx(0.4)
    assert alignment_error_rate([sure], [sure], [possible]) == 0.0
    # over a corpus the counts add up: hits 0 + (2 + 2), |A| 1 + 2, |S| 2 + 2
    corpus = alignment_error_rate([{(2, 0)}, sure], [sure, sure], [possible, possible])
    assert corpus == pytest.approx(1 - 4 / 7)
    with pytest.raises(ValueError, match="'1x2' is not a link"):
        parse_gold("0-0 1x2")


def test_the_scripts_aer_is_that_of_translate_py_force_decoding_the_references(trained, tmp_path):  # noqa: F811
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "alignment_error.py"),
            str(trained),
            "--device",
            "cpu",
            "--gold-dir",
            str(tmp_path),
        ],
        capture_output=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr.decode()
    pairs, gold = generate_pairs(50, 1234), generate_alignments(50, 1234)  # the checkpoint's toy test split
    assert (tmp_path / "test.en").read_text().splitlines() == [en for en, _ in pairs]
    assert (tmp_path / "test.align").read_text().splitlines() == gold
    scored = translate(
        f"checkpoint={trained}",
        f"input={tmp_path / 'test.en'}",
        f"score={tmp_path / 'test.de'}",
        "alignment=true",
        "output_format=jsonl",
    )
    words = [
        {tuple(link) for link in json.loads(line)["hypotheses"][0]["alignment"]}
        for line in scored.stdout.decode().splitlines()
    ]
    sure, possible = zip(*map(parse_gold, gold))
    aer = alignment_error_rate(words, list(sure), list(possible))
    assert done.stdout.decode().startswith(f"AER {100 * aer:.1f}% ")
    rng = random.Random(0)  # chance: each German word linked to a random English word
    chance = [{(rng.randrange(len(en.split())), j) for j in range(len(de.split()))} for en, de in pairs]
    assert aer < alignment_error_rate(chance, list(sure), list(possible)) - 0.1


def test_bad_alignment_settings_are_one_line_before_a_model_loads():
    with pytest.raises(ConfigError, match="alignment='maybe' must be true or false"):
        TranslateConfig(checkpoint="x.pt", alignment="maybe")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "evaluate.py"), "checkpoint=missing.pt", "alignment=maybe"],
        capture_output=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 2 and done.stderr.decode().strip().splitlines() == [
        "error: alignment='maybe' must be true or false"
    ]
