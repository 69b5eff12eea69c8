"""The reads behind the ring reader: runs of slots into rows, whole bodies, read-ahead hints, open budgets."""

from __future__ import annotations

import os

import numpy as np

from megatrace.trace import ring_format as fmt

COUNTER_LIMIT = 1 << 62  # a write counter beyond this is garbage: it cannot say where the tail is
_FADVISE = hasattr(os, "posix_fadvise")


def open_budget() -> int:
    """How many files one batch keeps open at once: a quarter of the descriptor limit, 8 to 128."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 64
    return 128 if soft == resource.RLIM_INFINITY else max(8, min(128, soft // 4))


def slot_runs(first_seq: int, n: int, cap: int, size: int) -> list[tuple[int, int, int]]:
    """(file offset, first row, rows) of each contiguous run of the slots of seqs ``first_seq`` ..
    ``first_seq + n - 1`` (n <= cap; two runs when the range wraps), cut where a truncated file ends."""
    slot = (first_seq - 1) % cap
    head = min(n, cap - slot)
    full_slots = min(cap, max(0, size - fmt.HEADER_SIZE) // fmt.RECORD_SIZE)
    runs = []
    for row, first, count in ((0, slot, head), (head, 0, n - head)):
        usable = min(count, max(0, full_slots - first))
        if usable:
            runs.append((fmt.HEADER_SIZE + first * fmt.RECORD_SIZE, row, usable))
    return runs


def pread_rows(fd: int, rows: np.ndarray, first_seq: int, cap: int, size: int) -> None:
    """Fill ``rows`` (uint8, (n, 64), zeroed, n <= cap) with the slots of seqs ``first_seq``, ``first_seq + 1``, ...

    One ``preadv`` per contiguous run of slots (two when the range wraps); slots past the end of a
    truncated file, or cut by it, stay zero (empty), as in the full read.
    """
    for offset, row, count in slot_runs(first_seq, len(rows), cap, size):
        os.preadv(fd, [rows[row:row + count]], offset)


def will_need(fd: int, offset: int, length: int) -> None:
    """Tell the kernel these bytes will be read soon (it reads them ahead, many files at once)."""
    if _FADVISE:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)


def pread_all(fd: int, n: int, offset: int) -> np.ndarray:
    """``n`` bytes at ``offset`` (fewer at the end of the file), read straight into a writable uint8 array."""
    buf = np.empty(max(n, 0), np.uint8)
    got = 0
    while got < len(buf):
        k = os.preadv(fd, [buf[got:got + (1 << 26)]], offset + got)
        if not k:
            break
        got += k
    return buf[:got]
