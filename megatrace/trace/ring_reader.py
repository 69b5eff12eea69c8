"""Out-of-process reader for ring files: every committed record, never a torn one.

The reader copies the file, checks both checksums of every record with numpy,
and re-reads the few slots that fail (a live writer may be mid-record). What it
cannot read is reported as a :class:`ReadProblem` naming the file and offset;
everything else is kept.

``read_ring(path, last=K)`` reads only the header and the newest ``K`` slots
(two or three ``pread`` calls, whatever the ring's size) and validates them the
same way; :func:`read_tails` does that for many rings at once, checking the
checksums of all of them in one vectorised pass. Hang analysis needs no more.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from megatrace.files import open_input, read_input
from megatrace.trace import ring_format as fmt

RECORD_DTYPE = np.dtype([
    ("seq", "<u8"), ("group_seq", "<u8"), ("t_enqueue", "<i8"), ("nbytes", "<u8"),
    ("group_id", "<u4"), ("peer", "<i4"), ("op", "<u2"), ("dtype", "u1"), ("flags", "u1"),
    ("head_check", "<u4"), ("t_complete", "<i8"), ("state", "u1"), ("_pad", "V3"),
    ("tail_check", "<u4"),
])
assert RECORD_DTYPE.itemsize == fmt.RECORD_SIZE

_ADLER_MOD = 65521
# Adler32 of a record head as two dot products: A sums the bytes, B weighs byte j (44 - j) times.
_ADLER_A = np.ones(fmt.HEAD_LEN, np.float32)
_ADLER_B = np.arange(fmt.HEAD_LEN, 0, -1).astype(np.float32)
_TAIL_R = np.array([pow(2, 32 * k, fmt.TAIL_PRIME) for k in range(4)], dtype=np.uint64)
_CHUNK = 1 << 18  # records per vectorised checksum pass: bounds the temporaries to ~60 MB


class RingFormatError(Exception):
    """The file is not a readable ring (bad magic, unknown version, too short)."""


@dataclass(frozen=True)
class ReadProblem:
    """Something in a ring or meta file that could not be read; the rest was kept."""

    path: str
    offset: int
    message: str
    severity: str = "error"  # "error": corruption; "warning": expected after a crash or while live

    def __str__(self) -> str:
        return f"{self.path}: offset {self.offset}: {self.message}"


@dataclass(frozen=True)
class RingHeader:
    path: str
    version: int
    capacity: int
    rank: int
    local_rank: int
    world_size: int
    pid: int
    anchor_wall_ns: int
    anchor_mono_ns: int
    job_id: str
    step_id: str
    host: str
    write_counter: int
    writer_state: int
    heartbeat_ns: int = 0  # the writer's last heartbeat (its host's CLOCK_MONOTONIC); 0: it does not beat
    pulse_ns: int = 0  # the writer's native pulse (same clock); 0: it has none
    signal: int = 0  # the terminating signal that reached the writer's process (SIGTERM); 0: none
    signal_ns: int = 0  # when it arrived (same clock)

    @property
    def closed_cleanly(self) -> bool:
        return self.writer_state == fmt.WriterState.CLOSED

    def to_wall_ns(self, mono_ns: int) -> int:
        """Convert a record's monotonic timestamp to this host's wall clock."""
        return self.anchor_wall_ns + (mono_ns - self.anchor_mono_ns)


@dataclass
class RingSnapshot:
    """One ring as read: header, valid records sorted by ``seq``, and what was lost."""

    header: RingHeader
    records: np.ndarray  # RECORD_DTYPE, sorted by seq
    problems: list[ReadProblem] = field(default_factory=list)
    dropped: int = 0  # records older than the window: overwritten because the ring wrapped (or, with
    #                   ``partial``, also left unread by ``read_ring(path, last=K)``)
    lost: int = 0  # records inside the window that were torn or corrupted
    partial: bool = False  # read with ``last=K`` and older records exist that were not read
    overwritten: int = 0  # of ``dropped``, those the ring itself overwrote (== dropped unless partial)

    def to_dicts(self) -> list[dict[str, int]]:
        names = [n for n in RECORD_DTYPE.names if not n.startswith("_") and not n.endswith("check")]
        return [{n: int(r[n]) for n in names} for r in self.records]


def _decode(raw: bytes) -> str:
    return raw.split(b"\x00", 1)[0].decode("utf-8", "replace")


def head_checks(raw: np.ndarray) -> np.ndarray:
    """Vectorised adler32 of the first 44 bytes of each 64-byte row of ``raw`` (uint8, shape (n, 64)).

    Both adler sums are float32 dot products: every partial sum is an integer below 255 * 990 < 2**24,
    so float32 holds it exactly, in any summation order. ``einsum`` rather than ``@``: a matrix product
    this skinny is fastest on one core, and a multi-threaded BLAS slows it down many times on a busy machine.
    """
    head = raw[:, :fmt.HEAD_LEN].astype(np.float32)
    a = (np.einsum("ij,j->i", head, _ADLER_A).astype(np.uint32) + 1) % _ADLER_MOD
    b = (np.einsum("ij,j->i", head, _ADLER_B).astype(np.uint32) + fmt.HEAD_LEN) % _ADLER_MOD
    return (b << 16) | a


def tail_checks(words: np.ndarray) -> np.ndarray:
    """Vectorised tail checksum of each record (``words``: uint32, shape (n, 16))."""
    return (words[:, 12].astype(np.uint64) * _TAIL_R[0] + words[:, 13] * _TAIL_R[1] + words[:, 14] * _TAIL_R[2]
            + words[:, 0] * _TAIL_R[3]) % np.uint64(fmt.TAIL_PRIME)


def _empty_rows(raw: np.ndarray) -> np.ndarray:
    """Rows of ``raw`` (uint8, (n, 64)) that are all zero (an OR of eight u64 columns beats ``any(axis=1)``)."""
    w = raw.view("<u8")
    acc = w[:, 0] | w[:, 1]
    for k in range(2, fmt.RECORD_SIZE // 8):
        acc |= w[:, k]
    return acc == 0


META_LIMIT = 64 << 20  # a meta file is a few KiB (a group line per group); refuse anything absurd
_HEADER_USED = fmt.SIGNAL_OFFSET + fmt.SIGNAL.size  # the header bytes that hold anything
_HEADER_REQUIRED = fmt.WRITER_STATE_OFFSET + fmt.WRITER_STATE.size  # ... of which a reader needs these


def parse_header(path: str, blob: bytes, file_size: int | None = None) -> tuple[RingHeader, list[ReadProblem]]:
    """The header fields and their problems; ``blob`` is the file's start (all of the 4096-byte header,
    or, with ``file_size`` given, at least its first 268 bytes; the later fields are read when present)."""
    problems: list[ReadProblem] = []
    size = len(blob) if file_size is None else file_size
    if size < fmt.HEADER_SIZE or len(blob) < _HEADER_REQUIRED:
        raise RingFormatError(f"{path}: {size} bytes, shorter than the {fmt.HEADER_SIZE}-byte ring header")
    static = blob[:fmt.HEADER_STATIC.size]
    (magic, version, header_size, record_size, capacity, rank, local_rank, world_size, pid,
     wall, mono, _reserved, job, step, host, _pad) = fmt.HEADER_STATIC.unpack(static)
    if magic != fmt.MAGIC:
        raise RingFormatError(f"{path}: offset 0: not a MegaTrace ring file (magic {magic!r})")
    if version != fmt.VERSION:
        raise RingFormatError(f"{path}: offset 8: ring format version {version} is not supported "
                              f"(this MegaTrace reads version {fmt.VERSION})")
    stored = fmt.HEADER_CHECK.unpack_from(blob, fmt.HEADER_CHECK_OFFSET)[0]
    if stored != fmt.header_check(static):
        problems.append(ReadProblem(path, fmt.HEADER_CHECK_OFFSET,
                                    "header checksum mismatch: header fields may be corrupted"))
    if header_size != fmt.HEADER_SIZE or record_size != fmt.RECORD_SIZE \
            or not fmt.MIN_CAPACITY <= capacity <= fmt.MAX_CAPACITY:
        raise RingFormatError(f"{path}: offset 12: implausible geometry (header {header_size}, "
                              f"record {record_size}, capacity {capacity})")
    if not 1 <= world_size <= fmt.MAX_WORLD_SIZE:
        # Sized tables (missing ranks, per-rank columns) follow the world size: never trust a huge one.
        raise RingFormatError(f"{path}: offset 32: world size {world_size} is outside 1..{fmt.MAX_WORLD_SIZE}")
    counter = fmt.WRITE_COUNTER.unpack_from(blob, fmt.WRITE_COUNTER_OFFSET)[0]
    state = fmt.WRITER_STATE.unpack_from(blob, fmt.WRITER_STATE_OFFSET)[0]
    beat, pulse, sig, sig_ns = (_field(blob, f, off) for f, off in (
        (fmt.HEARTBEAT, fmt.HEARTBEAT_OFFSET), (fmt.PULSE, fmt.PULSE_OFFSET), (fmt.SIGNAL, fmt.SIGNAL_OFFSET),
        (fmt.SIGNAL_NS, fmt.SIGNAL_NS_OFFSET)))
    header = RingHeader(path, version, capacity, rank, local_rank, world_size, pid, wall, mono,
                        _decode(job), _decode(step), _decode(host), counter, state, beat, pulse,
                        sig, sig_ns if sig else 0)
    return header, problems


def _field(blob: bytes, layout: struct.Struct, offset: int) -> int:
    """A mutable header field, or 0 when ``blob`` stops before it."""
    return layout.unpack_from(blob, offset)[0] if len(blob) >= offset + layout.size else 0


def _validate(raw: np.ndarray, slots: np.ndarray,
              capacity: int | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (empty, head_ok, tail_ok) masks for rows of ``raw``, which sit in ring slots ``slots``.

    ``capacity``: of the one ring the rows come from, or per row (uint64) for rows of several rings.
    """
    per_row = isinstance(capacity, np.ndarray)
    n = len(raw)
    empty = np.empty(n, bool)
    head_ok = np.empty(n, bool)
    tail_ok = np.empty(n, bool)
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        part = raw[lo:hi]
        words = part.view("<u4")
        rec = part.view(RECORD_DTYPE).reshape(-1)
        empty[lo:hi] = _empty_rows(part)
        cap = capacity[lo:hi] if per_row else np.uint64(capacity)
        in_place = (rec["seq"] > 0) & ((rec["seq"] - np.uint64(1)) % cap == slots[lo:hi])
        head_ok[lo:hi] = in_place & (head_checks(part) == rec["head_check"])
        tail_ok[lo:hi] = ((tail_checks(words) == rec["tail_check"]) & (rec["state"] >= fmt.State.ENQUEUED)
                          & (rec["state"] <= fmt.State.FAILED))
    return empty, head_ok, tail_ok


