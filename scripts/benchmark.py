"""Speed of the project against peer implementations, side by side in one run, with ratios.

    python scripts/benchmark.py --device cuda --size base --json bench.json
    python scripts/benchmark.py --device cpu --size base --threads 2          # small CPU batches
    python scripts/benchmark.py --device cpu --size tiny --sections data      # seconds

Sections (`--sections train,decode,data`):

train   One optimizer step (forward + backward + Adam, label-smoothed cross-entropy eps_ls = 0.1, §5.3-5.4)
        at a fixed shape (`--batch` sentences x `--length` source and target tokens) for
          ours            the project's Transformer with its own objective (Seq2SeqLoss),
          nn.Transformer  torch.nn.Transformer + one shared embedding (x sqrt(d_model)), sinusoidal
                          positions and the tied output projection (§3.4-3.5),
          Marian (HF)     Hugging Face MarianMTModel built from a MarianConfig of the same dims (sdpa),
        each eager and under torch.compile (ours with dynamic shapes, as training compiles it; the peers with
        static shapes; `--no-compile` skips compiling). Reported: target tokens/s (median of `--steps` steps,
        the models interleaved step by step so a busy machine slows all alike), FLOPs counted by
        torch.utils.flop_counter on one eager step, model FLOP utilisation against a matmul peak measured in
        this run (bf16 on CUDA, fp32 on the CPU), the step's peak memory above the resident weights and Adam
        state (CUDA allocator; sampled RSS on the CPU) and with them, and ours / peer. Then the eager models
        on batches built by the project's TokenBudgetBatchSampler from WMT-like lengths (`--budget-tokens`):
        real (non-pad) target tokens/s and the padding, and the wall time the paper's budgets (base: 100k
        steps, big: 300k steps, x 25k target tokens) would take at the measured speed. The big model is
        measured with `--big`, else its speed is the base speed scaled by the FLOPs counted for both.
decode  Random weights, `--src-len` source tokens, exactly `--new-tokens` output tokens (EOS suppressed
        until then): beam 4 over `--beam-sentences` and greedy over `--greedy-sentences` for ours
        (beam_search / greedy_search with min_len; on a CPU the weights packed for oneDNN once for all
        runs, as translate.py packs them once for all batches; on CUDA also static_beam_search with
        each step a CUDA graph replay, as translate.py cuda_graphs=true), Hugging Face `generate` and
        CTranslate2 (the same Marian model converted; fp32 on the CPU, `--ct2-compute` on CUDA): output
        tokens/s, sentences/s. The goals compare the fastest of ours with each peer.
data    TokenBudgetBatchSampler on `--data-pairs` synthetic WMT-like lengths at `--data-budget` tokens:
        build time and padding; with `--corpus-dir` (files train.<src>, train.<tgt>, maybe .gz) also the
        throughput of transformer.data.prepare.prepare (BPE learning + binarization), in pairs/s, and
        the host time of reading one training batch of the prepared shards (ShardDataset.batch).

Every model trains with fused Adam, as the training loop does. CUDA runs use bf16 autocast and TF32;
decoding runs the models in bf16 (as translate.py does) and CTranslate2 in `--ct2-compute`. CPU runs
are fp32 on `--threads` threads. A step here is what the model, loss and optimizer cost; the training
loop adds a gradient norm and three scalar reads per step. The matmul peak is torch's own (on the CPU
the better of its two fp32 GEMMs, MKL and oneDNN; the project's linear layers use oneDNN there, see
transformer/linear.py), so MFU is relative to what torch reaches on this machine, not to the hardware.
Peers that are not installed (`pip install transformer[bench]`) are skipped with a note; a section
that fails is noted, the others are still reported (and written), and the run then exits with an
error. The report ends with the project's goals for the device (TRAIN_GOAL, MEMORY_GOAL_GIB,
DECODE_GOALS), met or not. `--json` writes every figure. Sizes: tiny (smoke tests), base (the paper's
base model: N=6, d_model=512, h=8, d_ff=2048, vocab 37000); the big model is d_model=1024, h=16,
d_ff=4096.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import flop_counter
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also runs from a checkout not pip-installed

from transformer.config import DataConfig, ModelConfig  # noqa: E402
from transformer.data.batching import Batch, TokenBudgetBatchSampler, collate  # noqa: E402
from transformer.data.dataset import ShardDataset  # noqa: E402
from transformer.data.tokenizer import EOS_ID, PAD_ID  # noqa: E402
from transformer.decoding import beam_search, greedy_search, search_weights  # noqa: E402
from transformer.layers import sinusoidal_table  # noqa: E402
from transformer.linear import linear, prepacked  # noqa: E402
from transformer.model import Transformer  # noqa: E402
from transformer.static_search import static_beam_search  # noqa: E402
from transformer.training.loss import Seq2SeqLoss  # noqa: E402

SIZES = {
    "tiny": ModelConfig(vocab_size=1000, d_model=64, n_heads=4, d_ff=256, n_layers=2),
    "base": ModelConfig(),  # §6.1, Table 3: the base model
}
BIG = ModelConfig(d_model=1024, n_heads=16, d_ff=4096, dropout=0.3)  # Table 3: big
PAPER_BUDGETS = {  # §5.2: steps x ~25k target tokens per step; time the paper took on 8 P100 GPUs
    "base": (100_000, 12.0),
    "big": (300_000, 84.0),
}
PAPER_TOKENS_PER_STEP = 25_000
LR = 1e-4  # any small constant: the schedule does not change a step's cost
FIRST_TOKEN = 4  # random ids start above the special ids (pad, unk, bos, eos)
PAD_MULTIPLE = 8  # as trainer.pad_to_multiple
# Defaults per device: (cuda, cpu)
DEFAULTS = {
    "batch": (768, 16),
    "steps": (20, 5),
    "warmup": (3, 1),
    "budget_tokens": (25_000, 1024),
    "real_batches": (20, 4),
    "beam_sentences": (128, 32),
    "greedy_sentences": (512, 64),
    "decode_rounds": (3, 3),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="train,decode,data", help="comma-separated: train, decode, data")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--size", choices=sorted(SIZES), default="base")
    p.add_argument("--json", type=Path, help="write every figure to this JSON file")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (torch and CTranslate2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", default="torch,marian,ct2", help="comma-separated: torch, marian, ct2")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled models")
    p.add_argument("--batch", type=int, help="train: sentences per fixed-shape step (cuda 768, cpu 16)")
    p.add_argument("--length", type=int, default=32, help="train: source and target tokens per sentence")
    p.add_argument("--steps", type=int, help="train: timed steps per model (cuda 20, cpu 5)")
    p.add_argument("--warmup", type=int, help="train: untimed steps first, at least 1 (cuda 3, cpu 1)")
    p.add_argument("--budget-tokens", type=int, help="train: token budget of sampled batches (25000 / 1024)")
    p.add_argument("--real-batches", type=int, help="train: sampled batches timed per model (20 / 4)")
    p.add_argument("--big", action="store_true", help="train: also measure the big model (compiled)")
    p.add_argument("--src-len", type=int, default=30, help="decode: source tokens, EOS included")
    p.add_argument("--new-tokens", type=int, default=40, help="decode: output tokens per sentence")
    p.add_argument("--beam-sentences", type=int, help="decode: sentences for beam 4 (cuda 128, cpu 32)")
    p.add_argument("--greedy-sentences", type=int, help="decode: sentences for greedy (512 / 64)")
    p.add_argument("--decode-rounds", type=int, help="decode: timed runs per decoder (3)")
    p.add_argument("--ct2-compute", default="float16", help="decode: CTranslate2 compute type on CUDA")
    p.add_argument("--data-pairs", type=int, default=4_500_000, help="data: synthetic pairs to batch")
    p.add_argument("--data-budget", type=int, default=25_000, help="data: token budget per batch")
    p.add_argument("--corpus-dir", type=Path, help="data: also time prepare() on <dir>/train.<lang>")
    p.add_argument("--langs", default="en,de", help="data: source,target language of --corpus-dir")
    p.add_argument("--prepare-vocab", type=int, default=8000, help="data: BPE vocabulary for prepare()")
    args = p.parse_args(argv)
    _resolve_defaults(args, p)
    return args


def _resolve_defaults(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Device-dependent defaults, then every check of the flags before any heavy work."""
    for name, (cuda, cpu) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, cuda if args.device == "cuda" else cpu)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.peers = [s.strip() for s in args.peers.split(",") if s.strip()]
    bad = sorted(set(args.sections) - {"train", "decode", "data"}) + sorted(
        set(args.peers) - {"torch", "marian", "ct2"}
    )
    if bad:
        parser.error(f"unknown section(s) or peer(s): {', '.join(bad)}")
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
    if args.corpus_dir is not None and not args.corpus_dir.is_dir():
        parser.error(f"--corpus-dir={args.corpus_dir} is not a directory")
    if len(args.langs.split(",")) != 2:
        parser.error(f"--langs={args.langs} must be two languages, e.g. en,de")
    for lang in args.langs.split(",") if args.corpus_dir is not None else []:
        if not any((args.corpus_dir / f"train.{lang}{gz}").is_file() for gz in ("", ".gz")):
            parser.error(f"--corpus-dir={args.corpus_dir} has no train.{lang} (or train.{lang}.gz)")


