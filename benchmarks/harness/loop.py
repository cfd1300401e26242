"""The loop section: `train.py` itself, from process start, on WMT-like lengths (sampler, padding, length
buckets, accumulation, queue_step / finish_step, compile and CUDA graphs as configured), and the same
batches through a torch.nn.Transformer loop, eager and compiled.

Each run of ours is a `train.py` process; its TensorBoard scalars (one per step) give the wall time of
every step and its real target tokens, `TORCH_LOGS=recompiles` its recompiles. The first `first` steps
are counted from the process's start (imports, data loading, compiles, cuDNN plans included); the
`steady` steps after them on their own. PROFILED steps more run under torch.profiler
(`trainer.profile_steps`) for the GPU's kernel time per target token; times the steady tokens/s, that
is the GPU's busy share in the steady steps (the profiler slows the host, not the kernels).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.data import wmt_like_lengths
from harness.peers import TorchTransformerPeer
from transformer.checkpoint import load_checkpoint
from transformer.config import DataConfig, ModelConfig, TrainerConfig, from_dict
from transformer.data.batching import TokenBudgetBatchSampler
from transformer.data.corpus import batches_forever
from transformer.data.dataset import ShardDataset, load_meta
from transformer.data.prepare import prepare
from transformer.training.profile import Profiler

ROOT = Path(__file__).resolve().parents[2]
RUNS = ("eager", "compiled", "no-graphs", "no-cudnn", "buckets", "peer", "peer-compiled")
HIDDEN = ("trainer",)  # a row's working figures, not reported
PROFILED = 5  # steps after the timed ones, under torch.profiler


def loop_data(args: argparse.Namespace, work: Path) -> DataConfig:
    """The corpus of the loop runs, prepared (a no-op when it already is): --loop-corpus (files
    train.<src>, train.<tgt>), else synthetic words in WMT-like lengths written to `work`."""
    raw = args.loop_corpus
    if raw is None:
        raw = work / "synthetic"
        # a quarter as many words as BPE pieces: each word one piece (measured), the lengths WMT-like
        write_synthetic(raw, 2_000 if args.size == "tiny" else 50_000, args.loop_vocab // 4, args.seed)
    src_lang, tgt_lang = args.langs.split(",")
    cfg = DataConfig(
        name="bench_loop",
        source="local",
        path=str(raw),
        src_lang=src_lang,
        tgt_lang=tgt_lang,
        splits={"train": "train"},
        vocab_size=args.loop_vocab,
        lowercase=False,
        dir=str(args.loop_data_dir or work / "prepared"),
    )
    prepare(cfg)
    return cfg


def write_synthetic(out: Path, pairs: int, words: int, seed: int) -> None:
    """`pairs` sentence pairs of random words (a lexicon of `words`) with WMT-like lengths in words."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lexicon = ["".join(rng.choice(letters, rng.integers(3, 9))) for _ in range(words)]
    src, tgt = wmt_like_lengths(pairs, seed, max_len=120)
    for lang, lengths in (("en", src), ("de", tgt)):
        lines = (" ".join(lexicon[i] for i in rng.integers(0, len(lexicon), n)) for n in lengths)
        (out / f"train.{lang}").write_text("".join(line + "\n" for line in lines))


def train_overrides(args: argparse.Namespace, data: DataConfig, cfg: ModelConfig, run_dir: Path) -> list[str]:
    """train.py's command line for a loop run: the defaults of the device, no validation or saving."""
    cuda = args.device == "cuda"
    first, steady = args.loop_steps
    command = ["trainer=default" if cuda else "trainer=cpu", f"trainer.device={args.device}"]
    command += [f"data.{key}={getattr(data, key)}" for key in ("name", "source", "path", "dir", "vocab_size")]
    command += [f"data.src_lang={data.src_lang}", f"data.tgt_lang={data.tgt_lang}", "data.lowercase=false"]
    command += ["~data.splits.valid", "~data.splits.test", "data.local_splits=null", "data.num_workers=1"]
    command += [f"model.{key}={getattr(cfg, key)}" for key in ("d_model", "n_heads", "d_ff", "n_layers")]
    timed = first + steady
    command += [f"trainer.run_dir={run_dir}", f"trainer.max_steps={timed + PROFILED}"]
    command += [f"trainer.profile_steps=[{timed + 1},{timed + PROFILED}]", "trainer.progress=false"]
    command += ["trainer.log_every_steps=1", "trainer.eval_every_steps=0", "trainer.translate_every_steps=0"]
    command += ["trainer.save_every_steps=0", "trainer.save_every_minutes=0", "trainer.best_metric=loss"]
    return command + ["finish.average_last=0", "finish.evaluate_split=null"]


