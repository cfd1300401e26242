"""What a training run is made of and what its checkpoints save and restore: the model, Adam and the
schedule of Eq. (3), the batch sampler's position and every random generator (exact resume: on the
CPU an interrupted and resumed run ends with bitwise the same weights as an uninterrupted one)."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim import Adam
from torch.optim.lr_scheduler import LambdaLR

from transformer.checkpoint import FORMAT, TRAINED, list_checkpoints, save_best, save_numbered
from transformer.config import OptimConfig, TrainConfig, to_dict
from transformer.data.batching import TokenBudgetBatchSampler
from transformer.data.corpus import Corpus
from transformer.model import Transformer
from transformer.training.distributed import Runtime, gather_objects, wrap
from transformer.training.ema import EMA
from transformer.training.loss import CHUNK_ROWS, Seq2SeqLoss
from transformer.training.policy import Best
from transformer.training.schedule import make_scheduler

log = logging.getLogger(__name__)


@dataclass
class Resume:
    """The checkpoint a run continues from."""

    path: Path
    ckpt: dict[str, Any]

    @property
    def finetuned_from(self) -> str | None:
        """The checkpoint whose weights started the run (trainer.finetune_from); None: from scratch."""
        return self.ckpt.get("config", {}).get("trainer", {}).get("finetune_from")


@dataclass
class Run:
    """What a checkpoint saves and restores, and the optimizer steps taken so far."""

    cfg: TrainConfig
    runtime: Runtime
    run_dir: Path
    model: Transformer  # unwrapped (no compile, no DDP), with the kernels of the runtime
    optimizer: Adam
    scheduler: LambdaLR
    sampler: TokenBudgetBatchSampler
    meta: dict[str, Any]
    spm_model: bytes
    best: Best  # the best validation so far (trainer.best_metric)
    early_stopped: bool = False  # trainer.patience ran out
    step: int = 0
    interim: Path | None = None  # the interim checkpoint of this run it resumed from, replaced by the next
    ema: EMA | None = None  # the average of the weights (trainer.ema_decay)

    def save(
        self, data_state: dict[str, int], interim: bool = False, numbered: bool = True, best: bool = False
    ) -> None:
        """Write a checkpoint (rank 0); every rank takes part, for its RNG state. data_state: the
        sampler's state after the batches of the steps taken (the loop reads ahead); interim: written
        only because a signal stops the run; numbered: as checkpoint_<step>.pt; best: (also) as
        checkpoint_best.pt."""
        rngs = gather_objects(rng_state(), self.runtime)
        if not self.runtime.is_main:
            return
        trained = self.model.state_dict()
        ckpt = {
            "format": FORMAT,
            "model": trained if self.ema is None else self.ema.state_dict(self.model),
            "model_config": to_dict(self.cfg.model),
            "spm_model": self.spm_model,
            "data_meta": self.meta,
            "config": to_dict(self.cfg),
            "step": self.step,
            "optimizer": _portable(self.optimizer.state_dict()),
            "scheduler": _portable(self.scheduler.state_dict()),
            "data_state": data_state,  # the ranks agree on (epoch, position)
            "rng": rngs,  # one entry per rank
            "interim": interim,
            "best": self.best.state_dict(),
            # a resumed run takes the same (trainer.cpu_kernels); None: trained on no CPU, none chosen
            "kernels": self.runtime.kernels.record() if self.runtime.device.type == "cpu" else None,
            "batching": {"buckets": self.sampler.buckets},  # and the same (trainer.length_buckets)
            "early_stopped": self.early_stopped,
        }
        if self.ema is not None:
            ckpt[TRAINED] = trained
        path = None
        if numbered:
            path = save_numbered(ckpt, self.run_dir, self.cfg.trainer.keep_last, self.interim)
            self.interim = None
            log.info("step %d: saved %s", self.step, path)
        if best:
            log.info("step %d: saved %s", self.step, save_best(ckpt, self.run_dir, path))

    def restore(self, path: Path, ckpt: dict[str, Any]) -> None:
        # the initialisation is the checkpoint's, whatever this run's model.init: its weights replace them
        self.cfg = replace(self.cfg, model=replace(self.cfg.model, init=ckpt["model_config"]["init"]))
        self.model.load_state_dict(ckpt.get(TRAINED, ckpt["model"]))
        self._restore_average(path, ckpt)
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self._apply_optim_settings(ckpt.get("config", {}).get("optim", {}))
        self.sampler.load_state_dict(ckpt["data_state"])
        self.step = int(ckpt["step"])
        self.best.load_state_dict(ckpt.get("best") or {})
        if (TRAINED in ckpt) != (self.ema is not None):  # its best was of the other weights
            self.best = Best(self.best.metric)
        self.early_stopped = bool(ckpt.get("early_stopped"))
        if ckpt.get("interim") and path.resolve() in {p.resolve() for p in list_checkpoints(self.run_dir)}:
            self.interim = path  # this run's own: never a file of another run directory
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
            seed_everything(self.cfg.trainer.seed + rank + self.step)
        log.info("resumed from %s at step %d (epoch %d)", path, self.step, self.sampler.epoch)

    def _restore_average(self, path: Path, ckpt: dict[str, Any]) -> None:
        """The checkpoint's average of the weights; one without starts it from the resumed weights."""
        if self.ema is not None and TRAINED in ckpt:
            self.ema.load_state_dict(self.model, ckpt["model"])
        elif self.ema is not None:
            self.ema = EMA(self.model, self.ema.decay)
            log.info("%s holds no average of the weights: trainer.ema_decay starts one from it", path)
        elif TRAINED in ckpt:
            log.info(
                "trainer.ema_decay=0: training goes on from the trained weights of %s, not their average",
                path,
            )

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


