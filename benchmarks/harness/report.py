"""The report: tables of every section, the project's goals on the device (met or not), the JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.decode import ours_for
from harness.measure import PAD_MULTIPLE, ratio_spread
from harness.train import fastest_mode
from transformer.utils import atomic

Column = tuple[str, str, str]  # header, key, format spec


def print_table(title: str, columns: list[Column], rows: list[dict[str, Any]]) -> None:
    cells = [[h for h, _, _ in columns]]
    for row in rows:
        cells.append(["n/a" if row.get(key) is None else format(row[key], spec) for _, key, spec in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    print(f"\n{title}")
    for n, line in enumerate(cells):
        justified = (c.ljust(w) if col[2] == "" else c.rjust(w) for c, w, col in zip(line, widths, columns))
        print("  ".join(justified))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def print_train(train: dict[str, Any], meta: dict[str, Any]) -> None:
    shape = train["shape"]
    print_table(
        f"train: one step at {shape['batch']} x {shape['length']} tokens ({shape['target_tokens']} target "
        f"tokens), {meta['size']} dims, {meta['precision']}; median of {meta['steps']} interleaved steps; "
        f"peak {train['peak_tflops']:.2f} TFLOP/s (best of {train['peak_how']}, measured in this run)",
        [
            ("model", "model", ""),
            ("mode", "mode", ""),
            ("params M", "params_m", ".1f"),
            ("tokens/s", "tokens_per_s", ",.0f"),
            ("ms/step", "ms_per_step", ".1f"),
            ("GFLOP/step", "gflop_per_step", ".1f"),
            ("MFU", "mfu", ".1%"),
            ("step peak MiB", "step_peak_mib", ".0f"),
            ("+ weights, Adam", "peak_total_mib", ".0f"),
            ("1st step s", "first_step_s", ".1f"),
            ("ours/this", "ours_over_this", ".2f"),
            ("rounds' range", "range", ""),
        ],
        with_range(train["fixed"]),
    )
    sampled = train["sampled"]
    pad = sampled["padding_fraction"]
    print_table(
        f"train on {sampled['batches']} TokenBudgetBatchSampler batches (budget {sampled['budget_tokens']}, "
        f"{sampled['sentences_per_batch']:.0f} sentences, "
        f"{sampled['real_tgt_tokens_per_batch']:.0f} real target tokens per batch; "
        f"padding src {pad['src']:.1%}, tgt {pad['tgt']:.1%}), eager",
        [
            ("model", "model", ""),
            ("mode", "mode", ""),
            ("real tokens/s", "tokens_per_s", ",.0f"),
            ("ours/this", "ours_over_this", ".2f"),
        ],
        sampled["rows"],
    )
    print_table(
        f"the paper's budgets at our speed (25k target tokens per step; FLOPs per step big / "
        f"{meta['size']}: {train['big_over_measured_flops_per_step']:.2f}, counted)",
        [
            ("budget", "budget", ""),
            ("dims", "dims", ""),
            ("basis", "basis", ""),
            ("tokens/s", "tokens_per_s", ",.0f"),
            ("hours", "hours", ",.1f"),
            ("paper h (8 P100)", "paper_hours_8xP100", ".0f"),
        ],
        train["projections"],
    )


def with_range(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with their ours/this range over the rounds as the tables print it: "0.98-1.12"."""
    spread = ((r, r.get("ours_over_this_range") or [None, None]) for r in rows)
    return [{**r, "range": "n/a" if lo is None else f"{lo:.2f}-{hi:.2f}"} for r, (lo, hi) in spread]


def print_decode(decode: dict[str, Any]) -> None:
    for mode in decode.values():
        print_table(
            f"decode: beam {mode['beam']}{' (greedy)' * (mode['beam'] == 1)}, "
            f"{mode['sentences']} sentences x {mode['src_len']} source "
            f"tokens -> {mode['new_tokens']} output tokens each",
            [
                ("decoder", "decoder", ""),
                ("tokens/s", "tokens_per_s", ",.0f"),
                ("sentences/s", "sentences_per_s", ",.1f"),
                ("s/run", "seconds", ".2f"),
                ("ours/this", "ours_over_this", ".2f"),
                ("rounds' range", "range", ""),
            ],
            with_range(mode["rows"]),
        )