def run_ours(
    args: argparse.Namespace, data: DataConfig, cfg: ModelConfig, work: Path, name: str
) -> dict[str, Any]:
    """One train.py process: `eager` (the device's defaults: on CUDA the steps are CUDA graph replays),
    `compiled` (trainer.compile=true), `no-graphs` (trainer.cuda_graphs=false), `no-cudnn` (attention
    without the cuDNN backend) or `buckets` (the length buckets the device does not use by default: 12 on
    a CPU, none on CUDA, and so no graphs)."""
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cuda = args.device == "cuda"
    extra = {
        "eager": [],
        "compiled": ["trainer.compile=true"],
        "no-graphs": ["trainer.cuda_graphs=false"],
        "no-cudnn": [f"trainer.attention_backends=[flash,{'efficient' if cuda else 'math'}]"],
        "buckets": [f"trainer.length_buckets={0 if cuda else 12}"],
    }[name]
    command = [sys.executable, str(ROOT / "train.py"), *train_overrides(args, data, cfg, run_dir), *extra]
    env = dict(os.environ, TORCH_LOGS="recompiles", PYTHONUNBUFFERED="1")
    start = time.time()
    with open(work / f"{name}.log", "w") as out:  # written as it runs: a run cut short leaves its log
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    log = (work / f"{name}.log").read_text()
    if done.returncode != 0:
        raise RuntimeError(f"train.py ({name}) exited with {done.returncode}: {log[-2000:]}")
    steps = [(s.wall_time, s.value) for s in _scalars(run_dir, "train/tokens_per_step")]
    row = _windows(name, start, steps, args.loop_steps)
    row["recompiles"] = log.count("Recompiling function")
    row["peak_gib"] = max((m.value for m in _scalars(run_dir, "train/peak_mem_gib")), default=None)
    kernel_ms = next((m.value for m in _scalars(run_dir, "profile/kernel_ms_per_step")), None)
    row["gpu_busy"] = _busy(None if kernel_ms is None else kernel_ms * PROFILED / 1000, steps, row)
    return {**row, **_batching(run_dir)}


