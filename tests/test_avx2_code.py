"""The tests whose outcome depends on the CPU's instruction set (the kernels chosen, bitwise resumes with
them) run again with PyTorch held to AVX2 code (`ATEN_CPU_CAPABILITY=avx2`), so that a test that holds
only where the machine chooses every kernel (AVX-512) cannot pass here and fail on an AVX2 CPU. On a CPU
without AVX-512 this is the same code again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/test_kernel_choice.py",
    "tests/test_kernel_timing.py",
    "tests/test_training_run.py::test_interrupted_and_resumed_run_is_bitwise_the_uninterrupted_one",
    "tests/test_training_run.py::test_a_bucketed_run_records_its_buckets_and_resumes_onto_the_same_batches",
    "tests/test_training_run.py::test_a_checkpoint_from_before_buckets_resumes_onto_the_batches_it_had",
    "tests/test_training_run.py::test_a_stopped_and_resumed_run_keeps_and_averages_the_checkpoints_of_an_uninterrupted_one",
]


def test_the_kernel_and_resume_tests_hold_under_avx2_code():
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    check = [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"]
    assert not subprocess.run(check, capture_output=True, text=True, env=env).stdout.startswith("AVX512")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1] and "failed" not in done.stdout.splitlines()[-1]
