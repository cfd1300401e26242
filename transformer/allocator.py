"""CPU memory: keep freed memory in the process, as a caching allocator does.

glibc's malloc maps any large block (over 128 KiB to 32 MiB; the threshold adapts) from the operating
system with mmap and unmaps it when freed. A training step or a decoding step allocates
its activations, logits and gradients afresh, so every step page-faults them in again, zero-filled page
by page. On the 2-core VM of docs/results.md that was a third of a base training step and a tenth of beam
decoding time (scripts/benchmark.py, README). PyTorch's CUDA allocator caches for the same reason; on the
CPU PyTorch uses plain malloc, so the entry points (train.py, translate.py, scripts/evaluate.py,
scripts/benchmark.py) call `retain_freed_memory()` first. The cost: the process keeps its peak size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit: blocks up to 32 MiB come from the heap
NEVER_TRIM = 2**31 - 1  # the largest int mallopt takes: free memory at the heap's top stays mapped


def retain_freed_memory() -> bool:
    """Serve blocks up to 32 MiB from glibc's heap and never trim it. Linux with glibc only; elsewhere
    (macOS, Windows, musl) nothing changes. Returns whether the setting took effect.

    Larger blocks are still mapped and unmapped each time: M_MMAP_MAX=0 would keep them too, but with
    PyTorch's 64-byte-aligned allocations glibc then extends the heap for each one instead of reusing
    the freed block, and the process grows without bound.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # no libc found, or a libc without mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
