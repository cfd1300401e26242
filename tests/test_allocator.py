"""transformer/allocator.py: freed memory stays in the process, so regrown tensors are not faulted in anew.

Each case runs in a fresh interpreter: the setting is process-wide and cannot be undone.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from transformer import allocator

# Blocks that grow by 1 MiB a step, as a decoder's cache does: glibc maps each anew by default.
GROWING_BLOCKS = """
import resource, sys, torch
from transformer.allocator import retain_freed_memory
kept = retain_freed_memory() if sys.argv[1] == "keep" else False
before, pages = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, 0
for mib in range(1, 25):
    block = torch.ones(mib << 18)  # float32: mib MiB
    pages += (mib << 20) // resource.getpagesize()
    del block
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / pages)
"""


def faulted_share(mode: str) -> tuple[bool, float]:
    """(setting applied, page faults per page written) in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", GROWING_BLOCKS, mode], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    kept, share_kept = faulted_share("keep")
    if not kept:
        pytest.skip("this libc has no mallopt (not glibc)")
    _, share_default = faulted_share("default")
    assert share_default > 0.9  # the cost removed: by default every page of every block faults
    assert share_kept < 0.5 * share_default


def test_other_platforms_are_left_alone(monkeypatch):
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.retain_freed_memory() is False