def run_peer(
    args: argparse.Namespace, data: DataConfig, cfg: ModelConfig, ours: dict[str, Any], compiled: bool
) -> dict[str, Any]:
    """torch.nn.Transformer over the batches the `ours` run trained on (the same sampler, padding and
    buckets): forward, backward, Adam and one read of the loss per step, timed from its loop's start
    (model built, data open); compiled as a user would, `torch.compile(model)`."""
    device = torch.device(args.device)
    if device.type == "cuda":  # this peer's peak, not an earlier one's
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = from_dict(TrainerConfig, ours["trainer"])
    train = ShardDataset(Path(data.dir), "train")
    sampler = TokenBudgetBatchSampler(
        train.src_lengths,
        train.tgt_lengths,
        trainer.batch_tokens(1),
        seed=trainer.seed,
        pad_to_multiple=trainer.pad_to_multiple,
        buckets=ours["buckets"],
    )
    torch.manual_seed(args.seed)
    dims = {key: getattr(cfg, key) for key in ("d_model", "n_heads", "d_ff", "n_layers")}
    vocab = load_meta(data.dir)["vocab_size"]
    peer = TorchTransformerPeer(ModelConfig(**dims, vocab_size=vocab), 0.1).to(device).train()
    optimizer = torch.optim.Adam(peer.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    run = torch.compile(peer) if compiled else peer
    batches = batches_forever(sampler, train, trainer.pad_to_multiple, device)  # as train.py reads them
    first, steady = args.loop_steps
    start, steps, profiler = time.time(), [], Profiler(device)
    for step in range(first + steady + PROFILED):
        if step == first + steady:
            profiler.start()
        micro = [next(batches) for _ in range(trainer.grad_accum(1))]
        tokens = sum(batch.n_tgt_tokens for batch in micro)
        total = torch.zeros((), device=device)
        for batch in micro:
            with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                loss = run(batch.src, batch.tgt_in, batch.tgt_out)
            (loss / tokens).backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total.item()  # the one read per step, as the training loop's
        steps.append((time.time(), float(tokens)))
    row = _windows("peer-compiled" if compiled else "peer", start, steps, args.loop_steps)
    row["gpu_busy"] = _busy(profiler.stop(PROFILED).kernel_seconds, steps, row)
    row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return row


def _busy(
    kernel_seconds: float | None, steps: list[tuple[float, float]], row: dict[str, Any]
) -> float | None:
    """The GPU's busy share in the steady steps: the kernel time per target token of the profiled steps
    (the last PROFILED of `steps`) times the steady target tokens/s; None without kernel times."""
    if kernel_seconds is None:
        return None
    return kernel_seconds / sum(tokens for _, tokens in steps[-PROFILED:]) * row["steady_tokens_per_s"]


def _windows(
    name: str, start: float, steps: list[tuple[float, float]], windows: tuple[int, int]
) -> dict[str, Any]:
    """Target tokens/s of the first `first` steps from `start`, and of the `steady` steps after them;
    steps: (wall time at its end, its real target tokens), one per step."""
    first, steady = windows
    if len(steps) != first + steady + PROFILED:
        raise RuntimeError(f"{name}: {len(steps)} steps logged, {first + steady + PROFILED} expected")
    steps = steps[: first + steady]  # the profiled ones are slower
    times, tokens = np.array([t for t, _ in steps]), np.array([n for _, n in steps])
    return {
        "run": name,
        "first_step_s": float(times[0] - start),
        "first_tokens_per_s": float(tokens[:first].sum() / (times[first - 1] - start)),
        "steady_tokens_per_s": float(tokens[first:].sum() / (times[-1] - times[first - 1])),
        "tokens_per_step": float(tokens.mean()),
    }


def _scalars(run_dir: Path, tag: str) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep all
    events.Reload()
    return events.Scalars(tag) if tag in events.Tags()["scalars"] else []


def section_loop(args: argparse.Namespace, cfg: ModelConfig, keep: Callable[[dict], None]) -> dict[str, Any]:
    """The runs of --loop-runs, in that order, each kept (`keep`) as it ends; a peer run takes the
    batches of ours' eager run (an earlier one's in --loop-work, else it runs first)."""
    with tempfile.TemporaryDirectory(prefix="bench_loop_") as tmp:
        work = args.loop_work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = loop_data(args, work)
        meta = load_meta(data.dir)
        result = {
            "corpus": str(args.loop_corpus or "synthetic WMT-like lengths"),
            "pairs": meta["splits"]["train"]["pairs"],
            "vocab_size": meta["vocab_size"],
            "first_steps": args.loop_steps[0],
            "steady_steps": args.loop_steps[1],
            "rows": [],
        }
        rows = []
        for name in args.loop_runs:
            if name.startswith("peer"):
                ours = next((r for r in rows if r["run"] == "eager"), None) or _batching(work / "eager")
                ours = ours or run_ours(args, data, cfg, work, "eager")
                rows.append(run_peer(args, data, cfg, ours, compiled=name == "peer-compiled"))
            else:
                rows.append(run_ours(args, data, cfg, work, name))
            peer = next((r["steady_tokens_per_s"] for r in rows if r["run"] == "peer-compiled"), None)
            for row in rows:
                row["over_peer_compiled"] = row["steady_tokens_per_s"] / peer if peer else None
            result["rows"] = [{k: v for k, v in row.items() if k not in HIDDEN} for row in rows]
            keep(result)  # a run cut short later keeps this one's figures
    return result


def _batching(run_dir: Path) -> dict[str, Any] | None:
    """The trainer settings and buckets of an earlier run of ours, from its last checkpoint; None without."""
    path = run_dir / "checkpoints" / "checkpoint_last.pt"
    if not path.is_file():
        return None
    ckpt = load_checkpoint(path)
    return {"trainer": ckpt["config"]["trainer"], "buckets": ckpt["batching"]["buckets"]}
