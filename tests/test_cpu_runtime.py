"""A CPU training run's setup (transformer/kernels/memory.py, training/distributed.py: init_runtime):
freed memory stays with the process, oneDNN keeps more kernels, and bf16 on a CPU without native
bf16 instructions is flagged (the CPU's bf16 faked through transformer/devices.py)."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformer.config import TrainerConfig
from transformer.kernels.memory import ONEDNN_KERNELS, cache_onednn_kernels
from transformer.training.distributed import init_runtime
from transformer.utils import devices

ROOT = Path(__file__).resolve().parents[1]

# Frees a touched 256 MiB tensor and prints how many MiB the process's resident memory shrank by.
FREED = """
import sys, torch
from transformer.kernels import keep_freed_memory
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
if sys.argv[1] == "keep":
    assert keep_freed_memory()
x = torch.ones(64 << 20)
before = resident()
del x
print((before - resident()) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc are Linux's")
def test_freed_memory_stays_with_the_process_instead_of_going_back_to_the_system():
    def shrink(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", FREED, mode], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return int(run.stdout)

    assert shrink("plain") >= 200  # glibc unmaps a large block when it is freed
    assert shrink("keep") == 0  # kept for the next batch's tensors


def test_onednn_keeps_more_kernels_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    cache_onednn_kernels()
    assert int(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]) == ONEDNN_KERNELS > 1024
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    cache_onednn_kernels()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_without_native_bf16_is_flagged(monkeypatch, caplog, native):
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: native)
    with caplog.at_level(logging.WARNING):
        runtime = init_runtime(TrainerConfig(device="cpu", precision="bf16"))
    assert runtime.dtype == torch.bfloat16
    flagged = [r for r in caplog.records if "trainer.precision=fp32" in r.getMessage()]
    assert bool(flagged) is not native


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_is_bf16_on_a_cpu_that_multiplies_it_natively(monkeypatch, native):
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: native)
    runtime = init_runtime(TrainerConfig(device="cpu", precision="auto"))
    assert runtime.dtype == (torch.bfloat16 if native else torch.float32)
    assert devices.decoding_dtype("auto", torch.device("cpu")) == torch.float32  # decoding: fp32 on every CPU
