"""The training loop (§5): token-budget batches, the label-smoothed loss, Adam with the schedule of
Eq. (3), self-describing checkpoints and exact resume. What it is made of: `corpus` (the batches),
`state` (model, optimizer, what a checkpoint saves), `step` (one optimizer step), `policy` (when to
validate, save and stop), `monitor` (what it logs)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from transformer.checkpoint import (
    RESUME_KEYS,
    CheckpointError,
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    set_aside_newer,
)
from transformer.config import ConfigError, TrainConfig, TrainerConfig
from transformer.data.sources import split_names
from transformer.kernels import Kernels
from transformer.training.bleu import ValidText, load_valid_text, valid_bleu
from transformer.training.corpus import batches_forever, load_corpus
from transformer.training.distributed import (
    Runtime,
    all_reduce_sum,
    attention_backends,
    init_runtime,
    shutdown,
)
from transformer.training.graphs import StepGraphs, use_cuda_graphs
from transformer.training.monitor import Monitor, bf16_peak_flops
from transformer.training.policy import Decision, Policy
from transformer.training.state import Run, check_same_model, start_run
from transformer.training.step import finish_step, queue_step, validate
from transformer.utils.atomic import remove_temp_files

log = logging.getLogger(__name__)


def train(cfg: TrainConfig) -> Path:
    """Train until trainer.max_steps and return the run directory; SIGTERM or Ctrl-C save a checkpoint,
    then raise TrainingStopped."""
    trainer = cfg.trainer
    run_dir = Path(trainer.run_dir)
    _check_resume_setting(trainer, run_dir)
    _check_validation(cfg)
    runtime = init_runtime(trainer)
    use_cuda_graphs(cfg, runtime, trainer.length_buckets != 0)  # a mistake, said before the data loads
    if runtime.is_main and checkpoint_dir(run_dir).is_dir():
        remove_temp_files(checkpoint_dir(run_dir))  # of a save that a kill interrupted
    try:
        found = _find_resume(cfg, run_dir, runtime.is_main)
        if found is not None:
            runtime.kernels = _resumed_kernels(runtime, trainer, found[1])
            if runtime.is_main:
                set_aside_newer(run_dir, found[1]["step"])  # never rotated in or averaged with this run's
        corpus = load_corpus(cfg, runtime, None if found is None else found[1])
        run, objective = start_run(cfg, runtime, corpus.sampler, corpus.meta, corpus.spm_model)
        if found is not None:
            run.restore(*found)
        use_graphs = use_cuda_graphs(cfg, runtime, bool(corpus.sampler.buckets))
        graphs = StepGraphs(run, objective) if use_graphs else None  # made after restore: its rate tensor
        accum = trainer.grad_accum(runtime.world_size)
        batches = batches_forever(corpus.sampler, corpus.train, trainer.pad_to_multiple, runtime.device)
        validated = objective.module if runtime.distributed else objective  # no gradient sync needed
        text = load_valid_text(cfg) if trainer.bleu_every_steps and runtime.is_main else None
        validation = _Validation(validated, corpus.valid, text)
        peak = bf16_peak_flops(runtime.device) if runtime.dtype == torch.bfloat16 else None
        steps = (run.step, trainer.max_steps)
        monitor = Monitor(
            run_dir,
            runtime.is_main,
            trainer.progress,
            steps,
            trainer.log_every_steps,
            runtime.device,
            peak,
            trainer.profile_steps,
        )
        policy, micro = Policy(trainer, runtime, run.step), None
        with monitor, policy, attention_backends(trainer.attention_backends), logging_redirect_tqdm():
            _log_start(run, accum, graphs is not None)  # from here on a signal stops the run cleanly
            while run.step < trainer.max_steps and not run.early_stopped:
                micro = micro or [next(batches) for _ in range(accum)]
                monitor.before_step(run.step + 1)
                queued = queue_step(run, objective, micro, policy.requests(), graphs)
                consumed = run.sampler.state_dict()  # what a checkpoint of this step resumes from
                # the next step's batches are read and sent while the device works on this one
                upcoming = [next(batches) for _ in range(accum)] if run.step + 1 < trainer.max_steps else None
                stats, stop, save_due = finish_step(run, queued, micro)
                micro = upcoming
                decision = policy.after_step(run.step, stats, stop, save_due)
                if stats["finite"]:
                    monitor.step(run.step, stats)
                with torch.compiler.set_stance("force_eager"):  # compiled for training steps only
                    best = _validate(run, decision, validation, monitor)
                numbered = decision.save or run.early_stopped  # the last checkpoint of an early stop
                if numbered or best:
                    run.save(consumed, decision.interim, numbered, best)
                if numbered:  # a resume point; the best alone is none: the save clock runs on
                    policy.saved()
                if decision.stop:
                    policy.stop(run.step)
            policy.after_last_step(run.step)
        return run_dir
    finally:
        objective = None  # DDP's reducer goes before the process group does (distributed.shutdown)
        shutdown(runtime)


@dataclass
class _Validation:
    """What validations need: the objective, this rank's valid batches (loss), the valid text (BLEU,
    rank 0)."""

    objective: torch.nn.Module
    batches: list | None
    text: ValidText | None


def _validate(run: Run, decision: Decision, validation: _Validation, monitor: Monitor) -> bool:
    """The step's validations, logged; whether the best metric's was the best so far (checkpoint_best.pt
    is due). Sets run.early_stopped once trainer.patience validations in a row did not improve."""
    value = None
    if decision.validate and validation.batches is not None:
        loss, nll = validate(validation.objective, validation.batches, run.runtime)
        monitor.valid(run.step, loss, nll)
        value = loss if run.best.metric == "loss" else value
    if decision.bleu:
        scores = valid_bleu(run, validation.text) if run.runtime.is_main else {"bleu": 0.0, "sacrebleu": 0.0}
        scores = dict(zip(scores, all_reduce_sum(list(scores.values()), run.runtime)))  # rank 0's, everywhere
        monitor.bleu(run.step, scores)
        value = scores["bleu"] if run.best.metric == "bleu" else value
    if value is None:
        return False
    best = run.best.update(run.step, value)
    patience = run.cfg.trainer.patience
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


def _resumed_kernels(runtime: Runtime, trainer: TrainerConfig, ckpt: dict[str, Any]) -> Kernels:
    """The CPU kernels a resumed run takes: with trainer.cpu_kernels=auto those it was trained with, so
    that it resumes exactly (a checkpoint from before the choice: every kernel, as the CPU ran then); a
    run trained on a GPU takes those this CPU chooses (no resume across devices is bitwise)."""
    if runtime.device.type != "cpu" or ("kernels" in ckpt and ckpt["kernels"] is None):
        return runtime.kernels
    recorded = ckpt.get("kernels") or Kernels.choose(runtime.device, "on").record()
    if trainer.cpu_kernels == "auto":
        return Kernels(**recorded)
    if recorded != runtime.kernels.record():
        log.warning(
            "trainer.cpu_kernels=%s: the run was trained with %s; it goes on with %s, not bitwise as before",
            trainer.cpu_kernels,
            Kernels(**recorded).describe(),
            runtime.kernels.describe(),
        )
    return runtime.kernels


def _check_validation(cfg: TrainConfig) -> None:
    """What needs validations (BLEU, the best by BLEU, early stopping) on data without a valid split,
    refused before any heavy work; the validation loss alone is skipped, with a warning."""
    trainer = cfg.trainer
    if "valid" in split_names(cfg.data):
        return
    needs = [
        f"trainer.{k}={getattr(trainer, k)}" for k in ("bleu_every_steps", "patience") if getattr(trainer, k)
    ]
    needs += ["trainer.best_metric=bleu"] if trainer.best_metric == "bleu" else []
    if needs:
        raise ConfigError(
            f"{', '.join(needs)}: validations on the 'valid' split, which data {cfg.data.name} does not "
            "have; add one (data.splits.valid) or turn these off"
        )
    if trainer.eval_every_steps:
        log.warning("data %s has no 'valid' split: no validation loss, no checkpoint_best.pt", cfg.data.name)


def _check_resume_setting(trainer: TrainerConfig, run_dir: Path) -> None:
    """Mistakes in trainer.resume, found before any heavy work."""
    if trainer.resume == "never" and list_checkpoints(run_dir):
        raise ConfigError(
            f"{run_dir} already holds checkpoints and trainer.resume=never would mix two runs there; "
            "choose another trainer.run_dir, or trainer.resume=auto to continue"
        )
    if trainer.resume not in ("auto", "never") and not Path(trainer.resume).is_file():
        raise ConfigError(
            f"trainer.resume={trainer.resume}: no such file (use auto, never or a checkpoint path)"
        )


def _find_resume(cfg: TrainConfig, run_dir: Path, is_main: bool) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint the run continues from (None: from step 0); one that cannot resume it (no resume
    state, another model) fails here, before the data is prepared."""
    trainer = cfg.trainer
    if trainer.resume == "never":
        return None
    if trainer.resume == "auto":
        found = latest_checkpoint(run_dir)
    else:
        ckpt = load_checkpoint(trainer.resume)
        missing = [key for key in RESUME_KEYS if key not in ckpt]
        if missing:
            raise CheckpointError(f"{trainer.resume} cannot resume training: it has no {', '.join(missing)}")
        found = Path(trainer.resume), ckpt
    if found is not None:  # the vocabulary's size is the prepared data's: compared once it is
        check_same_model(cfg.model, *found, but=("vocab_size",))
    if found is not None and found[1]["step"] >= trainer.max_steps and is_main:
        log.warning(
            "%s is at step %d, trainer.max_steps=%d: nothing left to train (raise trainer.max_steps "
            "to train on)",
            found[0],
            found[1]["step"],
            trainer.max_steps,
        )
    return found


def _log_start(run: Run, accum: int, graphs: bool) -> None:
    trainer, runtime = run.cfg.trainer, run.runtime
    batch = trainer.batch_tokens(runtime.world_size)
    log.info(
        "%s on %s x%d (%s; CPU kernels: %s): %s parameters; %d batch(es) of <= %d padded tokens per rank "
        "per step, <= %d per step (trainer.tokens_per_step=%d, trainer.max_tokens=%d); length buckets: %s; "
        "attention backends: %s; CUDA graphs: %s",
        run.run_dir,
        runtime.device,
        runtime.world_size,
        str(runtime.dtype).removeprefix("torch."),
        runtime.kernels.describe(),
        f"{run.model.num_parameters():,}",
        accum,
        batch,
        batch * accum * runtime.world_size,
        trainer.tokens_per_step,
        trainer.max_tokens,
        " ".join(map(str, run.sampler.buckets)) if run.sampler.buckets else "none",
        ", ".join(trainer.attention_backends or ["torch's choice"]),
        "one per batch shape" if graphs else "off",
    )
