"""The data section: TokenBudgetBatchSampler on WMT-like lengths (build time, padding), with length
buckets (shapes per epoch, padding, real target tokens per step), prepare() on a corpus, and the host
time of reading a training batch from the prepared shards."""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.measure import PAD_MULTIPLE, timed
from transformer.config import DataConfig, TrainerConfig
from transformer.data.batching import TokenBudgetBatchSampler, bucket_lengths, padded_length
from transformer.data.dataset import ShardDataset


def wmt_like_lengths(n: int, seed: int, max_len: int = 250) -> tuple[np.ndarray, np.ndarray]:
    """Piece counts like WMT14 en-de training pairs: source lognormal with mean ~27, target ~1.1 x
    source with noise, both clipped to 1..max_len."""
    rng = np.random.default_rng(seed)
    sigma = 0.6
    src = rng.lognormal(math.log(27.0) - sigma**2 / 2, sigma, n)
    tgt = src * 1.1 * rng.lognormal(0.0, 0.15, n)
    return (
        np.clip(np.rint(src), 1, max_len).astype(np.int64),
        np.clip(np.rint(tgt), 1, max_len).astype(np.int64),
    )


def sampler_padding(
    src: np.ndarray, tgt: np.ndarray, batches: list[np.ndarray], budget: int, multiple: int
) -> dict[str, float]:
    """Padding of the batches as collate pads them (+EOS / +BOS, rounded up to `multiple`)."""

    def padded(lengths: np.ndarray, batch: np.ndarray) -> int:
        return padded_length(int(lengths[batch].max()), multiple)

    sizes = np.array([len(b) for b in batches])
    s_len = np.array([padded(src, b) for b in batches])
    t_len = np.array([padded(tgt, b) for b in batches])
    return {
        "src": 1 - float((src + 1).sum()) / float((sizes * s_len).sum()),
        "tgt": 1 - float((tgt + 1).sum()) / float((sizes * t_len).sum()),
        "budget_use": float((sizes * np.maximum(s_len, t_len)).sum()) / (len(batches) * budget),
    }


BUCKET_COUNTS = (0, 4, 8, 12, 16)  # trainer.length_buckets compared (0: off)


def bucket_rows(src: np.ndarray, tgt: np.ndarray, seed: int) -> list[dict[str, Any]]:
    """One epoch at the default batch budget with each number of length buckets: its distinct (rows, S,
    T) shapes, the padding of each side (empty pairs included) and the real target tokens per step of
    the default trainer.tokens_per_step."""
    trainer = TrainerConfig()
    budget, accum = trainer.batch_tokens(1), trainer.grad_accum(1)
    rows = []
    for n in BUCKET_COUNTS:
        buckets = bucket_lengths(src, tgt, n, PAD_MULTIPLE) if n else None
        sampler = TokenBudgetBatchSampler(
            src, tgt, budget, seed=seed, pad_to_multiple=PAD_MULTIPLE, buckets=buckets
        )
        shapes = []
        for batch in sampler.epoch_batches(0):
            shape = sampler.batch_shape(batch)
            if shape is None:
                widths = (
                    padded_length(int(src[batch].max()), PAD_MULTIPLE),
                    padded_length(int(tgt[batch].max()), PAD_MULTIPLE),
                )
                shape = (len(batch), *widths)
            else:
                shape = (shape[0], shape[1], shape[1])
            shapes.append(shape)
        sizes = np.array(shapes)  # (batches, 3): rows, S, T
        real_src, real_tgt = float((src + 1).sum()), float((tgt + 1).sum())
        rows.append(
            {
                "length_buckets": n,
                "buckets": buckets,
                "batches": len(shapes),
                "shapes": len(set(shapes)),
                "padding_src": 1 - real_src / float((sizes[:, 0] * sizes[:, 1]).sum()),
                "padding_tgt": 1 - real_tgt / float((sizes[:, 0] * sizes[:, 2]).sum()),
                "real_tgt_tokens_per_step": accum * real_tgt / len(shapes),
            }
        )
    return rows


