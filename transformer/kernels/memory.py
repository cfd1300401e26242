"""A CPU run's memory and oneDNN kernels kept from one batch to the next (docs/performance.md,
"Memory kept between batches"). Every batch has its own shapes: by default glibc hands each large
freed block back to the system, so the next batch faults fresh pages in, and oneDNN keeps the
kernels of only 1,024 shapes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt(3) parameters
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
HEAP_UP_TO = 1 << 30  # blocks up to this size come from the heap, not each from its own mapping
NEVER_TRIM = (1 << 31) - 1  # free memory the top of the heap may hold before any is given back
GROW_BY = 1 << 30  # reserved beyond each request when the heap grows
ONEDNN_KERNELS = 65536  # shapes whose compiled kernels oneDNN keeps


def keep_freed_memory() -> bool:
    """Serve blocks up to 1 GiB from glibc's heap and never shrink it; False where the C library has no
    mallopt (macOS, Windows) or refused a setting."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not loadable, or a C library without mallopt
        return False
    settings = ((M_MMAP_THRESHOLD, HEAP_UP_TO), (M_TRIM_THRESHOLD, NEVER_TRIM), (M_TOP_PAD, GROW_BY))
    return all([bool(mallopt(param, value)) for param, value in settings])


def cache_onednn_kernels() -> None:
    """Let oneDNN keep the kernels of ONEDNN_KERNELS shapes, unless ONEDNN_PRIMITIVE_CACHE_CAPACITY is
    set; it is read when oneDNN first compiles, so this must run before any model does."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_KERNELS))
