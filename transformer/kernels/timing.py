"""Decoding's CPU kernels chosen by timing them where they run (`cpu_kernels=auto` for translate.py,
evaluate.py, serve.py, `Translator` and training's valid BLEU; docs/performance.md, "Which kernel
where"). Which of oneDNN's products, packed products and the written-out short attention beats plain
PyTorch depends on the microarchitecture, the shapes and the mode, not on the instruction set alone, so
each is timed against plain PyTorch on the model's own shapes: its rounds interleaved with plain's
within a fixed budget (BUDGET seconds, at least ROUNDS rounds), and taken only where it wins: faster by
MARGIN on the medians, and faster in every round but at most one in five (a round the machine disturbed
does not decide); a tie keeps plain PyTorch. The decision is kept in a file (its key:
the CPU, torch, the threads, the model's dimensions, the precision, the rows), written atomically; an
unreadable file is ignored with a warning. Training keeps the rule of `Kernels.choose`: a timed choice
could change a run's random stream (noise dropout) or its rounding from one start to the next.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from transformer.attention import attention, reference_attention
from transformer.config import ModelConfig
from transformer.kernels import Kernels
from transformer.kernels.onednn import Products
from transformer.utils import atomic
from transformer.utils.devices import cpu_features

log = logging.getLogger(__name__)

BUDGET = 0.5  # seconds of timing per candidate, its rounds and plain PyTorch's together
ROUNDS = 5  # rounds per candidate at least, whatever the budget
MARGIN = 0.03  # a candidate's median faster than plain's by less is a tie
KEYS = 32  # positions of the self-attention cache and of the source when attention is timed
# a candidate and its work: (label, work) -> the seconds it took; the default runs it on the clock
Timer = Callable[[str, Callable[[], object]], float]


@dataclass
class Timed:
    """A candidate against plain PyTorch: the medians of their rounds (seconds), and in how many of the
    rounds the candidate was the faster."""

    plain: float
    candidate: float
    faster: int
    rounds: int

    @property
    def wins(self) -> bool:
        return self.candidate <= (1 - MARGIN) * self.plain and self.faster >= self.rounds - self.rounds // 5

    def describe(self) -> str:
        return (
            f"{self.candidate * 1e3:.2f} ms against {self.plain * 1e3:.2f} ms, "
            f"faster in {self.faster} of {self.rounds} rounds"
        )


def cache_file() -> Path:
    """Where decisions are kept: $XDG_CACHE_HOME/transformer/cpu_kernels.json (default ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "transformer" / "cpu_kernels.json"


def decoding_kernels(
    cfg: ModelConfig,
    device: torch.device,
    setting: str,
    int8: bool,
    rows: int,
    encoder_rows: int,
    timer: Timer | None = None,
    cache: Path | None = None,
) -> Kernels:
    """The kernels of decoding a model of `cfg` in `rows` hypotheses at a time, the encoder over
    `encoder_rows` source tokens: timed with `setting` "auto" on a CPU (or taken from the cache), else
    `Kernels.choose`'s (none off a CPU, all with "on", none with "off"). `int8`: the linear maps multiply
    in 8 bits whatever the choice (only attention is timed)."""
    if device.type != "cpu" or setting != "auto":
        return Kernels.choose(device, setting, int8=int8)
    cache = cache_file() if cache is None else cache
    key = _key(cfg, int8, rows, encoder_rows)
    decisions = _read(cache)
    if key in decisions:
        chosen = decisions[key]["kernels"]
        log.info("CPU kernels for decoding: %s (timed before on this machine)", _describe(chosen))
        return Kernels(int8=int8, **chosen)
    timed = _time_all(cfg, int8, rows, encoder_rows, timer or _clock)
    chosen = {name: t.wins for name, t in timed.items()}
    for name in ("onednn", "packed"):
        chosen.setdefault(name, False)
    decisions[key] = {"kernels": chosen, "timings": {name: asdict(t) for name, t in timed.items()}}
    _write(cache, decisions)
    details = "; ".join(f"{name} {t.describe()}" for name, t in timed.items())
    log.info("CPU kernels for decoding: %s (timed now: %s)", _describe(chosen), details)
    return Kernels(int8=int8, **chosen)


def _time_all(cfg: ModelConfig, int8: bool, rows: int, encoder_rows: int, timer: Timer) -> dict[str, Timed]:
    """Each candidate against plain PyTorch on random weights and inputs of the model's shapes (drawn from
    a generator of their own: the global random state, a training run's, is left as it was)."""
    random = torch.Generator().manual_seed(0)
    d, layers = cfg.d_model, cfg.n_layers
    attention_width = cfg.n_heads * cfg.d_k
    decoder = [(3 * attention_width, d), (d, attention_width), (attention_width, d), (d, attention_width)]
    decoder += [(cfg.d_ff, d), (d, cfg.d_ff)]  # W^QKV, W^O, cross W^Q, W^O, W_1, W_2: (out, in)
    timed = {}
    if not int8:
        vocab = [(min(cfg.vocab_size, 8192), d)] * max(1, math.ceil(cfg.vocab_size / 8192))
        timed["packed"] = _products(decoder * layers + vocab, rows, "packed", timer, random)
        # the encoder's maps and the decoder's keys and values of the source, once per batch
        kv_width = cfg.n_kv_heads * (cfg.d_k + cfg.d_v)
        encoder = [
            (3 * attention_width, d),
            (d, attention_width),
            (cfg.d_ff, d),
            (d, cfg.d_ff),
            (kv_width, d),
        ]
        timed["onednn"] = _products(encoder, encoder_rows, "onednn", timer, random)  # one layer's
    with torch.inference_mode():
        timed["short_attention"] = _attention(cfg, rows, timer, random)
    return timed


def _products(
    shapes: list[tuple[int, int]], rows: int, name: str, timer: Timer, random: torch.Generator
) -> Timed:
    """Plain F.linear against oneDNN (`name` "onednn") or oneDNN with packed weights ("packed") over
    one pass of the linear maps of `shapes` (out, in) at `rows` rows."""
    weights = [torch.randn(out, n_in, generator=random) / math.sqrt(n_in) for out, n_in in shapes]
    inputs = {n_in: torch.randn(rows, n_in, generator=random) for _, n_in in shapes}
    products = Products(onednn=name == "onednn", packed=name == "packed")
    with products.prepacked(weights), torch.inference_mode():

        def plain() -> None:
            for w in weights:
                F.linear(inputs[w.size(1)], w)

        def candidate() -> None:
            for w in weights:
                products(inputs[w.size(1)], w)

        return _rounds(name, plain, candidate, timer)


def _attention(cfg: ModelConfig, rows: int, timer: Timer, random: torch.Generator) -> Timed:
    """The fused kernel against attention written out, over one decoding step's self- and cross-attention
    in every layer: one query per row over KEYS positions."""
    heads, kv = cfg.n_heads, cfg.n_kv_heads
    q = torch.randn(rows, heads, 1, cfg.d_k, generator=random)
    k = torch.randn(rows, kv, KEYS, cfg.d_k, generator=random)
    v = torch.randn(rows, kv, KEYS, cfg.d_v, generator=random)
    mask = torch.ones(rows, 1, 1, KEYS, dtype=torch.bool)

    def fused() -> None:
        for _ in range(2 * cfg.n_layers):
            attention(q, k, v, mask, False, 0.0)

    def written_out() -> None:
        for _ in range(2 * cfg.n_layers):
            reference_attention(q, k, v, mask, False, 0.0)

    return _rounds("short_attention", fused, written_out, timer)


def _rounds(name: str, plain: Callable[[], None], candidate: Callable[[], None], timer: Timer) -> Timed:
    """Plain and candidate in turn, once untimed, then timed in rounds until BUDGET seconds and at
    least ROUNDS rounds."""
    plain(), candidate()
    times: dict[str, list[float]] = {"plain": [], "candidate": []}
    spent = 0.0
    while spent < BUDGET or len(times["plain"]) < ROUNDS:
        for label, work in (("plain", plain), ("candidate", candidate)):
            times[label].append(timer(f"{name}/{label}", work))
            spent += times[label][-1]
    plain_times, ours = times["plain"], times["candidate"]
    faster = sum(mine < theirs for mine, theirs in zip(ours, plain_times))
    return Timed(statistics.median(plain_times), statistics.median(ours), faster, len(ours))


def _clock(_label: str, work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _key(cfg: ModelConfig, int8: bool, rows: int, encoder_rows: int) -> str:
    """What a decision depends on: the CPU (its model and flags), torch, the threads, the model's
    dimensions, the precision, the rows."""
    cpu = cpu_features()
    flags = ""
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    dims = (
        f"d{cfg.d_model} h{cfg.n_heads}/{cfg.n_kv_heads} k{cfg.d_k} v{cfg.d_v} ff{cfg.d_ff} n{cfg.n_layers}"
    )
    return " | ".join(
        [
            f"{cpu.name} {cpu.capability} {hashlib.sha1(flags.encode()).hexdigest()[:12]}",
            f"torch {torch.__version__}",
            f"threads {torch.get_num_threads()}",
            f"{dims} V{cfg.vocab_size}",
            "int8" if int8 else "fp32",
            f"rows {rows}/{encoder_rows}",
        ]
    )


def _read(path: Path) -> dict[str, dict]:
    """The kept decisions; none (with a warning) where the file cannot be read as such."""
    if not path.is_file():
        return {}
    try:
        decisions = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(decisions, dict) or not all(
            isinstance(d, dict) and isinstance(d.get("kernels"), dict) for d in decisions.values()
        ):
            raise ValueError("not a mapping of decisions")
        return decisions
    except (OSError, UnicodeDecodeError, ValueError) as error:
        log.warning("ignoring the CPU kernels' decisions in %s (%s): timing them again", path, error)
        return {}


def _write(path: Path, decisions: dict[str, dict]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(path, (json.dumps(decisions, indent=1) + "\n").encode("utf-8"))
    except OSError as error:  # a read-only home: the choice holds for this process only
        log.warning("could not keep the CPU kernels' decision in %s: %s", path, error)


def _describe(chosen: dict[str, bool]) -> str:
    names = {
        "onednn": "oneDNN products",
        "packed": "packed oneDNN products",
        "short_attention": "short attention",
    }
    on = [names[name] for name, used in chosen.items() if used]
    return ", ".join(on) if on else "plain PyTorch"
