"""The training step as CUDA graph replays (`trainer.cuda_graphs`): when it is on, and that a step made
of replays is the eager step. On a CPU the recordings are re-runs of the recorded work: the same
buffers, copies and in-place updates that a replay reads and writes, against the plain step bit for
bit. On a GPU (`-m gpu`): the real graphs against eager, resume either way, no waiting in a replay."""

import re
from dataclasses import replace

import pytest
import torch
from test_training_run import (  # noqa: F401 (the corpus fixture)
    assert_same_state,
    compose_config,
    corpus,
    overrides,
    tensorboard_scalars,
)

from transformer.checkpoint import load_checkpoint
from transformer.config import ConfigError
from transformer.training import Parts, Plan, train
from transformer.training.distributed import Runtime
from transformer.training.graphs import StepGraphs
from transformer.training.step import queue_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BUCKETED = ("trainer.length_buckets=3", "trainer.eval_every_steps=0", "trainer.save_every_steps=4")


class Rerun:
    """A recorder whose replay runs the recorded work again, and checks that it found and left the
    gradients and the learning rate in the memory the recordings saw (a CUDA graph's are fixed)."""

    def __init__(self) -> None:
        self.recorded, self.run, self.memory = 0, None, None

    def addresses(self) -> list[int | None]:
        grads = [p.grad for p in self.run.model.parameters()]
        rates = [group["lr"] for group in self.run.optimizer.param_groups]
        return [None if t is None else t.data_ptr() for t in grads + rates]

    def __call__(self, work):
        self.recorded += 1
        work()
        self.memory = self.memory or self.addresses()

        def replay() -> None:
            assert self.addresses() == self.memory
            work()
            assert self.addresses() == self.memory

        return replay


def rerun_graphs(recorder: Rerun, shapes: list) -> Parts:
    """The parts of a run whose steps go through StepGraphs and `recorder`; `shapes` gets each batch's."""

    def graphs(run, objective):
        recorder.run, recorder.memory = run, None
        return StepGraphs(run, objective, record=recorder)

    def queue(run, objective, micro, flags, graphs):
        shapes.extend(tuple(b.src.shape) for b in micro)
        return queue_step(run, objective, micro, flags, graphs)

    return Parts(graphs=graphs, queue_step=queue)


def test_steps_of_replays_are_the_eager_steps_bit_for_bit(corpus, tmp_path):  # noqa: F811
    """Three bucket shapes over 12 steps of two batches: each shape and the update recorded once, every
    later batch copied into its shape's inputs and replayed; weights, Adam's moments and the schedule
    end as the plain steps leave them."""
    plain = tmp_path / "plain"
    train(compose_config(overrides(corpus, plain, "trainer.max_steps=12", *BUCKETED)))
    recorder, shapes = Rerun(), []
    graphed = tmp_path / "graphed"
    train(
        compose_config(overrides(corpus, graphed, "trainer.max_steps=12", *BUCKETED)),
        rerun_graphs(recorder, shapes),
    )
    assert len(shapes) == 24 and len(set(shapes)) == 3  # shapes repeat: most batches are replays
    assert recorder.recorded == len(set(shapes)) + 1  # a graph per shape and one for the update
    for step in (4, 12):
        a = load_checkpoint(plain / "checkpoints" / f"checkpoint_{step}.pt")
        b = load_checkpoint(graphed / "checkpoints" / f"checkpoint_{step}.pt")
        assert_same_state(a, b)
        assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]  # the rate a number
        assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == step


def test_a_run_resumes_across_graphs_on_and_off(corpus, tmp_path):  # noqa: F811
    """Steps 1-4 with graphs, 5-8 without, 9-12 with again: the uninterrupted plain run's weights."""
    plain = tmp_path / "plain"
    train(compose_config(overrides(corpus, plain, "trainer.max_steps=12", *BUCKETED)))
    mixed = overrides(corpus, tmp_path / "mixed", *BUCKETED)
    train(compose_config([*mixed, "trainer.max_steps=4"]), rerun_graphs(Rerun(), []))
    train(compose_config([*mixed, "trainer.max_steps=8"]))
    train(compose_config([*mixed, "trainer.max_steps=12"]), rerun_graphs(Rerun(), []))
    assert_same_state(
        load_checkpoint(tmp_path / "mixed" / "checkpoints" / "checkpoint_12.pt"),
        load_checkpoint(plain / "checkpoints" / "checkpoint_12.pt"),
    )


@pytest.mark.parametrize(
    ("extra", "needs"),
    [
        ((), "a CUDA device (trainer.device=cpu gives cpu)"),
        (("model.moe_experts=2",), "no mixture of experts"),
        (("trainer.length_buckets=0",), "length buckets (trainer.length_buckets > 0)"),
    ],
)
def test_cuda_graphs_are_refused_first_where_they_cannot_run(corpus, tmp_path, extra, needs):  # noqa: F811
    """trainer.cuda_graphs=true on a CPU, with a mixture of experts or without length buckets: a
    ConfigError that names what it needs, before the data is prepared."""
    unprepared = tmp_path / "unprepared"
    args = overrides(corpus, tmp_path, "trainer.cuda_graphs=true", f"data.dir={unprepared}", *extra)
    with pytest.raises(ConfigError, match=rf"trainer.cuda_graphs=true needs .*{re.escape(needs)}"):
        train(compose_config(args))
    assert not unprepared.exists()


