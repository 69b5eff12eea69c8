"""The reads behind the ring reader: runs of slots into rows, whole bodies, read-ahead hints, open budgets, and
the tail reader's batch reads (many files' headers, then runs of their slots: each in one pass of C when the
extension is built)."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatrace.files import INPUT_FLAGS
from megatrace.trace import ring_format as fmt

try:
    from megatrace.trace._ringfast import open_heads as _open_heads  # type: ignore[import-not-found]
    from megatrace.trace._ringfast import read_files as _read_files  # type: ignore[import-not-found]
    from megatrace.trace._ringfast import read_runs as _read_runs  # type: ignore[import-not-found]
except ImportError:  # not built: each file is opened and read on its own (the caller's way), runs by os.preadv
    _open_heads = _read_files = _read_runs = None

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


@dataclass
class OpenedHeads:
    """Many files opened and their headers read (:func:`open_heads`), row ``i`` for file ``i``."""

    fds: np.ndarray  # int32: the open descriptor, -1 where the caller must open and read the file its own way
    sizes: np.ndarray  # int64: file sizes
    lens: np.ndarray  # int64: header bytes read (fewer than asked in a short file)
    heads: np.ndarray  # uint8 (n, header_len)
    errs: np.ndarray  # int32: why fds[i] is -1 (an errno; EINVAL: not a regular file; ENOSYS: no C pass)

    def head(self, i: int) -> bytes:
        return self.heads[i, :int(self.lens[i])].tobytes()

    def all_heads(self) -> list[bytes]:
        """``head(i)`` of every row, in one pass (thousands of rows: no numpy indexing per row)."""
        width, flat = self.heads.shape[1], self.heads.tobytes()
        return [flat[i * width:i * width + n] for i, n in enumerate(self.lens.tolist())]


def open_heads(paths: Sequence[str | os.PathLike[str]], header_len: int, live: slice, tries: int) -> OpenedHeads:
    """Open ``paths`` read-only (``files.INPUT_FLAGS``: no link followed, nothing blocks) and read the first
    ``header_len`` bytes of each, its ``live`` words read again until two reads agree (at most ``tries`` times, as
    ``ring_header.read_header_bytes``): all files opened and their headers asked for first, so that the kernel reads
    them ahead together, then read; in one pass of C. A file that is anything but a regular file opened and read in
    whole (a link, a FIFO, an error, a short re-read of the live words), and every file where the extension is not
    built, gets fd -1: the caller opens and reads it its own way, which says what is wrong."""
    n = len(paths)
    out = OpenedHeads(np.full(n, -1, np.int32), np.zeros(n, np.int64), np.zeros(n, np.int64),
                      np.zeros((n, header_len), np.uint8), np.full(n, errno.ENOSYS, np.int32))
    if _open_heads is not None and n:
        _open_heads(paths, INPUT_FLAGS, header_len, live.start, live.stop, tries, out.fds, out.sizes, out.lens,
                    out.heads, out.errs)
    return out


def read_runs(fds: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], dest: np.ndarray,
              at: Sequence[int]) -> list[int]:
    """Read run ``j`` (``lengths[j]`` bytes of ``fds[j]`` at ``offsets[j]``) into the flat bytes of ``dest`` at
    ``at[j]``, the kernel asked for every run first; one read a run (a short one leaves the rest as it was). Returns
    each run's errno, 0 when read. In one pass of C when the extension is built, else with ``os.preadv``."""
    if not dest.flags.c_contiguous:
        raise ValueError("read_runs: dest must be one contiguous buffer")
    flat = dest.reshape(-1).view(np.uint8)
    m = len(fds)
    if _read_runs is not None and m:
        errs = np.zeros(m, np.int32)
        _read_runs(np.asarray(fds, np.int32), np.asarray(offsets, np.int64), np.asarray(lengths, np.int64), flat,
                   np.asarray(at, np.int64), errs)
        return errs.tolist()
    for fd, offset, length in zip(fds, offsets, lengths, strict=True):
        try:
            will_need(fd, offset, length)
        except OSError:
            pass  # (a hint: the read says what is wrong)
    out = []
    for fd, offset, length, start in zip(fds, offsets, lengths, at, strict=True):
        try:
            os.preadv(fd, [flat[start:start + length]], offset)
            out.append(0)
        except OSError as exc:
            out.append(exc.errno or errno.EIO)
    return out


def read_files(paths: Sequence[str | os.PathLike[str]], limit: int) -> list[bytes | None]:
    """The bytes of each of ``paths`` (small files: a rank's meta file), all opened (``files.INPUT_FLAGS``) and
    asked for before any is read; in one pass of C. None for a file the caller must read its own way, which says
    what is wrong: one that could not be opened, is not a regular file or holds more than ``limit`` bytes, and
    every file where the extension is not built."""
    if _read_files is None or not paths:
        return [None] * len(paths)
    return [got if isinstance(got, bytes) else None for got in _read_files(paths, INPUT_FLAGS, limit)]
