"""The ring-file format, version 1: constants, codes and checksums shared by writer and reader.

A ring file holds one rank's communication records. It is a fixed-size file:
a 4096-byte header followed by ``capacity`` records of 64 bytes. The writer
maps it into memory and never takes a lock; a reader in another process
validates every record with two checksums, so a torn or corrupted record is
recognised and never returned. ``docs/trace-format.md`` is the normative
description; this module is its executable twin.
"""

from __future__ import annotations

import enum
import struct
import zlib

MAGIC = b"MGTRACE\x00"
VERSION = 1
HEADER_SIZE = 4096
RECORD_SIZE = 64
DEFAULT_CAPACITY = 65536  # 4 MiB of records per rank: minutes of a busy trainer.
MIN_CAPACITY = 16
MAX_CAPACITY = 1 << 26
MAX_WORLD_SIZE = 1 << 20  # a header naming a larger world is damaged or hostile (the importers' limit too)

# Header: static part, protected by ``header_check`` (adler32 of bytes 0..252).
HEADER_STATIC = struct.Struct("<8sIIIIiiiiqqQ64s32s64s28s")
HEADER_CHECK_OFFSET = 252
HEADER_CHECK = struct.Struct("<I")
# Header: mutable part, written while the trainer runs.
WRITE_COUNTER_OFFSET = 256  # u64: sequence number of the last committed record
WRITER_STATE_OFFSET = 264  # u32: WriterState
WRITE_COUNTER = struct.Struct("<Q")
WRITER_STATE = struct.Struct("<I")
HEARTBEAT_OFFSET = 272  # u64: CLOCK_MONOTONIC of the writer's last heartbeat; 0: the writer does not beat
HEARTBEAT = struct.Struct("<Q")
HEARTBEAT_INTERVAL_NS = 100_000_000  # the torch tracer beats ten times a second from a Python thread: it stops when
#                                      the process stops or the interpreter is wedged (a thread holds the GIL)
PULSE_OFFSET = 280  # u64: CLOCK_MONOTONIC of the writer's last pulse; 0: the writer has no pulse
PULSE = struct.Struct("<Q")
PULSE_INTERVAL_NS = 10_000_000  # the C writer's native thread pulses every 10 ms, GIL or not: it stops only with
#                                 the process, and dates a death within 10 ms (which of two killed moments apart went first)
SIGNAL_NS_OFFSET = 288  # u64: CLOCK_MONOTONIC when a SIGTERM reached the writer's process; 0: none did
SIGNAL_NS = struct.Struct("<Q")
SIGNAL_OFFSET = 296  # u32: that signal's number (15); 0: none. A process ended from outside (a launcher
SIGNAL = struct.Struct("<I")  # killing the rest of a job, a time limit) says so; a SIGKILL or a crash cannot.

# Record: immutable head (bytes 0..44) + head_check, then a mutable tail.
RECORD_HEAD = struct.Struct("<QQqQIiHBB")  # seq, group_seq, t_enqueue, nbytes, gid, peer, op, dtype, flags
HEAD_CHECK_OFFSET = 44
HEAD_LEN = 44
HEAD_CHECK = struct.Struct("<I")
# The whole record in one pack, for the writer's first write of a slot.
RECORD = struct.Struct("<QQqQIiHBBIqB3xI")
RECORD_SEQ = struct.Struct("<Q")
TAIL_OFFSET = 48
RECORD_TAIL = struct.Struct("<qB3xI")  # t_complete, state, tail_check
TAIL_PRIME = 268435399  # largest prime below 2**28: keeps the vectorised reader in uint64


class WriterState(enum.IntEnum):
    """What the writer last said about itself (header offset 264)."""

    OPEN = 1
    CLOSED = 2  # the process shut the tracer down cleanly


class State(enum.IntEnum):
    """Lifecycle of one operation record."""

    EMPTY = 0
    ENQUEUED = 1  # the call was entered; not known to be complete
    COMPLETED = 2
    FAILED = 3  # the call raised


class Op(enum.IntEnum):
    """Operation codes. Variants of one wire operation share a code (see Flag.TENSOR_API)."""

    UNKNOWN = 0
    ALL_REDUCE = 1
    ALL_GATHER = 2
    REDUCE_SCATTER = 3
    BROADCAST = 4
    REDUCE = 5
    ALL_TO_ALL = 6
    BARRIER = 7
    SEND = 8
    RECV = 9
    GATHER = 10
    SCATTER = 11
    # Markers written by megatrace.step() / megatrace.phase(); group_id is 0.
    MARK_STEP = 100  # group_seq = step number
    MARK_PHASE = 101  # dtype = Phase code, peer = microbatch (-1 if none), group_seq = step

    @property
    def is_p2p(self) -> bool:
        return self in (Op.SEND, Op.RECV)

    @property
    def is_marker(self) -> bool:
        return self >= Op.MARK_STEP

    @property
    def label(self) -> str:
        return self.name.lower()


class Flag(enum.IntFlag):
    """Record flags (byte 43)."""

    NONE = 0
    ASYNC = 1  # async_op=True, isend/irecv: the caller did not wait
    BATCHED = 2  # issued inside batch_isend_irecv / a coalesced group
    DEVICE = 4  # the tensor lives on an accelerator (completion from a device event)
    TENSOR_API = 8  # *_into_tensor / *_tensor / *_single variant of the op
    NO_COMPLETION = 16  # completion cannot be observed; t_complete stays 0


class Phase(enum.IntEnum):
    """Training phases for phase markers."""

    OTHER = 0
    FORWARD = 1
    BACKWARD = 2
    OPTIMIZER = 3
    DATA = 4
    EVAL = 5


class Dtype(enum.IntEnum):
    """Element types of the transferred data."""

    UNKNOWN = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT64 = 4
    INT8 = 5
    UINT8 = 6
    INT16 = 7
    INT32 = 8
    INT64 = 9
    BOOL = 10
    FLOAT8_E4M3 = 11
    FLOAT8_E5M2 = 12
    COMPLEX64 = 13
    COMPLEX128 = 14


def head_check(head: bytes | memoryview) -> int:
    """Checksum of a record's immutable head (its first 44 bytes)."""
    return zlib.adler32(head)


def tail_check(t_complete: int, state: int, seq: int) -> int:
    """Checksum of a record's mutable tail, bound to the record's sequence number."""
    return (t_complete | state << 64 | (seq & 0xFFFFFFFF) << 96) % TAIL_PRIME


def header_check(static: bytes | memoryview) -> int:
    """Checksum of the header's static part (bytes 0..252)."""
    return zlib.adler32(static)


def file_size(capacity: int) -> int:
    return HEADER_SIZE + capacity * RECORD_SIZE


def ring_name(rank: int) -> str:
    return f"rank-{rank:05d}.ring"


def meta_name(rank: int) -> str:
    return f"rank-{rank:05d}.meta.jsonl"
