"""Lines longer than a model takes (`long_inputs`): split at sentence ends (Moses' rules), a sentence
still too long cut into parts at word starts, the parts translated alone and joined, against translating
each part on its own; or truncated. Through the Python API, translate.py and the server's encoding."""

from __future__ import annotations

import json
import logging

import pytest
from test_translate_cli import translate
from test_translate_features import LINES, trained  # noqa: F401 (a fixture)

from transformer.config import ConfigError, SearchConfig, TranslateConfig
from transformer.inference.translation import Translator

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SENTENCES = [line for line in LINES if line]
# outputs up to 10 x |X| + 50 in 1,024 positions: sources of at most 97 pieces (96 and EOS)
SHORT_ROOM = {"max_len_a": 10.0, "max_len_b": 50}


@pytest.fixture(scope="module")
def translator(trained):  # noqa: F811
    return Translator.from_checkpoint(trained, device="cpu", **SHORT_ROOM)


def test_a_line_of_sentences_too_long_is_translated_sentence_by_sentence(translator, caplog):
    line = " ".join(SENTENCES * 2)  # six sentences, about 130 pieces
    assert len(translator.tokenizer.encode(line)) > 96
    with caplog.at_level(logging.WARNING):
        (parts,) = translator.encode([line])
    assert len(parts) == 6 and "line 1:" in caplog.text and "6 parts" in caplog.text
    alone = translator.translate(SENTENCES * 2)
    assert translator.translate(line) == " ".join(t for t in alone if t)  # (an empty one adds no space)
    (nbest,) = translator.translate_nbest([line], search=SearchConfig(**SHORT_ROOM, nbest=2, beam_size=4))
    each = translator.translate_nbest(SENTENCES * 2, search=SearchConfig(**SHORT_ROOM, nbest=2, beam_size=4))
    for i, joined in enumerate(nbest):  # the i-th joins the sentences' i-th
        parts = [hypotheses[i] for hypotheses in each]
        assert joined.text == " ".join(t.text for t in parts if t.text)
        assert joined.pieces == [p for t in parts for p in t.pieces] and joined.pieces.count("</s>") == 6
        assert joined.log_prob == pytest.approx(sum(joined.token_log_probs), abs=1e-4)
        assert joined.score == pytest.approx(sum(t.score for t in parts), abs=1e-4)