def _drop_records_written_during_read(valid: np.ndarray, header: RingHeader) -> np.ndarray:
    """Keep a live snapshot contiguous: drop records numbered past the write counter + 1, and the ones they lapped.

    The header, with the counter, is copied before the body. A fast writer that laps slots while
    the body is copied leaves later slots holding records newer than the counter and earlier ones
    still holding the previous lap, which is older than the window: keeping the newer ones would
    leave a gap. (A counter below the newest record by more than a lap is damaged: ignored.)
    """
    if header.writer_state != fmt.WriterState.OPEN or not len(valid):
        return valid
    limit = header.write_counter + 1
    cap = header.capacity
    newest = int(valid["seq"][-1])
    if newest <= limit or limit + cap < newest:
        return valid
    later = valid["seq"][valid["seq"] > limit].astype(np.int64)
    # Each later record overwrote, during the copy, the record its slot held when the counter was
    # read: the newest such is `cutoff`. Everything up to it counts as overwritten, so the snapshot
    # stays one contiguous run instead of keeping older records across the gap.
    laps = (later - limit + cap - 1) // cap
    cutoff = int((later - laps * cap).max())
    return valid[(valid["seq"] <= limit) & (valid["seq"].astype(np.int64) > cutoff)]


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
        return _read_full_fd(fd, path, retries, retry_sleep)
    finally:
        os.close(fd)


