"""The training step as CUDA graphs (`trainer.cuda_graphs`): the forward and backward of each batch
shape, and the gradient norm with Adam's update (§5.3), recorded once and replayed; the math is
`step.queue_step`'s (docs/performance.md, "The step as CUDA graphs").
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from transformer.data.batching import Batch
from transformer.training.state import Run
from transformer.training.step import forward_backward, update

Recorder = Callable[[Callable[[], None]], Callable[[], None]]  # work -> its replay, after one eager run


class StepGraphs:
    """queue(counts, micro): `step.queue_step` for one step of a single-process run, as replays of the
    graphs of its batch shapes and of the update. What a replay reads stays where its recording saw it:
    gradients accumulate in place, the learning rate is a device tensor the schedule fills, sums and
    results have buffers of their own. `record` (default: CUDA graphs on a side stream, in one memory
    pool) runs the work it is given once, as that step's, and returns its replay."""

    def __init__(self, run: Run, objective: nn.Module, record: Recorder | None = None) -> None:
        device = run.runtime.device
        self.run, self.objective = run, objective
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.record = record or _CudaRecorder(self.stream)
        for p in run.model.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None  # where every replay accumulates
        # read by the update graph, filled by the schedule; CUDA's fused Adam reads a float32 rate, a
        # CPU's a number (a float64: the eager step's)
        dtype = torch.float32 if device.type == "cuda" else torch.float64
        for group in run.optimizer.param_groups:
            group.update(lr=torch.tensor(float(group["lr"]), dtype=dtype, device=device), capturable=True)
        self.counts = torch.zeros(3, dtype=torch.float64, device=device)  # target tokens, stop, save
        self.sums = torch.zeros(2, device=device)  # loss and NLL over the step's batches
        # what queue_step returns: the 2 sums, the 3 counts, the gradient norm
        self.values = torch.zeros(6, dtype=torch.float64, device=device)
        self.shapes: dict[tuple[int, ...], tuple[Batch, Callable[[], None]]] = {}
        self.replay_update: Callable[[], None] | None = None
        self.failed: Exception | None = None  # a recording that failed: the steps go on eagerly

    def queue(self, counts: Tensor, micro: list[Batch]) -> tuple[Tensor, list[str]]:
        """Queue the step: (the device tensor `finish_step` reads, its figures' names: none)."""
        self.counts.copy_(counts)  # on the stream that made `counts`: its memory is free once we return
        with _on_side(self.stream):
            self.sums.zero_()
            for batch in micro:
                self._forward_backward(batch)
            if self.replay_update is not None and self.failed is None:
                self.replay_update()
            else:
                with warnings.catch_warnings():  # eager: capturable Adam outside a graph
                    warnings.filterwarnings("ignore", "This instance was constructed with capturable=True")
                    self.replay_update = self._record(self._update)
            values = self.values.clone()  # this step's, whatever the next step's replays write
        return values, []

    def _forward_backward(self, batch: Batch) -> None:
        shape = (*batch.src.shape, *batch.tgt_in.shape)
        if shape in self.shapes and self.failed is None:
            inputs, replay = self.shapes[shape]
            for static, new in zip(_tensors(inputs), _tensors(batch)):
                static.copy_(new)
            replay()
            return
        inputs = Batch(*(t.clone() for t in _tensors(batch)), batch.n_src_tokens, batch.n_tgt_tokens)
        cfg, runtime = self.run.cfg.trainer, self.run.runtime

        def work() -> None:
            scale = runtime.world_size / self.counts[0]
            loss, nll, _ = forward_backward(self.objective, inputs, scale, runtime, cfg.max_tokens)
            self.sums += torch.stack([loss, nll])

        if (replay := self._record(work)) is not None:
            self.shapes[shape] = inputs, replay

    def _update(self) -> None:
        values, _ = update(self.run, self.sums, self.counts, {}, set_to_none=False)
        self.values.copy_(values)

    def _record(self, work: Callable[[], None]) -> Callable[[], None] | None:
        """`work` run once, as this step's, and its replay; None where a recording failed, now or before
        (`failed`): the work ran eagerly all the same, and the step goes on so."""
        if self.failed is not None:
            work()
            return None
        ran = False

        def tracked() -> None:
            nonlocal ran
            work()
            ran = True

        try:
            return self.record(tracked)
        except Exception as error:
            if not ran:  # the work itself failed: not the recording's doing
                raise
            self.failed = error
            return None

    def release(self) -> None:
        """Give the optimizer back to plain steps (learning rates as numbers, not capturable) and the
        recorded graphs' memory back to the device."""
        for group in self.run.optimizer.param_groups:
            group.update(lr=float(group["lr"]), capturable=False)
        self.shapes.clear()
        self.replay_update = None
        self.record = None


@contextmanager
def _on_side(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Work on `stream` (None: where it is), after what the current stream queued (the batches were
    sent there) and before what it queues next (the step's read)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            yield
    finally:  # also after a failure: what comes next (a redo's zeroed gradients) waits for the side work
        torch.cuda.current_stream().wait_stream(stream)


def _tensors(batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
    return batch.src, batch.tgt_in, batch.tgt_out


class _CudaRecorder:
    """Runs work eagerly, then records it as a CUDA graph (recording runs nothing), both on `stream`.
    Every graph records into one memory pool: they replay one after another, never at once, and no
    tensor of the pool passes from one graph to another (what does is allocated outside it)."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        if stream is None:
            raise ValueError("CUDA graphs need a CUDA device")
        self.stream, self.pool = stream, torch.cuda.graph_pool_handle()

    def __call__(self, work: Callable[[], None]) -> Callable[[], None]:
        work()
        graph, failure = torch.cuda.CUDAGraph(), None
        try:
            # the eager run compiled what the work needs: a compile now would be recorded, so it fails
            with (
                torch.cuda.graph(graph, pool=self.pool, stream=self.stream),
                torch.compiler.set_stance("fail_on_recompile"),
            ):
                try:
                    work()
                except Exception as error:  # raised as itself, not as the failed end of the recording
                    failure = error
        except RuntimeError:
            if failure is None:
                raise
        if failure is not None:
            raise failure
        return graph.replay
