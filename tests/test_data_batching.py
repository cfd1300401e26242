"""Token-budget batching (§5.2) and collation, checked against explicit arithmetic and brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from transformer.data.batching import (
    Batch,
    TokenBudgetBatchSampler,
    bucket_lengths,
    collate,
    pad_batch,
    padded_length,
)


def wmt_like_lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Source lengths lognormal around 27 pieces; targets about 8% longer with noise, like en->de."""
    rng = np.random.default_rng(seed)
    src = np.clip(np.rint(rng.lognormal(np.log(27) - 0.18, 0.6, n)), 1, 250).astype(np.int64)
    tgt = np.clip(np.rint(src * rng.lognormal(np.log(1.08), 0.2, n)), 1, 250).astype(np.int64)
    return src, tgt


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def fake_pairs(src_lengths, tgt_lengths) -> list[tuple[np.ndarray, np.ndarray]]:
    """Pairs of piece ids (all 7: never a special id) with the given lengths."""
    return [(np.full(s, 7), np.full(t, 7)) for s, t in zip(src_lengths, tgt_lengths)]


def all_rank_batches(src, tgt, max_tokens, world_size, epoch, **kwargs) -> list[list[np.ndarray]]:
    samplers = [
        TokenBudgetBatchSampler(src, tgt, max_tokens, rank=rank, world_size=world_size, **kwargs)
        for rank in range(world_size)
    ]
    return [sampler.epoch_batches(epoch) for sampler in samplers]


@pytest.mark.parametrize("pad_to_multiple", [1, 8])
def test_every_batch_fits_the_budget(pad_to_multiple):
    src, tgt = wmt_like_lengths(3000, seed=0)
    sampler = TokenBudgetBatchSampler(src, tgt, 1200, seed=3, pad_to_multiple=pad_to_multiple)
    pairs = fake_pairs(src, tgt)
    for indices in sampler.epoch_batches(0):
        longest = max(
            round_up(int(src[indices].max()) + 1, pad_to_multiple),
            round_up(int(tgt[indices].max()) + 1, pad_to_multiple),
        )
        assert len(indices) * longest <= 1200
        batch = collate([pairs[i] for i in indices], pad_to_multiple)  # the tensors the model will see
        assert batch.src.numel() <= 1200 and batch.tgt_in.numel() <= 1200


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_pair_exactly_once_per_epoch_with_equal_batch_counts(world_size):
    src, tgt = wmt_like_lengths(2001, seed=1)
    unsplit = len(TokenBudgetBatchSampler(src, tgt, 650, seed=5))
    assert unsplit % 2 and unsplit % 3, (
        "the batch count must be uneven for 2 and 3 ranks, to exercise the split"
    )
    for epoch in range(3):
        per_rank = all_rank_batches(src, tgt, 650, world_size, epoch, seed=5)
        assert len({len(batches) for batches in per_rank}) == 1
        seen = np.concatenate([np.concatenate(batches) for batches in per_rank])
        assert np.array_equal(np.sort(seen), np.arange(len(src)))  # every pair, and only once
        assert sum(len(batches) for batches in per_rank) == unsplit + (-unsplit) % world_size


def test_uneven_batch_counts_are_fixed_by_splitting_batches():
    src, tgt = np.full(10, 9), np.full(10, 9)  # 10 pairs of padded size 10: budget 50 -> 2 batches of 5
    per_rank = all_rank_batches(src, tgt, 50, 3, epoch=0, seed=0)
    assert [len(batches) for batches in per_rank] == [1, 1, 1]
    assert sorted(len(batch) for batches in per_rank for batch in batches) == [2, 3, 5]
    with pytest.raises(ValueError, match="cannot be shared evenly among 3 ranks"):
        TokenBudgetBatchSampler([9] * 4, [9] * 4, 10, rank=0, world_size=3).epoch_batches(0)
    with pytest.raises(ValueError, match="2 pairs cannot be shared among 3 ranks"):
        TokenBudgetBatchSampler([1, 2], [1, 2], 100, world_size=3)


def test_deterministic_per_seed_and_epoch():
    src, tgt = wmt_like_lengths(1500, seed=2)
    first = TokenBudgetBatchSampler(src, tgt, 900, seed=11)
    again = TokenBudgetBatchSampler(src, tgt, 900, seed=11)
    other_seed = TokenBudgetBatchSampler(src, tgt, 900, seed=12)
    as_lists = lambda batches: [batch.tolist() for batch in batches]  # noqa: E731
    assert as_lists(first.epoch_batches(4)) == as_lists(again.epoch_batches(4))
    assert as_lists(first.epoch_batches(0)) != as_lists(first.epoch_batches(1))
    assert as_lists(first.epoch_batches(0)) != as_lists(other_seed.epoch_batches(0))
    # Not only the order of the batches changes between epochs, but which pairs share a batch.
    groups = [{frozenset(batch.tolist()) for batch in first.epoch_batches(epoch)} for epoch in (0, 1)]
    assert groups[0] != groups[1]


