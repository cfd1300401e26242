"""Encode a split into compact binary shards, in parallel worker processes.

One side of one split is two files in the data directory:
  <role>.<lang>.bin   every sentence's piece ids back to back, little-endian uint16 (int32 if the
                      vocabulary has more than 65,536 pieces)
  <role>.<lang>.idx   n + 1 little-endian int64 offsets: sentence i is bin[idx[i]:idx[i + 1]]
No BOS/EOS is stored; batching adds them. Training pairs are filtered by length here, because a
sentence's length in pieces is only known once it is encoded. Every file is written atomically.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from transformer.data.tokenizer import Tokenizer
from transformer.utils import atomic
from transformer.vocab import UNK_ID

CHUNK_PAIRS = 20_000  # pairs per task sent to a worker: large enough to amortise the transfer
DROP_REASONS = ("empty", "too_long", "length_ratio")


@dataclass(frozen=True)
class LengthFilter:
    """Training pairs kept: both sides non-empty, at most `max_tokens` pieces, ratio at most `max_ratio`."""

    max_tokens: int
    max_ratio: float


@dataclass
class SplitStats:
    """What encoding one split produced; `dropped` counts each removed pair once, under its first reason."""

    pairs: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    src_tokens: int = 0
    tgt_tokens: int = 0
    unk_tokens: int = 0


@dataclass
class _Chunk:
    src_ids: np.ndarray  # (sum of src lengths,) the kept sentences' ids back to back
    src_lengths: np.ndarray  # (kept pairs,)
    tgt_ids: np.ndarray
    tgt_lengths: np.ndarray
    dropped: dict[str, int]


def shard_dtype(vocab_size: int) -> np.dtype:
    """The narrowest id type for the vocabulary: uint16 halves the disk and page-cache footprint."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")


def shard_files(role: str, lang: str) -> tuple[str, str]:
    """File names of the ids and the offsets of one side of one split."""
    return f"{role}.{lang}.bin", f"{role}.{lang}.idx"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def encode_split(
    src: list[str],
    tgt: list[str],
    out: dict[str, Path],
    model_bytes: bytes,
    *,
    length_filter: LengthFilter | None,
    num_workers: int,
    desc: str,
) -> SplitStats:
    """Encode aligned `src`/`tgt` lines into the files `out` names ("src_bin", "src_idx", "tgt_bin",
    "tgt_idx"); pairs failing `length_filter` are dropped (None keeps every pair, even empty ones)."""
    dtype = shard_dtype(Tokenizer.from_bytes(model_bytes).vocab_size)
    tasks = (
        (src[i : i + CHUNK_PAIRS], tgt[i : i + CHUNK_PAIRS], length_filter, dtype.str)
        for i in range(0, len(src), CHUNK_PAIRS)
    )
    stats = SplitStats(dropped={reason: 0 for reason in DROP_REASONS} if length_filter else {})
    src_lengths, tgt_lengths = [], []
    with ExitStack() as stack:
        src_bin = stack.enter_context(atomic.writing(out["src_bin"]))
        tgt_bin = stack.enter_context(atomic.writing(out["tgt_bin"]))
        chunks = _encode_chunks(tasks, model_bytes, num_workers, len(src) > CHUNK_PAIRS, stack)
        bar = stack.enter_context(tqdm(total=len(src), desc=desc, unit=" pairs", unit_scale=True))
        for chunk in chunks:
            src_bin.write(memoryview(chunk.src_ids))
            tgt_bin.write(memoryview(chunk.tgt_ids))
            src_lengths.append(chunk.src_lengths)
            tgt_lengths.append(chunk.tgt_lengths)
            _accumulate(stats, chunk)
            bar.update(len(chunk.src_lengths) + sum(chunk.dropped.values()))
        atomic.write_bytes(out["src_idx"], _offsets(src_lengths).tobytes())
        atomic.write_bytes(out["tgt_idx"], _offsets(tgt_lengths).tobytes())
    return stats


def _encode_chunks(
    tasks: Iterable[tuple], model_bytes: bytes, num_workers: int, parallel: bool, stack: ExitStack
) -> Iterator[_Chunk]:
    """Chunks in input order; a pool of `num_workers` processes when there is more than one chunk."""
    if num_workers == 1 or not parallel:
        _init_worker(model_bytes)
        return map(_encode_chunk, tasks)
    # The platform's default start method (fork on Linux, like DataLoader workers); the workers use
    # only SentencePiece and numpy. A worker that dies fails the run (BrokenProcessPool).
    executor = ProcessPoolExecutor(num_workers, initializer=_init_worker, initargs=(model_bytes,))
    stack.callback(executor.shutdown, wait=True, cancel_futures=True)
    return executor.map(_encode_chunk, tasks)


def _accumulate(stats: SplitStats, chunk: _Chunk) -> None:
    stats.pairs += len(chunk.src_lengths)
    stats.src_tokens += int(chunk.src_lengths.sum())
    stats.tgt_tokens += int(chunk.tgt_lengths.sum())
    stats.unk_tokens += int(
        np.count_nonzero(chunk.src_ids == UNK_ID) + np.count_nonzero(chunk.tgt_ids == UNK_ID)
    )
    for reason, count in chunk.dropped.items():
        stats.dropped[reason] += count


def _offsets(lengths: list[np.ndarray]) -> np.ndarray:
    offsets = np.zeros(sum(len(part) for part in lengths) + 1, dtype="<i8")
    if len(offsets) > 1:
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
    return offsets


_worker_tokenizer: Tokenizer | None = None  # one per worker process, built once by the initializer


def _init_worker(model_bytes: bytes) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.from_bytes(model_bytes)


def _encode_chunk(task: tuple[list[str], list[str], LengthFilter | None, str]) -> _Chunk:
    src_texts, tgt_texts, length_filter, dtype = task
    src = _worker_tokenizer.encode_batch(src_texts)
    tgt = _worker_tokenizer.encode_batch(tgt_texts)
    src_lengths = np.fromiter(map(len, src), dtype=np.int64, count=len(src))
    tgt_lengths = np.fromiter(map(len, tgt), dtype=np.int64, count=len(tgt))
    keep, dropped = _filter(src_lengths, tgt_lengths, length_filter)
    return _Chunk(
        _flatten(src, keep, src_lengths, dtype),
        src_lengths[keep],
        _flatten(tgt, keep, tgt_lengths, dtype),
        tgt_lengths[keep],
        dropped,
    )


def _filter(
    src_lengths: np.ndarray, tgt_lengths: np.ndarray, length_filter: LengthFilter | None
) -> tuple[np.ndarray, dict[str, int]]:
    """Which pairs to keep, and how many were dropped for each reason (first matching reason only)."""
    if length_filter is None:
        return np.ones(len(src_lengths), dtype=bool), {}
    longer = np.maximum(src_lengths, tgt_lengths)
    shorter = np.minimum(src_lengths, tgt_lengths)
    empty = shorter == 0  # text that encodes to no piece at all, e.g. only zero-width characters
    too_long = ~empty & (longer > length_filter.max_tokens)
    ratio = ~empty & ~too_long & (longer > length_filter.max_ratio * shorter)
    reasons = dict(zip(DROP_REASONS, (empty, too_long, ratio)))
    return ~(empty | too_long | ratio), {reason: int(mask.sum()) for reason, mask in reasons.items()}


def _flatten(sequences: list[list[int]], keep: np.ndarray, lengths: np.ndarray, dtype: str) -> np.ndarray:
    kept = itertools.compress(sequences, keep)
    return np.fromiter(itertools.chain.from_iterable(kept), dtype=dtype, count=int(lengths[keep].sum()))
