"""The train section: one optimizer step of each model at a fixed shape and on sampled WMT-like batches,
FLOPs and model FLOP utilisation, peak memory, and the paper's training budgets at the measured speed."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm import tqdm

from harness.data import wmt_like_lengths
from harness.measure import (
    FIRST_TOKEN,
    PAD_MULTIPLE,
    Setup,
    count_flops,
    interleave,
    matmul_peak,
    peak_memory,
    ratio_spread,
    release_free_memory,
    side_kernels,
    timed,
)
from harness.peers import MarianPeer, OursObjective, TorchTransformerPeer
from transformer.config import ModelConfig
from transformer.data.batching import Batch, TokenBudgetBatchSampler, collate
from transformer.kernels import Kernels

BIG = ModelConfig(d_model=1024, n_heads=16, d_ff=4096, dropout=0.3)  # Table 3: big
PAPER_BUDGETS = {  # §5.2: steps x ~25k target tokens per step; time the paper took on 8 P100 GPUs
    "base": (100_000, 12.0),
    "big": (300_000, 84.0),
}
PAPER_TOKENS_PER_STEP = 25_000
LR = 1e-4  # any small constant: the schedule does not change a step's cost


@dataclass
class Trainee:
    """One contender of the train section: a loss module (maybe compiled) and its Adam."""

    name: str
    mode: str  # "eager" | "compiled"
    run: nn.Module  # what a step calls: the module, or torch.compile of it
    module: nn.Module  # the eager module (FLOP counting, parameters)
    optimizer: torch.optim.Optimizer


def build_trainees(cfg: ModelConfig, families: list[str], setup: Setup, seed: int, compile: bool) -> list:
    """Every family eager, and compiled when asked (the same weights and Adam: compile wraps the module)."""
    builders = {"ours": OursObjective, "nn.Transformer": TorchTransformerPeer, "Marian (HF)": MarianPeer}
    side = side_kernels(setup.device)  # trainer.cpu_kernels=off (and =on)
    trainees = []
    for name in families:
        torch.manual_seed(seed)
        if name == "ours":  # with the kernels as training hands them over (training/state.py)
            module = OursObjective(cfg, setup.label_smoothing, Kernels.choose(setup.device))
        elif name in side:
            module = OursObjective(cfg, setup.label_smoothing, side[name])
        else:
            module = builders[name](cfg, setup.label_smoothing)
        module = module.to(setup.device).train()
        optimizer = torch.optim.Adam(module.parameters(), lr=LR, betas=(0.9, 0.98), eps=1e-9, fused=True)
        compiles = compile and name not in side  # (compiled code takes no CPU kernel anyway)
        eager = Eager(module) if compiles and name == "ours" else module
        trainees.append(Trainee(name, "eager", eager, module, optimizer))
        if compiles:
            trainees.append(Trainee(name, "compiled", compiled(name, module), module, optimizer))
    return trainees


def compiled(name: str, module: nn.Module) -> nn.Module:
    """Ours as `trainer.compile=true` compiles it (its regions in place, with dynamic shapes: one graph per
    region for every batch shape); the peers whole, with static shapes, their fastest at one shape."""
    if name == "ours":
        torch.fx.experimental._config.use_duck_shape = False  # as training/distributed.py: wrap
        module.objective.compile_regions()
        return module
    return torch.compile(module)


class Eager(nn.Module):
    """A module whose regions are compiled, run eagerly (the eager contender beside the compiled one)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Tensor) -> Tensor:
        with torch.compiler.set_stance("force_eager"):
            return self.module(*args)


def train_step(trainee: Trainee, batch: Batch, setup: Setup) -> None:
    """Forward, backward of the loss per target token, Adam update."""
    with setup.autocast():
        loss = trainee.run(batch.src, batch.tgt_in, batch.tgt_out)
    (loss / batch.n_tgt_tokens).backward()
    trainee.optimizer.step()
    trainee.optimizer.zero_grad(set_to_none=True)


def random_batch(cfg: ModelConfig, n: int, length: int, generator: torch.Generator) -> Batch:
    """n sentences of exactly `length` source and target tokens, no padding."""
    src = torch.randint(FIRST_TOKEN, cfg.vocab_size, (n, length), generator=generator)  # (B, S)
    tgt = torch.randint(FIRST_TOKEN, cfg.vocab_size, (n, length + 1), generator=generator)  # (B, T + 1)
    return Batch(src, tgt[:, :-1], tgt[:, 1:], n * length, n * length)


