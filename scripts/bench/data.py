"""The data section: TokenBudgetBatchSampler on WMT-like lengths (build time, padding), prepare() on a
corpus, and the host time of reading a training batch from the prepared shards."""

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

from bench.measure import PAD_MULTIPLE, timed
from transformer.config import DataConfig
from transformer.data.batching import TokenBudgetBatchSampler, padded_length
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
    train = meta["splits"]["train"]
    return {
        "corpus_dir": str(args.corpus_dir),
        "pairs_read": train["read"],
        "pairs_kept": train["pairs"],
        "vocab_size": meta["vocab_size"],
        "seconds": seconds,
        "pairs_per_s": train["read"] / seconds,
        "batch_reading": reading,
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
    if args.corpus_dir is not None:
        result["prepare"] = bench_prepare(args)
    return result