def bench_prepare(args: argparse.Namespace) -> dict[str, Any]:
    """prepare() (read, learn BPE, binarize the train split) on --corpus-dir, into a temporary directory."""
    from transformer.data.prepare import prepare

    src_lang, tgt_lang = args.langs.split(",")
    with tempfile.TemporaryDirectory() as out:
        cfg = DataConfig(
            name="benchmark",
            source="local",
            path=str(args.corpus_dir),
            local_splits={"train": "train"},
            dir=out,
            src_lang=src_lang,
            tgt_lang=tgt_lang,
            vocab_size=args.prepare_vocab,
            num_workers=args.threads,
        )
        seconds, _ = timed(lambda: prepare(cfg), torch.device("cpu"))
        meta = json.loads((Path(out) / "meta.json").read_text(encoding="utf-8"))
        reading = bench_batch_reading(Path(out), args.data_budget)
        prepared = ShardDataset(Path(out), "train")
        buckets = bucket_rows(prepared.src_lengths, prepared.tgt_lengths, args.seed)
    train = meta["splits"]["train"]
    return {
        "corpus_dir": str(args.corpus_dir),
        "pairs_read": train["read"],
        "pairs_kept": train["pairs"],
        "vocab_size": meta["vocab_size"],
        "seconds": seconds,
        "pairs_per_s": train["read"] / seconds,
        "batch_reading": reading,
        "buckets": buckets,
    }


def bench_batch_reading(data_dir: Path, budget: int, count: int = 100) -> dict[str, Any]:
    """The host time the training loop spends per batch of the prepared train split at `budget` tokens:
    reading its pairs from the shards and padding them (ShardDataset.batch), the first `count` batches."""
    dataset = ShardDataset(data_dir, "train")
    sampler = TokenBudgetBatchSampler(
        dataset.src_lengths, dataset.tgt_lengths, budget, seed=0, pad_to_multiple=PAD_MULTIPLE
    )
    batches = [batch.tolist() for batch in sampler.epoch_batches(0)[:count]]  # as the sampler yields them
    seconds, _ = timed(lambda: [dataset.batch(batch, PAD_MULTIPLE) for batch in batches], torch.device("cpu"))
    return {
        "batches": len(batches),
        "sentences_per_batch": sum(map(len, batches)) / len(batches),
        "ms_per_batch": 1e3 * seconds / len(batches),
    }


def section_data(args: argparse.Namespace) -> dict[str, Any]:
    """Batching of WMT-like lengths as training does it (pad_to_multiple=8), and the padding the same
    sampler leaves without the rounding (pad_to_multiple=1)."""
    src, tgt = wmt_like_lengths(args.data_pairs, args.seed)
    start = time.perf_counter()
    sampler = TokenBudgetBatchSampler(
        src, tgt, args.data_budget, seed=args.seed, pad_to_multiple=PAD_MULTIPLE
    )
    built = time.perf_counter()
    batches = sampler.epoch_batches(0)
    done = time.perf_counter()
    result = {
        "pairs": args.data_pairs,
        "budget_tokens": args.data_budget,
        "batches": len(batches),
        "sentences_per_batch": args.data_pairs / len(batches),
        "construct_s": built - start,
        "epoch_batches_s": done - built,
        "padding_fraction": sampler_padding(src, tgt, batches, args.data_budget, PAD_MULTIPLE),
    }
    unrounded = TokenBudgetBatchSampler(src, tgt, args.data_budget, seed=args.seed).epoch_batches(0)
    result["padding_fraction_multiple_1"] = sampler_padding(src, tgt, unrounded, args.data_budget, 1)
    result["buckets"] = bucket_rows(src, tgt, args.seed)
    if args.corpus_dir is not None:
        result["prepare"] = bench_prepare(args)
    return result
