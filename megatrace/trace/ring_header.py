"""A ring's header, what a read returns (:class:`RingSnapshot`), and the problems a read reports."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import numpy as np

from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_records import RECORD_DTYPE
from megatrace.errors import MegatraceError

HEADER_USED = fmt.SIGNAL_OFFSET + fmt.SIGNAL.size  # the header bytes that hold anything
_HEADER_REQUIRED = fmt.WRITER_STATE_OFFSET + fmt.WRITER_STATE.size  # ... of which a reader needs these
_SHOWN = 20  # problems reported one by one per kind; the rest are counted


class RingFormatError(MegatraceError):
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


LIVE_WORDS = slice(fmt.WRITE_COUNTER_OFFSET, HEADER_USED)  # the header words a live writer rewrites
LIVE_TRIES = 4


def read_header_bytes(fd: int, length: int = HEADER_USED) -> bytes:
    """The first ``length`` bytes of a ring file by ``pread``, its live words (counter, state, heartbeat, pulse,
    signal) read again until two reads agree: a ``pread`` beside a live writer can copy a word half old, half new
    (the kernel's copy is not word-atomic; about one read in a million, seen in CI). A writer rewrites these
    words at most every few microseconds (a call) and usually every 10 ms or more: two agreeing reads hold
    whole words. Against a writer faster than that, the last read is kept after :data:`LIVE_TRIES`."""
    blob = os.pread(fd, length, 0)
    if len(blob) < LIVE_WORDS.stop:
        return blob  # (a short file: parse_header says so)
    live = blob[LIVE_WORDS]
    for _ in range(LIVE_TRIES):
        again = os.pread(fd, len(live), LIVE_WORDS.start)
        if again == live:
            break
        live = again
    return blob[:LIVE_WORDS.start] + live + blob[LIVE_WORDS.stop:]


def _decode(raw: bytes) -> str:
    return raw.split(b"\x00", 1)[0].decode("utf-8", "replace")


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
    if len(blob) >= HEADER_USED:  # (the usual blob: every live word in one unpack)
        counter, state, beat, pulse, sig_ns, sig = _LIVE_FIELDS.unpack_from(blob, fmt.WRITE_COUNTER_OFFSET)
    else:
        counter = fmt.WRITE_COUNTER.unpack_from(blob, fmt.WRITE_COUNTER_OFFSET)[0]
        state = fmt.WRITER_STATE.unpack_from(blob, fmt.WRITER_STATE_OFFSET)[0]
        beat, pulse, sig, sig_ns = (_field(blob, f, off) for f, off in (
            (fmt.HEARTBEAT, fmt.HEARTBEAT_OFFSET), (fmt.PULSE, fmt.PULSE_OFFSET), (fmt.SIGNAL, fmt.SIGNAL_OFFSET),
            (fmt.SIGNAL_NS, fmt.SIGNAL_NS_OFFSET)))
    header = RingHeader(path, version, capacity, rank, local_rank, world_size, pid, wall, mono,
                        _decode(job), _decode(step), _decode(host), counter, state, beat, pulse,
                        sig, sig_ns if sig else 0)
    return header, problems


# counter, writer state, heartbeat, pulse, signal time, signal: the live words at their offsets (checked below)
_LIVE_FIELDS = struct.Struct("<QI4xQQQI")
assert [fmt.WRITE_COUNTER_OFFSET + struct.calcsize(_LIVE_FIELDS.format[:k]) for k in (1, 2, 5, 6, 7, 8)] == [
    fmt.WRITE_COUNTER_OFFSET, fmt.WRITER_STATE_OFFSET, fmt.HEARTBEAT_OFFSET, fmt.PULSE_OFFSET, fmt.SIGNAL_NS_OFFSET,
    fmt.SIGNAL_OFFSET] and fmt.WRITE_COUNTER_OFFSET + _LIVE_FIELDS.size == HEADER_USED


def _field(blob: bytes, layout: struct.Struct, offset: int) -> int:
    """A mutable header field, or 0 when ``blob`` stops before it."""
    return layout.unpack_from(blob, offset)[0] if len(blob) >= offset + layout.size else 0


def geometry_error(path: str, cap: int, size: int, expected: int) -> RingFormatError:
    # The checksum says the static header is damaged and the file size disagrees with its
    # capacity: the geometry itself may be the damaged field, and every slot would be misread.
    return RingFormatError(f"{path}: offset 20: header checksum mismatch and capacity {cap} does not match "
                           f"the file size ({size} bytes, expected {expected}); geometry is untrustworthy")


def truncation(path: str, cap: int, size: int) -> ReadProblem | None:
    expected = fmt.file_size(cap)
    if size >= expected:
        return None
    n_slots = min(cap, (size - fmt.HEADER_SIZE) // fmt.RECORD_SIZE)
    return ReadProblem(path, size, f"file truncated: {size} of {expected} bytes; slots {n_slots}..{cap - 1} are lost")


def torn_problems(path: str, slots: np.ndarray, seqs: np.ndarray) -> list[ReadProblem]:
    """Warnings for records whose head is whole but whose completion (``seqs``, in ring ``slots``) is not."""
    return [ReadProblem(path, fmt.HEADER_SIZE + int(slot) * fmt.RECORD_SIZE + fmt.TAIL_OFFSET,
                        f"completion of record seq {int(seq)} is unreadable (torn or corrupted); "
                        "kept as entered, not completed", "warning")
            for slot, seq in zip(slots[:_SHOWN], seqs[:_SHOWN])]


def unreadable_problems(path: str, slots: np.ndarray, overwritten: np.ndarray,
                        in_flight: np.ndarray) -> list[ReadProblem]:
    """What each unreadable record in ring ``slots`` was: ``overwritten`` by the writer while read, ``in_flight``
    (being written then: a live writer's newest slots), or else corrupted; past the first 20, a count."""
    problems = []
    for slot, lapped, writing in zip(slots[:_SHOWN], overwritten[:_SHOWN], in_flight[:_SHOWN]):
        off = fmt.HEADER_SIZE + int(slot) * fmt.RECORD_SIZE
        if lapped:
            problems.append(ReadProblem(path, off, "record overwritten by the writer while the file was read; "
                                                   "skipped", "warning"))
        elif writing:
            problems.append(ReadProblem(path, off, "record being written when the file was read "
                                                   "(writer running or killed mid-record); skipped", "warning"))
        else:
            problems.append(ReadProblem(path, off, "corrupted record (checksum or position mismatch); skipped"))
    if len(slots) > _SHOWN:
        problems.append(ReadProblem(path, fmt.HEADER_SIZE, f"{len(slots) - _SHOWN} more unreadable records"))
    return problems
