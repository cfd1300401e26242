"""trainer.profile_steps: a real run writes the profile of those steps (operators, Chrome trace) and
logs it; on a GPU the busy share against CUDA events' own timing of the kernels."""

import json
import time

import pytest
import torch
from test_training_run import compose_config, corpus, overrides, tensorboard_scalars  # noqa: F401 (fixture)

from transformer.config import ConfigError
from transformer.training import train
from transformer.training.profile import Profiler

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_run_profiles_its_profile_steps(corpus, tmp_path, caplog):  # noqa: F811
    caplog.set_level("INFO", logger="transformer.training.monitor")
    args = ["trainer.max_steps=5", "trainer.profile_steps=[2,3]", "trainer.log_every_steps=1"]
    train(compose_config(overrides(corpus, tmp_path, *args)))
    out = tmp_path / "profile"
    ops = (out / "ops.txt").read_text()
    assert "aten::" in ops and "Self CPU time total" in ops  # the operators of the two steps
    trace = json.loads((out / "trace.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    assert sorted(p.name for p in out.iterdir()) == ["ops.txt", "trace.json"]  # no temp file left
    assert "steps 2-3 profiled:" in caplog.text and "busy" not in caplog.text  # no device on a CPU
    assert tensorboard_scalars(tmp_path, "profile/wall_ms_per_step")  # logged at step 3
    assert len(tensorboard_scalars(tmp_path, "train/loss")) == 5  # and the run went on


@pytest.mark.parametrize("steps", ["[3,2]", "[0,2]", "[4]", "[1,2,3]"])
def test_profile_steps_must_be_a_first_and_a_last_step(corpus, tmp_path, steps):  # noqa: F811
    with pytest.raises(ConfigError, match=r"trainer.profile_steps=.* must be \[first, last\]"):
        compose_config(overrides(corpus, tmp_path, f"trainer.profile_steps={steps}"))


@pytest.mark.gpu
def test_on_a_gpu_the_busy_share_is_the_kernels_time_over_the_wall_time():
    """Kernels of a known length with the host asleep between them: the profile's kernel time is what
    CUDA events measure around them, and the busy share that time over the wall time."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    torch.cuda._sleep(1_000_000)  # a first kernel, out of the window
    torch.cuda.synchronize()
    profiler, timed = Profiler(device), []
    profiler.start()
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)  # ~10 ms at ~2 GHz
        end.record()
        timed.append((start, end))
        time.sleep(0.02)
    profiled = profiler.stop(steps=5)
    kernels = sum(start.elapsed_time(end) for start, end in timed) / 1000
    assert profiled.kernel_seconds == pytest.approx(kernels, rel=0.1)
    assert profiled.busy == pytest.approx(profiled.kernel_seconds / profiled.wall_seconds)
    assert 0.05 < profiled.busy < 0.9  # the host slept longer than the kernels ran
