"""The training loop (§5): token-budget batches, label-smoothed loss, Adam with the schedule of Eq. (3),
self-describing checkpoints and exact resume.

One optimizer step holds `trainer.tokens_per_step` padded tokens (B x max(S, T) per batch; the default
gives ~25k real target tokens, §5.1): each rank runs `trainer.grad_accum(world_size)` batches of
`trainer.batch_tokens(world_size)` padded tokens at most (the step's budget shared evenly, each at most
`trainer.max_tokens`). The loss is the sum over every non-pad target token of the step divided by
their number over all batches and ranks, so the update does not depend on how the step is split.

The host reads from the device once per step, and late: the whole step is queued first (forward,
backward, gradient norm and the update, which the device skips by itself when the loss or the
gradient is not finite), then the next step's batches are read and sent, and only then are the
step's loss and gradient norm read. So a GPU is not left waiting between steps while the host runs
the optimizer's Python and reads batches.

Exact resume: a checkpoint holds the weights, Adam's moments, the schedule's step, the sampler's
(epoch, position) and every rank's RNG states, and the loop draws nothing random that they don't cover;
on the CPU an interrupted and resumed run ends with bitwise the same weights as an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.optim import Adam
from torch.optim.lr_scheduler import LambdaLR
from tqdm.contrib.logging import logging_redirect_tqdm

from transformer.atomic import remove_temp_files
from transformer.checkpoint import (
    FORMAT,
    RESUME_KEYS,
    CheckpointError,
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from transformer.config import ConfigError, OptimConfig, TrainConfig, TrainerConfig, to_dict
from transformer.data.batching import Batch, TokenBudgetBatchSampler, padded_length
from transformer.data.dataset import ShardDataset, load_meta
from transformer.data.prepare import SPM_FILE, prepare
from transformer.model import Transformer
from transformer.training.distributed import (
    Runtime,
    all_reduce_sum,
    all_reduce_sum_tensor,
    gather_objects,
    init_runtime,
    shutdown,
    wait_for_main,
    wrap,
)
from transformer.training.loss import Seq2SeqLoss
from transformer.training.monitor import Monitor, bf16_peak_flops, train_flops
from transformer.training.schedule import make_scheduler

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on (out of memory, a diverging loss); the message says what to change."""


class TrainingStopped(Exception):
    """A signal (SIGTERM, Ctrl-C; on any rank) stopped the run after a checkpoint of `step`."""

    def __init__(self, step: int, signal_name: str | None) -> None:
        super().__init__(f"stopped at step {step} by {signal_name or 'a signal on another rank'}")
        self.step = step
        # a process's exit status after a signal: 128 + its number (SIGTERM 143, Ctrl-C 130)
        self.exit_status = 128 + signal.Signals[signal_name or "SIGTERM"].value


