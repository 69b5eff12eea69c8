"""Out-of-process reader for ring files: every committed record, never a torn one.

The reader copies the file, checks both checksums of every record with numpy,
and re-reads the few slots that fail (a live writer may be mid-record). What it
cannot read is reported as a :class:`ReadProblem` naming the file and offset;
everything else is kept.

``read_ring(path, last=K)`` reads only the header and the newest ``K`` slots
(two or three ``pread`` calls, whatever the ring's size) and validates them the
same way; :func:`read_tails` does that for many rings at once, checking the
checksums of all of them in one vectorised pass. Hang analysis needs no more.

This module is the reader's public entry; its parts live beside it: the records and their checksums
(``ring_records``), the header, snapshot and problems (``ring_header``), the reads (``ring_io``), the
full read (``ring_full``), the tail reads (``ring_tail``) and the meta file (``ring_meta``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence

import numpy as np

from megatrace.files import open_input
from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_full import copy_full, full_snapshot
from megatrace.trace.ring_header import (ReadProblem, RingFormatError, RingHeader, RingSnapshot, geometry_error,
                                         parse_header, read_header_bytes)
from megatrace.trace.ring_io import COUNTER_LIMIT, open_budget
from megatrace.trace.ring_meta import META_LIMIT, read_meta
from megatrace.trace.ring_records import RECORD_DTYPE, SlotCopy, head_checks, tail_checks, validate
from megatrace.trace.ring_tail import FRESHER, batch_tails, copy_tail, tail_snapshot, trim
from megatrace.trace.tail_pack import PackedFile

__all__ = ["META_LIMIT", "RECORD_DTYPE", "ReadProblem", "RingFormatError", "RingHeader", "RingSnapshot",
           "head_checks", "open_budget", "parse_header", "read_meta", "read_ring", "read_tails", "tail_checks"]


def read_ring(path: str | os.PathLike[str], retries: int = 3, retry_sleep: float = 0.002, *,
              last: int | None = None) -> RingSnapshot:
    """Read a ring file written by a live, killed or finished writer.

    ``last=K`` reads only the newest ``K`` records (the header and at most ``K + 2`` slots): the
    result is what the full read would return restricted to its newest ``K`` sequence numbers, with
    ``dropped`` counting every older record, ``overwritten`` those the ring itself overwrote and
    ``partial`` set when some were left unread. Only problems of the slots read are reported.
    Raises :class:`RingFormatError` only when the header itself is unusable.
    """
    path = str(path)
    if last is None:
        return _read_full(path, retries, retry_sleep)
    if last < 1:
        raise ValueError(f"last={last}: the number of records to read must be at least 1")
    return _read_tail(path, int(last), retries, retry_sleep)


def _read_full(path: str, retries: int, retry_sleep: float) -> RingSnapshot:
    fd = open_input(path)  # a regular file, not another user's link: a FIFO or device never blocks or floods
    try:
        header, problems, copy = copy_full(fd, path)
        _reread(fd, copy, retries, retry_sleep)
        return full_snapshot(path, header, problems, copy)
    finally:
        os.close(fd)


def _reread(fd: int, copy: SlotCopy, retries: int, retry_sleep: float) -> None:
    """Read the suspect rows of ``copy`` again, a few times (a live writer may be mid-record), and check them.

    A re-read that returns a record past the row's limit is a later lap: the row is marked raced and keeps
    its first copy.
    """
    bad = copy.suspects()
    for _ in range(retries if 0 < len(bad) < 4096 else 0):
        time.sleep(retry_sleep)
        for row in bad:
            chunk = os.pread(fd, fmt.RECORD_SIZE, fmt.HEADER_SIZE + int(copy.slots[row]) * fmt.RECORD_SIZE)
            if len(chunk) == fmt.RECORD_SIZE and chunk != copy.raw[row].tobytes():
                limit = copy.limits if isinstance(copy.limits, int) else int(copy.limits[row])
                if fmt.RECORD_SEQ.unpack_from(chunk)[0] > limit:
                    copy.raced[row] = True  # changed under us to a newer lap: keep the first copy
                else:
                    copy.raw[row] = np.frombuffer(chunk, np.uint8)
        copy.empty[bad], copy.head_ok[bad], copy.tail_ok[bad] = validate(copy.raw[bad], copy.slots[bad],
                                                                         copy.capacity)
        bad = copy.suspects()
        if not len(bad) or copy.raced[bad].all():
            break


def _read_tail(path: str, last: int, retries: int, retry_sleep: float) -> RingSnapshot:
    fd = open_input(path)
    try:
        size = os.fstat(fd).st_size
        snap = None
        for _ in range(retries + 1):  # a header that was stale by more than the window: read it again
            header, problems = parse_header(path, read_header_bytes(fd), size)
            cap = header.capacity
            if problems and size != fmt.file_size(cap):
                raise geometry_error(path, cap, size, fmt.file_size(cap))
            snap = None
            if last + 2 <= cap and header.write_counter < COUNTER_LIMIT:
                copy = copy_tail(fd, path, header, problems, size, last)
                _reread(fd, copy, retries, retry_sleep)
                snap = tail_snapshot(fd, path, header, problems, last, copy)
            if snap is not FRESHER:
                break
        if snap is FRESHER:
            snap = None
    finally:
        os.close(fd)
    # A small ring, a garbage or stale write counter, or a damaged tail: read it all and keep the tail.
    return snap if snap is not None else trim(_read_full(path, retries, retry_sleep), last)


def read_tails(paths: Sequence[str | os.PathLike[str]], last: int, retries: int = 3,
               retry_sleep: float = 0.002,
               pack: Mapping[str, PackedFile] | None = None) -> list[RingSnapshot | RingFormatError | OSError]:
    """``read_ring(path, last=last)`` for each path, in order; an unreadable file gives its exception.

    Fast for thousands of rings: each file costs one open, a header read and one or two reads of its
    tail into one shared buffer (the kernel is told ahead what will be read, a batch of files at a
    time); the checksums of all tails are checked in one vectorised pass.
    A ring whose tail is not spotless (a torn or corrupted slot, a live writer, a lagging or stale
    counter, a damaged header, a truncated or small file) is read again on its own by
    ``read_ring(path, last=last)``. The records of the others are views into the shared buffer.
    """
    if last < 1:
        raise ValueError(f"last={last}: the number of records to read must be at least 1")
    out = batch_tails(paths, last, pack)
    for i in range(len(paths)):
        if out[i] is None:
            try:
                out[i] = read_ring(paths[i], retries, retry_sleep, last=last)
            except (RingFormatError, OSError) as exc:
                out[i] = exc
    return out  # type: ignore[return-value]
