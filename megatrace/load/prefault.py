"""Fault in the pages of large new arrays on another core, while this one fills them.

On a virtual machine the first write to a fresh page costs far more than the write: at 16,384 ranks the record
columns alone (1.4 GiB) took seconds of kernel time in the loading thread. ``madvise(MADV_POPULATE_WRITE)``
(Linux 5.14) makes the kernel map the pages writable without changing their contents, so a daemon thread can do
it beside the loader (the call releases the interpreter lock) with no race on what the loader writes. Where the
kernel or the C library does not offer it, nothing happens: the loader faults the pages in itself, as before.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Iterable

import numpy as np

MADV_POPULATE_WRITE = 23  # linux/mman.h
_STEP = 64 << 20  # bytes asked for per call: the thread stops at the first refusal
_MIN_BYTES = 1 << 20  # smaller arrays are not worth a call


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def populate_in_background(arrays: Iterable[np.ndarray]) -> threading.Thread | None:
    """Start a daemon thread that faults in the pages of ``arrays`` (each of at least 1 MiB), first to last; the
    thread holds them until it is done. None when there is nothing to do or no ``madvise``."""
    big = [a for a in arrays if a.nbytes >= _MIN_BYTES]
    return _populate([(a.ctypes.data, a.nbytes) for a in big], keep=big) if big else None


def populate_span_in_background(address: int, nbytes: int) -> threading.Thread | None:
    """The same for ``nbytes`` of memory at ``address`` that stays mapped while the thread runs, in use or not: memory
    the heap keeps once freed (:func:`megatrace.analyze.heap.keep_freed_memory`)."""
    return _populate([(address, nbytes)]) if nbytes >= _MIN_BYTES else None


def _populate(spans: list[tuple[int, int]], keep: object = None) -> threading.Thread | None:
    madvise = _madvise()
    if madvise is None:
        return None
    page = mmap.PAGESIZE

    def run(hold: object = keep) -> None:  # (``hold``: the arrays stay alive while their pages are populated)
        for address, nbytes in spans:
            start = (address + page - 1) // page * page
            end = (address + nbytes) // page * page
            for lo in range(start, end, _STEP):
                if madvise(lo, min(_STEP, end - lo), MADV_POPULATE_WRITE) != 0:
                    return  # (not offered here, or no memory: the pages are faulted in where they are written)

    thread = threading.Thread(target=run, name="megatrace-populate", daemon=True)
    thread.start()
    return thread
