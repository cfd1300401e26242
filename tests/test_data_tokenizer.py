"""The shared SentencePiece BPE tokenizer: fixed special ids, round trips, serialization."""

from __future__ import annotations

import io

import pytest
import sentencepiece as spm
import torch

from transformer.data import tokenizer
from transformer.data.tokenizer import Tokenizer
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID

SENTENCES = [
    "the small dog sees the big cat in the garden .",
    "der kleine Hund sieht die große Katze im Garten .",
    "a woman plays with a red ball on the street .",
    "eine Frau spielt mit einem roten Ball auf der Straße .",
] * 20


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    return tokenizer.learn_bpe(SENTENCES, 80)


def test_special_ids_are_fixed(model_bytes):
    tok = Tokenizer.from_bytes(model_bytes)
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert tok.pieces([0, 1, 2, 3]) == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tok.vocab_size == 80


def test_round_trip_and_batch_encoding(model_bytes, tmp_path):
    tok = Tokenizer.from_bytes(model_bytes)
    text = "die große Katze sieht den kleinen Hund ."
    ids = tok.encode(text)
    assert all(i > EOS_ID for i in ids)  # pieces only: no BOS/EOS added
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor([BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID])) == text
    assert "".join(tok.pieces(ids)).replace("\u2581", " ").strip() == text
    assert tok.encode_batch([text, "", "a red ball"]) == [ids, [], tok.encode("a red ball")]
    (tmp_path / "spm.model").write_bytes(tok.model_bytes)
    assert Tokenizer.from_file(tmp_path / "spm.model").encode(text) == ids


def test_lowercase_is_built_into_the_model():
    tok = Tokenizer.from_bytes(tokenizer.learn_bpe(SENTENCES, 80, lowercase=True))
    for text in ("Die GROSSE Katze sieht den kleinen HUND .", "eine Frau auf der Straße ."):
        assert tok.decode(tok.encode(text)) == text.lower()  # "ß" stays (case folding would give "ss")
    assert tok.encode("Der Hund") == tok.encode("der hund") and tok.encode("ẞ") == tok.encode("ß")
    assert tok.decode(tok.encode("ﬁ")) == "fi"  # NFKC still applies, as in the cased model
    assert all(p == p.lower() for p in tok.pieces(range(4, tok.vocab_size)))  # no cased piece was learned
    cased = Tokenizer.from_bytes(tokenizer.learn_bpe(SENTENCES, 80))
    assert cased.decode(cased.encode("die Katze")) == "die Katze"


def test_unseen_characters_become_unk(model_bytes):
    assert UNK_ID in Tokenizer.from_bytes(model_bytes).encode("猫 dog")  # byte_fallback is off


def test_a_model_with_other_special_ids_is_refused():
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES), model_writer=buffer, vocab_size=60, model_type="bpe", minloglevel=2
    )  # SentencePiece's defaults: unk=0, bos=1, eos=2, no pad
    with pytest.raises(ValueError, match="special ids"):
        Tokenizer.from_bytes(buffer.getvalue())


def test_vocabulary_larger_than_the_text_allows():
    with pytest.raises(ValueError, match=r"data.vocab_size=5000 is too large for this corpus"):
        tokenizer.learn_bpe(SENTENCES, 5000)