def sampled_batches(cfg: ModelConfig, budget: int, count: int, seed: int) -> list[Batch]:
    """`count` batches as training sees them: TokenBudgetBatchSampler over WMT-like lengths, collated
    (padded to multiples of 8, as trainer.pad_to_multiple) from random token ids."""
    src_len, tgt_len = wmt_like_lengths(200_000, seed, max_len=min(250, cfg.max_positions - 1))
    sampler = TokenBudgetBatchSampler(src_len, tgt_len, budget, seed=seed, pad_to_multiple=PAD_MULTIPLE)
    rng = np.random.default_rng(seed)
    batches = []
    for indices in sampler.epoch_batches(0)[:count]:
        pairs = [
            (rng.integers(FIRST_TOKEN, cfg.vocab_size, s), rng.integers(FIRST_TOKEN, cfg.vocab_size, t))
            for s, t in zip(src_len[indices], tgt_len[indices])
        ]
        batches.append(collate(pairs, PAD_MULTIPLE))
    return batches


def padding_fraction(batches: list[Batch]) -> dict[str, float]:
    """Share of padded positions among all positions, per side."""
    src = sum(b.src.numel() for b in batches)
    tgt = sum(b.tgt_out.numel() for b in batches)
    return {
        "src": 1 - sum(b.n_src_tokens for b in batches) / src,
        "tgt": 1 - sum(b.n_tgt_tokens for b in batches) / tgt,
    }


def warm_up(trainee: Trainee, batch: Batch, setup: Setup, steps: int) -> float:
    """Untimed steps (a compiled model compiles in the first); the seconds of the first."""
    times = [timed(partial(train_step, trainee, batch, setup), setup.device)[0] for _ in range(steps)]
    return times[0]


def prepare(
    trainees: list[Trainee],
    batch: Batch,
    setup: Setup,
    warmup: int,
    facts: dict[tuple, dict],
    notes: list[str],
) -> list[Trainee]:
    """Warm each model up, count an eager model's FLOPs on a step of its own (a compiled model does the
    same math: it gets its eager twin's count) and measure its peak memory over one plain step:
    activations, gradients and transients above the resident weights and Adam state. A compiled model
    that fails (a compiler error) is left out with a note; the eager ones are the section's core."""
    ready = []
    for trainee in tqdm(trainees, desc="train warm-up (and compile)", leave=False):
        try:
            first = warm_up(trainee, batch, setup, warmup)
        except Exception as error:
            if trainee.mode == "eager":
                raise
            notes.append(f"{trainee.name} compiled failed and is left out: {type(error).__name__}: {error}")
            continue
        step = partial(train_step, trainee, batch, setup)
        twin = facts.get((trainee.name, "eager"))  # prepared first
        flops = twin["flops"] if twin is not None else count_flops(step)  # outside the memory window
        with peak_memory(setup.device) as used:
            step()
        facts[trainee.name, trainee.mode] = {"first": first, "flops": flops, "memory": used["mib"]}
        ready.append(trainee)
    return ready


