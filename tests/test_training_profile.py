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
    caplog.clear()
    resumed = ["trainer.max_steps=7", *args[1:]]
    train(compose_config(overrides(corpus, tmp_path, *resumed)))  # from step 5, past the window
    assert "goes on from step 5, past their start: no profile" in caplog.text


@pytest.mark.parametrize("steps", ["[3,2]", "[0,2]", "[4]", "[1,2,3]", "[2,1000001]"])
def test_profile_steps_must_be_a_first_and_a_last_step(corpus, tmp_path, steps):  # noqa: F811
    with pytest.raises(ConfigError, match=r"trainer.profile_steps=.* must be \[first, last\]"):
        compose_config(overrides(corpus, tmp_path, f"trainer.profile_steps={steps}"))


@pytest.mark.gpu
def test_on_a_gpu_the_busy_share_is_the_kernels_time_over_the_wall_time():
    """Matrix products and kernels of a known length, the host asleep between them: the profile's kernel
    time is what CUDA events measure around them (each kernel once, not again as its operator's), and
    the busy share that time over the wall time."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    Profiler.set_up(device)
    (a @ a).sum().item()  # the first product, out of the window
    profiler, timed = Profiler(device), []
    profiler.start()
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)  # ~10 ms at ~2 GHz
        for _ in range(4):
            a = (a @ a) / 64
        end.record()
        timed.append((start, end))
        time.sleep(0.02)
    profiled = profiler.stop(steps=5)
    kernels = sum(start.elapsed_time(end) for start, end in timed) / 1000
    assert profiled.kernel_seconds == pytest.approx(kernels, rel=0.1)
    assert profiled.busy == pytest.approx(profiled.kernel_seconds / profiled.wall_seconds)
    assert 0.05 < profiled.busy < 0.9  # the host slept longer than the kernels ran


@pytest.mark.gpu
def test_on_a_gpu_a_graphed_run_profiles_its_replays(corpus, tmp_path):  # noqa: F811
    """Steps of CUDA graph replays under the profiler: their kernels counted, the share a fraction."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    args = ["trainer.device=cuda", "trainer.length_buckets=3", "trainer.cuda_graphs=true"]
    args += ["trainer.max_steps=20", "trainer.profile_steps=[16,20]", "trainer.eval_every_steps=0"]
    train(compose_config(overrides(corpus, tmp_path, *args)))
    (busy,) = tensorboard_scalars(tmp_path, "profile/device_busy")
    assert 0.0 < busy <= 1.0
    assert "Self CUDA time total" in (tmp_path / "profile" / "ops.txt").read_text()