def test_cuda_graphs_are_off_with_ddp_and_refused_when_set():
    """Two processes on CUDA devices: DDP's all-reduce is not recorded (decided without a device)."""
    cfg = compose_config(["trainer.length_buckets=12"])
    ranks = Runtime(rank=0, world_size=2, device=torch.device("cuda"), dtype=torch.bfloat16)
    buckets = [8, 16]
    assert Plan(cfg, ranks, resume=None).cuda_graphs(buckets) is False
    assert Plan(cfg, replace(ranks, world_size=1), resume=None).cuda_graphs(buckets) is True
    cfg = replace(cfg, trainer=replace(cfg.trainer, cuda_graphs=True))
    with pytest.raises(
        ConfigError, match="needs one process, not 2: DDP's gradient all-reduce is not recorded"
    ):
        Plan(cfg, ranks, resume=None).cuda_graphs(buckets)


def test_cuda_graphs_are_off_by_default_on_a_cpu(corpus, tmp_path, caplog):  # noqa: F811
    caplog.set_level("INFO", logger="transformer.training.plan")
    train(compose_config(overrides(corpus, tmp_path, "trainer.max_steps=1", *BUCKETED)))
    assert "CUDA graphs: off" in caplog.text


def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


GPU = (
    "trainer.device=cuda",
    "trainer.precision=bf16",
    "trainer.length_buckets=3",
    "trainer.eval_every_steps=0",
)


@pytest.mark.gpu
def test_on_a_gpu_graphed_steps_train_as_eager_ones(corpus, tmp_path, caplog):  # noqa: F811
    """30 steps with and without CUDA graphs (dropout off: the same math): each step's loss within bf16
    noise, and the weights they end with."""
    _cuda_or_skip()
    caplog.set_level("INFO", logger="transformer.training.plan")
    losses, weights = {}, {}
    for graphs in ("true", "false"):
        run_dir = tmp_path / graphs
        args = [*GPU, "trainer.max_steps=30", "model.dropout=0", f"trainer.cuda_graphs={graphs}"]
        train(compose_config(overrides(corpus, run_dir, *args, "trainer.log_every_steps=1")))
        losses[graphs] = torch.tensor(tensorboard_scalars(run_dir, "train/loss"))
        weights[graphs] = load_checkpoint(run_dir / "checkpoints" / "checkpoint_30.pt")["model"]
    assert "CUDA graphs: one per batch shape" in caplog.text and len(losses["true"]) == 30
    torch.testing.assert_close(losses["true"], losses["false"], rtol=1e-2, atol=0.0)
    for name, tensor in weights["true"].items():
        torch.testing.assert_close(tensor, weights["false"][name], rtol=0.02, atol=2e-3, msg=name)


@pytest.mark.gpu
def test_on_a_gpu_a_graphed_run_resumes_with_graphs_off_and_on(corpus, tmp_path):  # noqa: F811
    """Steps 1-5 with graphs, 6-10 without, 11-15 with (dropout off): the weights of an uninterrupted
    graphed run within bf16 noise, and a checkpoint whose learning rate is a number."""
    _cuda_or_skip()
    args = [*GPU, "model.dropout=0", "trainer.save_every_steps=5"]
    whole = tmp_path / "whole"
    train(compose_config(overrides(corpus, whole, *args, "trainer.max_steps=15", "trainer.cuda_graphs=true")))
    parts = tmp_path / "parts"
    for steps, graphs in ((5, "true"), (10, "false"), (15, "true")):
        extra = [f"trainer.max_steps={steps}", f"trainer.cuda_graphs={graphs}"]
        train(compose_config(overrides(corpus, parts, *args, *extra)))
    final = load_checkpoint(parts / "checkpoints" / "checkpoint_15.pt")
    expected = load_checkpoint(whole / "checkpoints" / "checkpoint_15.pt")
    assert final["step"] == 15 and isinstance(final["optimizer"]["param_groups"][0]["lr"], float)
    for name, tensor in final["model"].items():
        torch.testing.assert_close(tensor, expected["model"][name], rtol=0.02, atol=2e-3, msg=name)


@pytest.mark.gpu
def test_on_a_gpu_a_step_of_replays_does_not_wait_for_the_device(corpus, tmp_path):  # noqa: F811
    """Once every shape of a step was recorded, queueing it is copies and replays: CUDA's own check
    finds nothing that waits."""
    _cuda_or_skip()
    seen, strict = set(), []

    def queue(run, objective, micro, flags, graphs=None):
        shapes = {tuple(b.src.shape) for b in micro}
        checked = graphs is not None and shapes <= seen and run.step > 0
        seen.update(shapes)
        torch.cuda.set_sync_debug_mode("error" if checked else "default")
        try:
            return queue_step(run, objective, micro, flags, graphs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            strict.append(checked)

    train(compose_config(overrides(corpus, tmp_path, *GPU, "trainer.max_steps=20")), Parts(queue_step=queue))
    assert sum(strict) >= 10
