"""The training loop (§5): it executes a run's `Plan` (plan.py) step after step: token-budget batches,
the label-smoothed loss, Adam with the schedule of Eq. (3), validations, self-describing checkpoints
and exact resume. What it is made of: `state` (model, optimizer, what a checkpoint saves), `step` (one
optimizer step), `fallback` (the speed paths a failed step turns off), `policy` (when to validate, save
and stop), `monitor` (what it logs); the `Parts` it runs with are handed in, so that a test or a tool
can swap one."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.contrib.logging import logging_redirect_tqdm

from transformer.config import TrainConfig
from transformer.training.bleu import SCORES, valid_scores
from transformer.training.distributed import all_reduce_sum
from transformer.training.fallback import SpeedPaths
from transformer.training.graphs import StepGraphs
from transformer.training.monitor import Monitor, bf16_peak_flops
from transformer.training.plan import Plan
from transformer.training.policy import Decision, Policy
from transformer.training.state import Run, start_run
from transformer.training.step import Replays, finish_step, queue_step, validate

log = logging.getLogger(__name__)


@dataclass
class Parts:
    """What a run is made of besides its plan, each swappable: the clock of the timed checkpoints and
    the throughput, the monitor (progress, TensorBoard), the step (queued on the device, then read),
    the saver of checkpoints, the graphs a step replays (None: as the plan decides) and a wrapper
    around the objective of the training steps (validations run the objective itself)."""

    clock: Callable[[], float] = time.perf_counter
    monitor: type[Monitor] = Monitor
    queue_step: Callable = queue_step
    finish_step: Callable = finish_step
    save: Callable = Run.save
    graphs: Callable[[Run, nn.Module], Replays] | None = None
    objective: Callable[[nn.Module], nn.Module] = lambda objective: objective


def train(cfg: TrainConfig, parts: Parts | None = None) -> Path:
    """Train until trainer.max_steps and return the run directory; SIGTERM or Ctrl-C save a checkpoint,
    then raise TrainingStopped."""
    parts = parts or Parts()
    plan = Plan.make(cfg)  # everything the settings and the checkpoint decide: mistakes stop here
    try:
        plan = plan.with_data()
        run, objective = start_run(
            plan.cfg, plan.runtime, plan.sampler, plan.corpus, plan.resume, plan.finetune
        )
        validated = objective.module if plan.runtime.distributed else objective  # no gradient sync needed
        objective = parts.objective(objective)
        graphs = parts.graphs or (StepGraphs if plan.graphs else None)
        _loop(plan, run, (objective, validated), graphs(run, objective) if graphs else None, parts)
        return plan.run_dir
    finally:
        objective = None  # DDP's reducer goes before the process group does (distributed.shutdown)
        plan.close()


def _loop(
    plan: Plan, run: Run, objectives: tuple[nn.Module, nn.Module], graphs: Replays | None, parts: Parts
) -> None:
    """objectives: the training steps' objective and the validations'."""
    trainer, runtime, (objective, validated) = plan.cfg.trainer, plan.runtime, objectives
    accum, batches = trainer.grad_accum(runtime.world_size), plan.batches
    peak = bf16_peak_flops(runtime.device) if runtime.dtype == torch.bfloat16 else None
    monitor = parts.monitor(
        plan.run_dir,
        runtime.is_main,
        trainer.progress,
        (run.step, trainer.max_steps),
        trainer.log_every_steps,
        runtime.device,
        peak,
        trainer.profile_steps,
        parts.clock,
    )
    policy, micro = Policy(trainer, runtime, run.step, parts.clock), None
    speed = SpeedPaths(run, (objective, validated), graphs, parts.queue_step, monitor)
    with monitor, policy, logging_redirect_tqdm():
        log.info("training steps %d to %d", run.step + 1, trainer.max_steps)  # a signal now stops cleanly
        while run.step < trainer.max_steps and not run.early_stopped:
            micro = micro or [next(batches) for _ in range(accum)]
            monitor.before_step(run.step + 1)
            queued = speed.queue(micro, policy.requests())  # redone on the plain path if a speed path fails
            consumed = run.sampler.state_dict()  # what a checkpoint of this step resumes from
            # the next step's batches are read and sent while the device works on this one
            upcoming = [next(batches) for _ in range(accum)] if run.step + 1 < trainer.max_steps else None
            stats, stop, save_due = parts.finish_step(run, queued, micro)
            micro = upcoming
            decision = policy.after_step(run.step, stats, stop, save_due)
            if stats["finite"]:
                monitor.step(run.step, stats)
            # validated with the average of the weights where kept
            averaged = run.ema is not None and (decision.validate or decision.translate)
            average = run.ema.swapped() if averaged else nullcontext()
            # compiled for training steps only
            with speed.context(), torch.compiler.set_stance("force_eager"), average:
                best = _validate(plan, run, decision, validated, monitor)
            numbered = decision.save or run.early_stopped  # the last checkpoint of an early stop
            if numbered or best:
                parts.save(run, consumed, decision.interim, numbered, best)
            if numbered:  # a resume point; the best alone is none: the save clock runs on
                policy.saved()
            if decision.stop:
                policy.stop(run.step)
        policy.after_last_step(run.step)


def _validate(plan: Plan, run: Run, decision: Decision, objective: nn.Module, monitor: Monitor) -> bool:
    """The step's validations, logged; whether the best metric's was the best so far (checkpoint_best.pt
    is due). Sets run.early_stopped once trainer.patience validations in a row did not improve."""
    value, runtime = None, plan.runtime
    if decision.validate and plan.corpus.valid is not None:
        loss, nll = validate(objective, plan.corpus.valid, runtime)
        monitor.valid(run.step, loss, nll)
        value = loss if run.best.metric == "loss" else value
    if decision.translate:
        scores = valid_scores(run, plan.corpus.valid_text) if runtime.is_main else dict.fromkeys(SCORES, 0.0)
        scores = dict(zip(scores, all_reduce_sum(list(scores.values()), runtime)))  # rank 0's, everywhere
        monitor.scores(run.step, scores)
        value = scores.get(run.best.metric, value)
    if value is None:
        return False
    best = run.best.update(run.step, value)
    patience = plan.cfg.trainer.patience
    if patience and run.best.since >= patience:
        run.early_stopped = True
        log.warning(
            "step %d: %d validations without a better %s than step %d's %.4g (trainer.patience=%d): "
            "training stops here",
            run.step,
            run.best.since,
            run.best.metric,
            run.best.step,
            run.best.value,
            patience,
        )
    return best