def train(cfg: TrainConfig) -> Path:
    """Train until trainer.max_steps and return the run directory; SIGTERM or Ctrl-C save a checkpoint,
    then raise TrainingStopped."""
    t = cfg.trainer
    run_dir = Path(t.run_dir)
    _check_resume_setting(t, run_dir)
    runtime = init_runtime(t)
    if runtime.is_main and checkpoint_dir(run_dir).is_dir():
        remove_temp_files(checkpoint_dir(run_dir))  # of a save that a kill interrupted
    try:
        # a checkpoint that cannot resume this run is refused before the data is prepared
        found = _find_resume(t, run_dir) if t.resume != "never" else None
        if found is not None and found[1]["step"] >= t.max_steps and runtime.is_main:
            log.warning(
                "%s is at step %d, trainer.max_steps=%d: nothing left to train (raise trainer.max_steps "
                "to train on)",
                found[0],
                found[1]["step"],
                t.max_steps,
            )
        # --- data: rank 0 prepares the corpus (a quick check when it is ready), the others wait
        if runtime.is_main:
            prepare(cfg.data)
        wait_for_main(runtime)
        data_dir = Path(cfg.data.dir)
        meta = load_meta(data_dir)
        train_set = ShardDataset(data_dir, "train")
        _check_lengths(train_set, t.pad_to_multiple, cfg.model.max_positions)
        sampler = TokenBudgetBatchSampler(
            train_set.src_lengths,
            train_set.tgt_lengths,
            t.batch_tokens(runtime.world_size),
            seed=t.seed,
            rank=runtime.rank,
            world_size=runtime.world_size,
            pad_to_multiple=t.pad_to_multiple,
        )

        # --- model: the corpus sets the vocabulary size; every rank starts from the same weights
        cfg = replace(cfg, model=replace(cfg.model, vocab_size=meta["vocab_size"]))
        _seed_everything(t.seed)
        model = Transformer(cfg.model)
        objective = wrap(Seq2SeqLoss(model, cfg.optim.label_smoothing), runtime, t.compile)
        _seed_everything(t.seed + runtime.rank)  # each rank its own dropout masks

        # --- optimizer: Adam with beta1 = 0.9, beta2 = 0.98, eps = 1e-9 and the schedule of Eq. (3)
        optimizer = _adam(model, cfg.optim)
        scheduler = make_scheduler(optimizer, cfg.optim, cfg.model.d_model)
        run = Run(
            cfg,
            runtime,
            run_dir,
            model,
            optimizer,
            scheduler,
            sampler,
            meta,
            (data_dir / SPM_FILE).read_bytes(),
        )

        # --- resume: weights, Adam's moments, schedule, data position and RNG states
        if found is not None:
            run.restore(*found)

        # --- loop: one optimizer step per iteration; checkpoints at step boundaries
        accum = t.grad_accum(runtime.world_size)
        _log_start(run, accum)
        valid = _valid_batches(data_dir, meta, t, runtime, cfg.model.max_positions)
        eval_module = objective.module if runtime.distributed else objective  # no gradient sync needed
        batches = _batches_forever(sampler, train_set, t.pad_to_multiple, runtime.device)
        peak = bf16_peak_flops(runtime.device) if runtime.dtype == torch.bfloat16 else None
        monitor = Monitor(
            run_dir,
            runtime.is_main,
            t.progress,
            (run.step, t.max_steps),
            t.log_every_steps,
            runtime.device,
            peak,
        )
        last_save, nonfinite, micro = time.monotonic(), 0, None
        with monitor, _StopSignal() as stop_signal, logging_redirect_tqdm():
            while run.step < t.max_steps:
                if micro is None:
                    micro = [next(batches) for _ in range(accum)]
                save_due = (
                    t.save_every_minutes > 0 and time.monotonic() - last_save >= 60 * t.save_every_minutes
                )
                flags = [float(stop_signal.received is not None), float(save_due)]
                queued = _queue_step(run, objective, micro, flags)
                consumed = run.sampler.state_dict()  # what a checkpoint of this step resumes from
                # The next step's batches are read and sent while the device works on this one.
                upcoming = [next(batches) for _ in range(accum)] if run.step + 1 < t.max_steps else None
                stats, stop, save_due = _finish_step(run, queued, micro)
                micro = upcoming
                if stats["finite"]:
                    nonfinite = 0
                    monitor.step(run.step, stats)
                else:
                    nonfinite = _skip_update(run.step, stats, nonfinite, t.max_nonfinite_steps)
                evaluate = _every(t.eval_every_steps, run.step) or run.step == t.max_steps
                if valid is not None and nonfinite == 0 and evaluate:
                    monitor.valid(run.step, *_validate(eval_module, valid, runtime))
                if (
                    stop
                    or save_due
                    or run.step == t.max_steps
                    or (nonfinite == 0 and _every(t.save_every_steps, run.step))
                ):
                    run.save(consumed)
                    last_save = time.monotonic()
                if stop:
                    # every rank stays until rank 0 has written the checkpoint: torchrun stops (and
                    # after 30 s kills) the other processes as soon as one exits with an error status
                    wait_for_main(runtime)
                    log.warning("stopped at step %d by a signal; continue with trainer.resume=auto", run.step)
                    raise TrainingStopped(run.step, stop_signal.received)
            # a signal during the last step, saved above: the finish stage waits for the next start
            if all_reduce_sum([float(stop_signal.received is not None)], runtime)[0] > 0:
                log.warning("stopped after the last step by a signal; the next start runs the finish stage")
                raise TrainingStopped(run.step, stop_signal.received)
        return run_dir
    finally:
        shutdown(runtime)


