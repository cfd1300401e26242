"""Read prepared shards: one split of a corpus as a random-access dataset over memory-mapped files.

The .bin files are memory-mapped, never loaded: a 4.5M-pair WMT14 training set costs only the offsets
(16 bytes per pair) in RAM, and processes reading it (the ranks of one machine) share the operating
system's page cache.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from transformer.config import ConfigError
from transformer.data.batching import Batch, pad_batch
from transformer.data.binarize import shard_files

_PREPARE_HINT = "prepare it with: python scripts/prepare_data.py data=<corpus> data.dir={dir}"


def load_meta(data_dir: str | Path) -> dict[str, Any]:
    """The meta.json of a fully prepared corpus directory (see prepare.py for its fields)."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise ConfigError(
            f"{data_dir} holds no prepared corpus (no meta.json); {_PREPARE_HINT.format(dir=data_dir)}"
        )
    meta = json.loads(path.read_text(encoding="utf-8"))
    if not meta.get("complete"):
        raise ConfigError(
            f"the preparation of {data_dir} did not finish; "
            "run the same prepare_data.py command again to complete it"
        )
    return meta


class ShardDataset:
    """Pairs (src_ids, tgt_ids) of one split (`role`: train, valid or test), piece ids without BOS/EOS."""

    def __init__(self, data_dir: str | Path, role: str) -> None:
        self.data_dir = Path(data_dir)
        self.meta = load_meta(self.data_dir)
        if role not in self.meta["splits"]:
            raise ConfigError(f"{data_dir} has no '{role}' split; it has: {', '.join(self.meta['splits'])}")
        self.role = role
        self._dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        self._bin_paths = []
        offsets = []
        for lang in (self.meta["src_lang"], self.meta["tgt_lang"]):
            bin_name, idx_name = shard_files(role, lang)
            self._bin_paths.append(self.data_dir / bin_name)
            offsets.append(np.fromfile(self.data_dir / idx_name, dtype="<i8"))
        self._src_offsets, self._tgt_offsets = offsets
        self._check_sizes()
        self.src_lengths = np.diff(self._src_offsets)  # (n,) pieces per source sentence
        self.tgt_lengths = np.diff(self._tgt_offsets)  # (n,) pieces per target sentence
        self._ids: list[np.ndarray] | None = None  # opened lazily, by the process that reads

    def _check_sizes(self) -> None:
        expected = self.meta["splits"][self.role]["pairs"]
        for path, offsets in zip(self._bin_paths, (self._src_offsets, self._tgt_offsets)):
            ids_in_file = path.stat().st_size // self._dtype.itemsize
            if len(offsets) != expected + 1 or offsets[-1] != ids_in_file:
                raise ConfigError(f"{path} does not match its index or meta.json; run prepare_data.py again")

    def _open(self) -> list[np.ndarray]:
        if self._ids is None:
            # np.memmap refuses empty files; a split whose sentences are all empty has an empty .bin
            self._ids = [
                np.memmap(path, dtype=self._dtype, mode="r")
                if path.stat().st_size
                else np.empty(0, self._dtype)
                for path in self._bin_paths
            ]
        return self._ids

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_ids"] = None  # memory maps are reopened in the receiving process, not pickled
        return state

    def __len__(self) -> int:
        return len(self.src_lengths)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} pairs")
        src_ids, tgt_ids = self._open()
        src = src_ids[self._src_offsets[index] : self._src_offsets[index + 1]]
        tgt = tgt_ids[self._tgt_offsets[index] : self._tgt_offsets[index + 1]]
        return np.asarray(src), np.asarray(tgt)

    def batch(
        self,
        indices: Sequence[int] | np.ndarray,
        pad_to_multiple: int = 1,
        shape: tuple[int, int] | None = None,
    ) -> Batch:
        """The pairs at `indices` as `collate` pads them (or `pad_batch` to `shape`), read with one gather
        per side: a training step's ~700 pairs take well under a millisecond instead of a few (two slices
        per pair)."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and not (0 <= indices.min() and indices.max() < len(self)):
            raise IndexError(f"indices out of range for {len(self)} pairs")
        src_ids, tgt_ids = self._open()
        src, src_lengths = _gather(src_ids, self._src_offsets, indices)
        tgt, tgt_lengths = _gather(tgt_ids, self._tgt_offsets, indices)
        return pad_batch(src, src_lengths, tgt, tgt_lengths, pad_to_multiple, shape)


def _gather(ids: np.ndarray, offsets: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sequences at `indices` back to back, and their lengths; i is ids[offsets[i]:offsets[i + 1]]."""
    starts, lengths = offsets[indices], offsets[indices + 1] - offsets[indices]
    # position j of the output reads ids[start of its sequence + (j - where its sequence begins)]
    begins = np.cumsum(lengths) - lengths
    positions = np.arange(int(lengths.sum())) + np.repeat(starts - begins, lengths)
    return np.asarray(ids[positions]), lengths
