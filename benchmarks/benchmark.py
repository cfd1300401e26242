"""Speed of the project against peer implementations, side by side in one run, with ratios.

    python benchmarks/benchmark.py --device cuda --size base --json bench.json
    python benchmarks/benchmark.py --device cpu --size base --threads 2          # small CPU batches
    python benchmarks/benchmark.py --device cpu --size tiny --sections data      # seconds
    python benchmarks/benchmark.py --summarize bench.json     # the goals of a saved run, measuring nothing

Sections (`--sections train,decode,data`; `loop` when asked):

train   One optimizer step (forward + backward + Adam, label-smoothed cross-entropy eps_ls = 0.1, §5.3-5.4)
        at a fixed shape (`--batch` sentences x `--length` source and target tokens) for
          ours            the project's Transformer with its own objective (Seq2SeqLoss),
          nn.Transformer  torch.nn.Transformer + one shared embedding (x sqrt(d_model)), sinusoidal
                          positions and the tied output projection (§3.4-3.5),
          Marian (HF)     Hugging Face MarianMTModel built from a MarianConfig of the same dims (sdpa),
        and on a CPU, eager only, ours with its CPU kernels off (cpu_kernels=off) and, where the
        instruction set chooses fewer than all (AVX2), on (cpu_kernels=on), as in decode;
        each eager and under torch.compile (ours by regions with dynamic shapes, as training compiles
        it; the peers whole with static shapes; `--no-compile` skips compiling). Reported: target tokens/s
        (median of `--steps` steps, the models interleaved step by step so a busy machine slows all alike;
        more while `--time-box` seconds last),
        FLOPs counted by
        torch.utils.flop_counter on one eager step, model FLOP utilisation against a matmul peak measured in
        this run (bf16 on CUDA, fp32 on the CPU), the step's peak memory above the resident weights and Adam
        state (CUDA allocator; sampled RSS on the CPU) and with them, and ours / peer. Then the eager models
        on batches built by the project's TokenBudgetBatchSampler from WMT-like lengths (`--budget-tokens`):
        real (non-pad) target tokens/s and the padding, and the wall time the paper's budgets (base: 100k
        steps, big: 300k steps, x 25k target tokens) would take at the measured speed. The big model is
        measured with `--big`, else its speed is the base speed scaled by the FLOPs counted for both.
decode  Random weights, `--src-len` source tokens, exactly `--new-tokens` output tokens (EOS suppressed
        until then): beam 4 over `--beam-sentences` and greedy over `--greedy-sentences` for ours
        (beam_search with min_len, greedy as its beam of 1, with the CPU kernels translate.py times on
        this machine; on a CPU also with the kernels off, and on where that choice is fewer, and in 8
        bits (precision=int8; x86 only), with the weights packed once for all runs (for oneDNN where
        the choice packs them, in 8 bits for int8), as translate.py packs them once for all batches;
        on CUDA also beam_search in static shapes with each step a CUDA graph replay, as translate.py
        cuda_graphs=true), Hugging Face `generate` and CTranslate2 (the same Marian model converted;
        fp32 on the CPU, `--ct2-compute` on CUDA): output tokens/s, sentences/s, over `--decode-rounds`
        rounds (more while `--time-box` seconds last). With `--vocabulary-map K`, ours also with a
        shortlist of K pieces per batch (vocabulary_map=FILE at K candidates), beside ours.
        The goals compare the fastest of ours with each peer, the shortlist not counted.
data    TokenBudgetBatchSampler on `--data-pairs` synthetic WMT-like lengths at `--data-budget` tokens:
        build time and padding; with `--corpus-dir` (files train.<src>, train.<tgt>, maybe .gz) also the
        throughput of transformer.data.prepare.prepare (BPE learning + binarization), in pairs/s, and
        the host time of reading one training batch of the prepared shards (ShardDataset.batch).
loop    train.py itself, each run a process (`--loop-runs`): eager (on CUDA its steps CUDA graph
        replays), compiled (trainer.compile=true), without CUDA graphs, with attention's backends but
        cuDNN, and with the length buckets the device does not use by default;
        the corpus `--loop-corpus` (files
        train.<src>, train.<tgt>; e.g. the WMT sample of benchmarks/wmt_sample_corpus.py) or synthetic words
        of WMT-like lengths, prepared with a `--loop-vocab` BPE into `--loop-data-dir`. Reported per run:
        target tokens/s over the first `--loop-steps` steps from process start (imports, data, compiles,
        plans) and over the steady steps after them, the seconds to the first step, recompiles, the real
        target tokens per step, peak memory and (CUDA; torch.profiler over 5 steps after them) the GPU's
        busy share; then the same batches through a torch.nn.Transformer loop eager and compiled (peer,
        peer-compiled).

Every model trains with fused Adam, as the training loop does. CUDA runs use bf16 autocast and TF32;
decoding runs the models in bf16 (as translate.py does) and CTranslate2 in `--ct2-compute`. CPU runs
are fp32 on `--threads` threads. A step here is what the model, loss and optimizer cost; the training
loop adds a gradient norm and three scalar reads per step. The matmul peak is torch's own (on the CPU
the better of its two fp32 GEMMs, MKL and oneDNN; the project's linear layers use oneDNN where the
instruction set chooses it, see transformer/kernels/), so MFU is relative to what torch reaches on this
machine, not to the hardware.
Peers that are not installed (`pip install -e ".[bench]"`) are skipped with a note. The sections run
in the order given, each printed and written to `--json` as soon as it ends (a killed run keeps what
it measured; train writes its eager figures before it compiles anything); a section that fails is
noted, the others are still reported, and the run then exits with an error; a peer that fails (a
compiled model, a decoder) is left out with a note. The report ends with the project's goals for the
device (harness/report.py: TRAIN_GOAL, MEMORY_GOAL_GIB, DECODE_GOALS, CPU_GOALS), met or not, each goal
against CTranslate2 with its bound: ours' products alone against the peer. `--json` writes every
figure. Sizes: tiny (smoke tests), base (the paper's base model: N=6, d_model=512, h=8, d_ff=2048,
vocab 37000); the big model is d_model=1024, h=16, d_ff=4096.

Every ratio ours / peer is the median of the rounds' ratios (a round times every model once, so a
busy moment slows all alike), printed with their range; a goal is met only where that median meets it.

The code, one file per part under harness/: measure.py (timing, interleaving, matmul peak, FLOPs, memory),
peers.py (the peer models and the CTranslate2 process), train.py, decode.py, data.py (the sections),
report.py (tables, goals, JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from harness.data import section_data
from harness.decode import section_decode
from harness.loop import RUNS, section_loop
from harness.measure import Setup, make_setup, register_cpu_flops, release_free_memory
from harness.peers import available_peers
from harness.report import print_header, print_section, print_summary, targets, write_json
from harness.train import section_train

from transformer.config import ModelConfig
from transformer.kernels import Kernels
from transformer.utils.devices import cpu_features

SIZES = {
    "tiny": ModelConfig(vocab_size=1000, d_model=64, n_heads=4, d_ff=256, n_layers=2),
    "base": ModelConfig(),  # §6.1, Table 3: the base model
}
# Defaults per device: (cuda, cpu)
DEFAULTS = {
    "batch": (768, 16),
    "steps": (20, 5),
    "warmup": (3, 1),
    "budget_tokens": (14_336, 1024),  # cuda: trainer.max_tokens, a default batch on one GPU
    "real_batches": (20, 4),
    "beam_sentences": (128, 32),
    "greedy_sentences": (512, 64),
    "decode_rounds": (5, 5),
    "loop_steps": ("100,200", "3,3"),  # the first steps (from process start), then the steady ones
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="train,decode,data", help="comma-separated: train, decode, data")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--size", choices=sorted(SIZES), default="base")
    p.add_argument("--json", type=Path, help="write every figure to this JSON file")
    p.add_argument("--summarize", type=Path, help="print the goals of a saved --json report; measure nothing")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (torch and CTranslate2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", default="torch,marian,ct2", help="comma-separated: torch, marian, ct2")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled models")
    p.add_argument("--batch", type=int, help="train: sentences per fixed-shape step (cuda 768, cpu 16)")
    p.add_argument("--length", type=int, default=32, help="train: source and target tokens per sentence")
    p.add_argument("--steps", type=int, help="train: timed steps per model (cuda 20, cpu 5)")
    p.add_argument("--warmup", type=int, help="train: untimed steps first, at least 1 (cuda 3, cpu 1)")
    p.add_argument("--budget-tokens", type=int, help="train: token budget of sampled batches (14336 / 1024)")
    p.add_argument("--real-batches", type=int, help="train: sampled batches timed per model (20 / 4)")
    p.add_argument("--big", action="store_true", help="train: also measure the big model (compiled)")
    p.add_argument("--src-len", type=int, default=30, help="decode: source tokens, EOS included")
    p.add_argument("--new-tokens", type=int, default=40, help="decode: output tokens per sentence")
    p.add_argument("--beam-sentences", type=int, help="decode: sentences for beam 4 (cuda 128, cpu 32)")
    p.add_argument("--greedy-sentences", type=int, help="decode: sentences for greedy (512 / 64)")
    p.add_argument("--decode-rounds", type=int, help="decode: timed runs per decoder, at least (5)")
    p.add_argument(
        "--vocabulary-map", type=int, default=0, help="decode: also ours with a shortlist of this many pieces"
    )
    p.add_argument(
        "--time-box", type=float, default=0.0, help="train, decode: go on timing rounds for this many seconds"
    )
    p.add_argument("--ct2-compute", default="bfloat16", help="decode: CTranslate2 compute type on CUDA")
    p.add_argument("--data-pairs", type=int, default=4_500_000, help="data: synthetic pairs to batch")
    p.add_argument("--data-budget", type=int, default=25_000, help="data: token budget per batch")
    p.add_argument("--corpus-dir", type=Path, help="data: also time prepare() on <dir>/train.<lang>")
    p.add_argument("--langs", default="en,de", help="data: source,target language of --corpus-dir")
    p.add_argument("--prepare-vocab", type=int, default=8000, help="data: BPE vocabulary for prepare()")
    p.add_argument("--loop-runs", default=",".join(RUNS), help=f"loop: comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--loop-steps", help="loop: first steps, steady steps (cuda 100,200; cpu 3,3)")
    p.add_argument("--loop-corpus", type=Path, help="loop: raw corpus dir (train.<lang>); default synthetic")
    p.add_argument("--loop-vocab", type=int, help="loop: BPE vocabulary (base 37000, tiny 500)")
    p.add_argument("--loop-data-dir", type=Path, help="loop: the prepared corpus (kept; default temporary)")
    p.add_argument("--loop-work", type=Path, help="loop: where runs and their logs go (default temporary)")
    args = p.parse_args(argv)
    _resolve_defaults(args, p)
    return args


def _resolve_defaults(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Device-dependent defaults, then every check of the flags before any heavy work."""
    for name, (cuda, cpu) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, cuda if args.device == "cuda" else cpu)
    args.sections = list(dict.fromkeys(s.strip() for s in args.sections.split(",") if s.strip()))
    args.peers = [s.strip() for s in args.peers.split(",") if s.strip()]
    args.loop_runs = [s.strip() for s in args.loop_runs.split(",") if s.strip()]
    bad = sorted(set(args.sections) - {"train", "decode", "data", "loop"}) + sorted(
        set(args.peers) - {"torch", "marian", "ct2"}
    )
    bad += sorted(set(args.loop_runs) - set(RUNS))
    if bad:
        parser.error(f"unknown section(s), peer(s) or loop run(s): {', '.join(bad)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is available; use --device cpu")
    positive = ("threads", "batch", "length", "steps", "budget_tokens", "real_batches", "src_len")
    positive += ("new_tokens", "beam_sentences", "greedy_sentences", "decode_rounds", "data_pairs")
    positive += ("data_budget", "prepare_vocab", "warmup")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.src_len < 2:
        parser.error("--src-len must be at least 2 (pieces + EOS)")
    vocab = SIZES[args.size].vocab_size
    if args.vocabulary_map and not 4 < args.vocabulary_map <= vocab:
        parser.error(f"--vocabulary-map={args.vocabulary_map} must be 0 (off) or 5 to {vocab:,} pieces")
    try:
        args.loop_steps = tuple(int(n) for n in args.loop_steps.split(","))
    except ValueError:
        args.loop_steps = ()
    if len(args.loop_steps) != 2 or min(args.loop_steps) < 1:
        parser.error(f"--loop-steps={args.loop_steps} must be two counts of at least 1, e.g. 100,200")
    if args.loop_vocab is None:
        args.loop_vocab = 500 if args.size == "tiny" else 37_000
    if args.loop_corpus is not None and not args.loop_corpus.is_dir():
        parser.error(f"--loop-corpus={args.loop_corpus} is not a directory")
    if args.corpus_dir is not None and not args.corpus_dir.is_dir():
        parser.error(f"--corpus-dir={args.corpus_dir} is not a directory")
    if len(args.langs.split(",")) != 2:
        parser.error(f"--langs={args.langs} must be two languages, e.g. en,de")
    for lang in args.langs.split(",") if args.corpus_dir is not None else []:
        if not any((args.corpus_dir / f"train.{lang}{gz}").is_file() for gz in ("", ".gz")):
            parser.error(f"--corpus-dir={args.corpus_dir} has no train.{lang} (or train.{lang}.gz)")


