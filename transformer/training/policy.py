"""When the training loop validates, saves and stops.

- validation: every `trainer.eval_every_steps` steps and after the last one; the valid split translated
  and scored (BLEU, chrF, chrF++) every `trainer.translate_every_steps` steps and after the last one;
- the best checkpoint: `checkpoint_best.pt` after each validation of `trainer.best_metric` that beats
  every earlier one (`Best`); `trainer.patience` validations in a row that do not improve stop the run
  early, with a checkpoint, and the finish stage runs;
- a checkpoint: every `trainer.save_every_steps` steps or `trainer.save_every_minutes` minutes, after
  the last step, and before a stop (an interim one, which the resumed run's next checkpoint replaces);
- a stop: SIGTERM or Ctrl-C (on any rank) stops the run after the current step's checkpoint, with
  `TrainingStopped`; during a `torch.compile` (minutes on a GPU) with no step since the last checkpoint,
  at once (on CUDA a backward compiled in autograd's device thread finishes first); a non-finite loss
  or gradient skips the update, and `trainer.max_nonfinite_steps` of them in a row stop the run with
  `TrainingError`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from torch._dynamo import callback as compile_callbacks

from transformer.config import TrainerConfig
from transformer.training.distributed import Runtime, all_reduce_sum, wait_for_main

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on (out of memory, a diverging loss); the message says what to change."""


class _StopNow(BaseException):
    """A signal during a compile: raised from the handler, through the compiler (which wraps exceptions
    of the Exception family), and turned into `TrainingStopped` as the loop leaves the policy."""


class TrainingStopped(Exception):
    """A signal (SIGTERM, Ctrl-C; on any rank) stopped the run after a checkpoint of `step`."""

    def __init__(self, step: int, signal_name: str | None) -> None:
        super().__init__(f"stopped at step {step} by {signal_name or 'a signal on another rank'}")
        self.step = step
        # a process's exit status after a signal: 128 + its number (SIGTERM 143, Ctrl-C 130)
        self.exit_status = 128 + signal.Signals[signal_name or "SIGTERM"].value


@dataclass
class Decision:
    """What to do after a step."""

    validate: bool
    translate: bool  # translate the valid split and score it
    save: bool
    interim: bool  # saved only for the stop: no save was due
    stop: bool


@dataclass
class Best:
    """The best validation so far of `metric` ("loss": lower is better; "bleu", "chrf", "chrf++":
    higher), its step, and the validations since that did not beat it; a checkpoint saves and restores it."""

    metric: str
    value: float | None = None
    step: int = 0
    since: int = 0

    def update(self, step: int, value: float) -> bool:
        """Count a validation; whether it is the best so far."""
        lower = self.metric == "loss"
        if self.value is None or (value < self.value if lower else value > self.value):
            self.value, self.step, self.since = value, step, 0
            return True
        self.since += 1
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value, "step": self.step, "since": self.since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's record; one of another metric (the run changed trainer.best_metric) starts anew."""
        if state.get("metric") == self.metric:
            self.value, self.step, self.since = state["value"], state["step"], state["since"]


