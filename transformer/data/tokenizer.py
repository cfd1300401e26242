"""One shared SentencePiece BPE vocabulary for source and target (§5.1: "a shared source-target
vocabulary of about 37000 tokens" learned with byte-pair encoding).

The token ids of the special symbols are fixed for the whole project and recorded in meta.json.
Checkpoints carry the model bytes, so a `Tokenizer` can be rebuilt with nothing but those bytes.
"""

from __future__ import annotations

import io
import re
import tempfile
import unicodedata
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path

import sentencepiece as spm

from transformer.vocab import BOS_ID, EOS_ID, PAD_ID, SPECIAL_IDS, UNK_ID


class Tokenizer:
    """Text <-> piece ids with the project's fixed special ids (pad=0, unk=1, bos=2, eos=3)."""

    def __init__(self, model_bytes: bytes) -> None:
        self._model_bytes = bytes(model_bytes)
        self._sp = spm.SentencePieceProcessor(model_proto=self._model_bytes)
        found = {
            "pad": self._sp.pad_id(),
            "unk": self._sp.unk_id(),
            "bos": self._sp.bos_id(),
            "eos": self._sp.eos_id(),
        }
        if found != SPECIAL_IDS:
            raise ValueError(
                f"the SentencePiece model has special ids {found}; this project needs {SPECIAL_IDS}"
            )

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        return cls(Path(path).read_bytes())

    @classmethod
    def from_bytes(cls, model_bytes: bytes) -> Tokenizer:
        return cls(model_bytes)

    @property
    def model_bytes(self) -> bytes:
        """The serialized SentencePiece model, as stored in checkpoints."""
        return self._model_bytes

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Piece ids of `text`, without BOS/EOS (callers add them where the model needs them)."""
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), out_type=int, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; padding, BOS and EOS are skipped (UNK decodes to a visible placeholder)."""
        kept = [int(i) for i in ids]
        return self._sp.decode([i for i in kept if i not in (PAD_ID, BOS_ID, EOS_ID)])

    def pieces(self, ids: Iterable[int]) -> list[str]:
        """The piece string of every id, special symbols included (for inspection and attention plots)."""
        return [self._sp.id_to_piece(int(i)) for i in ids]

    def piece_id(self, piece: str) -> int:
        """The id of a piece string (UNK_ID for one not in the vocabulary)."""
        return self._sp.piece_to_id(piece)


def learn_bpe(
    sentences: Iterable[str], vocab_size: int, *, lowercase: bool = False, num_threads: int = 1
) -> bytes:
    """Learn a BPE model (model_type=bpe, §5.1) on `sentences`; returns the serialized model.

    The caller samples the sentences (both languages together, so the vocabulary is shared) and writes
    the bytes atomically. character_coverage=1.0 keeps every character seen, which suits the small
    alphabets of European languages; byte_fallback is off, so unseen characters map to UNK.
    lowercase=True builds the lowercasing into the model's normalizer (see `_lowercase_rules`), so
    every later encode (training shards, translation input) is lowercased with no flag to pass on.
    """
    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory() as tmp:
        normalization = {"normalization_rule_name": "nmt_nfkc"}  # SentencePiece's default
        if lowercase:
            rules = Path(tmp) / "lowercase.tsv"
            rules.write_text(_lowercase_rules(), encoding="utf-8")
            normalization = {"normalization_rule_tsv": str(rules)}
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences),
                model_writer=buffer,
                model_type="bpe",
                vocab_size=vocab_size,
                character_coverage=1.0,
                byte_fallback=False,
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                num_threads=num_threads,
                minloglevel=2,  # SentencePiece logs hundreds of lines per run; errors still raise
                **normalization,
            )
        except RuntimeError as error:
            limit = re.search(
                r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(error)
            )
            if limit:
                raise ValueError(
                    f"data.vocab_size={limit.group(1)} is too large for this corpus: "
                    f"its sample supports at most {limit.group(2)} pieces; lower data.vocab_size"
                ) from None
            raise
    return buffer.getvalue()


@cache
def _lowercase_rules() -> str:
    """SentencePiece normalization rules (TSV of hex code points): each character -> NFKC, lowercased.

    SentencePiece's own case-folding rule (nmt_nfkc_cf) folds "ß" to "ss", which would change German
    words rather than lowercase them; str.lower() keeps "ß" (and maps "ẞ" to it). Rules apply per
    character, so unlike nmt_nfkc they do not compose a letter with a following combining accent.
    """
    rules = []
    for code in range(0x20, 0x30000):
        char = chr(code)
        if unicodedata.category(char) in ("Cs", "Co", "Cn"):  # surrogates, private use, unassigned
            continue
        folded = unicodedata.normalize("NFKC", char).lower()
        if folded and folded != char:
            rules.append(f"{code:X}\t{' '.join(f'{ord(c):X}' for c in folded)}")
    return "\n".join(rules) + "\n"