def test_resume_mid_epoch_equals_uninterrupted():
    src, tgt = wmt_like_lengths(1200, seed=3)
    make = lambda: TokenBudgetBatchSampler(src, tgt, 800, seed=7, rank=1, world_size=2)  # noqa: E731
    uninterrupted = make()
    expected = list(itertools.chain(iter(uninterrupted), iter(uninterrupted), iter(uninterrupted)))
    assert len(expected) == 3 * len(uninterrupted)

    interrupted = make()
    head = list(itertools.islice(iter(interrupted), 5))
    state = interrupted.state_dict()
    assert state == {"epoch": 0, "position": 5}
    resumed = make()
    resumed.load_state_dict(state)
    tail = list(itertools.chain(iter(resumed), iter(resumed), iter(resumed)))
    assert head + tail[: len(expected) - 5] == expected
    assert resumed.state_dict() == {"epoch": 2, "position": len(resumed)}  # the next iter() starts epoch 3

    resumed.set_epoch(1)
    assert list(resumed) == [batch.tolist() for batch in resumed.epoch_batches(1)]


def test_unshuffled_batches_go_from_short_to_long():
    src, tgt = wmt_like_lengths(800, seed=4)
    batches = TokenBudgetBatchSampler(src, tgt, 600, shuffle=False, seed=1).epoch_batches(0)
    other_seed = TokenBudgetBatchSampler(src, tgt, 600, shuffle=False, seed=2).epoch_batches(0)
    assert [b.tolist() for b in batches] == [b.tolist() for b in other_seed]
    longest = [max(src[b].max(), tgt[b].max()) for b in batches]
    assert longest == sorted(longest)


def test_a_pair_over_the_budget_gets_its_own_batch_with_a_warning():
    with pytest.warns(UserWarning, match="1 pairs are longer than max_tokens=50"):
        sampler = TokenBudgetBatchSampler([3, 80, 4, 5], [4, 2, 3, 6], 50)
    batches = [batch.tolist() for batch in sampler.epoch_batches(0)]
    assert [1] in batches
    assert sorted(itertools.chain.from_iterable(batches)) == [0, 1, 2, 3]


def test_padding_is_a_small_fraction_on_wmt_like_lengths():
    src, tgt = wmt_like_lengths(20000, seed=6)
    batches = TokenBudgetBatchSampler(src, tgt, 6000, seed=0).epoch_batches(0)
    pairs = fake_pairs(src, tgt)

    def padding(batches):
        padded = real = 0
        for indices in batches:
            batch = collate([pairs[i] for i in indices])
            padded += batch.src.numel() + batch.tgt_out.numel()
            real += int((batch.src != 0).sum() + (batch.tgt_out != 0).sum())
        assert real == int(src.sum() + tgt.sum()) + 2 * len(src)  # every token, and one EOS per side
        return 1 - real / padded

    # The same batch sizes, filled at random instead of by length: what length grouping saves.
    sizes = np.cumsum([len(batch) for batch in batches])[:-1]
    unsorted = np.split(np.random.default_rng(0).permutation(len(src)), sizes)
    assert padding(batches) < 0.10
    assert padding(batches) < padding(unsorted) / 4


def test_collate_pads_and_places_bos_and_eos():
    pairs = [(np.array([5, 6, 7]), np.array([8, 9])), (np.array([10]), np.array([11, 12, 13, 14]))]
    batch = collate(pairs, pad_to_multiple=4)
    assert isinstance(batch, Batch)
    assert batch.src.tolist() == [[5, 6, 7, 3], [10, 3, 0, 0]]
    assert batch.tgt_in.tolist() == [[2, 8, 9, 0, 0, 0, 0, 0], [2, 11, 12, 13, 14, 0, 0, 0]]
    assert batch.tgt_out.tolist() == [[8, 9, 3, 0, 0, 0, 0, 0], [11, 12, 13, 14, 3, 0, 0, 0]]
    assert (batch.n_src_tokens, batch.n_tgt_tokens) == (6, 8)
    assert batch.src.dtype == batch.tgt_in.dtype == batch.tgt_out.dtype == torch.long
    moved = batch.to("cpu")
    assert torch.equal(moved.tgt_out, batch.tgt_out) and moved.n_tgt_tokens == 8
    empty_target = collate([(np.array([4]), np.array([], dtype=np.int64))])
    assert empty_target.tgt_in.tolist() == [[2]] and empty_target.tgt_out.tolist() == [[3]]


