"""Token-budget batches (§5.2): "Sentence pairs were batched together by approximate sequence length.
Each training batch contained a set of sentence pairs containing approximately 25000 source tokens and
25000 target tokens."

`TokenBudgetBatchSampler` sorts pairs by padded length with a random tie-break, cuts the sorted run
greedily into the largest batches that fit the budget, and shuffles the batch order; everything is a
function of (seed, epoch), so every rank computes the same batches and takes its own share. With
length buckets (`bucket_lengths`) every batch takes one of a few fixed shapes instead: both sides
padded to a bucket's length, and as many rows as that length fits in the budget.
`collate` turns the pairs of one batch into padded tensors with BOS/EOS in place (§3.1: the decoder
input is the target shifted right); `pad_batch` does it for pieces given back to back, as
`ShardDataset.batch` reads them from the shards.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from transformer.vocab import BOS_ID, EOS_ID, PAD_ID


def padded_length(pieces: Any, multiple: int) -> Any:
    """The positions a sequence of `pieces` (an int or an array) takes in a batch: its pieces and the EOS
    (source, decoder target) or BOS (decoder input) added by `collate`, rounded up to `multiple`."""
    return (pieces + 1 + multiple - 1) // multiple * multiple


def bucket_lengths(src_lengths: Any, tgt_lengths: Any, n_buckets: int, multiple: int = 1) -> list[int]:
    """At most `n_buckets` padded lengths for the pairs of these piece counts, chosen to pad them least:
    each pair pads both sides to the smallest length that holds its padded max(S, T), and the lengths
    minimise the sum of what the pairs pad to (dynamic programming over the lengths that occur); the
    last is the longest pair's."""
    if n_buckets < 1:
        raise ValueError(f"n_buckets={n_buckets} must be at least 1")
    cost = np.maximum(
        padded_length(np.asarray(src_lengths), multiple), padded_length(np.asarray(tgt_lengths), multiple)
    )
    lengths, counts = np.unique(cost, return_counts=True)  # (C,) ascending
    upto = np.cumsum(counts).astype(np.float64)  # pairs of cost <= lengths[i]
    # padded[i]: the least total the pairs up to lengths[i] pad to, in k buckets, the last lengths[i]
    padded, choices = lengths * upto, []
    for _ in range(1, min(n_buckets, len(lengths))):
        # after a bucket ending at lengths[j], one from there to lengths[i]: (i, j), j < i
        totals = padded[None, :] + lengths[:, None] * (upto[:, None] - upto[None, :])
        totals[np.triu_indices(len(lengths))] = np.inf
        choices.append(totals.argmin(axis=1))
        padded = totals.min(axis=1)
    chosen = [len(lengths) - 1]  # the longest pair's length, then back through the choices
    for choice in reversed(choices):
        chosen.append(int(choice[chosen[-1]]))
    return sorted(int(lengths[i]) for i in chosen)


