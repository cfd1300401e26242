"""A vocabulary map, as CTranslate2's `vmap` (Marian's lexical shortlist plays the same part): the target
pieces the sources of a batch may need, so that its search projects onto those only (not in the paper:
opt-in, `vocabulary_map=FILE`; docs/translating.md#vocabulary-map).

The file, CTranslate2's format: a line per source n-gram, `src_1 ... src_n<TAB>tgt_1 ... tgt_k`, pieces
separated by spaces; the line of the empty n-gram holds the pieces every batch may take. A batch's
candidates: those, the pieces of every source n-gram of the batch the map holds, the special symbols,
and the pieces a target prefix or a constraint forces. `build` and `write` make one from a prepared
corpus.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from transformer.config import ConfigError
from transformer.data.tokenizer import Tokenizer
from transformer.utils import atomic
from transformer.vocab import EOS_ID, UNK_ID

log = logging.getLogger(__name__)


class VocabularyMap:
    """Source n-grams (token ids) -> the target pieces they may need, and the pieces always allowed."""

    def __init__(self, always: Iterable[int], rules: dict[tuple[int, ...], list[int]]) -> None:
        self.always = set(always) | set(range(EOS_ID + 1))  # the special symbols: PAD, UNK, BOS, EOS
        self.rules = rules
        self.orders = sorted({len(ngram) for ngram in rules})

    @classmethod
    def read(cls, path: str | Path) -> list[tuple[list[str], list[str]]]:
        """A map file's lines as (source n-gram, its target pieces), as pieces; the empty n-gram's line
        holds the pieces always allowed; blank lines are skipped, and an n-gram's lines add up (where
        CTranslate2 keeps the last). A line without a tab is refused, naming it."""
        entries = []
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise ConfigError(f"vocabulary_map={path}, line {number}: not UTF-8 text") from None
                if not line.strip():
                    continue
                source, tab, targets = line.rstrip("\r\n").partition("\t")
                if not tab:
                    raise ConfigError(f"vocabulary_map={path}, line {number}: no tab after the source n-gram")
                entries.append((source.split(), targets.split()))
        return entries

    @classmethod
    def of(cls, entries: list[tuple[list[str], list[str]]], tokenizer: Tokenizer) -> VocabularyMap:
        """A map of `read`'s entries with this tokenizer's ids; pieces it does not know are left out
        (an n-gram holding one never occurs), with one warning that counts them. A map that names target
        pieces but none the tokenizer knows (another model's) is refused."""
        always: list[int] = []
        rules: dict[tuple[int, ...], list[int]] = {}
        unknown = total = named = known = 0
        for source, targets in entries:
            ids = [tokenizer.piece_id(p) for p in source + targets]
            key, allowed = tuple(ids[: len(source)]), [i for i in ids[len(source) :] if i != UNK_ID]
            unknown, total = unknown + ids.count(UNK_ID), total + len(ids)
            named, known = named + len(targets), known + len(allowed)
            if not key:
                always += allowed
            elif UNK_ID not in key:
                rules.setdefault(key, []).extend(allowed)
        if named and not known:
            raise ConfigError(
                f"none of the vocabulary map's {named} target pieces is in this model's vocabulary: "
                f"is it another model's?"
            )
        if unknown:
            log.warning(
                "vocabulary map: %d of its %d pieces this model's vocabulary lacks, left out", unknown, total
            )
        return cls(always, rules)

    @classmethod
    def load(cls, path: str | Path, tokenizer: Tokenizer) -> VocabularyMap:
        return cls.of(cls.read(path), tokenizer)

    def candidates(self, sources: Sequence[Sequence[int]], forced: Iterable[int] = ()) -> Tensor:
        """(K,) the ascending ids a batch of sources (token ids, EOS and padding allowed) may output,
        with the `forced` ones (a prefix's, the constraints')."""
        found = set(self.always)
        found.update(forced)
        for source in sources:
            for n in self.orders:
                for i in range(len(source) - n + 1):
                    found.update(self.rules.get(tuple(source[i : i + n]), ()))
        return torch.tensor(sorted(found), dtype=torch.long)


def build(
    pairs: Iterable[tuple[np.ndarray, np.ndarray]],
    vocab: int,
    always: int = 100,
    per_source: int = 100,
) -> tuple[list[int], dict[int, list[int]]]:
    """A unigram map from (source ids, target ids) pairs: the `always` most frequent target pieces, and
    per source piece the `per_source` target pieces most often in the same pair, i.e. the most probable
    by p(t | s) from co-occurrence, each counted once per pair (the always-allowed ones left out)."""
    target_count = np.zeros(vocab, dtype=np.int64)
    codes = np.zeros(0, dtype=np.int64)  # source * vocab + target of every pair seen together
    counts = np.zeros(0, dtype=np.int64)  # in how many pairs
    chunk: list[np.ndarray] = []

    pending = 0  # codes in `chunk`

    def merge() -> tuple[np.ndarray, np.ndarray]:
        new, new_counts = np.unique(np.concatenate(chunk), return_counts=True)
        chunk.clear()
        merged, inverse = np.unique(np.concatenate([codes, new]), return_inverse=True)
        weights = np.concatenate([counts, new_counts]).astype(np.float64)  # exact below 2**53
        return merged, np.bincount(inverse, weights=weights, minlength=len(merged)).astype(np.int64)

    for src, tgt in pairs:
        s, t = np.unique(src), np.unique(tgt)
        target_count[t] += 1
        chunk.append((s[:, None].astype(np.int64) * vocab + t[None, :]).ravel())
        pending += chunk[-1].size
        if pending >= max(len(codes), 1 << 22):  # merged as often as the counts double: n log n in all
            codes, counts = merge()
            pending = 0
    if chunk:
        codes, counts = merge()
    target_count[: EOS_ID + 1] = 0  # the specials are always allowed anyway
    frequent = [int(i) for i in np.argsort(-target_count, kind="stable")[:always] if target_count[i] > 0]
    allowed = np.ones(vocab, dtype=bool)
    allowed[frequent] = False
    allowed[: EOS_ID + 1] = False
    source, target = codes // vocab, codes % vocab
    keep = allowed[target] & (source > EOS_ID)
    source, target, counts = source[keep], target[keep], counts[keep]
    order = np.lexsort((target, -counts, source))  # by source piece, then most frequent first
    source, target = source[order], target[order]
    starts = np.searchsorted(source, source)  # each entry's first of its source piece
    top = np.arange(len(source)) - starts < per_source
    rules: dict[int, list[int]] = {}
    for s, t in zip(source[top].tolist(), target[top].tolist()):
        rules.setdefault(s, []).append(t)
    return frequent, rules


def write(path: str | Path, tokenizer: Tokenizer, frequent: list[int], rules: dict[int, list[int]]) -> None:
    """The map in CTranslate2's format: the always-allowed pieces after an empty n-gram, then a line per
    source piece."""
    pieces = tokenizer.pieces
    lines = ["\t" + " ".join(pieces(frequent))]
    lines += [f"{pieces([s])[0]}\t{' '.join(pieces(targets))}" for s, targets in rules.items()]
    atomic.write_bytes(Path(path), ("\n".join(lines) + "\n").encode("utf-8"))