@dataclass
class Run:
    """What a checkpoint saves and restores, and the optimizer steps taken so far."""

    cfg: TrainConfig
    runtime: Runtime
    run_dir: Path
    model: Transformer  # unwrapped: no compile, no DDP
    optimizer: Adam
    scheduler: LambdaLR
    sampler: TokenBudgetBatchSampler
    meta: dict[str, Any]
    spm_model: bytes
    step: int = 0

    def save(self, data_state: dict[str, int]) -> None:
        """Write a checkpoint (rank 0); every rank takes part, for its RNG state. data_state: the
        sampler's state after the batches of the steps taken (the loop reads ahead)."""
        rngs = gather_objects(rng_state(), self.runtime)
        if not self.runtime.is_main:
            return
        ckpt = {
            "format": FORMAT,
            "model": self.model.state_dict(),
            "model_config": to_dict(self.cfg.model),
            "spm_model": self.spm_model,
            "data_meta": self.meta,
            "config": to_dict(self.cfg),
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data_state": data_state,  # the ranks agree on (epoch, position)
            "rng": rngs,  # one entry per rank
        }
        path = save_checkpoint(ckpt, self.run_dir, self.cfg.trainer.keep_last)
        log.info("step %d: saved %s", self.step, path)

    def restore(self, path: Path, ckpt: dict[str, Any]) -> None:
        # the initialisation is the checkpoint's, whatever this run's model.init: its weights replace them
        model = replace(self.cfg.model, init=ckpt["model_config"]["init"])
        self.cfg = replace(self.cfg, model=model)
        mine = to_dict(model)
        changed = sorted(k for k in mine if ckpt["model_config"].get(k) != mine[k])
        if changed:
            raise ConfigError(
                f"{path} holds a model with other settings ({', '.join(changed)}); "
                "set trainer.run_dir to a new directory, or trainer.resume=<checkpoint of this model>"
            )
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self._apply_optim_settings(ckpt.get("config", {}).get("optim", {}))
        self.sampler.load_state_dict(ckpt["data_state"])
        self.step = int(ckpt["step"])
        rngs, rank = ckpt["rng"], self.runtime.rank
        if len(rngs) == self.runtime.world_size:
            set_rng_state(rngs[rank])
        else:
            log.warning(
                "%s was written by %d ranks, not %d: the data order and dropout masks will differ from "
                "an uninterrupted run",
                path,
                len(rngs),
                self.runtime.world_size,
            )
            _seed_everything(self.cfg.trainer.seed + rank + self.step)
        log.info("resumed from %s at step %d (epoch %d)", path, self.step, self.sampler.epoch)

    def _apply_optim_settings(self, saved: dict[str, Any]) -> None:
        """This run's optim settings over those Adam's state was saved with (the README's advice after a
        divergence: a lower lr_scale or a longer warmup, then resume), from the next update on."""
        cfg = self.cfg.optim
        changed = {k: (saved[k], v) for k, v in to_dict(cfg).items() if k in saved and saved[k] != v}
        if changed:
            log.info(
                "resumed with other optim settings: %s",
                ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()),
            )
        for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group.update(
                betas=(cfg.beta1, cfg.beta2),
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
                lr=factor(self.scheduler.last_epoch),  # the schedule of this run (base lr 1.0)
            )


def _check_resume_setting(t: TrainerConfig, run_dir: Path) -> None:
    """Mistakes in trainer.resume, found before any heavy work."""
    if t.resume == "never" and list_checkpoints(run_dir):
        raise ConfigError(
            f"{run_dir} already holds checkpoints and trainer.resume=never would mix two runs there; "
            "choose another trainer.run_dir, or trainer.resume=auto to continue"
        )
    if t.resume not in ("auto", "never") and not Path(t.resume).is_file():
        raise ConfigError(f"trainer.resume={t.resume}: no such file (use auto, never or a checkpoint path)")


