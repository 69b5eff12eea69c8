"""A process that runs one analysis and ends: its allocator keeps what it frees, its cyclic collector rests.

* **Freed memory kept** (glibc's allocator, for the rest of the process). An analysis makes and drops
  arrays of tens to hundreds of MiB many times (columns, clock-aligned times, the index, per-step
  temporaries). By default glibc maps each large one afresh and unmaps it when it is freed, so every new
  array is faulted in again, page by page: at 4,096 ranks a full analysis spent about a third of its time
  in the kernel doing that (80,000 page faults; 40,000 with this, the first touch of its peak). Peak memory
  stays what it was; the process keeps it until it ends.
* **No huge pages asked for.** numpy asks the kernel for transparent huge pages on every array of 4 MiB or
  more. In a heap that keeps and reuses freed memory a 2 MiB page stays whole while the arrays in it come and
  go: at 16,384 ranks the peak was 1,952 to 2,053 MiB from run to run with them (the machine's supply of huge
  pages decides), 1,990 to 2,011 MiB without (over a dozen runs), and the kernel's time fell from 3.7-4.4 s to
  1.9-2.2 s (its 4 KiB faults are cheaper than zeroing 2 MiB pages); the whole analysis took no longer.
* **No cyclic garbage collection.** Loading 16,384 ranks makes hundreds of thousands of small objects (ranks'
  facts, meta entries, waits), and each of Python's full collections walks all of them: 8 full collections
  took 0.32 s of a 2.8 s quick analysis. Reference counting still frees everything that is not a cycle; a
  4,096-rank full analysis leaves about a thousand objects in cycles, freed when the process ends.

The commands run their analysis inside :func:`tuned_for_analysis` (the collector is back after it); the
library's ``analyze()`` changes nothing of the process it runs in.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator

import numpy as np

from megatrace.load.prefault import populate_span_in_background

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_INT_MAX = (1 << 31) - 1  # mallopt takes an int
_TOP_PAD = 64 << 20  # grow the heap 64 MiB at a time


_kept = False  # keep_freed_memory() took effect in this process


def keep_freed_memory() -> bool:
    """Serve large allocations from the heap and keep what is freed there; False where that cannot be asked
    (not glibc), which changes nothing but speed."""
    global _kept
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _kept = all(mallopt(param, value) == 1 for param, value in
                ((_M_MMAP_THRESHOLD, _INT_MAX), (_M_TRIM_THRESHOLD, _INT_MAX), (_M_TOP_PAD, _TOP_PAD)))
    return _kept


_WARM_MAX = 1 << 30  # bytes: well below the trim threshold (a top chunk above 2 GiB would be given back)


def warm_heap(nbytes: int) -> None:
    """Where freed memory is kept: fault in ``nbytes`` more of heap (at most 1 GiB) on another core, for the stages
    to come. A block is taken and at once given back (the heap keeps it, mapped), and a daemon thread populates its
    pages while the next stages start carving their arrays out of it. Ask for no more than the analysis will grow
    by: the pages count in its memory from then on. Elsewhere (a library caller's process) nothing happens."""
    if not _kept or nbytes < 1 << 20:
        return
    block = np.empty(min(nbytes, _WARM_MAX), np.uint8)
    address, size = block.ctypes.data, block.nbytes
    del block
    populate_span_in_background(address, size)


@contextlib.contextmanager
def tuned_for_analysis() -> Iterator[None]:
    """Run the block with freed memory kept (from then on), and without huge pages for numpy's arrays or cyclic
    garbage collection (until it ends: a command run inside a longer-lived process, a test's, gets both back)."""
    keep_freed_memory()
    enabled = gc.isenabled()
    gc.disable()
    huge = _ask_huge_pages(False)
    try:
        yield
    finally:
        _ask_huge_pages(huge)
        if enabled:
            gc.enable()


def _ask_huge_pages(on: bool | None) -> bool | None:
    """Set whether numpy madvises huge pages for its large arrays; the setting before (None: numpy cannot say)."""
    setter = getattr(getattr(getattr(np, "_core", None), "multiarray", None), "_set_madvise_hugepage", None)
    return bool(setter(on)) if setter is not None and on is not None else None
