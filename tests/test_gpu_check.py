"""scripts/gpu_check.py, the one command of a lent GPU machine, checked on the CPU: its dry run goes
through every step at toy sizes, and it installs carried wheels when a package is missing."""

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = [
    "environment",
    "loop_eager",
    "gpu_tests",
    "loop_no_graphs",
    "loop_peers",
    "loop_no_cudnn",
    "loop_buckets",
    "translate",
    "translate_cuda_graphs",
    "benchmark",
]


def test_the_dry_run_goes_through_every_step_and_writes_what_comes_back(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "summary.json").read_text())
    assert list(results) == STEPS and all(r["ok"] for r in results.values()), results
    assert results["translate_cuda_graphs"]["lines_equal"] == "50/50"
    loop = json.loads((tmp_path / "loop.json").read_text())
    assert [row["run"] for row in loop["rows"]] == ["eager", "no-graphs", "peer", "no-cudnn", "buckets"]
    assert all(row["steady_tokens_per_s"] > 0 for row in loop["rows"])
    assert "steady" in results["loop_eager"]["eager"] and "eager / peer:" in done.stdout  # the table, last
    assert json.loads((tmp_path / "benchmark.json").read_text())["meta"]
    log = (tmp_path / "steps.log").read_text()
    assert [line.split(":")[0] for line in log.splitlines() if line.startswith("=====")] == [
        f"===== {step}" for step in STEPS
    ]
    # what the device tool brings back: at most 8 plain files
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "benchmark.json",
        "loop.json",
        "steps.log",
        "summary.json",
        "summary.md",
    ]


def _wheel(directory: Path, name: str) -> Path:
    """A minimal pure-Python wheel holding the module `name`."""
    path = directory / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}.py", "ANSWER = 42\n")
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def test_missing_packages_are_installed_from_the_carried_wheels(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "gpu_check_probe")
    monkeypatch.setattr(gpu_check, "NEEDED", ("gpu_check_probe",))
    env = gpu_check.environment(wheels, tmp_path / "site")
    probe = [sys.executable, "-c", "import gpu_check_probe; print(gpu_check_probe.ANSWER)"]
    assert subprocess.run(probe, capture_output=True, text=True, env=env).stdout == "42\n"
    monkeypatch.setattr(gpu_check, "NEEDED", ("json",))  # nothing missing: nothing installed
    gpu_check.environment(wheels, tmp_path / "site2")
    assert not (tmp_path / "site2").exists()