def _find_resume(t: TrainerConfig, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    if t.resume == "auto":
        return latest_checkpoint(run_dir)
    ckpt = load_checkpoint(t.resume)
    missing = [key for key in RESUME_KEYS if key not in ckpt]
    if missing:
        raise CheckpointError(f"{t.resume} cannot resume training: it has no {', '.join(missing)}")
    return Path(t.resume), ckpt


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _adam(model: nn.Module, cfg: OptimConfig) -> Adam:
    """lr=1.0: the scheduler's factor is the learning rate itself. Fused kernels (CUDA and CPU):
    one pass over all parameters instead of a loop of small ops."""
    return Adam(
        model.parameters(),
        lr=1.0,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=True,
    )


def _log_start(run: Run, accum: int) -> None:
    t, runtime = run.cfg.trainer, run.runtime
    batch = t.batch_tokens(runtime.world_size)
    log.info(
        "%s on %s x%d (%s): %s parameters; %d batch(es) of <= %d padded tokens per rank per step, "
        "<= %d per step (trainer.tokens_per_step=%d, trainer.max_tokens=%d)",
        run.run_dir,
        runtime.device,
        runtime.world_size,
        str(runtime.dtype).removeprefix("torch."),
        f"{run.model.num_parameters():,}",
        accum,
        batch,
        batch * accum * runtime.world_size,
        t.tokens_per_step,
        t.max_tokens,
    )


def _batches_forever(
    sampler: TokenBudgetBatchSampler, dataset: ShardDataset, pad: int, device: torch.device
) -> Iterator[Batch]:
    """Batches on `device` in the sampler's order, epoch after epoch; the sampler's position counts
    those taken."""
    while True:
        for indices in sampler:
            yield dataset.batch(indices, pad).to(device, non_blocking=True)


def _check_lengths(dataset: ShardDataset, pad_to_multiple: int, max_positions: int) -> None:
    """A pair longer than the positional table would fail at its first batch, maybe hours into the run;
    the lengths are at hand, so it fails now."""
    longest = int(max(dataset.src_lengths.max(), dataset.tgt_lengths.max()))  # pieces
    positions = padded_length(longest, pad_to_multiple)  # as the batches pad it
    if positions > max_positions:
        raise ConfigError(
            f"the {dataset.role} split's longest pair needs {positions} positions ({longest} pieces "
            f"+ EOS, padded to a multiple of trainer.pad_to_multiple={pad_to_multiple}), more than "
            f"model.max_positions={max_positions}; raise model.max_positions or prepare the data with a "
            "lower data.max_tokens_per_sentence"
        )


def _valid_batches(
    data_dir: Path, meta: dict[str, Any], t: TrainerConfig, runtime: Runtime, max_positions: int
) -> list[Batch] | None:
    """This rank's share of the `valid` split, batched once; None when there is none or eval is off."""
    if "valid" not in meta["splits"] or t.eval_every_steps == 0:
        return None
    valid = ShardDataset(data_dir, "valid")
    _check_lengths(valid, t.pad_to_multiple, max_positions)
    sampler = TokenBudgetBatchSampler(
        valid.src_lengths,
        valid.tgt_lengths,
        t.max_tokens,
        shuffle=False,
        rank=runtime.rank,
        world_size=runtime.world_size,
        pad_to_multiple=t.pad_to_multiple,
    )
    return [valid.batch(batch, t.pad_to_multiple) for batch in sampler.epoch_batches(0)]


def _queue_step(run: Run, objective: nn.Module, micro: list[Batch], flags: list[float]) -> Tensor:
    """Queue one optimizer step on the device without waiting for it: forward/backward over this
    rank's batches, the gradient norm, and the update, which the device itself skips when the loss
    or the gradient is not finite (Adam's `found_inf`: weights, moments and step count stay as
    they were). Sums over the ranks are collectives on the device too.

    flags: this rank's stop and save requests. Returns the device tensor [loss sum, NLL sum, target
    tokens, stop, save, gradient norm], summed over the ranks, which `_finish_step` reads.
    """
    runtime = run.runtime
    local = torch.tensor([float(sum(b.n_tgt_tokens for b in micro)), *flags], dtype=torch.float64)
    counts = all_reduce_sum_tensor(local.to(runtime.device, non_blocking=True), runtime)  # (3,)
    sums = _accumulate(objective, micro, runtime, counts[0], run.cfg.trainer.max_tokens)  # (2,)
    norm = _grad_norm(run.model, run.cfg.optim.clip_grad_norm)  # () of the ranks' summed gradients
    sums = all_reduce_sum_tensor(sums.double(), runtime)
    run.optimizer.found_inf = (~(sums[0].isfinite() & norm.isfinite())).float()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return torch.cat([sums, counts, norm.double()[None]])


def _finish_step(run: Run, queued: Tensor, micro: list[Batch]) -> tuple[dict[str, Any], bool, bool]:
    """Wait for the step `_queue_step` queued (the step's one read from the device) and count it when
    it was finite: the schedule moves on only then.

    Returns the step's statistics (per target token) and whether any rank wants to stop or to save.
    """
    loss_sum, nll_sum, n_tokens, stop, save_due, grad_norm = queued.tolist()
    lr = run.optimizer.param_groups[0]["lr"]  # the rate of this step's update
    finite = math.isfinite(loss_sum) and math.isfinite(grad_norm)
    if finite:
        run.scheduler.step()
        run.step += 1
    stats = {
        "finite": finite,
        "loss": loss_sum / n_tokens,
        "nll": nll_sum / n_tokens,
        "tokens": n_tokens,
        "lr": lr,
        "grad_norm": grad_norm,
        "flops": sum(train_flops(run.cfg.model, *b.src.shape, b.tgt_in.size(1)) for b in micro),
    }
    return stats, stop > 0, save_due > 0


def _every(interval: int, step: int) -> bool:
    """Whether `step` is a multiple of `interval` (0 = never)."""
    return interval > 0 and step % interval == 0


def _accumulate(
    objective: nn.Module, micro: list[Batch], runtime: Runtime, n_tokens: Tensor, max_tokens: int
) -> Tensor:
    """Forward and backward over this rank's batches of one step; gradient = d(loss sum) / n_tokens,
    the step's target tokens over all ranks (a device scalar). Returns this rank's sums of the loss
    and of the NLL (2,)."""
    scale = runtime.world_size / n_tokens  # DDP averages the ranks' gradients; this turns it into the sum
    sums = torch.zeros(2, device=runtime.device)
    for i, batch in enumerate(micro):
        synced = not runtime.distributed or i == len(micro) - 1  # all-reduce gradients once, after the last
        with nullcontext() if synced else objective.no_sync():
            sums += torch.stack(_forward_backward(objective, batch, scale, runtime, max_tokens))
    return sums


def _forward_backward(
    objective: nn.Module, batch: Batch, scale: float, runtime: Runtime, max_tokens: int
) -> tuple[Tensor, Tensor]:
    try:
        with runtime.autocast():
            loss, nll = objective(batch.src, batch.tgt_in, batch.tgt_out)
        (loss * scale).backward()
    except torch.OutOfMemoryError:
        raise TrainingError(
            f"out of memory on {runtime.device} for a batch of src {tuple(batch.src.shape)}, tgt "
            f"{tuple(batch.tgt_in.shape)}; lower trainer.max_tokens (now {max_tokens}): gradient "
            "accumulation keeps the tokens per step at trainer.tokens_per_step"
        ) from None
    return loss.detach(), nll


def _grad_norm(model: nn.Module, clip: float) -> Tensor:
    """The global L2 norm of the gradients (on their device), clipped to `clip` when positive (the
    paper does not clip)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
    return norm


def _skip_update(step: int, stats: dict[str, Any], in_a_row: int, limit: int) -> int:
    """Count a skipped update; stop the run after `limit` of them in a row."""
    in_a_row += 1
    log.warning(
        "step %d: non-finite loss or gradient (loss %s, gradient norm %s); update skipped (%d in a row)",
        step + 1,
        stats["loss"],
        stats["grad_norm"],
        in_a_row,
    )
    if in_a_row >= limit:
        raise TrainingError(
            f"{in_a_row} non-finite updates in a row (trainer.max_nonfinite_steps={limit}): the run "
            "diverged; lower optim.lr_scale, raise optim.warmup_steps or set optim.clip_grad_norm and resume"
        )
    return in_a_row


@torch.no_grad()
def _validate(objective: nn.Module, batches: list[Batch], runtime: Runtime) -> tuple[float, float]:
    """Loss and NLL per target token on the `valid` split, summed over every rank's share."""
    objective.eval()
    loss_sum = nll_sum = n_tokens = 0.0
    for batch in batches:
        batch = batch.to(runtime.device, non_blocking=True)
        with runtime.autocast():
            loss, nll = objective(batch.src, batch.tgt_in, batch.tgt_out)
        loss_sum, nll_sum, n_tokens = (
            loss_sum + loss.item(),
            nll_sum + nll.item(),
            n_tokens + batch.n_tgt_tokens,
        )
    objective.train()
    loss_sum, nll_sum, n_tokens = all_reduce_sum([loss_sum, nll_sum, n_tokens], runtime)
    return loss_sum / n_tokens, nll_sum / n_tokens


class _StopSignal:
    """SIGTERM and Ctrl-C ask the loop to checkpoint at the next step boundary and exit; a second Ctrl-C
    interrupts at once. Handlers are installed only in the main thread (Python allows no other)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        log.warning("%s received: saving a checkpoint after this step", self.received)

    def __exit__(self, *_exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