def print_data(data: dict[str, Any]) -> None:
    pad, one = data["padding_fraction"], data["padding_fraction_multiple_1"]
    print(
        f"\ndata: TokenBudgetBatchSampler on {data['pairs']:,} WMT-like pairs at {data['budget_tokens']:,} "
        f"tokens: construct {data['construct_s']:.2f} s, epoch_batches {data['epoch_batches_s']:.2f} s; "
        f"{data['batches']:,} batches of {data['sentences_per_batch']:.0f} sentences; "
        f"padding src {pad['src']:.1%}, tgt {pad['tgt']:.1%}; budget used {pad['budget_use']:.1%} "
        f"(lengths padded to multiples of {PAD_MULTIPLE}; to multiples of 1: padding src {one['src']:.1%}, "
        f"tgt {one['tgt']:.1%}, budget used {one['budget_use']:.1%})"
    )
    print_buckets(data["buckets"], f"{data['pairs']:,} WMT-like pairs")
    if "prepare" in data:
        p = data["prepare"]
        print(
            f"data: prepare() on {p['corpus_dir']}: {p['pairs_read']:,} pairs ({p['pairs_kept']:,} kept), "
            f"BPE {p['vocab_size']:,}: {p['seconds']:.1f} s = {p['pairs_per_s']:,.0f} pairs/s"
        )
        r = p["batch_reading"]
        print(
            f"data: reading a training batch of the prepared corpus (ShardDataset.batch, budget "
            f"{data['budget_tokens']:,} tokens, {r['sentences_per_batch']:.0f} sentences, first "
            f"{r['batches']} batches): {r['ms_per_batch']:.2f} ms"
        )
        print_buckets(p["buckets"], f"the prepared {p['corpus_dir']} ({p['pairs_kept']:,} pairs)")


def print_buckets(rows: list[dict[str, Any]], what: str) -> None:
    """Length buckets against none: one epoch's batch shapes, padding and real target tokens per step."""
    shown = [{**r, "lengths": " ".join(map(str, r["buckets"] or [])) or "-"} for r in rows]
    print_table(
        f"data: length buckets (trainer.length_buckets; 0: off) on {what}, one epoch at the default "
        f"batch budget, lengths padded to multiples of {PAD_MULTIPLE}",
        [
            ("length_buckets", "length_buckets", "d"),
            ("lengths", "lengths", ""),
            ("batches", "batches", ",d"),
            ("shapes", "shapes", ",d"),
            ("padding src", "padding_src", ".1%"),
            ("padding tgt", "padding_tgt", ".1%"),
            ("real tgt tokens/step", "real_tgt_tokens_per_step", ",.0f"),
        ],
        shown,
    )


# The goals of each device, (CPU, CUDA), and on a CPU of each instruction set (CPU_GOALS)
TRAIN_GOAL = (1.3, 2.0)  # ours / torch.nn.Transformer (CUDA: compiled), training step tokens/s
MEMORY_GOAL_GIB = 10.0  # CUDA: ours' peak (weights and Adam included) at the fixed ~25k-token shape
# beam 4, ours / peer (CPU, CUDA); int8 peers against ours int8
DECODE_GOALS = {"CTranslate2 int8": (1.2, None), "CTranslate2": (1.2, 1.0), "HF generate": (2.0, 5.0)}
# a CPU without AVX-512 (AVX2, ARM): never slower than torch.nn.Transformer; per decoding mode, ours / peer
CPU_GOALS = {
    "train": 1.0,
    "beam4": {"CTranslate2 int8": 1.2, "CTranslate2": 1.0, "HF generate": 2.0},
    "greedy": {"CTranslate2 int8": 1.1, "CTranslate2": 1.1},
}
AVX512 = ("AVX-512", "AVX512-BF16", "AMX")


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The project's speed and memory goals on this run's device: ratios ours / peer, and on CUDA the
    peak memory of a training step."""
    cuda = report["meta"]["device"] == "cuda"
    wide = cuda or report["meta"].get("cpu", {}).get("isa") in AVX512  # the goals of AVX-512 CPUs
    found = []
    fixed = report["train"]["fixed"] if "train" in report else []
    ours = fastest_mode(fixed, "ours") if fixed else None
    if any(r["model"] == "nn.Transformer" for r in fixed):  # each in its fastest mode, as a user runs it
        peer = fastest_mode(fixed, "nn.Transformer")
        peer_compiled = [r for r in fixed if r["model"] == "nn.Transformer" and r["mode"] == "compiled"]
        if cuda and peer_compiled:  # the GPU goal is stated against the compiled peer
            peer = peer_compiled[0]
        goal = f"train step, ours ({ours['mode']}) vs nn.Transformer ({peer['mode']})"
        target = TRAIN_GOAL[cuda] if wide else CPU_GOALS["train"]
        found.append(_goal(goal, ours, peer, "step_times_s", target))
    if cuda and ours is not None and ours["peak_total_mib"] is not None:
        tokens = report["train"]["shape"]["target_tokens"]
        gib = ours["peak_total_mib"] / 1024
        goal = f"train step peak memory, ours ({ours['mode']}), {tokens:,} target tokens"
        found.append({"goal": goal, "gib": gib, "target": MEMORY_GOAL_GIB, "met": gib <= MEMORY_GOAL_GIB})
    if "decode" in report:
        for mode, decode in report["decode"].items():
            found += _decode_goals(mode, decode["rows"], cuda, wide)
    return found


def _decode_goals(mode: str, rows: list[dict[str, Any]], cuda: bool, wide: bool) -> list[dict[str, Any]]:
    """The goals of one decoding mode (beam 4, or greedy on a CPU without AVX-512), each against
    CTranslate2 with its bound: the peer's time over that of ours' products alone, round by round."""
    if wide:
        goals = {k: v[cuda] for k, v in DECODE_GOALS.items()} if mode == "beam4" else {}
    else:
        goals = CPU_GOALS.get(mode, {})
    found, what = [], "beam 4" if mode == "beam4" else "greedy"
    for r in rows:
        name = r["decoder"]
        goal = next((g for prefix, g in goals.items() if name.startswith(prefix)), None)
        ours = ours_for(rows, name)
        if goal is None or name == "CTranslate2 int8_float32" or ours is None:
            continue
        found.append(_goal(f"{what}, {ours['decoder']} vs {name}", ours, r, "run_times_s", goal))
        bound = next((b for b in rows if b["decoder"] == f"{ours['decoder']}, products only"), None)
        if bound is not None and name.startswith("CTranslate2"):
            found[-1]["bound"] = _goal("", bound, r, "run_times_s", goal)["ratio"]
    return found


def _goal(goal: str, ours: dict[str, Any], peer: dict[str, Any], times: str, target: float) -> dict[str, Any]:
    """A speed goal, ours / peer: the median of the rounds' ratios and their range where both rows have
    each round's time (a saved report may not), else the ratio of the speeds; met only where that
    median (or ratio) meets the target."""
    if times in ours and times in peer:
        ratio, lo, hi = ratio_spread(ours[times], peer[times])
        spread = {"range": [lo, hi], "rounds": len(ours[times])}
    else:
        ratio, spread = ours["tokens_per_s"] / peer["tokens_per_s"], {"range": None, "rounds": None}
    return {"goal": goal, "ratio": ratio, **spread, "target": target, "met": ratio >= target}


def print_header(meta: dict[str, Any]) -> None:
    cpu = meta["cpu"]  # the host CPU; on a CPU run, the kernels chosen for it
    isa = f"{cpu['name']}, {cpu['isa']} (torch capability {cpu['capability']})"
    where = f"cpu: {isa}, training's CPU kernels: {meta['cpu_kernels']}"
    if meta["device"] != "cpu":
        where = f"{meta['device']}: {meta['device_name']}, host CPU {isa}"
    print(f"== benchmark: {where}; torch {meta['torch']}, {meta['size']} dims, {meta['threads']} threads ==")


def print_section(name: str, report: dict[str, Any]) -> None:
    """A section's tables, printed as soon as it has finished."""
    if name == "train":
        print_train(report["train"], report["meta"])
    elif name == "decode":
        print_decode(report["decode"])
    elif name == "loop":
        print_loop(report["loop"])
    else:
        print_data(report["data"])