# ------------------------------------------------------------------------------------- measuring


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
    runs: dict[str, Callable[[int], Any]], rounds: int, device: torch.device, desc: str
) -> dict[str, list[tuple[float, Any]]]:
    """Run each fn(round) once per round, in a rotating order, so that load from other processes
    falls on every contender alike; returns (seconds, result) per run."""
    names = list(runs)
    results: dict[str, list[tuple[float, Any]]] = {name: [] for name in names}
    for i in tqdm(range(rounds), desc=desc, unit="round", leave=False):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            results[name].append(timed(partial(runs[name], i), device))
    return results


def matmul_peak(device: torch.device) -> tuple[float, str]:
    """Measured matmul FLOP/s: the best of a few large square matmuls (bf16 on CUDA, fp32 on the CPU,
    where torch's MKL matmul and the oneDNN linear of transformer/linear.py are both timed)."""
    dtype, n, repeat = (torch.bfloat16, 8192, 20) if device.type == "cuda" else (torch.float32, 1536, 2)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    gemms = {"matmul": lambda: a @ b}
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        gemms["oneDNN linear"] = lambda: linear(a, b)  # what transformer/linear.py runs on the CPU
    rates = {}
    for name, gemm in gemms.items():
        seconds = min(timed(lambda gemm=gemm: [gemm() for _ in range(repeat)], device)[0] for _ in range(6))
        rates[name] = 2 * n**3 * repeat / seconds
    each = ", ".join(f"{name} {rate / 1e12:.2f}" for name, rate in rates.items())
    return max(rates.values()), f"{str(dtype).removeprefix('torch.')} {n}x{n}: {each} TFLOP/s"


