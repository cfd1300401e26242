"""The prepared corpus as training reads it (§5.1): the training pairs in token-budget batches (in shapes
from a fixed set with length buckets), epoch after epoch; the valid split batched once, and its raw
text for BLEU."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from transformer.config import ConfigError, TrainConfig, TrainerConfig
from transformer.data.batching import Batch, TokenBudgetBatchSampler, bucket_lengths, padded_length
from transformer.data.dataset import ShardDataset, load_meta
from transformer.data.prepare import SPM_FILE
from transformer.data.sources import Split, read_split

log = logging.getLogger(__name__)


@dataclass
class Corpus:
    meta: dict[str, Any]  # the prepared corpus' meta.json
    spm_model: bytes  # its tokenizer, which every checkpoint carries
    train: ShardDataset
    longest: int  # the positions the train split's longest pair is padded to
    valid: list[Batch] | None  # this rank's share of the valid split; None when there is none or eval is off
    valid_text: Split | None  # rank 0: the valid split's raw text to translate (trainer.bleu_sentences of it)

    def sampler(
        self, trainer: TrainerConfig, rank: int, world_size: int, buckets: int | list[int] | None
    ) -> TokenBudgetBatchSampler:
        """This rank's share of each step's batches, in length buckets: as many as `buckets` says (those
        that pad the corpus least; 0: none), or the lengths it lists (a resumed run's), or none (None)."""
        lengths = (self.train.src_lengths, self.train.tgt_lengths)
        if isinstance(buckets, int):
            buckets = bucket_lengths(*lengths, buckets, trainer.pad_to_multiple) if buckets else None
        elif buckets is not None and buckets[-1] < self.longest:
            raise ConfigError(
                f"the checkpoint's length buckets {buckets} do not hold the corpus's longest pair "
                f"({self.longest} padded tokens; the data changed?): set trainer.length_buckets to "
                "batch it anew"
            )
        return TokenBudgetBatchSampler(
            *lengths,
            trainer.batch_tokens(world_size),
            seed=trainer.seed,
            rank=rank,
            world_size=world_size,
            pad_to_multiple=trainer.pad_to_multiple,
            buckets=buckets,
        )


def read_corpus(cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> Corpus:
    """The prepared corpus of cfg.data as rank `rank` of `world_size` reads it, its pairs checked
    against the model's positions."""
    trainer, data_dir = cfg.trainer, Path(cfg.data.dir)
    meta = load_meta(data_dir)
    train = ShardDataset(data_dir, "train")
    longest = check_lengths(train, trainer.pad_to_multiple, cfg.model.max_positions)
    valid = valid_batches(data_dir, meta, trainer, (rank, world_size), cfg.model.max_positions)
    if "valid" not in meta["splits"] and trainer.eval_every_steps and rank == 0:
        log.warning("data %s has no 'valid' split: no validation loss, no checkpoint_best.pt", cfg.data.name)
    text = None
    if trainer.translate_every_steps and rank == 0:
        split = read_split(cfg.data, "valid")
        n = trainer.bleu_sentences or len(split.src)
        text = replace(split, src=split.src[:n], tgt=split.tgt[:n])
    return Corpus(meta, (data_dir / SPM_FILE).read_bytes(), train, longest, valid, text)


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
    data_dir: Path, meta: dict[str, Any], trainer: TrainerConfig, ranks: tuple[int, int], max_positions: int
) -> list[Batch] | None:
    """This rank's share of the `valid` split, batched once (ranks: this rank, their number); None when
    there is none or eval is off."""
    if "valid" not in meta["splits"] or trainer.eval_every_steps == 0:
        return None
    valid = ShardDataset(data_dir, "valid")
    check_lengths(valid, trainer.pad_to_multiple, max_positions)
    sampler = TokenBudgetBatchSampler(
        valid.src_lengths,
        valid.tgt_lengths,
        trainer.max_tokens,
        shuffle=False,
        rank=ranks[0],
        world_size=ranks[1],
        pad_to_multiple=trainer.pad_to_multiple,
    )
    return [valid.batch(batch, trainer.pad_to_multiple) for batch in sampler.epoch_batches(0)]
