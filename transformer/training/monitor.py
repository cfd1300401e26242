"""Watching a run: a tqdm bar (loss, learning rate, tokens/s, ETA) and TensorBoard scalars under
`<run_dir>/tensorboard` (train loss, perplexity, lr, gradient norm, tokens/s, real target tokens per
step, model FLOP utilisation on GPUs whose bf16 peak is known, the peak GPU memory of tensors so far;
validation loss and perplexity; the valid split's BLEU, chrF and chrF++); with trainer.profile_steps,
a profile of those steps (`profile.Profiler`) under `<run_dir>/profile`. Only rank 0 writes anything.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from transformer.config import ModelConfig
from transformer.training.profile import Profiled, Profiler
from transformer.utils.atomic import write_bytes

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets; longer names are matched first
# ("GH200" before "H200"). Cards not listed get no MFU.
BF16_PEAK_FLOPS = {
    "GH200": 989e12,
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
}


def bf16_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(BF16_PEAK_FLOPS, key=len, reverse=True):
        if key in name:
            return BF16_PEAK_FLOPS[key]
    return None


def train_flops(cfg: ModelConfig, batch: int, src_len: int, tgt_len: int) -> float:
    """Matmul FLOPs of one forward + backward pass over a padded (B, S) -> (B, T) batch.

    2 FLOPs per multiply-add, x3 for the backward pass; embeddings, norms and softmax are ignored.
    """
    d, h, kv = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
    q_width, k_width, v_width = h * cfg.d_k, kv * cfg.d_k, kv * cfg.d_v
    self_attn = d * (q_width + k_width + v_width) + h * cfg.d_v * d  # W^Q, W^K, W^V, W^O
    ffn = 2 * d * cfg.d_ff
    if cfg.moe_experts:  # k experts per token, and the router (capacity drops not subtracted)
        ffn = cfg.moe_top_k * ffn + d * cfg.moe_experts
    src_tokens, tgt_tokens = batch * src_len, batch * tgt_len
    encoder = src_tokens * (self_attn + ffn)
    cross = tgt_tokens * (d * q_width + h * cfg.d_v * d) + src_tokens * d * (k_width + v_width)
    decoder = tgt_tokens * (self_attn + ffn) + cross
    projection = tgt_tokens * d * cfg.vocab_size
    # QK^T and the weighted sum of V: per query, per key, h * (d_k + d_v) multiply-adds
    scores = h * (cfg.d_k + cfg.d_v) * (src_tokens * src_len + tgt_tokens * tgt_len + tgt_tokens * src_len)
    return 6.0 * (cfg.n_layers * (encoder + decoder + scores) + projection)


STEP_FIGURES = {"loss", "nll", "tokens", "lr", "grad_norm", "flops", "seconds", "steps"}


class Monitor:
    """Progress bar and TensorBoard scalars; a no-op on ranks other than 0."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        progress: bool,
        steps: tuple[int, int],
        every: int,
        device: torch.device,
        peak_flops: float | None,
        profile_steps: list[int] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """steps: (first step of this process, last step of the run); profile_steps: [first, last];
        clock: seconds from any origin, for the throughput."""
        self.enabled, self.every, self.device, self.peak_flops = enabled, every, device, peak_flops
        self.run_dir, self.profile_steps = run_dir, profile_steps
        self.profiler: Profiler | None = None  # while the profile_steps run
        start_step, max_steps = steps
        if enabled:
            from torch.utils.tensorboard import SummaryWriter  # a second to import; only rank 0 needs it

            # a resumed run's events replace those the interrupted one wrote past its checkpoint
            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)
        self.bar = tqdm(
            total=max_steps,
            initial=start_step,
            unit="step",
            dynamic_ncols=True,
            disable=not (enabled and progress),
        )
        self._sums: dict[str, float] = {}
        self.clock = clock
        self._last_time = clock()
        if enabled and profile_steps:
            if start_step >= profile_steps[0]:
                log.warning(
                    "trainer.profile_steps=%s: the run goes on from step %d, past their start: no profile",
                    profile_steps,
                    start_step,
                )
            Profiler.set_up(device)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def before_step(self, step: int) -> None:
        """Optimizer step `step` is about to be queued: the profile starts at the first of profile_steps."""
        starts = self.profile_steps and step == self.profile_steps[0] and self.profiler is None  # once
        if self.enabled and starts:
            self.profiler = Profiler(self.device)
            self.profiler.start()

    def step(self, step: int, stats: dict[str, float]) -> None:
        """One optimizer step: loss and nll per target token, tokens (target), lr, grad_norm, flops, and
        the objective's own figures (e.g. moe_dropped), each logged as the interval's mean."""
        if self.profiler is not None and step >= self.profile_steps[1]:
            self._profiled(step, self.profiler.stop(step - self.profile_steps[0] + 1))
            self.profiler = None
        now = self.clock()
        seconds, self._last_time = now - self._last_time, now
        for key, value in stats.items():
            if key != "finite":
                self._sums[key] = self._sums.get(key, 0.0) + value
        self._sums["seconds"] = self._sums.get("seconds", 0.0) + seconds
        self._sums["steps"] = self._sums.get("steps", 0.0) + 1
        if not self.enabled:
            return
        self.bar.set_postfix(
            loss=f"{stats['loss']:.3f}",
            lr=f"{stats['lr']:.2e}",
            tok_s=f"{stats['tokens'] / seconds:,.0f}",
            refresh=False,  # update() redraws at the bar's own pace (mininterval), not at every step
        )
        self.bar.update(1)
        if step % self.every == 0:
            self._flush(step)

    def _flush(self, step: int) -> None:
        sums, self._sums = self._sums, {}
        steps, seconds = sums["steps"], sums["seconds"]
        scalars = {
            "train/loss": sums["loss"] / steps,
            "train/ppl": math.exp(min(sums["nll"] / steps, 50.0)),  # perplexity of the unsmoothed NLL
            "train/lr": sums["lr"] / steps,
            "train/grad_norm": sums["grad_norm"] / steps,
            "train/tokens_per_s": sums["tokens"] / seconds,  # target tokens, all ranks together
            "train/tokens_per_step": sums["tokens"] / steps,  # real ones (§5.1: about 25,000)
        }
        for key in sorted(sums.keys() - STEP_FIGURES):
            scalars[f"train/{key}"] = sums[key] / steps  # the objective's figures
        if self.peak_flops:  # this rank's model FLOP/s against its card's dense bf16 peak
            scalars["train/mfu"] = sums["flops"] / seconds / self.peak_flops
        if self.device.type == "cuda":  # the allocator's own count: no wait for the device
            scalars["train/peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        log.info("step %d: %s", step, ", ".join(f"{tag[6:]} {value:.4g}" for tag, value in scalars.items()))

    def _profiled(self, step: int, profiled: Profiled) -> None:
        """The profile's table and Chrome trace under <run_dir>/profile; its figures logged."""
        out = self.run_dir / "profile"
        out.mkdir(exist_ok=True)
        write_bytes(out / "ops.txt", profiled.table.encode())
        with tempfile.TemporaryDirectory() as tmp:  # the profiler writes the trace by name
            profiled.profile.export_chrome_trace(f"{tmp}/trace.json")
            write_bytes(out / "trace.json", Path(f"{tmp}/trace.json").read_bytes())
        per_step = 1000 / profiled.steps
        self.writer.add_scalar("profile/wall_ms_per_step", profiled.wall_seconds * per_step, step)
        busy = ""
        if profiled.busy is not None:
            self.writer.add_scalar("profile/kernel_ms_per_step", profiled.kernel_seconds * per_step, step)
            self.writer.add_scalar("profile/device_busy", profiled.busy, step)
            busy = f", device kernels {profiled.kernel_seconds * per_step:.1f} ms: busy {profiled.busy:.0%}"
        log.info(
            "steps %d-%d profiled: %.1f ms per step%s; %s",
            step - profiled.steps + 1,
            step,
            profiled.wall_seconds * per_step,
            busy,
            out,
        )

    def valid(self, step: int, loss: float, nll: float) -> None:
        if self.enabled:
            self.writer.add_scalar("valid/loss", loss, step)
            self.writer.add_scalar("valid/ppl", math.exp(min(nll, 50.0)), step)
            log.info("step %d: valid loss %.4f, perplexity %.2f", step, loss, math.exp(min(nll, 50.0)))

    def scores(self, step: int, scores: dict[str, float]) -> None:
        """The valid split's translations scored: the corpus's BLEU as valid/bleu, sacreBLEU, chrF and
        chrF++ beside it (valid/sacrebleu, valid/chrf, valid/chrf++)."""
        if self.enabled:
            for name, value in scores.items():
                self.writer.add_scalar(f"valid/{name}", value, step)
            log.info(
                "step %d: valid BLEU %.2f (sacreBLEU %.2f), chrF %.2f, chrF++ %.2f",
                step,
                scores["bleu"],
                scores["sacrebleu"],
                scores["chrf"],
                scores["chrf++"],
            )

    def fallback(self, step: int, message: str) -> None:
        """A speed path failed at `step` and the run goes on without it (`fallback.SpeedPaths`)."""
        log.warning("%s", message)
        if self.enabled:
            self.writer.add_text("train/fallback", message, step)

    def close(self) -> None:
        if self.profiler is not None:  # the run ended inside profile_steps: nothing to report
            self.profiler.cancel()
        if self.enabled:
            self.bar.close()
            self.writer.close()