def test_a_sentence_too_long_is_cut_at_word_starts_into_parts_that_fit(translator):
    line = " ".join(["the old man sees the small bird and the dog"] * 12)  # no sentence end
    pieces = translator.tokenizer.encode(line)
    (parts,) = translator.encode([line])
    assert len(pieces) > 96 and len(parts) == -(-len(pieces) // 96)
    assert all(len(part) <= 97 and part[-1] == 3 for part in parts)  # pieces + EOS
    assert [i for part in parts for i in part[:-1]] == pieces  # nothing lost, nothing repeated
    texts = [translator.tokenizer.decode(part[:-1]) for part in parts]
    assert all(translator.tokenizer.pieces(part[:1])[0].startswith("▁") for part in parts)  # at a word
    assert " ".join(texts) == line
    assert translator.translate(line) == " ".join(translator.translate(texts))


def test_a_split_lines_alignment_is_its_parts_moved_to_their_place_in_the_line(translator):
    sentences = SENTENCES + SENTENCES[::-1]  # no part repeats its neighbour: a wrong offset shows
    line, tokenizer = " ".join(sentences), translator.tokenizer
    search = SearchConfig(**SHORT_ROOM, alignment=True)
    whole, parts = translator.translate_nbest(line, search=search)[0], translator.translate(sentences)
    # two of the parts translate to nothing: their sources still come before the next parts'
    assert len(translator.encode([line])[0]) == 6 and parts.count("") == 2
    assert whole.text == " ".join(filter(None, parts))
    each = [hypotheses[0] for hypotheses in translator.translate_nbest(sentences, search=search)]
    # the linked pieces, and words, as text: the whole line's against each sentence's alone
    source = tokenizer.pieces(tokenizer.encode(line))
    target = [piece for piece in whole.pieces if piece != "</s>"]
    assert [(source[i], target[j]) for i, j in whole.alignment.pieces] == [
        (tokenizer.pieces(tokenizer.encode(sentence))[i], part.pieces[j])
        for sentence, part in zip(sentences, each)
        for i, j in part.alignment.pieces
    ]
    assert [(line.split()[i], whole.text.split()[j]) for i, j in whole.alignment.words] == [
        (sentence.split()[i], part.text.split()[j])
        for sentence, part in zip(sentences, each)
        for i, j in part.alignment.words
    ]
    assert whole.alignment.piece_counts == (len(source), len(target))
    assert whole.alignment.word_counts == (len(line.split()), len(whole.text.split()))


def test_truncate_keeps_the_first_pieces(translator, caplog):
    line = " ".join(SENTENCES * 2)
    truncate = SearchConfig(**SHORT_ROOM, long_inputs="truncate")
    with caplog.at_level(logging.WARNING):
        (parts,) = translator.encode([line], truncate)
    assert parts == [translator.tokenizer.encode(line)[:96] + [3]]
    assert "line 1:" in caplog.text and "translating the first 96 pieces" in caplog.text
    assert translator.translate(line, search=truncate) != translator.translate(line)


def test_translate_py_splits_by_default_one_output_line_per_input_line(trained, tmp_path):  # noqa: F811
    long_line = " ".join(SENTENCES * 2)
    stdin = "\n".join([SENTENCES[0], long_line, "", long_line]).encode()
    settings = [f"checkpoint={trained}", "max_len_a=10", "max_len_b=50"]
    split = translate(*settings, stdin=stdin)
    cut = translate(*settings, "long_inputs=truncate", stdin=stdin)
    jsonl = translate(*settings, "output_format=jsonl", stdin=stdin)
    assert split.returncode == cut.returncode == jsonl.returncode == 0, split.stderr.decode()
    lines = split.stdout.decode().splitlines()
    assert len(lines) == 4 and lines[1] == lines[3] and lines[2] == ""
    expected = Translator.from_checkpoint(trained, device="cpu", **SHORT_ROOM).translate(long_line)
    assert lines[1] == expected and len(cut.stdout.decode().splitlines()) == 4
    assert cut.stdout.decode().splitlines()[1] != lines[1]
    assert "line 2:" in split.stderr.decode() and "line 4:" in split.stderr.decode()
    entries = [json.loads(line) for line in jsonl.stdout.decode().splitlines()]
    assert entries[1]["hypotheses"][0]["text"] == expected
    assert entries[1]["hypotheses"][0]["pieces"].count("</s>") == 6
    # fairseq's lines: H- holds the pieces A- counts (no part's </s>), P- every part's EOS too
    fairseq = translate(*settings, "output_format=fairseq", "alignment=true", stdin=stdin)
    rows = dict(line.split("\t", 1) for line in fairseq.stdout.decode().splitlines() if line[2:4] == "1\t")
    pieces = rows["H-1"].split("\t")[1].split()
    assert "</s>" not in pieces and len(pieces) + 6 == len(rows["P-1"].split())
    assert max(int(link.split("-")[1]) for link in rows["A-1"].split()) == len(pieces) - 1


def test_with_constraints_only_the_lines_with_phrases_stay_whole(trained, tmp_path):  # noqa: F811
    """translate.py constraints=FILE: a long line without phrases is split as ever, one with phrases cut
    to fit (its phrases are the whole line's); a line whose phrases alone exceed the model's positions
    is translated without them, with a warning naming it: one output line per input line, no stop."""
    long_line = " ".join(SENTENCES * 2)
    lines = [long_line, long_line, SENTENCES[0], SENTENCES[1]]
    phrases = ["", "Katze", "Katze " * 600, "Hund"]
    (tmp_path / "terms.de").write_text("".join(p + "\n" for p in phrases), encoding="utf-8")
    settings = [f"checkpoint={trained}", "max_len_a=10", "max_len_b=50", "output_format=jsonl"]
    done = translate(*settings, f"constraints={tmp_path / 'terms.de'}", stdin="\n".join(lines).encode())
    assert done.returncode == 0, done.stderr.decode()
    entries = [json.loads(line)["hypotheses"][0] for line in done.stdout.decode().splitlines()]
    assert len(entries) == 4
    assert entries[0]["pieces"].count("</s>") == 6 and entries[1]["pieces"].count("</s>") == 1
    assert "Katze" in entries[1]["text"] and "Hund" in entries[3]["text"]
    api = Translator.from_checkpoint(trained, device="cpu", **SHORT_ROOM)
    assert entries[2]["text"] == api.translate(SENTENCES[0])  # as without the phrase
    warnings = done.stderr.decode()
    assert "line 1: " in warnings and "parts" in warnings  # split
    assert "line 2: " in warnings and "translating the first 96 pieces" in warnings  # cut
    assert "line 3: its target prefix and constraints take" in warnings and "without them" in warnings


def test_a_bad_long_inputs_value_is_one_line_before_loading():
    with pytest.raises(ConfigError, match="long_inputs='cut' must be one of 'split' or 'truncate'"):
        TranslateConfig(checkpoint="x.pt", long_inputs="cut")
    done = translate("checkpoint=missing.pt", "long_inputs=cut", stdin=b"a\n")
    assert done.returncode == 2 and "long_inputs='cut' must be" in done.stderr.decode()
