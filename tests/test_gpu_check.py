"""benchmarks/gpu_check.py, every GPU check in one command, checked on the CPU: its dry run goes through
every step at toy sizes, and a step's leftover processes never run into the next."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = [  # in order of value; the compiled ones have no dry run
    "environment",
    "loop_eager",
    "loop_no_cudnn",
    "gpu_tests",
    "loop_peers",
    "loop_no_graphs",
    "translate",
    "translate_cuda_graphs",
    "loop_buckets",
    "benchmark",
]


def test_the_dry_run_goes_through_every_step_and_writes_what_comes_back(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "summary.json").read_text())
    assert list(results) == STEPS and all(r["ok"] for r in results.values()), results
    assert results["translate_cuda_graphs"]["lines_equal"] == "50/50"
    loop = json.loads((tmp_path / "loop.json").read_text())
    assert [row["run"] for row in loop["rows"]] == ["eager", "no-cudnn", "peer", "no-graphs", "buckets"]
    assert all(row["steady_tokens_per_s"] > 0 for row in loop["rows"])
    assert "steady" in results["loop_eager"]["eager"] and "eager / peer:" in done.stdout  # the table, last
    assert json.loads((tmp_path / "benchmark.json").read_text())["meta"]
    log = (tmp_path / "steps.log").read_text()
    assert [line.split(":")[0] for line in log.splitlines() if line.startswith("=====")] == [
        f"===== {step}" for step in STEPS
    ]
    assert "/loop/eager.log\n" in log and "step 7:" in log  # the end of each train.py log
    # a few plain files: what is kept of the run
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "benchmark.json",
        "loop.json",
        "steps.log",
        "summary.json",
        "summary.md",
    ]


def test_some_steps_only_and_a_peer_without_the_run_it_needs_is_skipped(tmp_path):
    """--steps runs those asked for; the peers' loop trains
    on the eager run's batches: without that run it is skipped, not run in its place."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run(
        [*command, "--steps", "loop_peers,benchmark"], capture_output=True, text=True, env=env
    )
    results = json.loads((tmp_path / "summary.json").read_text())
    assert list(results) == ["environment", "loop_peers", "benchmark"], done.stdout + done.stderr
    assert results["loop_peers"]["status"] == "skipped: no eager run" and results["benchmark"]["ok"]
    assert done.returncode == 1  # not every step ran well
    wrong = subprocess.run([*command, "--steps", "loop_eager,warp"], capture_output=True, text=True, env=env)
    assert wrong.returncode == 2 and "--steps: warp unknown; the steps are loop_eager, " in wrong.stderr


def test_what_a_step_leaves_running_is_killed_before_the_next(tmp_path):
    """A step's process that exits while its child goes on (train.py saving after SIGTERM) does not
    leave that child running into the next step."""
    gpu_check = _module()
    check = gpu_check.Check(tmp_path, True, dict(os.environ), time.monotonic() + 120)
    spawn = "import subprocess; print(subprocess.Popen(['sleep', '600']).pid, flush=True)"
    assert check.run("leaves_a_child", [sys.executable, "-c", spawn], 60)
    pid = int((tmp_path / "steps.log").read_text().split()[-1])
    time.sleep(0.5)
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "State:\tZ" in status.read_text()  # gone, or a zombie


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check