def print_loop(loop: dict[str, Any]) -> None:
    shown = [{**r, "buckets": len(r["buckets"]) if r.get("buckets") else 0} for r in loop["rows"]]
    print_table(
        f"loop: train.py from process start on {loop['corpus']} ({loop['pairs']:,} pairs, vocabulary "
        f"{loop['vocab_size']:,}): target tokens/s over the first {loop['first_steps']} steps and the "
        f"{loop['steady_steps']} steady steps after them; peers on the same batches from their loop's start",
        [
            ("run", "run", ""),
            ("first steps tok/s", "first_tokens_per_s", ",.0f"),
            ("steady tok/s", "steady_tokens_per_s", ",.0f"),
            ("s to step 1", "first_step_s", ".1f"),
            ("recompiles", "recompiles", "d"),
            ("buckets", "buckets", "d"),
            ("real tgt tokens/step", "tokens_per_step", ",.0f"),
            ("GPU busy", "gpu_busy", ".0%"),
            ("peak GiB", "peak_gib", ".1f"),
            ("steady / peer-compiled", "over_peer_compiled", ".2f"),
        ],
        shown,
    )


def print_summary(report: dict[str, Any]) -> None:
    """The run's time and load, the goals of the device, the notes."""
    meta = report["meta"]
    if "seconds" in meta:
        load = meta.get("load_average_at_end")
        load = "n/a" if load is None else f"{load[0]:.1f}"
        print(f"\n== {meta['seconds']:.0f} s in all; load average {load} at the end ==")
    if report["targets"]:
        print("\ntargets on this device (ours / peer, and peak memory on CUDA):")
        for t in report["targets"]:
            verdict = "met" if t["met"] else "NOT met"
            if "gib" in t:
                print(f"  {t['goal']}: {t['gib']:.1f} GiB (target <= {t['target']:g} GiB: {verdict})")
            else:
                bound = f"; its products alone {t['bound']:.2f}x" if "bound" in t else ""
                rounds = ""
                if t.get("range"):
                    lo, hi = t["range"]
                    rounds = f"median of {t['rounds']} rounds, {lo:.2f}-{hi:.2f}; "
                target = f"target >= {t['target']}x: {verdict}{bound}"
                print(f"  {t['goal']}: {t['ratio']:.2f}x ({rounds}{target})")
    for note in report.get("notes", []):
        print(f"note: {note}")


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Atomically: a kill while writing never leaves half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(path, (json.dumps(report, indent=2) + "\n").encode("utf-8"))