def _read_full_fd(fd: int, path: str, retries: int, retry_sleep: float) -> RingSnapshot:
    size = os.fstat(fd).st_size
    header, problems = parse_header(path, os.pread(fd, fmt.HEADER_SIZE, 0), size)
    cap = header.capacity
    expected = fmt.file_size(cap)
    if problems and size != expected:
        raise _geometry_error(path, cap, size, expected)
    # Read no more than the capacity allows: a sparse file far larger than that costs nothing more.
    body = _pread_all(fd, min(size, expected) - fmt.HEADER_SIZE, fmt.HEADER_SIZE)
    n_slots = len(body) // fmt.RECORD_SIZE
    if len(body) + fmt.HEADER_SIZE < expected:
        got = len(body) + fmt.HEADER_SIZE
        problems.append(ReadProblem(path, got, f"file truncated: {got} of {expected} bytes; "
                                               f"slots {n_slots}..{cap - 1} are lost"))
    raw = np.frombuffer(body[:n_slots * fmt.RECORD_SIZE], dtype=np.uint8).reshape(n_slots, fmt.RECORD_SIZE).copy()
    empty, head_ok, tail_ok = _validate(raw, np.arange(n_slots, dtype=np.uint64), cap)

    # A live writer may be mid-record: re-read the slots that failed, a few times. A re-read
    # may only return a record that fits this snapshot (at most one past its newest record):
    # a slot the writer has since refilled on a later lap is skipped as "raced", not mixed in.
    # A live ring's slot that holds a record a whole lap older than the newest was copied before
    # the writer refilled it (a reader preempted mid-copy, or a writer thread between taking its
    # number and writing): it is re-read too, so the copy does not skip the record it now holds.
    seqs = raw.view(RECORD_DTYPE).reshape(-1)["seq"]  # a view: follows the re-reads
    newest = int(seqs[head_ok].max()) if head_ok.any() else 0
    limit = max(newest, min(header.write_counter, newest + 1)) + 1
    live = not header.closed_cleanly

    def suspects() -> np.ndarray:
        odd = ~empty & (~head_ok | ~tail_ok)
        if live and newest > cap:
            odd |= head_ok & (seqs <= np.uint64(newest - cap))
        return np.flatnonzero(odd)

    bad = suspects()
    raced = np.zeros(n_slots, bool)
    if 0 < len(bad) < 4096:
        for _ in range(retries):
            time.sleep(retry_sleep)
            for slot in bad:
                chunk = os.pread(fd, fmt.RECORD_SIZE, fmt.HEADER_SIZE + int(slot) * fmt.RECORD_SIZE)
                if len(chunk) == fmt.RECORD_SIZE and chunk != raw[slot].tobytes():
                    if fmt.RECORD_SEQ.unpack_from(chunk)[0] > limit:
                        raced[slot] = True  # changed under us to a newer lap: keep the first copy
                    else:
                        raw[slot] = np.frombuffer(chunk, np.uint8)
            empty[bad], head_ok[bad], tail_ok[bad] = _validate(raw[bad], bad.astype(np.uint64), cap)
            bad = suspects()
            if not len(bad) or raced[bad].all():
                break

    records = raw.view(RECORD_DTYPE).reshape(-1)
    valid = records[head_ok]
    torn_tail = head_ok & ~tail_ok
    if torn_tail.any():
        fixed = records[torn_tail].copy()
        fixed["state"] = fmt.State.ENQUEUED
        fixed["t_complete"] = 0
        valid = np.concatenate([records[head_ok & tail_ok], fixed])
    valid = valid[np.argsort(valid["seq"], kind="stable")]  # 5x faster than sort(order=)
    valid = _drop_records_written_during_read(valid, header)

    max_seq = int(valid["seq"][-1]) if len(valid) else 0
    max_seq = max(max_seq, min(header.write_counter, max_seq + 1))
    dropped = max(0, max_seq - cap)
    # A slot torn when copied and refilled on a later lap by the re-read: the record it held in this
    # window, and every older one, are overwritten now (as in the tail read). Keeping the older ones
    # would leave a gap where that record was.
    for slot in np.flatnonzero(raced):
        held = max_seq - (max_seq - 1 - int(slot)) % cap  # the newest seq <= max_seq that lives in this slot
        dropped = max(dropped, held)
    # A copy of a live ring is not instantaneous: a slot copied before the writer lapped it
    # holds a record older than the window. It was overwritten: count it dropped, not kept.
    valid = valid[valid["seq"] > dropped]
    for slot in np.flatnonzero(torn_tail & (records["seq"] > dropped))[:20]:
        problems.append(ReadProblem(
            path, fmt.HEADER_SIZE + int(slot) * fmt.RECORD_SIZE + fmt.TAIL_OFFSET,
            f"completion of record seq {int(records[slot]['seq'])} is unreadable (torn or corrupted); "
            "kept as entered, not completed", "warning"))
    window = max_seq - dropped
    lost = max(0, window - len(valid))
    unreadable = np.flatnonzero(~empty & ~head_ok)
    head_slot = (max_seq) % cap  # where the next record goes: a torn slot here is a record being written
    live = not header.closed_cleanly  # after a clean close no record can be half-written: a bad slot is corrupt
    for slot in unreadable[:20]:
        off = fmt.HEADER_SIZE + int(slot) * fmt.RECORD_SIZE
        if raced[slot]:
            problems.append(ReadProblem(path, off, "record overwritten by the writer while the file was read; "
                                                   "skipped", "warning"))
        elif live and (int(slot) == head_slot or int(slot) == (max_seq - 1) % cap):
            problems.append(ReadProblem(path, off, "record being written when the file was read "
                                                   "(writer running or killed mid-record); skipped", "warning"))
        else:
            problems.append(ReadProblem(path, off, "corrupted record (checksum or position mismatch); skipped"))
    if len(unreadable) > 20:
        problems.append(ReadProblem(path, fmt.HEADER_SIZE, f"{len(unreadable) - 20} more unreadable records"))
    return RingSnapshot(header, valid, problems, dropped, lost, overwritten=dropped)


