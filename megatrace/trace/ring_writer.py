"""The in-process ring writer: fixed-size, memory-mapped, lock-free, crash-safe.

The hot path (:meth:`RingWriter.begin` and :meth:`RingWriter.complete`) packs
straight into the shared mapping; it takes no lock and allocates no buffer. A
record's head is written once, with its checksum; completion rewrites only the
16-byte tail, which has its own checksum, so a writer killed mid-update leaves
the head intact and the record readable as "entered, completion unknown".
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import socket
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from megatrace.errors import MegatraceError
from megatrace.files import create_private, move_aside, private_dir
from megatrace.trace import ring_format as fmt
from megatrace.trace.warnings import warn_once


class RingOpenError(MegatraceError, OSError):
    """The ring file could not be created; the message names the path and the reason."""


@dataclass(frozen=True)
class RingIdentity:
    """Who writes a ring: stored in the header."""

    rank: int
    world_size: int
    local_rank: int = -1
    job_id: str = ""
    step_id: str = ""
    host: str = ""
    pid: int = 0


def _encode(text: str, size: int) -> bytes:
    raw = text.encode("utf-8", "replace")[:size]
    return raw + b"\x00" * (size - len(raw))


class RingWriter:
    """Writes one rank's records into ``<directory>/rank-NNNNN.ring``."""

    def __init__(self, directory: str | os.PathLike[str], identity: RingIdentity,
                 capacity: int = fmt.DEFAULT_CAPACITY, use_native: bool = True) -> None:
        if not fmt.MIN_CAPACITY <= capacity <= fmt.MAX_CAPACITY:
            raise ValueError(f"ring capacity {capacity} outside [{fmt.MIN_CAPACITY}, {fmt.MAX_CAPACITY}]")
        self.directory = Path(directory)
        self.identity = identity
        self.capacity = capacity
        self._capacity = capacity
        self.path = self.directory / fmt.ring_name(identity.rank)
        self.meta_path = self.directory / fmt.meta_name(identity.rank)
        self._mm, self._meta_fd = self._create()
        self._view = memoryview(self._mm)
        # Header fields another process reads while we run (counter, heartbeat, state) are stored as whole
        # words through these views: struct.pack_into zero-fills its bytes before it writes them, so a reader
        # could see a counter or heartbeat of 0 between the two (an aligned 8-byte copy is one store).
        self._u64 = self._view[:fmt.HEADER_SIZE].cast("Q")
        self._u32 = self._view[:fmt.HEADER_SIZE].cast("I")
        self._next_seq = itertools.count(1).__next__  # atomic under the GIL
        self.wrapped = False
        self._first_overwrite = capacity + 1
        self.native = False
        self.fast = None  # the C hot path (FastRing), shared with the c10d dispatcher hook
        if use_native:
            self._use_native()
        self.closed = False

    def _use_native(self) -> None:
        """Swap in the C hot path (same bytes, ~5x faster) when it was built."""
        if os.environ.get("MEGATRACE_PURE_PYTHON") == "1":
            return
        try:
            from megatrace.trace._ringfast import FastRing  # type: ignore[import-not-found]
        except ImportError:
            return
        fast = FastRing(self._mm, self.capacity, on_wrap=self._on_wrap)
        self.begin = fast.begin  # type: ignore[method-assign]
        self.complete = fast.complete  # type: ignore[method-assign]
        self.complete_now = fast.complete_now  # type: ignore[method-assign]
        self.fast = fast
        self.native = True

    # -- creation ---------------------------------------------------------
    def _create(self) -> tuple[mmap.mmap, int]:
        """The mapped ring and the meta file's descriptor, both new files (mode 0600) in a private directory.

        The directory must be this user's own and writable by nobody else (:func:`megatrace.files.private_dir`):
        a directory another user made first, or a link they planted, is refused, and tracing is off. Every
        name is then used relative to the directory's descriptor, never through a link.
        """
        size = fmt.file_size(self.capacity)
        ring, meta = self.path.name, self.meta_path.name
        if sys.byteorder != "little":
            raise RingOpenError(0, f"cannot write ring file {self.path}: ring files are little-endian and this "
                                   "host is big-endian")
        try:
            dfd = private_dir(self.directory)
        except OSError as exc:
            raise RingOpenError(exc.errno, f"cannot use trace directory {self.directory}: "
                                           f"{exc.strerror or exc}") from None
        try:
            try:
                move_aside(dfd, ring, meta)  # a previous attempt of the same rank: keep it, never overwrite
                fd = create_private(dfd, ring)
            except OSError as exc:
                raise RingOpenError(exc.errno, f"cannot create ring file {self.path}: {exc.strerror}") from None
            try:
                # Reserve the blocks now: a sparse file on a full tmpfs would SIGBUS the trainer later.
                os.posix_fallocate(fd, 0, size)
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                os.close(fd)
                try:
                    os.unlink(ring, dir_fd=dfd)
                except OSError:
                    pass
                raise RingOpenError(exc.errno, f"cannot reserve {size} bytes for ring file {self.path}: "
                                               f"{exc.strerror}") from None
            os.close(fd)
            self._write_header(mm)
            try:  # the rank's own file (just moved aside if it existed): a new name in a private directory
                meta_fd = os.open(meta, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                  dir_fd=dfd)
            except OSError as exc:
                mm.close()
                raise RingOpenError(exc.errno, f"cannot create meta file {self.meta_path}: {exc.strerror}") from None
        finally:
            os.close(dfd)
        return mm, meta_fd

    def _write_header(self, mm: mmap.mmap) -> None:
        ident = self.identity
        wall, mono = time.time_ns(), time.monotonic_ns()
        static = fmt.HEADER_STATIC.pack(
            fmt.MAGIC, fmt.VERSION, fmt.HEADER_SIZE, fmt.RECORD_SIZE, self.capacity,
            ident.rank, ident.local_rank, ident.world_size, ident.pid or os.getpid(),
            wall, mono, 0,
            _encode(ident.job_id, 64), _encode(ident.step_id, 32),
            _encode(ident.host or socket.gethostname(), 64), b"\x00" * 28)
        mm[0:len(static)] = static
        fmt.HEADER_CHECK.pack_into(mm, fmt.HEADER_CHECK_OFFSET, fmt.header_check(static))
        fmt.WRITE_COUNTER.pack_into(mm, fmt.WRITE_COUNTER_OFFSET, 0)
        fmt.WRITER_STATE.pack_into(mm, fmt.WRITER_STATE_OFFSET, fmt.WriterState.OPEN)

    # -- hot path ---------------------------------------------------------
    # Struct methods and clocks are bound as default arguments: each global or
    # attribute lookup saved is ~20 ns on a path that runs for every collective.
    def begin(self, op: int, group_id: int, group_seq: int, nbytes: int, peer: int = -1,
              dtype: int = 0, flags: int = 0, *, _now=time.monotonic_ns, _pack=fmt.RECORD.pack_into,
              _pack_check=fmt.HEAD_CHECK.pack_into, _counter=fmt.WRITE_COUNTER_OFFSET // 8,
              _adler=zlib.adler32, _prime=fmt.TAIL_PRIME) -> tuple[int, int]:
        """Commit an 'entered' record; returns the handle passed to :meth:`complete`."""
        seq = self._next_seq()
        idx = (seq - 1) % self._capacity
        off = 4096 + (idx << 6)
        mm = self._mm
        # tail (t_complete=0, state=ENQUEUED) checksum: see ring_format.tail_check
        _pack(mm, off, seq, group_seq, _now(), nbytes, group_id, peer, op, dtype, flags, 0,
              0, 1, (1 << 64 | (seq & 0xFFFFFFFF) << 96) % _prime)
        _pack_check(mm, off + 44, _adler(mm[off:off + 44]))
        self._u64[_counter] = seq
        if seq == self._first_overwrite:
            self._on_wrap(seq)
        return off, seq

    def complete_now(self, handle: tuple[int, int], *, _now=time.monotonic_ns,
                     _pack=fmt.RECORD_TAIL.pack_into, _prime=fmt.TAIL_PRIME) -> None:
        """Complete a record from the thread that began it, right after the call returned.

        Skips :meth:`complete`'s wrap check: no other record of this thread came in between.
        """
        off, seq = handle
        t = _now()
        _pack(self._mm, off + 48, t, 2, (t | 2 << 64 | (seq & 0xFFFFFFFF) << 96) % _prime)

    def complete(self, handle: tuple[int, int], state: int = 2, *, _now=time.monotonic_ns,
                 _pack=fmt.RECORD_TAIL.pack_into, _seq_at=fmt.RECORD_SEQ.unpack_from,
                 _prime=fmt.TAIL_PRIME) -> None:
        """Mark the record as completed (state 2) or failed (state 3), timestamped now."""
        off, seq = handle
        if _seq_at(self._mm, off)[0] != seq:
            return  # the ring wrapped past this record while it was outstanding
        t = _now()
        _pack(self._mm, off + 48, t, state, (t | state << 64 | (seq & 0xFFFFFFFF) << 96) % _prime)

    def _on_wrap(self, seq: int) -> None:
        if self.wrapped:
            return
        self.wrapped = True
        warn_once("ring-wrap", f"ring {self.path} is full after {seq - 1} records; it now wraps and "
                               "overwrites the oldest records (raise MEGATRACE_RING_RECORDS to keep more)")

    # -- cold path --------------------------------------------------------
    def write_meta(self, kind: str, **fields: object) -> None:
        """Append one JSON line (group creation, job facts) to the rank's meta file."""
        line = json.dumps({"kind": kind, "t_mono_ns": time.monotonic_ns(), **fields},
                          separators=(",", ":"), default=str) + "\n"
        os.write(self._meta_fd, line.encode())

    def start_pulse(self) -> bool:
        """Start the C writer's pulse thread (``pulse_ns``, every 10 ms); False without the C hot path."""
        if self.fast is None:
            return False
        self.fast.start_pulse(fmt.PULSE_INTERVAL_NS)
        return True

    def beat(self, *, _now=time.monotonic_ns, _word=fmt.HEARTBEAT_OFFSET // 8) -> None:
        """Say "this process still runs": the header's heartbeat, rewritten by the tracer's heartbeat thread."""
        self._u64[_word] = _now()

    @property
    def records_written(self) -> int:
        return fmt.WRITE_COUNTER.unpack_from(self._mm, fmt.WRITE_COUNTER_OFFSET)[0]

    def close(self) -> None:
        """Mark the ring closed cleanly. The file stays for the collector."""
        if self.closed:
            return
        self.closed = True
        # Closed first, then the pulse and the SIGTERM mark stop: a launcher's SIGTERM that lands while the
        # pulse thread is joined (up to one interval) still finds the ring closed or marked, never neither.
        self._u32[fmt.WRITER_STATE_OFFSET // 4] = fmt.WriterState.CLOSED
        if self.fast is not None:
            self.fast.stop_pulse()
        os.close(self._meta_fd)
        # The mapping stays valid until the process exits: late completions from helper
        # threads may still land. The kernel writes the pages back on unmap.