def describe(args: argparse.Namespace, setup: Setup, cfg: ModelConfig) -> dict[str, Any]:
    cuda, cpu = setup.device.type == "cuda", cpu_features()
    return {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(setup.device) if cuda else cpu.name,
        "cpu": {
            "name": cpu.name,
            "isa": cpu.isa,
            "capability": cpu.capability,
            "bf16": cpu.bf16,
            "amx": cpu.amx,
        },
        "cpu_kernels": Kernels.choose(setup.device).describe(),
        "torch": torch.__version__,
        "size": args.size,
        "model": {k: getattr(cfg, k) for k in ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers")},
        "precision": "bf16 autocast, fused Adam, TF32" if cuda else "fp32",
        "threads": args.threads if not cuda else torch.get_num_threads(),
        "steps": args.steps,
        "compile": args.compile,
        "argv": sys.argv[1:],
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.summarize is not None:  # a saved run's goals, as this version of the harness states them
        report = json.loads(args.summarize.read_text())
        report["targets"] = targets(report)
        print_summary(report)
        return report
    start = time.perf_counter()
    setup = make_setup(args.device, args.threads)
    cfg = SIZES[args.size]
    notes: list[str] = []
    peers = available_peers(args, notes)
    register_cpu_flops()
    report: dict[str, Any] = {"meta": describe(args, setup, cfg), "notes": notes}
    print_header(report["meta"])

    def keep(figures: dict[str, Any] | None = None) -> None:
        """Add figures to the report and write it: a killed run keeps what it measured."""
        report.update(figures or {})
        if args.json is not None:
            write_json(args.json, report)

    keep()
    sections = {
        "train": lambda: section_train(args, cfg, setup, peers, notes, lambda train: keep({"train": train})),
        "decode": lambda: section_decode(args, cfg, setup, peers, notes),
        "data": lambda: section_data(args),
        "loop": lambda: section_loop(args, cfg, lambda loop: keep({"loop": loop})),
    }
    failed = []
    for name in args.sections:  # each printed and written as it ends: a kill keeps what was measured
        try:
            report[name] = sections[name]()
            print_section(name, report)
        except Exception as error:  # the other sections' figures are still reported; the run fails at the end
            notes.append(f"section {name} failed: {type(error).__name__}: {error}")
            failed.append(name)
        release_free_memory(setup.device)
        keep()
    if "train" in report and not args.big:
        notes.append("big model not measured (--big): its speed is the base speed scaled by counted FLOPs")
    report["targets"] = targets(report)
    report["meta"]["seconds"] = time.perf_counter() - start
    report["meta"]["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print_summary(report)
    if args.json is not None:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    if failed:
        raise SystemExit(f"benchmark: section(s) {', '.join(failed)} failed (see the notes above)")
    return report


if __name__ == "__main__":
    main()