# ---------------------------------------------------------------------------------------------------
# Tails: the newest K records only.
# ---------------------------------------------------------------------------------------------------
_COUNTER_LIMIT = 1 << 62  # a write counter beyond this is garbage: it cannot say where the tail is


def _geometry_error(path: str, cap: int, size: int, expected: int) -> RingFormatError:
    # The checksum says the static header is damaged and the file size disagrees with its
    # capacity: the geometry itself may be the damaged field, and every slot would be misread.
    return RingFormatError(f"{path}: offset 20: header checksum mismatch and capacity {cap} does not match "
                           f"the file size ({size} bytes, expected {expected}); geometry is untrustworthy")


def _truncation(path: str, cap: int, size: int) -> ReadProblem | None:
    expected = fmt.file_size(cap)
    if size >= expected:
        return None
    n_slots = min(cap, (size - fmt.HEADER_SIZE) // fmt.RECORD_SIZE)
    return ReadProblem(path, size, f"file truncated: {size} of {expected} bytes; slots {n_slots}..{cap - 1} are lost")


def _trim(snap: RingSnapshot, last: int) -> RingSnapshot:
    """A full read restricted to its newest ``last`` sequence numbers."""
    max_seq = snap.dropped + snap.lost + len(snap.records)
    start = max_seq - last
    if start <= snap.dropped:
        return snap
    keep = snap.records[snap.records["seq"] > start]
    return RingSnapshot(snap.header, keep, snap.problems, start, last - len(keep), True, snap.dropped)


def _slot_runs(first_seq: int, n: int, cap: int, size: int) -> list[tuple[int, int, int]]:
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


def _pread_rows(fd: int, rows: np.ndarray, first_seq: int, cap: int, size: int) -> None:
    """Fill ``rows`` (uint8, (n, 64), zeroed, n <= cap) with the slots of seqs ``first_seq``, ``first_seq + 1``, ...

    One ``preadv`` per contiguous run of slots (two when the range wraps); slots past the end of a
    truncated file, or cut by it, stay zero (empty), as in the full read.
    """
    for offset, row, count in _slot_runs(first_seq, len(rows), cap, size):
        os.preadv(fd, [rows[row:row + count]], offset)


def _will_need(fd: int, offset: int, length: int) -> None:
    """Tell the kernel these bytes will be read soon (it reads them ahead, many files at once)."""
    if _FADVISE:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)


