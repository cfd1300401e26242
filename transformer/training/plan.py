"""A training run, planned before it runs (§5). What a run decides is resolved in two phases, each
logged in one line:

1. `Plan.make(cfg)`, before any data work, from the configuration and the checkpoint alone: every check
   of the settings, the device and precision, the resume point and its checks, the CPU kernels (a
   resumed run's own), compile, and whether the steps may be CUDA graphs at all; a mistake stops the
   run here, before hours of data preparation.
2. `plan.with_data()`: the corpus prepared (by rank 0) and read, and what it decides: the vocabulary,
   the length buckets (a resumed run's own), the batches, whether the steps are CUDA graphs.

The loop (`loop.train`) only executes the plan.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from transformer.checkpoint import (
    RESUME_KEYS,
    CheckpointError,
    check_same_model,
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    set_aside_newer,
)
from transformer.config import LENGTH_BUCKETS, RESUME_CHANGES, ConfigError, TrainConfig, to_dict
from transformer.data.batching import Batch, TokenBudgetBatchSampler
from transformer.data.corpus import Corpus, batches_forever, read_corpus
from transformer.data.prepare import SPM_FILE, prepare
from transformer.data.tokenizer import Tokenizer
from transformer.kernels import Kernels
from transformer.training.distributed import Runtime, init_runtime, shutdown, wait_for_main
from transformer.training.finish import check_finish
from transformer.training.lock import lock, unlock
from transformer.training.state import Resume
from transformer.utils.atomic import remove_temp_files

log = logging.getLogger(__name__)
# model settings of the training, not of the weights: a fine-tuning run may change them (the vocabulary
# is the checkpoint's, its tokenizer encoding the corpus)
TRAINING_ONLY = ("init", "dropout", "attention_dropout", "moe_capacity", "moe_aux_loss")


@dataclass
class Plan:
    """What a run decided: before the data (`make`), then with it (`with_data`)."""

    cfg: TrainConfig
    runtime: Runtime  # rank, world size, device, precision, CPU kernels
    resume: Resume | None  # None: from step 0
    finetune: Resume | None = None  # the checkpoint whose weights step 0 starts from (trainer.finetune_from)
    # decided with the data
    corpus: Corpus | None = None
    sampler: TokenBudgetBatchSampler | None = None  # this rank's share of each step's batches
    batches: Iterator[Batch] | None = None  # its batches on the device, from where the sampler stands
    graphs: bool = False  # each step CUDA graph replays
    locked: bool = False  # this plan holds the run directory's lock (rank 0, until `close`)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.trainer.run_dir)

    @classmethod
    def make(cls, cfg: TrainConfig) -> Plan:
        """Everything the configuration and the checkpoint decide, with every check that needs no data."""
        check_settings(cfg)
        runtime = init_runtime(cfg.trainer)
        plan = cls(cfg, runtime, resume=None)
        try:
            plan.cuda_graphs()  # a mistake in trainer.cuda_graphs, said before any file is touched
            if runtime.is_main:  # one writer per run directory, from here to `close`
                lock(plan.run_dir)
                plan.locked = True
            plan.resume = find_resume(cfg, runtime)
            plan.finetune = find_finetune(cfg, plan.resume)
            runtime.kernels = choose_kernels(cfg, runtime, plan.resume)
        except BaseException:
            plan.close()
            raise
        plan.log_start()
        return plan

    def close(self) -> None:
        """The end of the run's process group and of its hold on the run directory."""
        shutdown(self.runtime)
        if self.locked:
            unlock(self.run_dir)
            self.locked = False

    def given_tokenizer(self) -> bytes | None:
        """The BPE a fine-tuning run encodes its corpus with: its checkpoint's, also once it goes on from
        its own checkpoints (which carry it), should the data be prepared again; None: learned on it."""
        if self.finetune is not None:
            return self.finetune.ckpt["spm_model"]
        started = self.resume is not None and self.resume.finetuned_from
        return self.resume.ckpt["spm_model"] if started else None

    def with_data(self) -> Plan:
        """The corpus (prepared by rank 0 while the others wait) and what it decides."""
        cfg, runtime = self.cfg, self.runtime
        if runtime.is_main:  # a quick check when it is ready
            prepare(cfg.data, tokenizer=self.given_tokenizer())
        wait_for_main(runtime)
        corpus = read_corpus(cfg, runtime.rank, runtime.world_size)
        vocab = corpus.meta["vocab_size"]
        fresh = self.resume is None and self.finetune is None
        if fresh and corpus.meta["tokenizer"].get("model_type") == "given":
            raise ConfigError(
                f"{cfg.data.dir} holds data encoded with a checkpoint's tokenizer (trainer.finetune_from); "
                "a new run learns its own: choose another data.dir, or data.force=true to rebuild it"
            )
        if self.resume is not None:  # the rest of the model was compared before the data (`find_resume`)
            check_vocabulary(cfg, self.resume, vocab)
        if self.resume is not None and (changes := check_resume_changes(cfg, self.resume, corpus.spm_model)):
            log.warning("resumed with %s (trainer.resume_changes)", "; ".join(changes))
        sampler = corpus.sampler(cfg.trainer, runtime.rank, runtime.world_size, self.length_buckets())
        batches = batches_forever(sampler, corpus.train, cfg.trainer.pad_to_multiple, runtime.device)
        model = replace(cfg.model, vocab_size=vocab)  # the corpus's vocabulary
        plan = replace(self, cfg=replace(cfg, model=model), corpus=corpus, sampler=sampler, batches=batches)
        recorded = self.recorded_buckets()
        if self.resume is not None and sampler.buckets != recorded:
            log.warning(
                "trainer.length_buckets=%s: the run was batched with buckets %s, it goes on with %s: other "
                "batches than it would have had",
                cfg.trainer.length_buckets,
                recorded,
                sampler.buckets,
            )
        plan.graphs = plan.cuda_graphs(sampler.buckets)
        plan.log_data()
        return plan

    def length_buckets(self) -> int | list[int] | None:
        """The length buckets of this run (trainer.length_buckets): a resumed run's are its checkpoint's
        (one from before buckets had none), so that it goes on with the very batches it would have had;
        else their number, by device where unset."""
        n = self.cfg.trainer.length_buckets
        if n is None and self.resume is not None:
            return self.recorded_buckets()
        return LENGTH_BUCKETS.get(self.runtime.device.type, 0) if n is None else n

    def recorded_buckets(self) -> list[int] | None:
        """The length buckets the resumed checkpoint was batched with (None: none, or no checkpoint)."""
        batching = None if self.resume is None else self.resume.ckpt.get("batching")
        return None if batching is None else batching["buckets"]

    def cuda_graphs(self, buckets: list[int] | None = None) -> bool:
        """Whether the steps are CUDA graph replays: trainer.cuda_graphs, or where unset, wherever they
        can run (`buckets`: the run's length buckets). Set to true where they cannot: a ConfigError that
        says what they need. Before the data is read only trainer.length_buckets=0 says that there will be
        no buckets."""
        cfg, runtime = self.cfg, self.runtime
        bucketed = bool(buckets) if self.corpus is not None else cfg.trainer.length_buckets != 0
        needs = []
        if runtime.device.type != "cuda":
            needs.append(f"a CUDA device (trainer.device={cfg.trainer.device} gives {runtime.device})")
        if runtime.distributed:
            needs.append(f"one process, not {runtime.world_size}: DDP's gradient all-reduce is not recorded")
        if cfg.model.moe_experts:
            needs.append("no mixture of experts (model.moe_experts=0): its routing sizes tensors by the data")
        if not bucketed:
            needs.append(
                "length buckets (trainer.length_buckets > 0): without them every batch has a new shape"
            )
        if cfg.trainer.cuda_graphs and needs:
            raise ConfigError(f"trainer.cuda_graphs=true needs {'; '.join(needs)}")
        return not needs if cfg.trainer.cuda_graphs is None else cfg.trainer.cuda_graphs

    def log_start(self) -> None:
        trainer, runtime, resume = self.cfg.trainer, self.runtime, self.resume
        start = "step 0" if resume is None else f"{resume.path} at step {resume.ckpt['step']}"
        if self.finetune is not None:
            start = f"step 0 with the weights of {self.finetune.path} (fine-tuning)"
        batch = trainer.batch_tokens(runtime.world_size)
        accum = trainer.grad_accum(runtime.world_size)
        log.info(
            "plan: %s on %s x%d (%s; CPU kernels: %s), from %s; %d batch(es) of <= %d padded tokens per "
            "rank per step, <= %d per step (trainer.tokens_per_step=%d, trainer.max_tokens=%d); compile: "
            "%s; attention backends: %s",
            self.run_dir,
            runtime.device,
            runtime.world_size,
            str(runtime.dtype).removeprefix("torch."),
            runtime.kernels.describe(),
            start,
            accum,
            batch,
            batch * accum * runtime.world_size,
            trainer.tokens_per_step,
            trainer.max_tokens,
            "by regions" if trainer.compile else "off",
            ", ".join(trainer.attention_backends or ["torch's choice"]),
        )

    def log_data(self) -> None:
        buckets = self.sampler.buckets
        log.info(
            "data: %s, %s training pairs, vocabulary %d; length buckets: %s; CUDA graphs: %s",
            self.cfg.data.dir,
            f"{len(self.corpus.train):,}",
            self.cfg.model.vocab_size,
            " ".join(map(str, buckets)) if buckets else "none",
            "one per batch shape" if self.graphs else "off",
        )