def start_run(
    cfg: TrainConfig,
    runtime: Runtime,
    sampler: TokenBudgetBatchSampler,
    corpus: Corpus,
    resume: Resume | None,
    finetune: Resume | None = None,
) -> tuple[Run, nn.Module]:
    """The model (every rank starts from the same weights: `finetune`'s where given) on the device with
    its kernels, its objective as the device runs it (`distributed.wrap`), Adam with beta1 = 0.9,
    beta2 = 0.98, eps = 1e-9 and the schedule of Eq. (3); then, resuming, the checkpoint's state in all
    of them."""
    seed_everything(cfg.trainer.seed)
    kernels = runtime.kernels
    model = Transformer(cfg.model)
    if finetune is not None:
        model.load_state_dict(finetune.ckpt["model"])
        log.info("fine-tuning %s: its weights, a new optimizer, schedule and step count", finetune.path)
    model = kernels.apply(model.to(runtime.device))
    ema = EMA(model, cfg.trainer.ema_decay) if cfg.trainer.ema_decay else None
    chunks = -(-cfg.trainer.max_tokens // CHUNK_ROWS)  # a batch's target tokens fit these chunks of the loss
    objective = Seq2SeqLoss(model, cfg.optim.label_smoothing, kernels.products, chunks)
    objective = wrap(objective, runtime, cfg.trainer.compile)
    seed_everything(cfg.trainer.seed + runtime.rank)  # each rank its own dropout masks
    optimizer = adam(model, cfg.optim)
    scheduler = make_scheduler(optimizer, cfg.optim, cfg.model.d_model)
    run_dir, best, meta = Path(cfg.trainer.run_dir), Best(cfg.trainer.best_metric), corpus.meta
    run = Run(cfg, runtime, run_dir, model, optimizer, scheduler, sampler, meta, corpus.spm_model, best)
    run.ema = ema
    if resume is not None:
        run.restore(resume.path, resume.ckpt)
    return run, objective


def adam(model: nn.Module, cfg: OptimConfig) -> Adam:
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


def _portable(state: dict[str, Any]) -> dict[str, Any]:
    """Adam's or the schedule's state_dict as any run resumes it: learning rates as numbers, not the
    device tensor that CUDA graphs read (a resumed run sets its own: `Run.restore`, `StepGraphs`)."""
    for group in state.get("param_groups", []):
        group.update(lr=float(group["lr"]), capturable=False)
    if "_last_lr" in state:
        state["_last_lr"] = [float(lr) for lr in state["_last_lr"]]
    return state


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every random generator training touches: Python, NumPy, torch CPU and CUDA."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """The inverse of `rng_state`."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