_FADVISE = hasattr(os, "posix_fadvise")


_FRESHER = object()  # _tail_of: the counter moved on by more than the window while the tail was read


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    """``n`` bytes at ``offset`` (fewer at the end of the file)."""
    parts = []
    while n > 0:
        chunk = os.pread(fd, min(n, 1 << 26), offset)
        if not chunk:
            break
        parts.append(chunk)
        n -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def _read_tail(path: str, last: int, retries: int, retry_sleep: float) -> RingSnapshot:
    fd = open_input(path)
    try:
        size = os.fstat(fd).st_size
        snap = None
        for _ in range(retries + 1):  # a header that was stale by more than the window: read it again
            header, problems = parse_header(path, os.pread(fd, _HEADER_USED, 0), size)
            cap = header.capacity
            if problems and size != fmt.file_size(cap):
                raise _geometry_error(path, cap, size, fmt.file_size(cap))
            snap = None
            if last + 2 <= cap and header.write_counter < _COUNTER_LIMIT:
                snap = _tail_of(fd, path, header, problems, size, last, retries, retry_sleep)
            if snap is not _FRESHER:
                break
        if snap is _FRESHER:
            snap = None
    finally:
        os.close(fd)
    # A small ring, a garbage or stale write counter, or a damaged tail: read it all and keep the tail.
    return snap if snap is not None else _trim(_read_full(path, retries, retry_sleep), last)


