"""Speed paths that fall back (transformer/training/fallback.py): a failed CUDA-graph capture, compile,
fused-attention backend or CPU kernel, each injected through the run's parts at step 3, turns that path
off with one warning (and a TensorBoard entry); the step is redone, and the run ends bitwise where the
same run with the switch off from step 3 on ends (steps 1-2 on the path, saved, resumed with it off)."""

import logging

import pytest
import torch
from test_training_graphs import BUCKETED, Rerun
from test_training_run import (  # noqa: F401 (the corpus fixture)
    assert_same_state,
    compose_config,
    corpus,
    overrides,
)
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer.checkpoint import load_checkpoint
from transformer.kernels.cpu import ShortAttention
from transformer.training import Parts, train
from transformer.training.graphs import StepGraphs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = ("trainer.max_steps=6", "trainer.save_every_steps=2", "trainer.eval_every_steps=0")
FAILING_BATCH = 5  # two batches a step: the first of step 3


def final(run_dir):
    return load_checkpoint(run_dir / "checkpoints" / "checkpoint_6.pt")


def switched_off_from_step_3(corpus, run_dir, on: list[str], off: str):  # noqa: F811
    """The reference: steps 1-2 with the speed path on, then resumed with it off."""
    train(compose_config(overrides(corpus, run_dir, *on, *STEPS, "trainer.max_steps=2")))
    train(compose_config(overrides(corpus, run_dir, *on, *STEPS, off)))
    return final(run_dir)


class FailingAt(nn.Module):
    """The training objective, which at its FAILING_BATCH-th call runs `fail` first (once: not on the
    redo)."""

    def __init__(self, objective: nn.Module, fail) -> None:
        super().__init__()
        self.objective, self.fail, self.calls = objective, fail, 0

    def forward(self, src, tgt_in, tgt_out):
        self.calls += 1
        if self.calls == FAILING_BATCH:
            self.fail(self.objective, src, tgt_in, tgt_out)
        return self.objective(src, tgt_in, tgt_out)


def failing(fail) -> Parts:
    return Parts(objective=lambda objective: FailingAt(objective, fail))


def test_a_failed_fused_attention_backend_falls_back_to_the_math_backend(corpus, tmp_path, caplog):  # noqa: F811
    """torch's efficient kernel, which a CPU lacks, at step 3: torch raises "No available kernel"."""

    def efficient_attention(objective, *batch):
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            objective(*batch)

    on = ["trainer.cpu_kernels=off"]
    with caplog.at_level(logging.WARNING):
        train(
            compose_config(overrides(corpus, tmp_path / "fell_back", *on, *STEPS)),
            failing(efficient_attention),
        )
    [warning] = [r.message for r in caplog.records if "failed" in r.message]
    assert warning.startswith("step 3: fused attention backends failed (RuntimeError: ")
    assert warning.endswith(
        "redone and going on without them (trainer.attention_backends=[math] keeps them off)"
    )
    reference = switched_off_from_step_3(
        corpus, tmp_path / "reference", on, "trainer.attention_backends=[math]"
    )
    assert_same_state(final(tmp_path / "fell_back"), reference)


def test_a_failed_compile_falls_back_to_eager_steps(corpus, tmp_path, caplog):  # noqa: F811
    """A compiler backend that raises, at step 3: torch.compile's BackendCompilerFailed."""

    def broken_compiler(objective, src, *_):
        def backend(graph, example_inputs):
            raise RuntimeError("the compiler broke")

        torch.compile(lambda t: t * 2, backend=backend)(src.float())

    on = ["trainer.compile=true", "model.dropout=0"]
    with caplog.at_level(logging.WARNING):
        train(
            compose_config(overrides(corpus, tmp_path / "fell_back", *on, *STEPS)), failing(broken_compiler)
        )
    assert "step 3: compiled regions failed (BackendCompilerFailed: " in caplog.text
    assert "(trainer.compile=false keeps them off)" in caplog.text
    torch._dynamo.reset()
    reference = switched_off_from_step_3(corpus, tmp_path / "reference", on, "trainer.compile=false")
    assert_same_state(final(tmp_path / "fell_back"), reference)


def test_a_failed_cpu_kernel_falls_back_to_plain_pytorch(corpus, tmp_path, caplog):  # noqa: F811
    """The written-out attention of the first encoder layer raises at its FAILING_BATCH-th batch."""

    class Failing(ShortAttention):
        calls = 0

        def forward(self, *args, **kwargs):
            Failing.calls += 1
            if Failing.calls == FAILING_BATCH:
                raise RuntimeError("could not create a primitive")
            return super().forward(*args, **kwargs)

    def install(objective):
        attention = objective.model.encoder[0].self_attn
        assert isinstance(attention, ShortAttention)
        attention.__class__ = Failing
        return objective

    on = ["trainer.cpu_kernels=on"]
    with caplog.at_level(logging.WARNING):
        train(
            compose_config(overrides(corpus, tmp_path / "fell_back", *on, *STEPS)), Parts(objective=install)
        )
    assert (
        "step 3: CPU kernels failed (RuntimeError: could not create a primitive); redone and going on "
        "without them (trainer.cpu_kernels=off keeps them off)" in caplog.text
    )
    fell_back = final(tmp_path / "fell_back")
    assert not any(fell_back["kernels"].values())  # a resume goes on with the plain modules too
    reference = switched_off_from_step_3(corpus, tmp_path / "reference", on, "trainer.cpu_kernels=off")
    assert_same_state(fell_back, reference)


class FailingCapture(Rerun):
    """Records as `Rerun` does, but its `n`-th recording fails after the work ran, as a CUDA-graph
    capture fails after the eager run before it."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def __call__(self, work):
        replay = super().__call__(work)
        if self.recorded == self.n:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return replay


@pytest.mark.parametrize("n", [1, 2, 3, 4])  # a batch's recording, the update's, one of a later step
def test_a_failed_graph_capture_finishes_the_step_eagerly_and_the_run_without_graphs(corpus, tmp_path, n):  # noqa: F811
    """With CUDA graphs the steps are bit for bit the plain steps (test_training_graphs.py): a run whose
    n-th recording fails ends as the plain run, its failure logged and in TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recorder = FailingCapture(n)

    def graphs(run, objective):
        recorder.run = run
        return StepGraphs(run, objective, record=recorder)

    train(compose_config(overrides(corpus, tmp_path / "graphed", *STEPS, *BUCKETED)), Parts(graphs=graphs))
    train(compose_config(overrides(corpus, tmp_path / "plain", *STEPS, *BUCKETED)))
    assert recorder.recorded == n  # nothing recorded after the failure
    graphed = final(tmp_path / "graphed")
    assert_same_state(graphed, final(tmp_path / "plain"))
    assert graphed["optimizer"]["param_groups"] == final(tmp_path / "plain")["optimizer"]["param_groups"]
    events = EventAccumulator(str(tmp_path / "graphed" / "tensorboard"))
    events.Reload()
    [entry] = events.Tensors("train/fallback/text_summary")
    text = entry.tensor_proto.string_val[0].decode()
    assert "CUDA graphs failed (RuntimeError: CUDA error: operation not permitted" in text
    assert text.endswith("finished and going on without them (trainer.cuda_graphs=false keeps them off)")


def test_a_failure_on_no_speed_path_stops_the_run_as_before(corpus, tmp_path, caplog):  # noqa: F811
    def bug(*_):
        raise ValueError("a bug of the objective")

    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="a bug of the objective"):
        train(compose_config(overrides(corpus, tmp_path, "trainer.cpu_kernels=on", *STEPS)), failing(bug))
    assert "failed" not in caplog.text