class TokenBudgetBatchSampler:
    """Batches of pair indices whose padded size B * max(S, T) stays within `max_tokens`.

    S and T count the EOS (source) and BOS/EOS (target) added by `collate`, rounded up to
    `pad_to_multiple` as `collate` pads them. A pair longer than the budget on its own still gets a
    batch, of size one, over the budget (with a warning at construction): dropping it silently would be
    worse, and the training split is already length-filtered when prepared.

    Distributed training: each of `world_size` ranks builds the same epoch's batches and keeps every
    `world_size`-th one, so the ranks see disjoint batches that cover every pair exactly once. When the
    batch count does not divide evenly, the largest batches are halved until it does, so every rank runs
    the same number of steps.

    Length buckets (`buckets`, ascending padded lengths covering every pair, e.g. `bucket_lengths`): a
    pair counts as the smallest bucket length that holds it, so that a batch pads both sides to that
    length L and, with `batch_shape`, to the budget's max_tokens // L rows: a handful of shapes for a
    whole epoch (a compiled or CUDA-graphed step is planned once per shape), for some extra padding.

    Resuming: iteration yields the rest of the current epoch from `position`; once an epoch is finished,
    the next `iter()` starts the following one, so a training loop can simply iterate again and again.
    `state_dict()` captures (epoch, position); after `load_state_dict()`, iterate on without calling
    `set_epoch`, which restarts an epoch from its beginning. `position` counts batches handed out, so a
    loop that prefetches should save the number of batches it actually consumed instead.
    """

    def __init__(
        self,
        src_lengths: Sequence[int] | np.ndarray,
        tgt_lengths: Sequence[int] | np.ndarray,
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        pad_to_multiple: int = 1,
        buckets: Sequence[int] | None = None,
    ) -> None:
        src = np.asarray(src_lengths, dtype=np.int64)
        tgt = np.asarray(tgt_lengths, dtype=np.int64)
        if src.shape != tgt.shape or src.ndim != 1:
            raise ValueError(
                f"src_lengths {src.shape} and tgt_lengths {tgt.shape} must be 1-D of equal length"
            )
        if max_tokens <= 0 or pad_to_multiple < 1:
            raise ValueError(
                f"max_tokens={max_tokens} must be positive and pad_to_multiple={pad_to_multiple} >= 1"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if len(src) < world_size:
            raise ValueError(f"{len(src)} pairs cannot be shared among {world_size} ranks")
        self.max_tokens, self.shuffle, self.seed = max_tokens, shuffle, seed
        self.rank, self.world_size = rank, world_size
        padded_src = padded_length(src, pad_to_multiple)
        padded_tgt = padded_length(tgt, pad_to_multiple)
        self._cost = np.maximum(padded_src, padded_tgt)  # what one pair adds to B * max(S, T)
        self.buckets = None if buckets is None else [int(length) for length in buckets]
        if self.buckets is not None:
            if self.buckets != sorted(set(self.buckets)) or self._cost.max() > self.buckets[-1]:
                raise ValueError(
                    f"buckets {self.buckets} must ascend and hold the longest pair ({self._cost.max()} "
                    "padded tokens)"
                )
            self._cost = np.asarray(self.buckets)[np.searchsorted(self.buckets, self._cost)]  # (N,)
        # Sort by cost first (it keeps the greedy cut exact), then by which side is longer, then by the
        # shorter side: the pairs of a batch then agree on both padded lengths. On WMT-like lengths this
        # wastes about 1% of a batch on padding, against about 8% when sorting by cost alone.
        span = int(self._cost.max()) + 1
        src_longer = (padded_src >= padded_tgt).astype(np.int64)
        self._sort_key = (self._cost * 2 + src_longer) * span + np.minimum(padded_src, padded_tgt)
        oversized = int(np.count_nonzero(self._cost > max_tokens))
        if oversized:
            warnings.warn(
                f"{oversized} pairs are longer than max_tokens={max_tokens} (longest: "
                f"{self._cost.max()} padded tokens); each gets a batch of its own, over the budget",
                stacklevel=2,
            )
        self.epoch = 0
        self.position = 0
        self._cached: tuple[int, list[np.ndarray]] | None = None

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of `epoch`, in order: arrays of pair indices."""
        if self._cached is None or self._cached[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            if self.shuffle:
                permutation = rng.permutation(len(self._cost))  # a random tie-break among equal lengths
                order = permutation[np.argsort(self._sort_key[permutation], kind="stable")]
            else:
                order = np.argsort(self._sort_key, kind="stable")
            bounds = _greedy_cut(self._cost[order].tolist(), self.max_tokens)
            batches = _split_until_divisible(np.split(order, bounds[1:-1]), self.world_size)
            if self.shuffle:
                batches = [batches[i] for i in rng.permutation(len(batches))]
            self._cached = (epoch, batches[self.rank :: self.world_size])
        return self._cached[1]

    def batch_shape(self, indices: Sequence[int] | np.ndarray) -> tuple[int, int] | None:
        """(rows, length) that a batch of these pairs is padded to with buckets; None without."""
        if self.buckets is None:
            return None
        length = int(self._cost[np.asarray(indices)].max())
        return max(len(indices), self.max_tokens // length), length

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first batch."""
        self.epoch, self.position = epoch, 0

    def __len__(self) -> int:
        return len(self.epoch_batches(self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.epoch_batches(self.epoch)
        if self.position >= len(batches):  # the previous pass finished this epoch
            self.set_epoch(self.epoch + 1)
            batches = self.epoch_batches(self.epoch)
        while self.position < len(batches):
            batch = batches[self.position]
            self.position += 1
            yield batch.tolist()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def _greedy_cut(costs: list[int], max_tokens: int) -> list[int]:
    """Batch boundaries [0, ..., n] over ascending `costs`: each batch takes as many pairs as fit.

    Costs ascend, so a batch [start, end) pads to (end - start) * costs[end - 1], which grows with `end`:
    the largest fitting `end` is found by binary search, between one pair and max_tokens // costs[start].
    """
    bounds = [0]
    start, n = 0, len(costs)
    while start < n:
        low, high = start + 1, min(n, start + max(1, max_tokens // costs[start]))
        while low < high:
            middle = (low + high + 1) // 2
            if (middle - start) * costs[middle - 1] <= max_tokens:
                low = middle
            else:
                high = middle - 1
        bounds.append(low)
        start = low
    return bounds


def _split_until_divisible(batches: list[np.ndarray], world_size: int) -> list[np.ndarray]:
    """Halve the batches with the most pairs until every rank can get as many batches as the others.

    A half of a batch fits the budget whenever the batch does, and every pair stays in exactly one batch.
    """
    while len(batches) % world_size:
        largest = max(range(len(batches)), key=lambda i: len(batches[i]))
        if len(batches[largest]) < 2:
            raise ValueError(
                f"{len(batches)} single-pair batches cannot be shared evenly among {world_size} ranks; "
                "raise max_tokens"
            )
        batch = batches.pop(largest)
        batches[largest:largest] = np.array_split(batch, 2)
    return batches


class Batch(NamedTuple):
    """A padded batch (§3.1): the decoder reads `tgt_in` (shifted right) and predicts `tgt_out`."""

    src: torch.Tensor  # (B, S) source pieces + EOS, right-padded with PAD_ID
    tgt_in: torch.Tensor  # (B, T) BOS + target pieces
    tgt_out: torch.Tensor  # (B, T) target pieces + EOS
    n_src_tokens: int  # non-pad entries of src
    n_tgt_tokens: int  # non-pad entries of tgt_out (the tokens the loss is averaged over)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._replace(
            src=self.src.to(device, non_blocking=non_blocking),
            tgt_in=self.tgt_in.to(device, non_blocking=non_blocking),
            tgt_out=self.tgt_out.to(device, non_blocking=non_blocking),
        )


def collate(pairs: Sequence[tuple[np.ndarray, np.ndarray]], pad_to_multiple: int = 1) -> Batch:
    """Pad (src_ids, tgt_ids) pairs of piece ids into a `Batch`; lengths round up to `pad_to_multiple`."""
    src_lengths = np.array([len(src) for src, _ in pairs], dtype=np.int64)
    tgt_lengths = np.array([len(tgt) for _, tgt in pairs], dtype=np.int64)
    src_ids = np.concatenate([src for src, _ in pairs])
    tgt_ids = np.concatenate([tgt for _, tgt in pairs])
    return pad_batch(src_ids, src_lengths, tgt_ids, tgt_lengths, pad_to_multiple)


def pad_batch(
    src_ids: np.ndarray,
    src_lengths: np.ndarray,
    tgt_ids: np.ndarray,
    tgt_lengths: np.ndarray,
    pad_to_multiple: int = 1,
    shape: tuple[int, int] | None = None,
) -> Batch:
    """The `Batch` of B pairs given as their pieces back to back: src_ids (sum of src_lengths,) and
    tgt_ids (sum of tgt_lengths,), pair after pair; src_lengths, tgt_lengths (B,). With `shape` (rows,
    length), both sides are padded to that length and rows beyond B are empty pairs (an EOS, a BOS and
    no target token to predict: they add nothing to the loss).

    A handful of whole-array operations, whatever B: a boolean mask's True entries are visited row by
    row, in the order the pieces come.
    """
    b = len(src_lengths)
    real = np.arange(b)
    rows = b
    width_src = int(padded_length(src_lengths.max(), pad_to_multiple))
    width_tgt = int(padded_length(tgt_lengths.max(), pad_to_multiple))
    if shape is not None:
        if shape[0] < b or shape[1] < max(width_src, width_tgt):
            raise ValueError(f"{b} pairs of up to {max(width_src, width_tgt)} positions do not fit {shape}")
        rows, width_src, width_tgt = shape[0], shape[1], shape[1]
    columns_src, columns_tgt = np.arange(width_src), np.arange(width_tgt)
    src = np.full((rows, width_src), PAD_ID, dtype=np.int64)
    src[:b][columns_src < src_lengths[:, None]] = src_ids
    src[real, src_lengths] = EOS_ID
    src[b:, 0] = EOS_ID  # the empty pairs that fill a shape
    tgt_in = np.full((rows, width_tgt), PAD_ID, dtype=np.int64)
    tgt_in[:, 0] = BOS_ID
    tgt_in[:b][(columns_tgt >= 1) & (columns_tgt <= tgt_lengths[:, None])] = tgt_ids  # shifted right
    tgt_out = np.full((rows, width_tgt), PAD_ID, dtype=np.int64)
    tgt_out[:b][columns_tgt < tgt_lengths[:, None]] = tgt_ids
    tgt_out[real, tgt_lengths] = EOS_ID
    return Batch(
        torch.from_numpy(src),
        torch.from_numpy(tgt_in),
        torch.from_numpy(tgt_out),
        n_src_tokens=int(src_lengths.sum()) + b,
        n_tgt_tokens=int(tgt_lengths.sum()) + b,
    )
