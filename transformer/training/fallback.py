"""Speed paths that fall back: a training step that fails on a path the run took for speed (a CUDA-graph
capture, compile, a fused-attention backend, a CPU kernel) is redone on the plain path, which the run
keeps to its end, with one warning that names the switch turning the path off and the error's first
line (also in TensorBoard, as train/fallback). A run of several processes stops instead, as before: a
redo on one rank would leave the others waiting in the step's collectives.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from transformer.data.batching import Batch
from transformer.kernels import Kernels
from transformer.kernels.cpu import NoiseDropout, OneDNNFeedForward, OneDNNLinear, ShortAttention
from transformer.training.distributed import attention_backends
from transformer.training.loss import Seq2SeqLoss
from transformer.training.monitor import Monitor
from transformer.training.state import Run, rng_state, set_rng_state
from transformer.training.step import Replays

COMPILERS = ("torch._dynamo", "torch._inductor", "torch._functorch")  # compiling, or compiled code
KERNEL_MODULES = (OneDNNLinear, OneDNNFeedForward, NoiseDropout, ShortAttention)


@dataclass(frozen=True)
class SpeedPath:
    name: str  # as the warning says it
    switch: str  # the override that keeps it off from the start


GRAPHS = SpeedPath("CUDA graphs", "trainer.cuda_graphs=false")
COMPILE = SpeedPath("compiled regions", "trainer.compile=false")
ATTENTION = SpeedPath("fused attention backends", "trainer.attention_backends=[math]")
KERNELS = SpeedPath("CPU kernels", "trainer.cpu_kernels=off")


class SpeedPaths:
    """The run's training step (`queue_step`) on the speed paths it has on, each turned off for good
    where a step fails on it; that step is then redone from where it began (gradients zeroed, random
    generators as they were: Adam has not stepped). A failed CUDA-graph capture needs no redo: the work
    it recorded ran eagerly before, and the graphs finish the step eagerly (`StepGraphs.failed`)."""

    def __init__(
        self,
        run: Run,
        objectives: tuple[nn.Module, Seq2SeqLoss],
        graphs: Replays | None,
        queue_step: Callable,
        monitor: Monitor,
    ) -> None:
        trainer = run.cfg.trainer
        self.run, (self.objective, self.loss), self.graphs = run, objectives, graphs
        self.queue_step, self.monitor = queue_step, monitor
        self.backends = trainer.attention_backends
        self.eager = False  # compiled regions run as plain code
        self.on = [GRAPHS] if graphs is not None else []
        self.on += [COMPILE] if trainer.compile else []
        self.on += [ATTENTION] if self.backends != ["math"] else []
        self.on += [KERNELS] if any(run.runtime.kernels.record().values()) else []

    @contextmanager
    def context(self) -> Iterator[None]:
        """Where a step or a validation runs: the attention backends and compile as they stand."""
        with (
            attention_backends(self.backends),
            torch.compiler.set_stance("force_eager" if self.eager else "default"),
        ):
            yield

    def queue(self, micro: list[Batch], flags: list[float]) -> Any:
        """`queue_step` of these batches, redone on the plain path where a speed path fails (an error
        that the redo meets again was no speed path's: it is raised)."""
        rngs, failed = rng_state(), None
        while True:
            try:
                with self.context():
                    queued = self.queue_step(self.run, self.objective, micro, flags, self.graphs)
            except Exception as error:
                again = failed is not None and (type(error), str(error)) == (type(failed), str(failed))
                path = None if self.run.runtime.distributed or again else self.blame(error)
                if path is None:
                    raise
                failed = error
                self.run.optimizer.zero_grad(set_to_none=self.graphs is None)  # graphs keep their memory
                set_rng_state(rngs)
                self.turn_off(path, error)
                continue
            if self.graphs is not None and self.graphs.failed is not None:
                self.turn_off(GRAPHS, self.graphs.failed)
            return queued

    def blame(self, error: Exception) -> SpeedPath | None:
        """The speed path on which `error` was raised (the innermost frame that one of them runs), if on."""
        for frame, _ in reversed(list(traceback.walk_tb(error.__traceback__))):
            module, owner = frame.f_globals.get("__name__", ""), frame.f_locals.get("self")
            for path, here in (
                (COMPILE, module.startswith(COMPILERS) or "torchinductor" in frame.f_code.co_filename),
                (KERNELS, module.startswith("transformer.kernels") or isinstance(owner, KERNEL_MODULES)),
                (ATTENTION, module == "transformer.attention"),
            ):
                if here and path in self.on:
                    return path
        return None

    def turn_off(self, path: SpeedPath, error: BaseException) -> None:
        run = self.run
        self.on.remove(path)
        if path is GRAPHS:
            self.graphs.release()
            self.graphs = None
        elif path is COMPILE:
            self.eager = True
        elif path is ATTENTION:
            self.backends = ["math"]
        elif path is KERNELS:
            plain = Kernels.choose(run.runtime.device, "off")
            run.runtime.kernels, run.model = plain, plain.apply(run.model)  # the same parameters
            self.loss.model, self.loss.products = run.model, plain.products
            if run.cfg.trainer.compile:  # the copies' compiled calls are the old modules'
                self.loss.compile_regions()
        lines = str(error).strip().splitlines()
        done = "finished" if path is GRAPHS else "redone"  # a failed capture ran its work: see StepGraphs
        self.monitor.fallback(
            run.step + 1,
            f"step {run.step + 1}: {path.name} failed ({type(error).__name__}: {lines[0] if lines else ''}); "
            f"{done} and going on without them ({path.switch} keeps them off)",
        )