def test_a_batch_padded_to_a_shape_has_empty_pairs_below_its_own():
    pairs = [(np.array([5, 6, 7]), np.array([8, 9])), (np.array([10]), np.array([11, 12, 13, 14]))]
    src = np.concatenate([p[0] for p in pairs])
    tgt = np.concatenate([p[1] for p in pairs])
    batch = pad_batch(src, np.array([3, 1]), tgt, np.array([2, 4]), 4, shape=(3, 8))
    assert batch.src.tolist() == [
        [5, 6, 7, 3, 0, 0, 0, 0],
        [10, 3, 0, 0, 0, 0, 0, 0],
        [3, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert batch.tgt_in.tolist() == [[2, 8, 9, 0, 0, 0, 0, 0], [2, 11, 12, 13, 14, 0, 0, 0], [2] + [0] * 7]
    assert batch.tgt_out.tolist() == [[8, 9, 3, 0, 0, 0, 0, 0], [11, 12, 13, 14, 3, 0, 0, 0], [0] * 8]
    assert (batch.n_src_tokens, batch.n_tgt_tokens) == (6, 8)  # the empty pair counts no token
    with pytest.raises(ValueError, match=r"2 pairs of up to 8 positions do not fit \(1, 8\)"):
        pad_batch(src, np.array([3, 1]), tgt, np.array([2, 4]), 4, shape=(1, 8))


def test_works_as_a_dataloader_batch_sampler():
    src, tgt = wmt_like_lengths(300, seed=8)
    pairs = fake_pairs(src, tgt)
    sampler = TokenBudgetBatchSampler(src, tgt, 500, seed=0)
    loader = torch.utils.data.DataLoader(pairs, batch_sampler=sampler, collate_fn=collate)
    assert len(loader) == len(sampler)
    assert sum(batch.src.shape[0] for batch in loader) == 300


def brute_force_buckets(src, tgt, n_buckets, multiple) -> int:
    """The least total padded length over every choice of at most n_buckets lengths that hold all pairs."""
    cost = np.maximum(padded_length(src, multiple), padded_length(tgt, multiple))
    lengths = sorted(set(cost.tolist()))

    def total(buckets):
        return int(np.asarray(buckets)[np.searchsorted(buckets, cost)].sum())

    shorter = lengths[:-1]
    return min(
        total([*chosen, lengths[-1]])
        for k in range(n_buckets)
        for chosen in itertools.combinations(shorter, k)
    )


@pytest.mark.parametrize("seed", range(6))
def test_bucket_lengths_pad_least_as_a_brute_force_search_finds(seed):
    rng = np.random.default_rng(seed)
    src, tgt = rng.integers(1, 70, 40), rng.integers(1, 70, 40)
    for n_buckets, multiple in ((1, 1), (3, 1), (4, 8), (5, 4)):
        buckets = bucket_lengths(src, tgt, n_buckets, multiple)
        cost = np.maximum(padded_length(src, multiple), padded_length(tgt, multiple))
        assert len(buckets) <= n_buckets and buckets == sorted(set(buckets)) and buckets[-1] == cost.max()
        assert all(length % multiple == 0 for length in buckets)
        padded = int(np.asarray(buckets)[np.searchsorted(buckets, cost)].sum())
        assert padded == brute_force_buckets(src, tgt, n_buckets, multiple)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_bucketed_batches_take_one_of_a_few_shapes_and_hold_every_pair_once(world_size):
    src, tgt = wmt_like_lengths(3001, seed=9)
    buckets = bucket_lengths(src, tgt, 6, multiple=8)
    samplers = [
        TokenBudgetBatchSampler(
            src, tgt, 1200, seed=2, rank=rank, world_size=world_size, pad_to_multiple=8, buckets=buckets
        )
        for rank in range(world_size)
    ]
    shapes, seen = set(), []
    for sampler in samplers:
        for indices in sampler.epoch_batches(0):
            shape = sampler.batch_shape(indices)
            longest = max(
                padded_length(int(src[indices].max()), 8), padded_length(int(tgt[indices].max()), 8)
            )
            length = min(b for b in buckets if b >= longest)  # the smallest bucket that holds the batch
            assert shape == (max(1200 // length, len(indices)), length)
            shapes.add(shape)
            seen.append(indices)
    assert len(shapes) <= len(buckets)
    assert len({len(sampler) for sampler in samplers}) == 1
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(len(src)))


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="must be 1-D of equal length"):
        TokenBudgetBatchSampler([1, 2], [1], 10)
    with pytest.raises(ValueError, match="rank=2 must be in"):
        TokenBudgetBatchSampler([1, 2], [1, 2], 10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="max_tokens=0 must be positive"):
        TokenBudgetBatchSampler([1, 2], [1, 2], 0)
    with pytest.raises(ValueError, match=r"buckets \[8\] must ascend and hold the longest pair \(16 padded"):
        TokenBudgetBatchSampler([1, 9], [1, 2], 100, pad_to_multiple=8, buckets=[8])