def _linear_flops(x_shape: Any, w_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """oneDNN linear: x (..., K) @ w (N, K)^T, 2 FLOPs per multiply-add."""
    return 2 * math.prod(x_shape) * w_shape[0]


def _register_cpu_flops() -> None:
    """torch's FLOP counter knows the CUDA attention kernels and the BLAS ops only; count the CPU flash
    attention kernel and the oneDNN linear of transformer/linear.py alike."""
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


def _release_free_memory(device: torch.device) -> None:
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
    _release_free_memory(device)
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


# ------------------------------------------------------------------------------------- the models


class OursObjective(nn.Module):
    """The project's training objective, Seq2SeqLoss; returns the summed smoothed loss only."""

    def __init__(self, cfg: ModelConfig, label_smoothing: float) -> None:
        super().__init__()
        self.objective = Seq2SeqLoss(Transformer(cfg), label_smoothing)

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        return self.objective(src, tgt_in, tgt_out)[0]


def smoothed_loss_sum(logits: Tensor, tgt_out: Tensor, label_smoothing: float) -> Tensor:
    """The peers' loss: torch's label-smoothed cross-entropy, summed over non-pad targets."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),  # (B * T, V)
        tgt_out.reshape(-1),
        ignore_index=PAD_ID,
        label_smoothing=label_smoothing,
        reduction="sum",
    )


class TorchTransformerPeer(nn.Module):
    """torch.nn.Transformer (post-LN, ReLU; it adds a final LayerNorm to each stack) with the paper's
    embeddings: one matrix for source, target and output projection (§3.4), x sqrt(d_model),
    sinusoidal positions (§3.5)."""

    def __init__(self, cfg: ModelConfig, label_smoothing: float) -> None:
        super().__init__()
        self.d_model, self.label_smoothing = cfg.d_model, label_smoothing
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)
        self.register_buffer("table", sinusoidal_table(cfg.max_positions, cfg.d_model), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.core = nn.Transformer(
            cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.n_layers, cfg.d_ff, cfg.dropout, batch_first=True
        )

    def _embed(self, tokens: Tensor) -> Tensor:
        positions = self.table[: tokens.size(1)]
        return self.dropout(self.embed(tokens) * math.sqrt(self.d_model) + positions)  # (B, T, d_model)

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        src_pad = src == PAD_ID  # (B, S), True = padding
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1), device=src.device)
        states = self.core(
            self._embed(src),
            self._embed(tgt_in),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return smoothed_loss_sum(states @ self.embed.weight.t(), tgt_out, self.label_smoothing)


def marian_config(cfg: ModelConfig) -> Any:
    """A MarianConfig of the same dims: post-LN, ReLU, sinusoidal positions, x sqrt(d_model), one shared
    embedding. Marian's own ids: eos 0, unk 1, pad (and decoder start) V - 1; it adds biases the paper's
    attention has not."""
    from transformers import MarianConfig

    v = cfg.vocab_size
    return MarianConfig(
        vocab_size=v,
        decoder_vocab_size=v,
        d_model=cfg.d_model,
        encoder_layers=cfg.n_layers,
        decoder_layers=cfg.n_layers,
        encoder_attention_heads=cfg.n_heads,
        decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        activation_function="relu",
        dropout=cfg.dropout,
        attention_dropout=0.0,
        activation_dropout=0.0,
        max_position_embeddings=cfg.max_positions,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=v - 1,
        eos_token_id=0,
        decoder_start_token_id=v - 1,
        forced_eos_token_id=None,
    )


def build_marian(cfg: ModelConfig) -> nn.Module:
    from transformers import MarianMTModel

    return MarianMTModel._from_config(marian_config(cfg), attn_implementation="sdpa")


class MarianPeer(nn.Module):
    """Hugging Face MarianMTModel (sdpa attention) with torch's label-smoothed cross-entropy."""

    def __init__(self, cfg: ModelConfig, label_smoothing: float) -> None:
        super().__init__()
        self.marian, self.label_smoothing = build_marian(cfg), label_smoothing

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        out = self.marian(
            input_ids=src, attention_mask=(src != PAD_ID).long(), decoder_input_ids=tgt_in, use_cache=False
        )
        return smoothed_loss_sum(out.logits, tgt_out, self.label_smoothing)


def available_peers(args: argparse.Namespace, notes: list[str]) -> set[str]:
    """The requested peers whose packages import; a note for each one skipped."""
    peers = set(args.peers)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally; never wait on the network
    for peer, module in (("marian", "transformers"), ("ct2", "ctranslate2")):
        if peer not in peers:
            continue
        try:
            __import__(module)
        except ImportError:
            peers.discard(peer)
            notes.append(f"{module} is not installed: {peer} skipped (pip install transformer[bench])")
    if "marian" in peers:
        import transformers

        transformers.logging.set_verbosity_error()
    return peers


# ------------------------------------------------------------------------------------- train


@dataclass
class Trainee:
    """One contender of the train section: a loss module (maybe compiled) and its Adam."""

    name: str
    mode: str  # "eager" | "compiled"
    run: nn.Module  # what a step calls: the module, or torch.compile of it
    module: nn.Module  # the eager module (FLOP counting, parameters)
    optimizer: torch.optim.Optimizer


@dataclass
class Setup:
    device: torch.device
    autocast: Callable[[], Any]
    label_smoothing: float = 0.1  # §5.4


def make_setup(args: argparse.Namespace) -> Setup:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return Setup(device, lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    torch.set_num_threads(args.threads)
    return Setup(device, nullcontext)


def build_trainees(cfg: ModelConfig, families: list[str], setup: Setup, seed: int, compile: bool) -> list:
    """Every family eager, and compiled when asked (the same weights and Adam: compile wraps the module)."""
    builders = {"ours": OursObjective, "nn.Transformer": TorchTransformerPeer, "Marian (HF)": MarianPeer}
    trainees = []
    for name in families:
        torch.manual_seed(seed)
        module = builders[name](cfg, setup.label_smoothing).to(setup.device).train()
        optimizer = torch.optim.Adam(module.parameters(), lr=LR, betas=(0.9, 0.98), eps=1e-9, fused=True)
        trainees.append(Trainee(name, "eager", module, module, optimizer))
        if compile:
            trainees.append(Trainee(name, "compiled", compiled(name, module), module, optimizer))
    return trainees


def compiled(name: str, module: nn.Module) -> nn.Module:
    """Ours as `trainer.compile=true` compiles it (dynamic shapes: one graph for every batch shape);
    the peers with static shapes, their fastest at one fixed shape."""
    return torch.compile(module, dynamic=name == "ours")


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


def first_steps(trainees: list[Trainee], batch: Batch, setup: Setup, warmup: int) -> dict[int, float]:
    """Run the untimed warm-up steps (compilation happens here); seconds of each one's first step."""
    first = {}
    for i, trainee in enumerate(tqdm(trainees, desc="train warm-up (and compile)", leave=False)):
        for step in range(warmup):
            seconds, _ = timed(partial(train_step, trainee, batch, setup), setup.device)
            if step == 0:
                first[i] = seconds
    return first


def step_costs(trainees: list[Trainee], batch: Batch, setup: Setup) -> tuple[dict[str, int], dict[int, Any]]:
    """One more step of each model, for its peak memory (activations, gradients and transients above
    the resident weights and Adam state) and, when eager, its FLOPs (a compiled model does the same
    math: it gets its eager twin's count)."""
    flops, memory = {}, {}
    for i, trainee in enumerate(trainees):
        step = partial(train_step, trainee, batch, setup)
        with peak_memory(setup.device) as used:
            if trainee.mode == "eager":
                flops[trainee.name] = count_flops(step)
            else:
                step()
        memory[i] = used["mib"]
    return flops, memory


def bench_fixed(
    trainees: list[Trainee], batch: Batch, setup: Setup, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Fixed-shape steps: tokens/s, FLOPs, memory of every model; the models interleaved."""
    first = first_steps(trainees, batch, setup, args.warmup)
    flops, memory = step_costs(trainees, batch, setup)
    runs = {i: (lambda _, t=t: train_step(t, batch, setup)) for i, t in enumerate(trainees)}
    times = interleave(runs, args.steps, setup.device, "train steps")
    resident = [resident_mib(t) for t in trainees]
    rows = []
    for i, t in enumerate(trainees):
        seconds = statistics.median(s for s, _ in times[i])
        rows.append(
            {
                "model": t.name,
                "mode": t.mode,
                "params_m": sum(p.numel() for p in t.module.parameters()) / 1e6,
                "tokens_per_s": batch.n_tgt_tokens / seconds,
                "ms_per_step": 1000 * seconds,
                "gflop_per_step": flops[t.name] / 1e9,
                "step_peak_mib": memory[i],
                "resident_mib": resident[i],
                "peak_total_mib": None if memory[i] is None else resident[i] + memory[i],
                "first_step_s": first[i],
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
    """ours / this, against our row of the same mode."""
    ours = {r["mode"]: r[key] for r in rows if r["model"] == "ours"}
    for r in rows:
        r["ours_over_this"] = ours[r["mode"]] / r[key] if r["mode"] in ours else None


def bench_sampled(
    trainees: list[Trainee], cfg: ModelConfig, setup: Setup, args: argparse.Namespace
) -> dict[str, Any]:
    """The eager models on token-budget batches of WMT-like lengths (compiling every new batch shape
    would dominate): real target tokens/s, padding, sentences per batch."""
    batches = sampled_batches(cfg, args.budget_tokens, args.real_batches, args.seed)
    batches = [b.to(setup.device) for b in batches]
    eager = [t for t in trainees if t.mode == "eager"]
    for t in eager:
        train_step(t, batches[0], setup)  # warm-up on this section's shapes
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


def bench_big(setup: Setup, batch: Batch, args: argparse.Namespace) -> float:
    """Target tokens/s of the big model (compiled), at the fixed shape."""
    [trainee] = build_trainees(BIG, ["ours"], setup, args.seed, compile=False)
    trainee = replace(trainee, mode="compiled", run=compiled("ours", trainee.module))
    first_steps([trainee], batch, setup, args.warmup)
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
    x (FLOPs per step of the measured dims / of the big dims, both counted), i.e. at equal MFU."""
    ours_sampled = next(r for r in sampled["rows"] if r["model"] == "ours")
    speeds = [
        ("fixed shape, best mode", fastest_mode(fixed, "ours")["tokens_per_s"]),
        ("sampled batches, eager, real tokens", ours_sampled["tokens_per_s"]),
    ]
    rows = []
    for basis, speed in speeds:
        for budget, (steps, paper_hours) in PAPER_BUDGETS.items():
            measured = budget == "big" and big_tokens_per_s is not None and basis.startswith("fixed")
            if budget == "base" or measured:
                dims, tokens_per_s = (size if budget == "base" else "big"), (big_tokens_per_s or speed)
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
    args: argparse.Namespace, cfg: ModelConfig, setup: Setup, peers: set[str]
) -> dict[str, Any]:
    """Fixed-shape and sampled-batch steps, model FLOP utilisation against the better of two matmul peaks
    (measured before and after the timed steps: on a shared machine either may meet a busy moment),
    and the projections of the paper's budgets."""
    families = ["ours"] + ["nn.Transformer"] * ("torch" in peers) + ["Marian (HF)"] * ("marian" in peers)
    batch = random_batch(cfg, args.batch, args.length, torch.Generator().manual_seed(args.seed))
    batch = batch.to(setup.device)
    trainees = build_trainees(cfg, families, setup, args.seed, args.compile)
    peak, how = matmul_peak(setup.device)
    fixed = bench_fixed(trainees, batch, setup, args)
    peak = max(peak, matmul_peak(setup.device)[0])
    for row in fixed:
        row["mfu"] = row["gflop_per_step"] * 1e9 / (row["ms_per_step"] / 1000) / peak
    sampled = bench_sampled(trainees, cfg, setup, args)
    del trainees
    _release_free_memory(setup.device)
    big_cfg = replace(BIG, vocab_size=cfg.vocab_size)
    shape = (args.batch, args.length)
    flop_ratio = meta_step_flops(cfg, *shape) / meta_step_flops(big_cfg, *shape)
    big = bench_big(setup, batch, args) if args.big else None
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


# ------------------------------------------------------------------------------------- decode


class _MarianVocabulary:
    """What CTranslate2's converter reads from a tokenizer: id -> piece, eos and unk. Piece i is "t<i>",
    except Marian's eos 0, unk 1 and pad V - 1 (dropped by the converter, as Marian's own vocabulary)."""

    eos_token, unk_token = "</s>", "<unk>"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @staticmethod
    def piece(i: int) -> str:
        return {0: "</s>", 1: "<unk>"}.get(i, f"t{i}")

    def get_vocab(self) -> dict[str, int]:
        vocab = {self.piece(i): i for i in range(self.vocab_size - 1)}
        vocab["<pad>"] = self.vocab_size - 1
        return vocab


def ct2_convert(marian: nn.Module, workdir: Path) -> str:
    """Convert the (float32, CPU) Marian model with ctranslate2's TransformersConverter; returns its path."""
    from ctranslate2.converters import TransformersConverter

    class InMemoryConverter(TransformersConverter):
        """The converter, fed this model and vocabulary instead of loading them from the hub."""

        def load_model(self, model_class: Any, path: str, **kwargs: Any) -> nn.Module:
            return marian

        def load_tokenizer(self, tokenizer_class: Any, path: str, **kwargs: Any) -> _MarianVocabulary:
            return _MarianVocabulary(marian.config.vocab_size)

    marian.config.save_pretrained(workdir / "hf")  # the converter reads the config from disk
    return InMemoryConverter(str(workdir / "hf")).convert(str(workdir / "ct2"), force=True)


# The CTranslate2 decoder's own process: one JSON request per line in, one reply per line out.
CT2_WORKER = """
import json, sys
import ctranslate2
model, device, compute_type, threads = sys.argv[1:5]
translator = ctranslate2.Translator(
    model, device=device, compute_type=compute_type, inter_threads=1, intra_threads=int(threads)
)
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    try:
        results = translator.translate_batch(
            job["tokens"], beam_size=job["beam"], min_decoding_length=job["new_tokens"],
            max_decoding_length=job["new_tokens"], max_batch_size=0,
        )
        print(json.dumps({"tokens": sum(len(r.hypotheses[0]) for r in results)}), flush=True)
    except RuntimeError as error:
        print(json.dumps({"error": str(error)}), flush=True)
"""


class Ct2Process:
    """CTranslate2 in a process of its own. Sharing one made both slower: in a process where CTranslate2
    had translated once, our beam search ran 11% slower for good (1.87 -> 2.08 s per run, base dims,
    2 threads; Hugging Face's generate left it unchanged), and CTranslate2 took 2.4-2.6 s per run there
    against 2.1 s alone."""

    def __init__(self, model: str, device: str, compute_type: str, threads: int) -> None:
        command = [sys.executable, "-c", CT2_WORKER, model, device, compute_type, str(threads)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":  # its traceback went to stderr
            raise RuntimeError(f"CTranslate2 could not load the model (exit status {self.process.wait()})")

    def translate(self, tokens: list[list[str]], beam: int, new_tokens: int) -> int:
        """Translate with min = max decoding length; returns the output tokens."""
        request = {"tokens": tokens, "beam": beam, "new_tokens": new_tokens}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline() or '{"error": "the CTranslate2 process ended"}')
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["tokens"]


def decode_inputs(cfg: ModelConfig, n: int, src_len: int, seed: int) -> dict[str, Any]:
    """The same random source pieces for every decoder, each with its own EOS (ours 3, Marian 0)."""
    generator = torch.Generator().manual_seed(seed)
    pieces = torch.randint(FIRST_TOKEN, cfg.vocab_size - 1, (n, src_len - 1), generator=generator)
    ours = torch.cat([pieces, torch.full((n, 1), EOS_ID)], dim=1)  # (N, S)
    marian = torch.cat([pieces, torch.zeros(n, 1, dtype=torch.long)], dim=1)  # (N, S)
    tokens = [[_MarianVocabulary.piece(i) for i in row] for row in marian.tolist()]
    return {"ours": ours, "marian": marian, "ct2": tokens}


def ours_decoder(model: Transformer, new_tokens: int, graphs: bool = False) -> Callable[[Tensor, int], int]:
    """beam_search / greedy_search with exactly new_tokens outputs: L = 0 x |X| + new_tokens, and EOS
    suppressed through step new_tokens (min_len). With graphs, static_beam_search replaying each step as
    a CUDA graph (greedy: a beam of 1 without length penalty), recorded anew for every call, as
    translate.py does for every batch. Returns the output tokens."""

    def run(src: Tensor, beam: int) -> int:
        limits = {"max_len_a": 0.0, "max_len_b": new_tokens, "min_len": new_tokens}
        if graphs:
            result = static_beam_search(model, src, beam_size=beam, alpha=0.6 if beam > 1 else 0.0, **limits)
        elif beam > 1:
            result = beam_search(model, src, beam_size=beam, alpha=0.6, **limits)
        else:
            result = greedy_search(model, src, **limits)
        return sum(len(tokens) for tokens in result.tokens)

    return run


def hf_decoder(model: nn.Module, new_tokens: int) -> Callable[[Tensor, int], int]:
    """Hugging Face generate with min_new_tokens = max_new_tokens; returns the generated tokens."""

    @torch.inference_mode()
    def run(src: Tensor, beam: int) -> int:
        out = model.generate(
            input_ids=src,
            attention_mask=torch.ones_like(src),
            num_beams=beam,
            do_sample=False,
            min_new_tokens=new_tokens,
            max_new_tokens=new_tokens,
        )
        return int((out[:, 1:] != model.config.pad_token_id).sum())  # the decoder start token excluded

    return run


def ct2_decoder(worker: Ct2Process, new_tokens: int) -> Callable[[list[list[str]], int], int]:
    """CTranslate2 translate_batch with min = max decoding length (EOS is not counted in it: outputs
    have exactly that many tokens; checked in the run)."""
    return lambda tokens, beam: worker.translate(tokens, beam, new_tokens)


def build_decoders(
    ours: Transformer,
    cfg: ModelConfig,
    setup: Setup,
    peers: set[str],
    args: argparse.Namespace,
    workdir: Path,
    notes: list[str],
) -> dict[str, tuple[str, Callable[[Any, int], int]]]:
    """name -> (which inputs it reads, run(inputs, beam) -> output tokens). Random weights, eval mode;
    bf16 models on CUDA, as translate.py runs them."""
    cuda = setup.device.type == "cuda"
    decoders = {"ours": ("ours", ours_decoder(ours, args.new_tokens))}
    # on CUDA also ours as translate.py cuda_graphs=true runs it; last, so that were its capture to fail
    # the peers are measured already
    graphed = {"ours, CUDA graphs": ("ours", ours_decoder(ours, args.new_tokens, graphs=True))}
    graphed = graphed if cuda else {}
    if "marian" not in peers:
        if "ct2" in peers:
            notes.append("CTranslate2 converts the Marian model, which needs transformers: skipped")
        return decoders | graphed
    torch.manual_seed(args.seed)
    marian = build_marian(cfg).eval()
    hf = ("marian", hf_decoder(marian, args.new_tokens))
    if "ct2" in peers:
        compute = args.ct2_compute if cuda else "float32"
        try:
            worker = Ct2Process(ct2_convert(marian, workdir), setup.device.type, compute, args.threads)
            decoders[f"CTranslate2 {compute}"] = ("ct2", ct2_decoder(worker, args.new_tokens))
        except (RuntimeError, ValueError) as error:
            notes.append(f"CTranslate2 could not load the model on {setup.device.type}: {error}")
    marian.to(setup.device, torch.bfloat16 if cuda else torch.float32)
    decoders["HF generate"] = hf
    return decoders | graphed


def bench_decode_mode(
    decoders: dict[str, tuple[str, Callable[[Any, int], int]]],
    beam: int,
    n: int,
    cfg: ModelConfig,
    setup: Setup,
    args: argparse.Namespace,
    notes: list[str],
) -> dict[str, Any]:
    """Every decoder on the same n sentences, interleaved run by run; medians."""
    inputs = decode_inputs(cfg, n, args.src_len, args.seed)
    inputs = {k: v.to(setup.device) if isinstance(v, Tensor) else v for k, v in inputs.items()}
    few = n if setup.device.type == "cuda" else min(n, 4)  # a CPU needs no full-size warm-up
    for name, (key, run) in list(decoders.items()):
        try:
            run(inputs[key][:few], beam)
        except RuntimeError as error:  # e.g. CTranslate2 missing the CUDA libraries it loads at run time
            if name == "ours":
                raise
            notes.append(f"{name} failed on {setup.device.type} and is left out: {error}")
            del decoders[name]
    runs = {name: (lambda _, k=key, run=run: run(inputs[k], beam)) for name, (key, run) in decoders.items()}
    times = interleave(runs, args.decode_rounds, setup.device, f"decode beam {beam}")
    rows = []
    for name, results in times.items():
        seconds = statistics.median(s for s, _ in results)
        tokens = results[0][1]
        if tokens != n * args.new_tokens:
            notes.append(f"{name} (beam {beam}) produced {tokens} tokens, not {n} x {args.new_tokens}")
        rows.append(
            {
                "decoder": name,
                "tokens_per_s": tokens / seconds,
                "sentences_per_s": n / seconds,
                "seconds": seconds,
                "output_tokens": tokens,
                "run_times_s": [s for s, _ in results],
            }
        )
    ours = rows[0]["tokens_per_s"]
    for r in rows:
        r["ours_over_this"] = ours / r["tokens_per_s"]
    return {"beam": beam, "sentences": n, "src_len": args.src_len, "new_tokens": args.new_tokens} | {
        "rows": rows
    }


def section_decode(
    args: argparse.Namespace, cfg: ModelConfig, setup: Setup, peers: set[str], notes: list[str]
) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if setup.device.type == "cuda" else torch.float32  # as translate.py
    ours = Transformer(cfg).eval().to(setup.device, dtype)
    with tempfile.TemporaryDirectory() as workdir:
        decoders = build_decoders(ours, cfg, setup, peers, args, Path(workdir), notes)
        # ours as translate.py runs it: the decoder's weights packed for oneDNN once for all batches (on
        # a CPU; CTranslate2 packs its own when it loads the model)
        with torch.inference_mode(), prepacked(search_weights(ours)):
            return {
                "beam4": bench_decode_mode(decoders, 4, args.beam_sentences, cfg, setup, args, notes),
                "greedy": bench_decode_mode(decoders, 1, args.greedy_sentences, cfg, setup, args, notes),
            }


# ------------------------------------------------------------------------------------- data


def sampler_padding(
    src: np.ndarray, tgt: np.ndarray, batches: list[np.ndarray], budget: int, multiple: int
) -> dict[str, float]:
    """Padding of the batches as collate pads them (+EOS / +BOS, rounded up to `multiple`)."""

    def padded(lengths: np.ndarray, batch: np.ndarray) -> int:
        return -(-(int(lengths[batch].max()) + 1) // multiple) * multiple

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


# ------------------------------------------------------------------------------------- report

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
        ],
        train["fixed"],
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
            ],
            mode["rows"],
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


# The goals of each device: (CPU, CUDA)
TRAIN_GOAL = (1.3, 2.0)  # ours / torch.nn.Transformer (CUDA: compiled), training step tokens/s
MEMORY_GOAL_GIB = 10.0  # CUDA: ours' peak (weights and Adam included) at the fixed ~25k-token shape
DECODE_GOALS = {"CTranslate2": (1.2, 1.0), "HF generate": (2.0, 5.0)}  # beam 4, ours / peer


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The project's speed and memory goals on this run's device: ratios ours / peer, and on CUDA the
    peak memory of a training step."""
    cuda = report["meta"]["device"] == "cuda"
    found = []
    fixed = report["train"]["fixed"] if "train" in report else []
    ours = fastest_mode(fixed, "ours") if fixed else None
    if any(r["model"] == "nn.Transformer" for r in fixed):  # each in its fastest mode, as a user runs it
        peer = fastest_mode(fixed, "nn.Transformer")
        peer_compiled = [r for r in fixed if r["model"] == "nn.Transformer" and r["mode"] == "compiled"]
        if cuda and peer_compiled:  # the GPU goal is stated against the compiled peer
            peer = peer_compiled[0]
        goal = f"train step, ours ({ours['mode']}) vs nn.Transformer ({peer['mode']})"
        ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
        found.append(
            {"goal": goal, "ratio": ratio, "target": TRAIN_GOAL[cuda], "met": ratio >= TRAIN_GOAL[cuda]}
        )
    if cuda and ours is not None and ours["peak_total_mib"] is not None:
        tokens = report["train"]["shape"]["target_tokens"]
        gib = ours["peak_total_mib"] / 1024
        goal = f"train step peak memory, ours ({ours['mode']}), {tokens:,} target tokens"
        found.append({"goal": goal, "gib": gib, "target": MEMORY_GOAL_GIB, "met": gib <= MEMORY_GOAL_GIB})
    if "decode" in report:
        rows = report["decode"]["beam4"]["rows"]
        fastest = max((r for r in rows if r["decoder"].startswith("ours")), key=lambda r: r["tokens_per_s"])
        for r in rows:
            name = r["decoder"]
            goal = next((g[cuda] for prefix, g in DECODE_GOALS.items() if name.startswith(prefix)), None)
            if goal is not None:
                ratio = fastest["tokens_per_s"] / r["tokens_per_s"]
                text = f"beam 4, {fastest['decoder']} vs {name}"
                found.append({"goal": text, "ratio": ratio, "target": goal, "met": ratio >= goal})
    return found


def print_report(report: dict[str, Any]) -> None:
    meta = report["meta"]
    load = meta["load_average_at_end"]
    print(
        f"\n== benchmark: {meta['device_name']}, torch {meta['torch']}, {meta['size']} dims, "
        f"{meta['threads']} CPU threads, {meta['seconds']:.0f} s in all; load average "
        f"{'n/a' if load is None else f'{load[0]:.1f}'} at the end =="
    )
    if "train" in report:
        print_train(report["train"], meta)
    if "decode" in report:
        print_decode(report["decode"])
    if "data" in report:
        print_data(report["data"])
    if report["targets"]:
        print("\ntargets on this device (ours / peer, and peak memory on CUDA):")
        for t in report["targets"]:
            verdict = "met" if t["met"] else "NOT met"
            if "gib" in t:
                print(f"  {t['goal']}: {t['gib']:.1f} GiB (target <= {t['target']:g} GiB: {verdict})")
            else:
                print(f"  {t['goal']}: {t['ratio']:.2f}x (target >= {t['target']}x: {verdict})")
    for note in report["notes"]:
        print(f"note: {note}")


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Atomically: a temporary file in the same directory, flushed and synced, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        json.dump(report, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(f.name, 0o666 & ~umask)  # the permissions of any new file, not the temporary file's 0600
    os.replace(f.name, path)


def describe(args: argparse.Namespace, setup: Setup, cfg: ModelConfig) -> dict[str, Any]:
    cuda = setup.device.type == "cuda"
    return {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(setup.device) if cuda else platform.processor() or "cpu",
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
    start = time.perf_counter()
    setup = make_setup(args)
    cfg = SIZES[args.size]
    notes: list[str] = []
    peers = available_peers(args, notes)
    _register_cpu_flops()
    report: dict[str, Any] = {"meta": describe(args, setup, cfg)}
    sections = {
        "train": lambda: section_train(args, cfg, setup, peers),
        "decode": lambda: section_decode(args, cfg, setup, peers, notes),
        "data": lambda: section_data(args),
    }
    failed = []
    for name, section in sections.items():
        if name not in args.sections:
            continue
        try:
            report[name] = section()
        except Exception as error:  # the other sections' figures are still reported; the run fails at the end
            notes.append(f"section {name} failed: {type(error).__name__}: {error}")
            failed.append(name)
        _release_free_memory(setup.device)
    if "train" in report and not args.big:
        notes.append("big model not measured (--big): its speed is the base speed scaled by counted FLOPs")
    report["targets"] = targets(report)
    report["notes"] = notes
    report["meta"]["seconds"] = time.perf_counter() - start
    report["meta"]["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print_report(report)
    if args.json is not None:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    if failed:
        raise SystemExit(f"benchmark: section(s) {', '.join(failed)} failed (see the notes above)")
    return report


if __name__ == "__main__":
    main()