def _tail_of(fd: int, path: str, header: RingHeader, problems: list[ReadProblem], size: int, last: int,
             retries: int, retry_sleep: float) -> RingSnapshot | None | object:
    """The newest ``last`` records near the write counter; None when the counter cannot be trusted to find them."""
    cap, counter = header.capacity, header.write_counter
    hi = counter + 1  # the writer may have committed one record past its counter (format section 6.3)
    lo = max(1, hi - last)
    n = hi + 2 - lo  # the candidates for the window, plus one slot to see a counter lagging further
    raw = np.zeros((n, fmt.RECORD_SIZE), np.uint8)
    _pread_rows(fd, raw, lo, cap, size)
    cut = _truncation(path, cap, size)
    if cut is not None:
        problems.append(cut)
    seqs = np.arange(lo, lo + n, dtype=np.uint64)  # the record each row should hold on this lap
    slots = (seqs - np.uint64(1)) % np.uint64(cap)
    empty, head_ok, tail_ok = _validate(raw, slots, cap)

    # A live writer may be mid-record: re-read the rows that failed, and the rows of a live ring
    # the counter calls written that still hold an older lap (copied just before the writer refilled
    # them), a few times.
    # A re-read that returns a later lap than the row's expected record is "raced" and not mixed in
    # (as the full read).
    live = not header.closed_cleanly
    found = raw.view(RECORD_DTYPE).reshape(-1)["seq"]  # a view: follows the re-reads
    committed = seqs <= np.uint64(counter)  # rows past the counter may still hold the older lap

    def suspects() -> np.ndarray:
        odd = ~empty & (~head_ok | ~tail_ok)
        if live:
            odd |= head_ok & committed & (found < seqs)
        return np.flatnonzero(odd)

    bad = suspects()
    raced = np.zeros(n, bool)
    for _ in range(retries if 0 < len(bad) < 4096 else 0):
        time.sleep(retry_sleep)
        for j in bad:
            chunk = os.pread(fd, fmt.RECORD_SIZE, fmt.HEADER_SIZE + int(slots[j]) * fmt.RECORD_SIZE)
            if len(chunk) == fmt.RECORD_SIZE and chunk != raw[j].tobytes():
                if fmt.RECORD_SEQ.unpack_from(chunk)[0] > int(seqs[j]):
                    raced[j] = True
                else:
                    raw[j] = np.frombuffer(chunk, np.uint8)
        empty[bad], head_ok[bad], tail_ok[bad] = _validate(raw[bad], slots[bad], cap)
        bad = suspects()
        if not len(bad) or raced[bad].all():
            break

    rec = raw.view(RECORD_DTYPE).reshape(-1)
    exact = head_ok & (rec["seq"] == seqs)
    newer = head_ok & (rec["seq"] > seqs)  # the writer lapped this slot while it was read
    if exact[-1] or newer[-1]:  # a record two past the counter: the counter lags more than one record
        now = fmt.WRITE_COUNTER.unpack(os.pread(fd, 8, fmt.WRITE_COUNTER_OFFSET))[0]
        if now <= counter:
            return None  # a stale counter, not a live writer: the newest records may be anywhere
        if now > counter + last:
            return _FRESHER  # the window read is older than the writer's whole window now: read again
        # else a live writer moved on while the file was read: the snapshot ends where its counter was
    found = np.flatnonzero(exact[:-1])
    newest = int(seqs[found[-1]]) if len(found) else 0
    if not newest and lo > 1:
        return None  # nothing valid near the counter: let the full read find the newest record
    max_seq = max(newest, min(counter, newest + 1))
    if max(1, max_seq - last + 1) < lo:
        return None  # the newest records are corrupted: the window reaches below what was read
    dropped = max(0, max_seq - last)
    overwritten = max(0, max_seq - cap)
    # A slot the writer refilled on a later lap while the file was read: that record and every older one
    # are overwritten now (as in the full read, where such a record moves the window past them).
    lapped = np.flatnonzero((newer | raced)[:-1])
    if len(lapped):
        floor = int(seqs[lapped[-1]])
        if floor >= max_seq:
            return None  # the writer lapped the whole window while it was read
        dropped, overwritten = max(dropped, floor), max(overwritten, floor)
    keep = exact & (seqs > dropped) & (seqs <= max_seq)
    valid = rec[keep].copy()  # rows are in seq order already
    torn = keep & ~tail_ok
    if torn.any():
        fix = torn[keep]
        valid["state"][fix] = fmt.State.ENQUEUED
        valid["t_complete"][fix] = 0
    for j in np.flatnonzero(torn)[:20]:
        problems.append(ReadProblem(
            path, fmt.HEADER_SIZE + int(slots[j]) * fmt.RECORD_SIZE + fmt.TAIL_OFFSET,
            f"completion of record seq {int(seqs[j])} is unreadable (torn or corrupted); "
            "kept as entered, not completed", "warning"))
    unreadable = np.flatnonzero(~empty & (~head_ok | newer) & (seqs > dropped) & (seqs <= max_seq + 1))
    live = not header.closed_cleanly  # after a clean close no record can be half-written: a bad slot is corrupt
    for j in unreadable[:20]:
        off = fmt.HEADER_SIZE + int(slots[j]) * fmt.RECORD_SIZE
        if raced[j] or newer[j]:
            problems.append(ReadProblem(path, off, "record overwritten by the writer while the file was read; "
                                                   "skipped", "warning"))
        elif live and int(seqs[j]) >= max_seq:
            problems.append(ReadProblem(path, off, "record being written when the file was read "
                                                   "(writer running or killed mid-record); skipped", "warning"))
        else:
            problems.append(ReadProblem(path, off, "corrupted record (checksum or position mismatch); skipped"))
    if len(unreadable) > 20:
        problems.append(ReadProblem(path, fmt.HEADER_SIZE, f"{len(unreadable) - 20} more unreadable records"))
    return RingSnapshot(header, valid, problems, dropped, max_seq - dropped - len(valid), dropped > overwritten,
                        overwritten)


