"""How the benchmark measures: timing with the device's queued work, models interleaved round by round,
a matmul peak, FLOPs counted by torch.utils.flop_counter, peak memory (CUDA allocator or sampled RSS)."""

from __future__ import annotations

import ctypes
import gc
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils import flop_counter
from tqdm import tqdm

from transformer.kernels import Kernels, Products

FIRST_TOKEN = 4  # random ids start above the special ids (pad, unk, bos, eos)
PAD_MULTIPLE = 8  # as trainer.pad_to_multiple
KERNELS_OFF = "ours (kernels off)"  # plain PyTorch, cpu_kernels=off
KERNELS_ON = "ours (kernels on)"  # every CPU kernel, cpu_kernels=on


@dataclass
class Setup:
    """Where and how every model runs."""

    device: torch.device
    autocast: Callable[[], Any]
    label_smoothing: float = 0.1  # §5.4


def make_setup(device_name: str, threads: int) -> Setup:
    """bf16 autocast and TF32 on CUDA; fp32 on `threads` threads on the CPU."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return Setup(device, lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    torch.set_num_threads(threads)
    return Setup(device, nullcontext)


def side_kernels(device: torch.device, chosen: Kernels | None = None) -> dict[str, Kernels]:
    """Ours beside itself on a CPU: with the kernels off, and with all of them on where the machine
    chooses fewer (`chosen`; default: training's choice by the instruction set), so that one run shows
    whether the choice wins there."""
    if device.type != "cpu":
        return {}
    side = {KERNELS_OFF: Kernels()}
    every = Kernels.choose(device, "on")
    chosen = Kernels.choose(device) if chosen is None else chosen
    if (chosen.record(), chosen.packed) != (every.record(), every.packed):
        side[KERNELS_ON] = every
    return side


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """(seconds, result) of fn(), with the device's queued work included."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def interleave(
    runs: dict[str, Callable[[int], Any]], rounds: int, device: torch.device, desc: str, time_box: float = 0.0
) -> dict[str, list[tuple[float, Any]]]:
    """Run each fn(round) once per round, in a rotating order, so that load from other processes
    falls on every contender alike: `rounds` rounds, and more while `time_box` seconds from the first
    have not passed; returns (seconds, result) per run."""
    names = list(runs)
    results: dict[str, list[tuple[float, Any]]] = {name: [] for name in names}
    start, i = time.perf_counter(), 0
    with tqdm(desc=desc, unit="round", leave=False, total=rounds) as bar:
        while i < rounds or time.perf_counter() - start < time_box:
            for name in names[i % len(names) :] + names[: i % len(names)]:
                results[name].append(timed(partial(runs[name], i), device))
            i += 1
            bar.update(1)
    return results


def ratio_spread(ours: list[float], this: list[float]) -> tuple[float, float, float]:
    """Ours' speed over this one's round by round (this round's seconds over ours'): their median, the
    lowest and the highest."""
    ratios = [t / o for o, t in zip(ours, this)]
    return statistics.median(ratios), min(ratios), max(ratios)


def matmul_peak(device: torch.device) -> tuple[float, str]:
    """Measured matmul FLOP/s: the best of a few large square matmuls (bf16 on CUDA, fp32 on the CPU,
    where torch's MKL matmul and the oneDNN linear of transformer/kernels/onednn.py are both timed)."""
    dtype, n, repeat = (torch.bfloat16, 8192, 20) if device.type == "cuda" else (torch.float32, 1536, 2)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    gemms = {"matmul": lambda: a @ b}
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        onednn = Products(onednn=True)  # what transformer/kernels/onednn.py runs on the CPU
        gemms["oneDNN linear"] = lambda: onednn(a, b)
    rates = {}
    for name, gemm in gemms.items():
        seconds = min(timed(lambda gemm=gemm: [gemm() for _ in range(repeat)], device)[0] for _ in range(6))
        rates[name] = 2 * n**3 * repeat / seconds
    each = ", ".join(f"{name} {rate / 1e12:.2f}" for name, rate in rates.items())
    return max(rates.values()), f"{str(dtype).removeprefix('torch.')} {n}x{n}: {each} TFLOP/s"


def _linear_flops(x_shape: Any, w_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """oneDNN linear: x (..., K) @ w (N, K)^T, 2 FLOPs per multiply-add."""
    return 2 * math.prod(x_shape) * w_shape[0]


def register_cpu_flops() -> None:
    """torch's FLOP counter knows the CUDA attention kernels and the BLAS ops only; count the CPU flash
    attention kernel and the oneDNN linear of transformer/kernels/onednn.py alike."""
    aten = torch.ops.aten

    def register(op: Any, formula: Callable[..., int], get_raw: bool) -> None:
        if op not in flop_counter.flop_registry and op.default not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op, get_raw=get_raw)(formula)  # once per process

    if torch.backends.mkldnn.is_available():
        register(torch.ops.mkldnn._linear_pointwise, _linear_flops, get_raw=False)
    forward = aten._scaled_dot_product_flash_attention_for_cpu
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward
    register(forward, flop_counter.sdpa_flop, get_raw=True)
    register(backward, flop_counter.sdpa_backward_flop, get_raw=True)


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of the matmuls and attention kernels fn() dispatches (torch.utils.flop_counter)."""
    with flop_counter.FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def release_free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif platform.system() == "Linux":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed heap pages, so RSS deltas mean something
        except OSError:
            pass


@contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, float | None]]:
    """{'mib': peak memory of the block above what was allocated before it}: the CUDA allocator's
    peak, or on the CPU the resident set sampled every millisecond (None where /proc is missing)."""
    result: dict[str, float | None] = {"mib": None}
    release_free_memory(device)
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield result
        sync(device)
        result["mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        return
    base = _rss_bytes()
    if base is None:
        yield result
        return
    peak, done = [base], threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], _rss_bytes() or 0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        done.set()
        sampler.join()
    result["mib"] = (max(peak[0], _rss_bytes() or 0) - base) / 2**20