class Policy:
    """The loop's decisions, step by step; a context that handles SIGTERM and Ctrl-C meanwhile (a second
    Ctrl-C interrupts at once). Handlers are installed only in the main thread (Python allows no other)."""

    def __init__(
        self, trainer: TrainerConfig, runtime: Runtime, step: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """clock: seconds from any origin, for trainer.save_every_minutes."""
        self.trainer, self.runtime, self.clock = trainer, runtime, clock
        self.step = step  # the last finished step
        self.saved_step = step  # the step of the last checkpoint (or of the start)
        self.received: str | None = None  # the signal this rank received
        self.compiling = False  # inside torch.compile: a signal stops the run at once
        self.last_save = clock()
        self.nonfinite = 0  # skipped updates in a row
        self._previous: dict[int, Any] = {}

    def requests(self) -> list[float]:
        """This rank's wishes for the step about to run, summed over the ranks with it: stop, save."""
        minutes = self.trainer.save_every_minutes
        save_due = minutes > 0 and self.clock() - self.last_save >= 60 * minutes
        return [float(self.received is not None), float(save_due)]

    def after_step(self, step: int, stats: dict[str, Any], stop: bool, save_due: bool) -> Decision:
        """stats: the step's (`step.finish_step`); stop, save_due: any rank's requests."""
        self.step = step
        if stats["finite"]:
            self.nonfinite = 0
        else:
            self._skipped(step, stats)
        last, healthy = step == self.trainer.max_steps, self.nonfinite == 0
        due = save_due or last or (healthy and _every(self.trainer.save_every_steps, step))
        every = self.trainer.translate_every_steps
        translate = every > 0 and (_every(every, step) or last)
        return Decision(
            validate=healthy and (_every(self.trainer.eval_every_steps, step) or last),
            translate=healthy and translate,
            save=stop or due,
            interim=stop and not due,
            stop=stop,
        )

    def saved(self) -> None:
        self.last_save, self.saved_step = self.clock(), self.step

    def stop(self, step: int) -> None:
        """After the checkpoint of `step`: every rank waits until rank 0 has written it (torchrun stops,
        and after 30 s kills, the other processes as soon as one exits with an error status)."""
        wait_for_main(self.runtime)
        log.warning("stopped at step %d by a signal; continue with trainer.resume=auto", step)
        raise TrainingStopped(step, self.received)

    def after_last_step(self, step: int) -> None:
        """A signal during the last step (its checkpoint written) stops the run too: the finish stage
        waits for the next start."""
        if all_reduce_sum([float(self.received is not None)], self.runtime)[0] > 0:
            log.warning("stopped after the last step by a signal; the next start runs the finish stage")
            raise TrainingStopped(step, self.received)

    def _skipped(self, step: int, stats: dict[str, Any]) -> None:
        self.nonfinite += 1
        log.warning(
            "step %d: non-finite loss or gradient (loss %s, gradient norm %s); update skipped (%d in a row)",
            step + 1,
            stats["loss"],
            stats["grad_norm"],
            self.nonfinite,
        )
        if self.nonfinite >= self.trainer.max_nonfinite_steps:
            raise TrainingError(
                f"{self.nonfinite} non-finite updates in a row (trainer.max_nonfinite_steps="
                f"{self.trainer.max_nonfinite_steps}): the run diverged; lower optim.lr_scale, raise "
                "optim.warmup_steps or set optim.clip_grad_norm and resume"
            )

    def __enter__(self) -> Policy:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        compile_callbacks.on_compile_start(self._compile_starts)
        compile_callbacks.on_compile_end(self._compile_ends)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        if self.compiling and self._nothing_unsaved():
            raise _StopNow
        log.warning("%s received: saving a checkpoint after this step", self.received)

    def _compile_starts(self, *_args: object) -> None:
        self.compiling = True
        main = threading.current_thread() is threading.main_thread()  # Python raises nowhere else
        if self.received is not None and main and self._nothing_unsaved():
            raise _StopNow  # the signal came before this compile, in the same step

    def _compile_ends(self, *_args: object) -> None:
        self.compiling = False

    def _nothing_unsaved(self) -> bool:
        """No step finished since the last checkpoint (or the start): stopping now loses nothing."""
        return self.step == self.saved_step

    def __exit__(self, kind: type[BaseException] | None, *_exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        with suppress(ValueError):  # absent once the compiler has been reset
            compile_callbacks.callback_handler.remove_start_callback(self._compile_starts)
            compile_callbacks.callback_handler.remove_end_callback(self._compile_ends)
        if kind is _StopNow:
            log.warning(
                "%s received while compiling: stopped at once, nothing unsaved (step %d; trainer.resume=auto "
                "goes on from there)",
                self.received,
                self.step,
            )
            raise TrainingStopped(self.step, self.received) from None


def _every(interval: int, step: int) -> bool:
    """Whether `step` is a multiple of `interval` (0 = never)."""
    return interval > 0 and step % interval == 0
