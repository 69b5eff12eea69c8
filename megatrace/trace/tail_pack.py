"""The tails pack: what a quick (tail) load reads of every ring, and every meta file, in one file of a bundle.

A collection writes ``tails.pack`` beside ``rings/``. For each ring it holds the bytes a quick load
reads (its header and the slots of its newest :data:`PACK_TAIL` records and the two after them), copied
from the very bytes of the ring in ``rings/`` as its node read them; for each meta file, its bytes. A
quick analysis of the bundle then opens one file instead of two per rank (32,768 ranks on a network
filesystem: one open, not 65,536). A ring the pack lacks, one whose tail in the pack is too short for
the load, or every ring when the pack is older than ``rings/``, is read from ``rings/`` as before::

    pack    b"MTTAILP1" | entry | entry | ... | index | u64 where the index starts | b"MTTAILX1"
    entry   u32 length of what follows | u16 name length | name | u64 file size | u64 first seq
            | u32 header length | header | rows (a ring: the slots of seqs first, first + 1, ...) or the file
    index   per entry: u16 name length | name | u64 where the entry starts | u32 its length

A reader reads the index, then the entries it uses: not the whole pack. Entries are whole or absent: a
pack cut short (a root stopped while writing it, before its index) is indexed by reading it through,
and keeps its whole entries.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_header import HEADER_USED, RingFormatError, RingHeader, parse_header
from megatrace.trace.ring_io import COUNTER_LIMIT, slot_runs

PACK_NAME = "tails.pack"
MAGIC = b"MTTAILP1"
INDEX_MAGIC = b"MTTAILX1"
_INDEX_ROW = struct.Struct("<QI")
_TRAILER = struct.Struct("<Q8s")
PACK_TAIL = 128  # records per ring: the quick load's tail (megatrace.load.directory.QUICK_TAIL)
META_PACK_LIMIT = 64 << 10  # a meta file is a few KiB; a larger one is read from rings/
ENTRY_OVERHEAD = 512  # an entry's length fields and name, rounded up
_ENTRY = struct.Struct("<IH")
_SPAN = struct.Struct("<QQI")
_PACKED_RE = re.compile(r"^rank-\d+\.(ring|meta\.jsonl)$")  # current attempts only


def packed(name: str) -> bool:
    """Whether the trace file ``name`` goes into the pack (the current attempt's ring and meta file)."""
    return bool(_PACKED_RE.match(name))


def tail_span(head: bytes, size: int, last: int = PACK_TAIL) -> tuple[int, int, int] | None:
    """(first seq, rows, capacity) a tail load of ``last`` records reads of a ring with header bytes ``head`` and
    ``size`` bytes; None when it reads that ring whole instead (a damaged header, a truncated file, a stale
    counter)."""
    try:
        header, problems = parse_header("ring", head, size)
    except RingFormatError:
        return None
    return None if problems else header_span(header, size, last)


def header_span(header: RingHeader, size: int, last: int) -> tuple[int, int, int] | None:
    """:func:`tail_span` of a ring whose header parsed without problems."""
    cap, counter = header.capacity, header.write_counter
    if size != fmt.file_size(cap) or (last + 2 > cap and counter + 2 > cap) or counter >= COUNTER_LIMIT:
        return None
    first = max(1, counter + 1 - last)
    return first, counter + 3 - first, cap


class TailCapture:
    """Picks what goes into the pack out of a trace file's bytes as they are read, in order, once."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        self.ring = name.endswith(".ring")
        self.head = bytearray()
        self.body = bytearray()
        self.first = 0
        self.runs: list[tuple[int, int, int]] | None = None  # (file offset, row, rows) of the tail's slots
        self.offset = 0
        self.wanted = self.ring or size <= META_PACK_LIMIT

    def feed(self, data: bytes | memoryview) -> None:
        """The next bytes of the file."""
        start, self.offset = self.offset, self.offset + len(data)
        if not self.wanted:
            return
        if not self.ring:
            self.body += data
            return
        if len(self.head) < HEADER_USED:
            self.head += data[:HEADER_USED - len(self.head)]
            if len(self.head) < HEADER_USED:
                return
            span = tail_span(bytes(self.head), self.size)
            if span is None:
                self.wanted = False
                return
            self.first, rows, cap = span
            self.runs = slot_runs(self.first, rows, cap, self.size)
            self.body = bytearray(rows * fmt.RECORD_SIZE)
        assert self.runs is not None
        for offset, row, count in self.runs:
            lo, hi = max(offset, start), min(offset + count * fmt.RECORD_SIZE, self.offset)
            if lo < hi:
                at = row * fmt.RECORD_SIZE + lo - offset
                self.body[at:at + hi - lo] = data[lo - start:hi - start]

    def entry(self) -> bytes | None:
        """The file's pack entry, once every byte of it was fed; None when it has none."""
        if not self.wanted or self.offset != self.size or (self.ring and self.runs is None):
            return None
        return pack_entry(self.name, self.size, self.first, bytes(self.head), bytes(self.body))


def pack_entry(name: str, size: int, first: int, head: bytes, body: bytes) -> bytes:
    raw = name.encode()
    rest = raw + _SPAN.pack(size, first, len(head)) + head + body
    return _ENTRY.pack(len(rest) + 2, len(raw)) + rest


@dataclass(frozen=True)
class PackedFile:
    """One file's entry: its size, and a ring's header and tail rows (from seq ``first``) or a meta file's bytes."""

    size: int
    first: int
    head: bytes
    body: memoryview

    def rows(self, first: int, n: int) -> memoryview | None:
        """The slots of seqs ``first`` .. ``first + n - 1``, when the entry holds them all."""
        lo = (first - self.first) * fmt.RECORD_SIZE
        hi = lo + n * fmt.RECORD_SIZE
        return self.body[lo:hi] if self.first and first >= self.first and hi <= len(self.body) else None


def _entry_at(view: memoryview, at: int) -> tuple[str, PackedFile, int] | None:
    """(name, entry, end) of the entry at byte ``at`` of ``view``; None when it runs past ``view``'s end (a pack cut
    short, or a block that ends mid-entry). Raises ValueError for an entry that is not one."""
    if at + _ENTRY.size > len(view):
        return None
    length, name_len = _ENTRY.unpack_from(view, at)
    if length + 4 > ENTRY_OVERHEAD + META_PACK_LIMIT + HEADER_USED + (PACK_TAIL + 2) * fmt.RECORD_SIZE:
        raise ValueError(f"entry at byte {at}: {length} bytes, more than an entry may have")
    end = at + 4 + length
    body_at = at + _ENTRY.size + name_len + _SPAN.size
    if end > len(view):
        return None
    if body_at > end:
        raise ValueError(f"entry at byte {at}: shorter than its own fields")
    name = bytes(view[at + _ENTRY.size:at + _ENTRY.size + name_len]).decode("utf-8", "replace")
    size, first, head_len = _SPAN.unpack_from(view, at + _ENTRY.size + name_len)
    if body_at + head_len > end or not packed(name):
        raise ValueError(f"entry at byte {at}: {name!r} is not a packed trace file")
    return name, PackedFile(size, first, bytes(view[body_at:body_at + head_len]), view[body_at + head_len:end]), end


def parse_pack(data: bytes) -> dict[str, PackedFile]:
    """The whole entries of a pack's bytes, by file name (a first entry of a name wins). Raises ValueError for
    bytes that are not a pack."""
    if not data.startswith(MAGIC):
        raise ValueError("not a MegaTrace tails pack")
    view = memoryview(data)
    if data.endswith(INDEX_MAGIC) and len(data) >= len(MAGIC) + _TRAILER.size:  # (the entries end at the index)
        view = view[:min(_TRAILER.unpack_from(data, len(data) - _TRAILER.size)[0], len(data))]
    out: dict[str, PackedFile] = {}
    at = len(MAGIC)
    while (got := _entry_at(view, at)) is not None:
        name, entry, at = got
        out.setdefault(name, entry)
    return out


def pack_index(rows: list[tuple[str, int, int]], at: int) -> bytes:
    """The index and trailer of a pack whose entries (name, where, length) end at byte ``at``."""
    out = bytearray()
    for name, offset, length in rows:
        raw = name.encode()
        out += struct.pack("<H", len(raw)) + raw + _INDEX_ROW.pack(offset, length)
    return bytes(out) + _TRAILER.pack(at, INDEX_MAGIC)


class TailPack(Mapping[str, PackedFile]):
    """A bundle's pack, open: an index of its entries (name -> where), each read when asked for. Its memory is the
    index, not the pack (~9 KiB a rank: 290 MiB at 32,768 ranks)."""

    SCAN_BYTES = 8 << 20

    def __init__(self, fd: int, max_entries: int) -> None:
        """Index the pack open at ``fd`` (which it then owns): from its index, else by reading it through. Raises
        ValueError for a file that is not a pack, or one with more than ``max_entries`` entries (a pack holds two
        per ring at most)."""
        self.fd = fd
        self.index: dict[str, tuple[int, int]] = {}
        if os.pread(fd, len(MAGIC), 0) != MAGIC:
            raise ValueError("not a MegaTrace tails pack")
        size = os.fstat(fd).st_size
        end = size
        trailer = os.pread(fd, _TRAILER.size, size - _TRAILER.size) if size >= len(MAGIC) + _TRAILER.size else b""
        if len(trailer) == _TRAILER.size and trailer.endswith(INDEX_MAGIC):
            end = _TRAILER.unpack(trailer)[0]
            if not len(MAGIC) <= end <= size - _TRAILER.size:
                raise ValueError("its index is not within it")
            if self._read_index(os.pread(fd, size - _TRAILER.size - end, end), end, max_entries):
                return
            self.index = {}
        self._scan(end, max_entries)

    def _read_index(self, data: bytes, end: int, max_entries: int) -> bool:
        """Take the index ``data`` of a pack whose entries end at ``end``; False when it is not one."""
        at = 0
        while at < len(data):
            if at + 2 > len(data):
                return False
            (name_len,) = struct.unpack_from("<H", data, at)
            if at + 2 + name_len + _INDEX_ROW.size > len(data):
                return False
            name = data[at + 2:at + 2 + name_len].decode("utf-8", "replace")
            offset, length = _INDEX_ROW.unpack_from(data, at + 2 + name_len)
            if not len(MAGIC) <= offset <= offset + length <= end or not packed(name):
                return False
            self.index.setdefault(name, (offset, length))
            if len(self.index) > max_entries:
                raise ValueError(f"more than {max_entries} entries")
            at += 2 + name_len + _INDEX_ROW.size
        return True

    def _scan(self, end: int, max_entries: int) -> None:
        """Index the entries before byte ``end`` by reading them through (a pack without its index)."""
        base, block = len(MAGIC), b""
        largest = ENTRY_OVERHEAD + META_PACK_LIMIT + HEADER_USED + (PACK_TAIL + 2) * fmt.RECORD_SIZE
        while base + len(block) < end and (chunk := os.pread(self.fd, min(self.SCAN_BYTES, end - base - len(block)),
                                                             base + len(block))):
            block += chunk
            at = 0
            while at + _ENTRY.size <= len(block):  # (each entry is checked whole when it is read)
                length, name_len = _ENTRY.unpack_from(block, at)
                if length + 4 > largest or _ENTRY.size + name_len > length + 4:
                    raise ValueError(f"entry at byte {base + at}: {length} bytes, not an entry")
                if at + 4 + length > len(block):
                    break
                name = block[at + _ENTRY.size:at + _ENTRY.size + name_len].decode("utf-8", "replace")
                self.index.setdefault(name, (base + at, 4 + length))
                at += 4 + length
            if len(self.index) > max_entries:
                raise ValueError(f"more than {max_entries} entries")
            base, block = base + at, block[at:]

    def __getitem__(self, name: str) -> PackedFile:
        """The entry of ``name``; KeyError when the pack has none, or none that is whole and of that name (the
        file is then read from rings/)."""
        offset, length = self.index[name]
        try:
            got = _entry_at(memoryview(os.pread(self.fd, length, offset)), 0)
        except (OSError, ValueError):
            got = None
        if got is None or got[0] != name:
            raise KeyError(name)
        return got[1]

    def __contains__(self, name: object) -> bool:
        return name in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def single_entry(blob: bytes) -> tuple[str, PackedFile] | None:
    """(name, entry) when ``blob`` is exactly one whole pack entry, else None."""
    try:
        got = _entry_at(memoryview(blob), 0)
    except ValueError:
        return None
    return (got[0], got[1]) if got is not None and got[2] == len(blob) else None


def entry_limit(name: str) -> int:
    """The most bytes an entry of trace file ``name`` may have."""
    body = HEADER_USED + (PACK_TAIL + 2) * fmt.RECORD_SIZE if name.endswith(".ring") else META_PACK_LIMIT
    return body + ENTRY_OVERHEAD


def read_pack(directory: Path, rings: Path, count: int) -> TailPack | None:
    """The pack of the bundle ``directory`` for the ``count`` ring files in ``rings``, open and indexed, when it may
    be trusted for them: in that directory's parent and not older than the directory (a file added or replaced
    since). None without one, or when it is not a pack (of at most ``count`` rings). The caller closes it."""
    from megatrace.files import open_input

    if rings.name != "rings" or rings.parent != directory:
        return None
    try:
        fd = open_input(directory / PACK_NAME)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_mtime_ns < os.stat(rings).st_mtime_ns:
            raise ValueError("older than rings/")
        return TailPack(fd, 2 * count)
    except (OSError, ValueError):
        os.close(fd)
        return None