def check_settings(cfg: TrainConfig) -> None:
    """Mistakes that the settings alone show and their checks could not (they are the machine's or the
    run directory's), found before any heavy work: trainer.resume, the finish stage's decoding."""
    trainer, run_dir = cfg.trainer, Path(cfg.trainer.run_dir)
    if trainer.resume == "never" and list_checkpoints(run_dir):
        raise ConfigError(
            f"{run_dir} already holds checkpoints and trainer.resume=never would mix two runs there; "
            "choose another trainer.run_dir, or trainer.resume=auto to continue"
        )
    if trainer.resume not in ("auto", "never") and not Path(trainer.resume).is_file():
        raise ConfigError(
            f"trainer.resume={trainer.resume}: no such file (use auto, never or a checkpoint path)"
        )
    if trainer.finetune_from is not None:
        if not Path(trainer.finetune_from).is_file():
            raise ConfigError(f"trainer.finetune_from={trainer.finetune_from}: no such file")
        if trainer.resume not in ("auto", "never"):
            raise ConfigError(
                f"trainer.finetune_from starts a new run, trainer.resume={trainer.resume} continues one: "
                "give one"
            )
    check_finish(cfg)
    every, average = trainer.save_every_steps, cfg.finish.average_last
    if average > 1 and every and trainer.max_steps % every:
        log.warning(
            "trainer.save_every_steps=%d does not divide trainer.max_steps=%d: the %d checkpoints "
            "finish.average_last averages are not evenly spaced up to the last step (choose a divisor)",
            every,
            trainer.max_steps,
            average,
        )


