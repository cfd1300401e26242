"""The corpus as training reads it (§5.1): rank 0 prepares it while the other ranks wait; the training
pairs come in token-budget batches (in shapes from a fixed set with length buckets), epoch after epoch;
the valid split is batched once."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from transformer.config import LENGTH_BUCKETS, ConfigError, TrainConfig, TrainerConfig
from transformer.data.batching import Batch, TokenBudgetBatchSampler, bucket_lengths, padded_length
from transformer.data.dataset import ShardDataset, load_meta
from transformer.data.prepare import SPM_FILE, prepare
from transformer.training.distributed import Runtime, wait_for_main

log = logging.getLogger(__name__)


@dataclass
class Corpus:
    meta: dict[str, Any]  # the prepared corpus' meta.json
    spm_model: bytes  # its tokenizer, which every checkpoint carries
    train: ShardDataset
    sampler: TokenBudgetBatchSampler  # this rank's share of each step's batches
    valid: list[Batch] | None  # this rank's share of the valid split; None when there is none or eval is off


def load_corpus(cfg: TrainConfig, runtime: Runtime, resumed: dict[str, Any] | None = None) -> Corpus:
    """The prepared corpus, batched for this run (`resumed`: the checkpoint it resumes from, whose
    batching it keeps)."""
    trainer = cfg.trainer
    if runtime.is_main:
        prepare(cfg.data)  # a quick check when it is ready
    wait_for_main(runtime)
    data_dir = Path(cfg.data.dir)
    meta = load_meta(data_dir)
    train = ShardDataset(data_dir, "train")
    longest = check_lengths(train, trainer.pad_to_multiple, cfg.model.max_positions)
    sampler = TokenBudgetBatchSampler(
        train.src_lengths,
        train.tgt_lengths,
        trainer.batch_tokens(runtime.world_size),
        seed=trainer.seed,
        rank=runtime.rank,
        world_size=runtime.world_size,
        pad_to_multiple=trainer.pad_to_multiple,
        buckets=_buckets(trainer, runtime, train, resumed, longest),
    )
    valid = valid_batches(data_dir, meta, trainer, runtime, cfg.model.max_positions)
    return Corpus(meta, (data_dir / SPM_FILE).read_bytes(), train, sampler, valid)


def _buckets(
    trainer: TrainerConfig,
    runtime: Runtime,
    train: ShardDataset,
    resumed: dict[str, Any] | None,
    longest: int,
) -> list[int] | None:
    """The length buckets of this run (trainer.length_buckets): a resumed run's are its checkpoint's (one
    from before buckets had none), so that it goes on with the very batches it would have had; `longest`:
    the padded length of the train split's longest pair (`check_lengths`)."""
    recorded = None if resumed is None else (resumed.get("batching") or {"buckets": None})["buckets"]
    n = trainer.length_buckets
    if n is None and resumed is not None:
        if recorded is not None and recorded[-1] < longest:
            raise ConfigError(
                f"the checkpoint's length buckets {recorded} do not hold the corpus's longest pair "
                f"({longest} padded tokens; the data changed?): set trainer.length_buckets to batch it anew"
            )
        return recorded
    if n is None:
        n = LENGTH_BUCKETS.get(runtime.device.type, 0)
    lengths = (train.src_lengths, train.tgt_lengths)
    buckets = bucket_lengths(*lengths, n, trainer.pad_to_multiple) if n else None
    if resumed is not None and buckets != recorded:
        log.warning(
            "trainer.length_buckets=%d: the run was batched with buckets %s, it goes on with %s: other "
            "batches than it would have had",
            n,
            recorded,
            buckets,
        )
    return buckets


def batches_forever(
    sampler: TokenBudgetBatchSampler, dataset: ShardDataset, pad: int, device: torch.device
) -> Iterator[Batch]:
    """Batches on `device` in the sampler's order (and shapes), epoch after epoch; the sampler's
    position counts those taken."""
    while True:
        for indices in sampler:
            yield dataset.batch(indices, pad, sampler.batch_shape(indices)).to(device, non_blocking=True)


def check_lengths(dataset: ShardDataset, pad_to_multiple: int, max_positions: int) -> int:
    """A pair longer than the positional table would fail at its first batch, maybe hours into the run;
    the lengths are at hand, so it fails now. Returns the positions the longest pair is padded to."""
    longest = int(max(dataset.src_lengths.max(), dataset.tgt_lengths.max()))  # pieces
    positions = padded_length(longest, pad_to_multiple)  # as the batches pad it
    if positions > max_positions:
        raise ConfigError(
            f"the {dataset.role} split's longest pair needs {positions} positions ({longest} pieces "
            f"+ EOS, padded to a multiple of trainer.pad_to_multiple={pad_to_multiple}), more than "
            f"model.max_positions={max_positions}; raise model.max_positions or prepare the data with a "
            "lower data.max_tokens_per_sentence"
        )
    return positions


def valid_batches(
    data_dir: Path, meta: dict[str, Any], trainer: TrainerConfig, runtime: Runtime, max_positions: int
) -> list[Batch] | None:
    """This rank's share of the `valid` split, batched once; None when there is none or eval is off."""
    if "valid" not in meta["splits"] or trainer.eval_every_steps == 0:
        return None
    valid = ShardDataset(data_dir, "valid")
    check_lengths(valid, trainer.pad_to_multiple, max_positions)
    sampler = TokenBudgetBatchSampler(
        valid.src_lengths,
        valid.tgt_lengths,
        trainer.max_tokens,
        shuffle=False,
        rank=runtime.rank,
        world_size=runtime.world_size,
        pad_to_multiple=trainer.pad_to_multiple,
    )
    return [valid.batch(batch, trainer.pad_to_multiple) for batch in sampler.epoch_batches(0)]
