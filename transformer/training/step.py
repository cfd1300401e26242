"""One optimizer step (§5.3), queued on the device without waiting for it, then read once; and the
validation loss.

One step holds `trainer.tokens_per_step` padded tokens: each rank runs `trainer.grad_accum(world_size)`
batches of `trainer.batch_tokens(world_size)` padded tokens at most. The loss is the sum over every
non-pad target token of the step divided by their number over all batches and ranks, so the update
does not depend on how the step is split.

The host reads from the device once per step, and late (docs/performance.md, "The training loop"):
the whole step is queued first (forward, backward, gradient norm and the update, which the device
skips by itself when the loss or the gradient is not finite), then the loop reads the next step's
batches, and only then this step's loss and gradient norm.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from transformer.data.batching import Batch
from transformer.training.distributed import Runtime, all_reduce_sum, all_reduce_sum_tensor
from transformer.training.monitor import train_flops
from transformer.training.policy import TrainingError
from transformer.training.state import Run


class Replays(Protocol):
    """The step as replays of recorded work (`graphs.StepGraphs`): `queue_step`'s result, given the
    step's counts on the device and its batches; `failed`: the error of a recording that failed (the
    step was finished without replays), after which `release` gives the optimizer back to plain steps."""

    failed: Exception | None

    def queue(self, counts: Tensor, micro: list[Batch]) -> tuple[Tensor, list[str]]: ...

    def release(self) -> None: ...


def queue_step(
    run: Run, objective: nn.Module, micro: list[Batch], flags: list[float], graphs: Replays | None = None
) -> tuple[Tensor, list[str]]:
    """Queue one optimizer step on the device without waiting for it: forward/backward over this
    rank's batches, the gradient norm, and the update, which the device itself skips when the loss
    or the gradient is not finite (Adam's `found_inf`: weights, moments and step count stay as
    they were). Sums over the ranks are collectives on the device too; `graphs`: the same step as
    CUDA graph replays (`graphs.StepGraphs`).

    flags: this rank's stop and save requests. Returns the device tensor [loss sum, NLL sum, target
    tokens, stop, save, gradient norm, then the objective's figures of this rank's last batch (e.g.
    the share of mixture-of-experts assignments dropped)], the sums and counts over all ranks, which
    `finish_step` reads with `names`.
    """
    runtime = run.runtime
    local = torch.tensor([float(sum(b.n_tgt_tokens for b in micro)), *flags], dtype=torch.float64)
    counts = all_reduce_sum_tensor(local.to(runtime.device, non_blocking=True), runtime)  # (3,)
    if graphs is not None:
        return graphs.queue(counts, micro)
    sums, figures = accumulate(objective, micro, runtime, counts[0], run.cfg.trainer.max_tokens)
    return update(run, sums, counts, figures)


def update(
    run: Run, sums: Tensor, counts: Tensor, figures: dict[str, Tensor], set_to_none: bool = True
) -> tuple[Tensor, list[str]]:
    """The gradient norm and Adam's update after the step's backward passes (skipped by the device when
    not finite), the gradients zeroed (or freed: `set_to_none`); the values `queue_step` returns."""
    runtime = run.runtime
    norm = grad_norm(run.model, run.cfg.optim.clip_grad_norm)  # () of the ranks' summed gradients
    sums = all_reduce_sum_tensor(sums.double(), runtime)
    run.optimizer.found_inf = (~(sums[0].isfinite() & norm.isfinite())).float()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=set_to_none)
    extra = [value.to(runtime.device, torch.float64)[None] for value in figures.values()]
    return torch.cat([sums, counts, norm.double()[None], *extra]), list(figures)


def finish_step(
    run: Run, queued: tuple[Tensor, list[str]], micro: list[Batch]
) -> tuple[dict[str, Any], bool, bool]:
    """Wait for the step `queue_step` queued (the step's one read from the device) and count it when
    it was finite: the schedule moves on only then.

    Returns the step's statistics (per target token, and the objective's figures by name) and whether
    any rank wants to stop or to save.
    """
    values, names = queued
    loss_sum, nll_sum, n_tokens, stop, save_due, norm, *figures = values.tolist()
    lr = float(run.optimizer.param_groups[0]["lr"])  # the rate of this step's update (a tensor with graphs)
    finite = math.isfinite(loss_sum) and math.isfinite(norm)
    if finite:
        run.scheduler.step()
        run.step += 1
        if run.ema is not None:
            run.ema.update(run.step)
    stats = {
        "finite": finite,
        "loss": loss_sum / n_tokens,
        "nll": nll_sum / n_tokens,
        "tokens": n_tokens,
        "lr": lr,
        "grad_norm": norm,
        "flops": sum(train_flops(run.cfg.model, *b.src.shape, b.tgt_in.size(1)) for b in micro),
    }
    stats.update(zip(names, figures))
    return stats, stop > 0, save_due > 0


def accumulate(
    objective: nn.Module, micro: list[Batch], runtime: Runtime, n_tokens: Tensor, max_tokens: int
) -> tuple[Tensor, dict[str, Tensor]]:
    """Forward and backward over this rank's batches of one step; gradient = d(loss sum) / n_tokens,
    the step's target tokens over all ranks (a device scalar). Returns this rank's sums of the loss
    and of the NLL (2,), and the objective's figures of the last batch."""
    scale = runtime.world_size / n_tokens  # DDP averages the ranks' gradients; this turns it into the sum
    sums, figures = torch.zeros(2, device=runtime.device), {}
    for i, batch in enumerate(micro):
        synced = not runtime.distributed or i == len(micro) - 1  # all-reduce gradients once, after the last
        with nullcontext() if synced else objective.no_sync():
            loss, nll, figures = forward_backward(objective, batch, scale, runtime, max_tokens)
            sums += torch.stack([loss, nll])
    return sums, figures


def forward_backward(
    objective: nn.Module, batch: Batch, scale: float, runtime: Runtime, max_tokens: int
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    try:
        with runtime.autocast():
            loss, nll, figures = objective(batch.src, batch.tgt_in, batch.tgt_out)
        (loss * scale).backward()
    except torch.OutOfMemoryError:
        raise TrainingError(
            f"out of memory on {runtime.device} for a batch of src {tuple(batch.src.shape)}, tgt "
            f"{tuple(batch.tgt_in.shape)}; lower trainer.max_tokens (now {max_tokens}): gradient "
            "accumulation keeps the tokens per step at trainer.tokens_per_step"
        ) from None
    return loss.detach(), nll, figures


def grad_norm(model: nn.Module, clip: float) -> Tensor:
    """The global L2 norm of the gradients (on their device), clipped to `clip` when positive (the
    paper does not clip)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
    return norm


@torch.no_grad()
def validate(objective: nn.Module, batches: list[Batch], runtime: Runtime) -> tuple[float, float]:
    """Loss and NLL per target token on the `valid` split, summed over every rank's share."""
    objective.eval()
    loss_sum = nll_sum = n_tokens = 0.0
    for batch in batches:
        batch = batch.to(runtime.device, non_blocking=True)
        with runtime.autocast():
            loss, nll, _ = objective(batch.src, batch.tgt_in, batch.tgt_out)
        loss_sum, nll_sum, n_tokens = (
            loss_sum + loss.item(),
            nll_sum + nll.item(),
            n_tokens + batch.n_tgt_tokens,
        )
    objective.train()
    loss_sum, nll_sum, n_tokens = all_reduce_sum([loss_sum, nll_sum, n_tokens], runtime)
    return loss_sum / n_tokens, nll_sum / n_tokens