def _whole_records(raw: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """Rows of ``raw`` that hold exactly record ``seqs`` (hence in their slot), both checksums and state right."""
    out = np.empty(len(raw), bool)
    for lo in range(0, len(raw), _CHUNK):
        part = raw[lo:lo + _CHUNK]
        rec = part.view(RECORD_DTYPE).reshape(-1)
        out[lo:lo + _CHUNK] = ((rec["seq"] == seqs[lo:lo + _CHUNK]) & (head_checks(part) == rec["head_check"])
                               & (tail_checks(part.view("<u4")) == rec["tail_check"])
                               & (rec["state"] - np.uint8(fmt.State.ENQUEUED) <= fmt.State.FAILED - fmt.State.ENQUEUED))
    return out


def _older_or_empty(raw: np.ndarray, seqs: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Rows that are empty or hold a valid head of an older lap than record ``seqs`` (nothing newer)."""
    empty, head_ok, _ = _validate(raw, (seqs - np.uint64(1)) % caps, caps)
    return empty | (head_ok & (raw.view(RECORD_DTYPE).reshape(-1)["seq"] < seqs))


def open_budget() -> int:
    """How many files one batch keeps open at once: a quarter of the descriptor limit, 8 to 128."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 64
    return 128 if soft == resource.RLIM_INFINITY else max(8, min(128, soft // 4))


def _read_heads_and_tails(paths: Sequence[str | os.PathLike[str]], which: range, last: int, raw: np.ndarray,
                          out: list, heads: list, first: np.ndarray, rows: np.ndarray, caps: np.ndarray,
                          sizes: list[int]) -> None:
    """``read_tails``' reads for the files ``which``, in three passes so that the kernel reads ahead for
    all of them at once when they are not cached: open each file and ask for its header; read the
    headers and ask for each tail; read the tails (into ``raw``, at each ring's rows)."""
    stride = last + 2
    fds: dict[int, int] = {}
    try:
        for i in which:
            try:
                fds[i] = open_input(paths[i])
            except OSError as exc:
                out[i] = exc
                continue
            _will_need(fds[i], 0, _HEADER_USED)
        for i, fd in fds.items():
            try:
                sizes[i] = os.fstat(fd).st_size
                header, problems = parse_header(str(paths[i]), os.pread(fd, _HEADER_USED, 0), sizes[i])
            except (RingFormatError, OSError) as exc:
                out[i] = exc
                continue
            heads[i] = header
            cap, counter = header.capacity, header.write_counter
            if problems or sizes[i] != fmt.file_size(cap) or stride > cap or counter >= _COUNTER_LIMIT:
                continue  # read on its own later
            lo = max(1, counter + 1 - last)
            first[i], rows[i], caps[i] = lo, counter + 3 - lo, cap
            for offset, _, count in _slot_runs(lo, int(rows[i]), cap, sizes[i]):
                _will_need(fd, offset, count * fmt.RECORD_SIZE)
        for i in which:
            if rows[i]:
                try:
                    _pread_rows(fds[i], raw[i * stride:i * stride + int(rows[i])], int(first[i]), int(caps[i]),
                                sizes[i])
                except OSError as exc:
                    out[i], rows[i] = exc, 0
    finally:
        for fd in fds.values():
            os.close(fd)


def read_tails(paths: Sequence[str | os.PathLike[str]], last: int, retries: int = 3,
               retry_sleep: float = 0.002) -> list[RingSnapshot | RingFormatError | OSError]:
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
    stride = last + 2  # rows per ring: the window, the slot one past the counter, and one more
    n_paths = len(paths)
    raw = np.zeros((n_paths * stride, fmt.RECORD_SIZE), np.uint8)
    out: list[RingSnapshot | RingFormatError | OSError | None] = [None] * n_paths
    heads: list[RingHeader | None] = [None] * n_paths
    first = np.ones(n_paths, np.uint64)
    rows = np.zeros(n_paths, np.int64)  # rows read; 0: not on the fast path
    caps = np.ones(n_paths, np.uint64)
    sizes = [0] * n_paths
    step = open_budget()
    for lo in range(0, n_paths, step):
        _read_heads_and_tails(paths, range(lo, min(n_paths, lo + step)), last, raw, out, heads, first, rows, caps,
                              sizes)

    # Spotless: every slot from the window's oldest record to the counter holds exactly its record, with
    # both checksums right; the slot after the counter holds that record (the counter lags by one) or
    # an older lap or nothing; the slot after that an older lap or nothing (format, section 6.3).
    col = np.arange(stride, dtype=np.int64)[None, :]
    seqs = (first[:, None] + col.astype(np.uint64)).reshape(-1)
    whole = _whole_records(raw, seqs).reshape(n_paths, stride)
    n = rows[:, None]
    clean = (rows > 0) & (whole | (col >= n - 2)).all(axis=1)
    ends = np.maximum(rows - 2, 0)
    at_hi = whole[np.arange(n_paths), ends]
    past = (np.arange(n_paths) * stride)[:, None] + np.stack([ends, ends + 1], axis=1)  # counter + 1, counter + 2
    older = _older_or_empty(raw[past.reshape(-1)], seqs[past.reshape(-1)], np.repeat(caps, 2)).reshape(n_paths, 2)
    clean &= (at_hi | older[:, 0]) & older[:, 1]
    # The window ends at counter + 1 if that record is there, else at the counter.
    max_seq = first.astype(np.int64) + rows - 3 + at_hi
    dropped = np.maximum(0, max_seq - last)
    start = np.arange(n_paths) * stride + dropped + 1 - first.astype(np.int64)
    stop = np.arange(n_paths) * stride + max_seq + 1 - first.astype(np.int64)
    records = raw.view(RECORD_DTYPE).reshape(-1)
    for i in np.flatnonzero(clean).tolist():
        d, m = int(dropped[i]), int(max_seq[i])
        over = max(0, m - int(caps[i]))
        out[i] = RingSnapshot(heads[i], records[start[i]:stop[i]], [], d, 0, d > over, over)
    for i in range(n_paths):
        if out[i] is None:
            try:
                out[i] = read_ring(paths[i], retries, retry_sleep, last=last)
            except (RingFormatError, OSError) as exc:
                out[i] = exc
    return out  # type: ignore[return-value]


def read_meta(path: str | os.PathLike[str]) -> tuple[list[dict], list[ReadProblem]]:
    """Read a rank's meta file (JSON lines); a torn last line or a bad line is reported, not fatal."""
    path = str(path)
    entries: list[dict] = []
    problems: list[ReadProblem] = []
    try:
        data = read_input(path, META_LIMIT)
    except FileNotFoundError:
        return entries, [ReadProblem(path, 0, "meta file missing: group names and members unknown", "warning")]
    except OSError as exc:
        return entries, [ReadProblem(path, 0, f"meta file unreadable: {exc.strerror or exc}")]
    offset = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            problems.append(ReadProblem(path, offset, "last line is incomplete (writer stopped mid-line); "
                                                      "skipped", "warning"))
            break
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict) or "kind" not in entry:
                raise ValueError("not an object with a 'kind'")
            entries.append(entry)
        except ValueError as exc:
            problems.append(ReadProblem(path, offset, f"unreadable meta line: {exc}"))
        except RecursionError:  # nested deeper than the parser goes: hostile or broken, never a traceback
            problems.append(ReadProblem(path, offset, "unreadable meta line: nested too deeply"))
        offset += len(line)
    return entries, problems