def bench_fixed(
    trainees: list[Trainee], facts: dict[tuple, dict], batch: Batch, setup: Setup, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Fixed-shape steps of the prepared models, interleaved: tokens/s, FLOPs, memory."""
    runs = {i: (lambda _, t=t: train_step(t, batch, setup)) for i, t in enumerate(trainees)}
    times = interleave(runs, args.steps, setup.device, "train steps", args.time_box)
    rows = []
    for i, t in enumerate(trainees):
        seconds = statistics.median(s for s, _ in times[i])
        fact, resident = facts[t.name, t.mode], resident_mib(t)
        rows.append(
            {
                "model": t.name,
                "mode": t.mode,
                "params_m": sum(p.numel() for p in t.module.parameters()) / 1e6,
                "tokens_per_s": batch.n_tgt_tokens / seconds,
                "ms_per_step": 1000 * seconds,
                "gflop_per_step": fact["flops"] / 1e9,
                "step_peak_mib": fact["memory"],
                "resident_mib": resident,
                "peak_total_mib": None if fact["memory"] is None else resident + fact["memory"],
                "first_step_s": fact["first"],
                "step_times_s": [s for s, _ in times[i]],
            }
        )
    add_ratios(rows)
    return rows


def resident_mib(trainee: Trainee) -> float:
    """What a model keeps between steps: its weights and its optimizer's state (gradients are freed)."""
    state = [v for s in trainee.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in [*trainee.module.parameters(), *state]) / 2**20


def add_ratios(rows: list[dict[str, Any]], key: str = "tokens_per_s") -> None:
    """ours / this, against our row of the same mode: the median of the rounds' ratios and their range
    where the rows have each step's time, else the ratio of the speeds."""
    ours = {r["mode"]: r for r in rows if r["model"] == "ours"}
    for r in rows:
        mine = ours.get(r["mode"])
        r["ours_over_this"] = None if mine is None else mine[key] / r[key]
        if mine is not None and "step_times_s" in r:
            r["ours_over_this"], *r["ours_over_this_range"] = ratio_spread(
                mine["step_times_s"], r["step_times_s"]
            )


def bench_sampled(
    trainees: list[Trainee], cfg: ModelConfig, setup: Setup, args: argparse.Namespace
) -> dict[str, Any]:
    """The eager models on token-budget batches of WMT-like lengths (compiling every new batch shape
    would dominate): real target tokens/s, padding, sentences per batch."""
    batches = sampled_batches(cfg, args.budget_tokens, args.real_batches, args.seed)
    batches = [b.to(setup.device) for b in batches]
    eager = [t for t in trainees if t.mode == "eager"]
    # warm-up on this section's shapes; on CUDA on every one (its first step allocates and picks kernels)
    for t in eager:
        for b in batches if setup.device.type == "cuda" else batches[:1]:
            train_step(t, b, setup)
    runs = {i: (lambda r, t=t: train_step(t, batches[r], setup)) for i, t in enumerate(eager)}
    times = interleave(runs, len(batches), setup.device, "sampled-batch steps")
    real = sum(b.n_tgt_tokens for b in batches)
    rows = [
        {"model": t.name, "mode": t.mode, "tokens_per_s": real / sum(s for s, _ in times[i])}
        for i, t in enumerate(eager)
    ]
    add_ratios(rows)
    return {
        "budget_tokens": args.budget_tokens,
        "batches": len(batches),
        "sentences_per_batch": statistics.mean(b.src.size(0) for b in batches),
        "real_tgt_tokens_per_batch": real / len(batches),
        "padding_fraction": padding_fraction(batches),
        "rows": rows,
    }


def meta_step_flops(cfg: ModelConfig, batch: int, length: int) -> int:
    """FLOPs of one training step of our model, counted on the meta device (no memory, no time)."""
    with torch.device("meta"):
        objective = OursObjective(cfg, 0.1)
        src = torch.randint(FIRST_TOKEN, cfg.vocab_size, (batch, length))
        tgt = torch.randint(FIRST_TOKEN, cfg.vocab_size, (batch, length))
    return count_flops(lambda: objective(src, tgt, tgt).backward())


def bench_big(big_cfg: ModelConfig, setup: Setup, batch: Batch, args: argparse.Namespace) -> float:
    """Target tokens/s of the big model (compiled), at the fixed shape."""
    [trainee] = build_trainees(big_cfg, ["ours"], setup, args.seed, compile=False)
    trainee = replace(trainee, mode="compiled", run=compiled("ours", trainee.module))
    warm_up(trainee, batch, setup, args.warmup)
    times = interleave(
        {0: lambda _: train_step(trainee, batch, setup)}, args.steps, setup.device, "big steps"
    )
    return batch.n_tgt_tokens / statistics.median(s for s, _ in times[0])


def fastest_mode(rows: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """The row of `model` in its fastest mode (eager or compiled)."""
    return max((r for r in rows if r["model"] == model), key=lambda r: r["tokens_per_s"])


def projections(
    fixed: list[dict[str, Any]],
    sampled: dict[str, Any],
    size: str,
    flop_ratio: float,
    big_tokens_per_s: float | None,
) -> list[dict[str, Any]]:
    """Wall time of the paper's training budgets (§5.2) at our measured speed: the base budget at the
    measured dims; the big budget at the big dims, measured (`--big`, fixed shape) or the measured speed
    x (FLOPs per step of the measured dims / of the big dims, both counted), i.e. at equal MFU. A
    measured big speed (compiled) replaces the fixed-shape basis' estimate only."""
    ours_sampled = next(r for r in sampled["rows"] if r["model"] == "ours")
    speeds = [
        ("fixed shape, best mode", fastest_mode(fixed, "ours")["tokens_per_s"]),
        ("sampled batches, eager, real tokens", ours_sampled["tokens_per_s"]),
    ]
    rows = []
    for basis, speed in speeds:
        for budget, (steps, paper_hours) in PAPER_BUDGETS.items():
            if budget == "base":
                dims, tokens_per_s = size, speed
            elif big_tokens_per_s is not None and basis.startswith("fixed"):
                dims, tokens_per_s = "big, measured (compiled)", big_tokens_per_s
            else:
                dims, tokens_per_s = f"big, from {size} x counted FLOPs", speed * flop_ratio
            rows.append(
                {
                    "budget": f"{budget} ({steps // 1000}k steps)",
                    "dims": dims,
                    "basis": basis,
                    "tokens_per_s": tokens_per_s,
                    "hours": steps * PAPER_TOKENS_PER_STEP / tokens_per_s / 3600,
                    "paper_hours_8xP100": paper_hours,
                }
            )
    return rows


def section_train(
    args: argparse.Namespace,
    cfg: ModelConfig,
    setup: Setup,
    peers: set[str],
    notes: list[str],
    publish: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Fixed-shape and sampled-batch steps, model FLOP utilisation against the best matmul peak measured
    around the timed steps (on a shared machine one may meet a busy moment), and the projections of the
    paper's budgets. The eager models come first and their figures are published (written to the JSON)
    before anything compiles: compiling takes most of the section's time and is its likeliest failure.
    Then the compiled models join, and every model is timed again, interleaved with all the others."""
    families = ["ours", *side_kernels(setup.device)]
    families += ["nn.Transformer"] * ("torch" in peers) + ["Marian (HF)"] * ("marian" in peers)
    batch = random_batch(cfg, args.batch, args.length, torch.Generator().manual_seed(args.seed))
    batch = batch.to(setup.device)
    trainees = build_trainees(cfg, families, setup, args.seed, args.compile)
    eager = [t for t in trainees if t.mode == "eager"]
    big_cfg = replace(BIG, vocab_size=cfg.vocab_size)
    shape = (args.batch, args.length)
    flop_ratio = meta_step_flops(cfg, *shape) / meta_step_flops(big_cfg, *shape)
    facts: dict[tuple, dict] = {}  # (model, mode) -> first step s, FLOPs, memory
    peaks = [matmul_peak(setup.device)]
    ready = prepare(eager, batch, setup, args.warmup, facts, notes)
    fixed = bench_fixed(ready, facts, batch, setup, args)
    sampled = bench_sampled(eager, cfg, setup, args)
    peaks.append(matmul_peak(setup.device))
    result = train_result(args, batch, peaks, fixed, sampled, flop_ratio, None)
    if args.compile:
        publish(result)
        ready += prepare(
            [t for t in trainees if t.mode == "compiled"], batch, setup, args.warmup, facts, notes
        )
        fixed = bench_fixed(ready, facts, batch, setup, args)
        peaks.append(matmul_peak(setup.device))
        result = train_result(args, batch, peaks, fixed, sampled, flop_ratio, None)
    del trainees, eager, ready
    release_free_memory(setup.device)
    if args.big:
        publish(result)
        big = bench_big(big_cfg, setup, batch, args)
        result = train_result(args, batch, peaks, fixed, sampled, flop_ratio, big)
    return result


def train_result(
    args: argparse.Namespace,
    batch: Batch,
    peaks: list[tuple[float, str]],
    fixed: list[dict[str, Any]],
    sampled: dict[str, Any],
    flop_ratio: float,
    big: float | None,
) -> dict[str, Any]:
    """The section's figures: the rows with their MFU against the best peak, and the projections."""
    peak, how = max(peaks)  # (FLOP/s, how): the best one and its own breakdown
    for row in fixed:
        row["mfu"] = row["gflop_per_step"] * 1e9 / (row["ms_per_step"] / 1000) / peak
    return {
        "shape": {"batch": args.batch, "length": args.length, "target_tokens": batch.n_tgt_tokens},
        "peak_tflops": peak / 1e12,
        "peak_how": how,
        "fixed": fixed,
        "sampled": sampled,
        "big_over_measured_flops_per_step": 1 / flop_ratio,
        "big_tokens_per_s": big,
        "projections": projections(fixed, sampled, args.size, flop_ratio, big),
    }