def find_resume(cfg: TrainConfig, runtime: Runtime) -> Resume | None:
    """The checkpoint the run continues from (None: from step 0); one that cannot resume it (no resume
    state, another model) fails here, before the data is prepared. Then rank 0 tidies the run directory:
    the checkpoints of steps past it set aside (never rotated in or averaged with this run's), and what
    an interrupted save left removed."""
    trainer, run_dir = cfg.trainer, Path(cfg.trainer.run_dir)
    resume = None
    if trainer.resume == "auto":
        found = latest_checkpoint(run_dir)
        resume = None if found is None else Resume(*found)
    elif trainer.resume != "never":
        ckpt = load_checkpoint(trainer.resume)
        missing = [key for key in RESUME_KEYS if key not in ckpt]
        if missing:
            raise CheckpointError(f"{trainer.resume} cannot resume training: it has no {', '.join(missing)}")
        resume = Resume(Path(trainer.resume), ckpt)
    if resume is not None:  # the vocabulary's size is the prepared data's: compared once it is
        check_same_start(cfg, resume)
        check_same_model(cfg.model, resume.path, resume.ckpt, but=("vocab_size",))
        tokenizer = Path(cfg.data.dir) / SPM_FILE  # where prepared data is kept, not prepared anew
        prepared = tokenizer.read_bytes() if tokenizer.is_file() and not cfg.data.force else None
        check_resume_changes(cfg, resume, prepared)
    if resume is not None and runtime.is_main:
        set_aside_newer(run_dir, resume.ckpt["step"])
        if resume.ckpt["step"] >= trainer.max_steps:
            log.warning(
                "%s is at step %d, trainer.max_steps=%d: nothing left to train (raise trainer.max_steps "
                "to train on)",
                resume.path,
                resume.ckpt["step"],
                trainer.max_steps,
            )
    if runtime.is_main and checkpoint_dir(run_dir).is_dir():
        remove_temp_files(checkpoint_dir(run_dir))
    return resume


def check_same_start(cfg: TrainConfig, resume: Resume) -> None:
    """Refuse to go on, as a fine-tuning run of trainer.finetune_from, with a run that did not start from
    that checkpoint."""
    path = cfg.trainer.finetune_from
    started = resume.finetuned_from
    if path is not None and (started is None or Path(started).resolve() != Path(path).resolve()):
        raise ConfigError(
            f"trainer.finetune_from={path}, but {cfg.trainer.run_dir} holds a run started "
            f"{f'from {started}' if started else 'from scratch'} ({resume.path}); choose another "
            "trainer.run_dir"
        )


