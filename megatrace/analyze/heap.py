"""Keep the memory an analysis frees for its next arrays (glibc's allocator), in a process that analyses and ends.

An analysis makes and drops arrays of tens to hundreds of MiB many times (columns, clock-aligned times, the
index, per-step temporaries). By default glibc maps each large one afresh and unmaps it when it is freed, so
every new array is faulted in again, page by page: at 4,096 ranks a full analysis spent about a third of its
time in the kernel doing that (80,000 page faults; 40,000 with this, the first touch of its peak). Peak memory
stays what it was; the process keeps it until it ends, so only commands that end after one analysis call this.
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_INT_MAX = (1 << 31) - 1  # mallopt takes an int
_TOP_PAD = 64 << 20  # grow the heap 64 MiB at a time


def keep_freed_memory() -> bool:
    """Serve large allocations from the heap and keep what is freed there; False where that cannot be asked
    (not glibc), which changes nothing but speed."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_MMAP_THRESHOLD, _INT_MAX), (_M_TRIM_THRESHOLD, _INT_MAX), (_M_TOP_PAD, _TOP_PAD)))