def find_finetune(cfg: TrainConfig, resume: Resume | None) -> Resume | None:
    """The checkpoint whose weights start the run (trainer.finetune_from), its model compared with this
    run's before the data is prepared; None without one, or once the run has its own checkpoints."""
    path = cfg.trainer.finetune_from
    if path is None:
        return None
    if resume is not None:  # (`check_same_start` compared its start)
        log.info("trainer.finetune_from=%s started this run; it goes on from %s", path, resume.path)
        return None
    ckpt = load_checkpoint(path)
    missing = [key for key in ("model", "model_config", "spm_model") if not ckpt.get(key)]
    if missing:
        lacks = ", ".join(missing)
        raise CheckpointError(f"trainer.finetune_from={path} cannot start a run: it has no {lacks}")
    theirs, mine = ckpt["model_config"], to_dict(cfg.model)
    changed = [
        f"model.{key}={mine[key]} (the checkpoint's: {theirs.get(key)})"
        for key in sorted(mine)
        if key not in (*TRAINING_ONLY, "vocab_size") and theirs.get(key) != mine[key]
    ]
    if changed:
        raise ConfigError(
            f"trainer.finetune_from={path} holds another model: {', '.join(changed)}; set the checkpoint's"
        )
    return Resume(Path(path), ckpt)


def check_vocabulary(cfg: TrainConfig, resume: Resume, vocab_size: int) -> None:
    """Refuse to resume a model of another vocabulary (the size the prepared data gives)."""
    check_same_model(replace(cfg.model, vocab_size=vocab_size), resume.path, resume.ckpt)


def check_resume_changes(cfg: TrainConfig, resume: Resume, spm_model: bytes | None) -> list[str]:
    """Refuse a resume that changes what the run means unless trainer.resume_changes accepts it: the
    tokenizer (`spm_model`, the data's; None: not known yet) and the batch budget under which the data
    position is read (RESUME_CHANGES); a checkpoint from before a key was recorded is not compared on it.
    Returns the differences accepted, as the log says them."""
    recorded = resume.ckpt.get("config", {}).get("trainer", {})
    changed = {
        f"trainer.{key}": f"{recorded[key]} -> {getattr(cfg.trainer, key)}"
        for key in (name.removeprefix("trainer.") for name in RESUME_CHANGES if name.startswith("trainer."))
        if key in recorded and recorded[key] != getattr(cfg.trainer, key)
    }
    if resume.ckpt.get("spm_model") and spm_model is not None and resume.ckpt["spm_model"] != spm_model:
        check_vocabulary(cfg, resume, Tokenizer.from_bytes(spm_model).vocab_size)  # the model's error first
        changed["tokenizer"] = f"not {Path(cfg.data.dir) / SPM_FILE}"
    refused = [key for key in changed if key not in cfg.trainer.resume_changes]
    if refused:
        raise ConfigError(
            f"{resume.path} was trained with other {', '.join(f'{k} ({changed[k]})' for k in refused)}: "
            f"the run would go on with {'other token ids' if 'tokenizer' in refused else 'other batches'}; "
            f"undo the change, or set trainer.resume_changes=[{','.join(refused)}] to go on knowingly"
        )
    return [f"{key} {change}" for key, change in changed.items()]


def choose_kernels(cfg: TrainConfig, runtime: Runtime, resume: Resume | None) -> Kernels:
    """The CPU kernels of the run (trainer.cpu_kernels): by the CPU with "auto", except that a resumed run
    takes those it was trained with, so that it resumes exactly (a checkpoint from before the choice:
    every kernel, as the CPU ran then); a run trained on a GPU takes those this CPU chooses (no resume
    across devices is bitwise)."""
    setting = cfg.trainer.cpu_kernels
    chosen = Kernels.choose(runtime.device, setting)
    if resume is None or runtime.device.type != "cpu" or resume.ckpt.get("kernels", {}) is None:
        return chosen
    recorded = resume.ckpt.get("kernels") or Kernels.choose(runtime.device, "on").record()
    if setting == "auto":
        return Kernels(**recorded)
    if recorded != chosen.record():
        log.warning(
            "trainer.cpu_kernels=%s: the run was trained with %s; it goes on with %s, not bitwise as before",
            setting,
            Kernels(**recorded).describe(),
            chosen.describe(),
        )
    return chosen
