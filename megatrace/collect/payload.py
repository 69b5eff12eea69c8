"""What a node sends through the gather: a header (its facts and file list), then its files' bytes in chunks.

A node's stream is a sequence of messages, each far below MPI's 2 GiB count limit and the issue's
256 MiB bound, so that neither a group leader nor the root ever holds more than one of them::

    header   b"MTHEAD3\\n" | zlib(JSON {node, error, facts, files: [{name, size, sha256, placed}, ...]})
    chunk    b"MTDATA3\\n" | u32 file index | u64 offset | zlib(at most CHUNK_BYTES of that file)
    end      b"MTFEND3\\n" | u32 file index | u64 size | sha256 (32 bytes)
    tail     b"MTTAIL3\\n" | u32 file index | the file's entry in the bundle's tails pack (trace/tail_pack.py)

A file the node wrote into the bundle itself (a job directory every node sees: ``placed`` is its path
in the bundle, with its size and sha256) has no chunks; every other file follows the header, in the
header's order, in chunks of increasing offset, then its end: its size and sha256 as read (the node
reads each file once, a chunk at a time, so its digest is known only at the end). A ring's or meta
file's tail follows its end, or the header for a placed file: what the root's quick verdict reads,
which it gathers into one file. No pickle: a payload is data, and the root may run as root.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from megatrace.collect.node import TRACE_FILE_RE, NodeSnapshot
from megatrace.errors import MegatraceError

HEAD_MAGIC = b"MTHEAD3\n"
CHUNK_MAGIC = b"MTDATA3\n"
END_MAGIC = b"MTFEND3\n"
TAIL_MAGIC = b"MTTAIL3\n"
_TAIL_OF = struct.Struct("<I")
_CHUNK_AT = struct.Struct("<IQ")
_FILE_END = struct.Struct("<IQ32s")
UNREADABLE = bytes(32)  # a file end's digest when its node could not read it whole (no file has this sha256)
CHUNK_BYTES = 16 << 20  # raw bytes per chunk: one message, compressed, stays below 17 MiB
MAX_HEAD_BYTES = 256 << 20  # a header's JSON: facts are a few MiB at most (stacks, kernel log)
COMPRESS_LEVEL = 1  # rings are mostly zeros or repetitive records: level 1 gets most of the gain, fast


class PayloadError(MegatraceError, ValueError):
    """A message that cannot be decoded."""


@dataclass
class FileEntry:
    """One trace file of a node: its size, and where the node wrote it itself (bundle-relative) with its
    sha256 (a streamed file's comes at its end)."""

    name: str
    size: int
    sha256: str | None = None
    placed: str | None = None


@dataclass
class NodeHeader:
    """A node's first message: who it is, its facts, and the files it holds."""

    node: str
    error: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    files: list[FileEntry] = field(default_factory=list)

    @property
    def streamed(self) -> list[tuple[int, FileEntry]]:
        """The files whose bytes follow the header, with their index."""
        return [(i, f) for i, f in enumerate(self.files) if f.placed is None]


def header_of(snap: NodeSnapshot, placed: dict[str, FileEntry] | None = None) -> NodeHeader:
    """The header of ``snap``; ``placed``: file name -> its entry, for the files the node wrote into the bundle."""
    placed = placed or {}
    files = [placed.get(n) or FileEntry(n, snap.files[n].size) for n in sorted(snap.files)]
    return NodeHeader(snap.node, snap.error, snap.facts, files)


def streamed_pieces(snap: NodeSnapshot, head: NodeHeader) -> Iterator[tuple[int, int, bytes | None, bytes]]:
    """For every file ``head`` does not say was placed, read once a chunk at a time: (index, offset, chunk, b"")
    for each chunk, then (index, size, None, sha256 digest) at its end."""
    for index, entry in head.streamed:
        offset, digest = 0, hashlib.sha256()
        try:
            for data in snap.files[entry.name].chunks(CHUNK_BYTES):
                digest.update(data)
                yield index, offset, data, b""
                offset += len(data)
        except OSError:  # gone, or replaced since the snapshot: the root drops it and says so
            yield index, offset, None, UNREADABLE
            continue
        yield index, offset, None, digest.digest()


def messages(snap: NodeSnapshot, head: NodeHeader) -> Iterator[bytes]:
    """``head`` packed, the tails of the files it says were placed, then the chunks, the end and the tail of
    every other file."""
    yield pack_header(head)
    for index, f in enumerate(head.files):
        entry = snap.files[f.name].tail_entry if f.placed is not None else None
        if entry is not None:
            yield pack_tail(index, entry)
    for index, at, data, digest in streamed_pieces(snap, head):
        if data is not None:
            yield pack_chunk(index, at, data)
            continue
        yield pack_end(index, at, digest)
        if (entry := snap.files[head.files[index].name].tail_entry) is not None:
            yield pack_tail(index, entry)


def pack_header(head: NodeHeader) -> bytes:
    doc = {"node": head.node, "error": head.error, "facts": head.facts, "files": [asdict(f) for f in head.files]}
    return HEAD_MAGIC + zlib.compress(json.dumps(doc, default=str).encode(), COMPRESS_LEVEL)


def _inflate(blob: bytes | memoryview, limit: int, what: str) -> bytes:
    z = zlib.decompressobj()
    try:
        raw = z.decompress(blob, limit + 1)
    except zlib.error as exc:
        raise PayloadError(f"{what} does not decompress: {exc}") from None
    if len(raw) > limit or z.unconsumed_tail:
        raise PayloadError(f"{what} inflates past {limit} bytes")
    return raw


def unpack_header(blob: bytes) -> NodeHeader:
    if not blob.startswith(HEAD_MAGIC):
        raise PayloadError("not a MegaTrace node header")
    try:
        doc = json.loads(_inflate(memoryview(blob)[len(HEAD_MAGIC):], MAX_HEAD_BYTES, "node header"))
    except ValueError as exc:
        raise PayloadError(f"node header is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("files", []), list):
        raise PayloadError("node header is not an object with a file list")
    files = []
    for f in doc.get("files", []):
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or not TRACE_FILE_RE.match(name):
            raise PayloadError(f"node header names an unexpected file {name!r}")
        size, sha, placed = f.get("size"), f.get("sha256"), f.get("placed")
        if not isinstance(size, int) or size < 0 or (sha is not None and not _is_digest(sha)) \
                or (placed is not None and sha is None):
            raise PayloadError(f"node header: {name}: size or sha256 missing")
        if placed is not None and placed != f"rings/{name}":
            raise PayloadError(f"node header: {name} placed at an unexpected path {placed!r}")
        files.append(FileEntry(name, size, sha, placed))
    facts = doc.get("facts")
    return NodeHeader(str(doc.get("node", "?")), doc.get("error"), facts if isinstance(facts, dict) else {}, files)


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def pack_chunk(index: int, offset: int, data: bytes | memoryview) -> bytes:
    return CHUNK_MAGIC + _CHUNK_AT.pack(index, offset) + zlib.compress(data, COMPRESS_LEVEL)


def unpack_chunk(blob: bytes) -> tuple[int, int, bytes]:
    """(file index, offset, bytes) of a chunk message."""
    if not blob.startswith(CHUNK_MAGIC) or len(blob) < len(CHUNK_MAGIC) + _CHUNK_AT.size:
        raise PayloadError("not a MegaTrace data chunk")
    index, offset = _CHUNK_AT.unpack_from(blob, len(CHUNK_MAGIC))
    return index, offset, _inflate(memoryview(blob)[len(CHUNK_MAGIC) + _CHUNK_AT.size:], CHUNK_BYTES, "data chunk")


def pack_end(index: int, size: int, digest: bytes) -> bytes:
    return END_MAGIC + _FILE_END.pack(index, size, digest)


def is_end(blob: bytes) -> bool:
    return blob.startswith(END_MAGIC)


def unpack_end(blob: bytes) -> tuple[int, int, str]:
    """(file index, size, sha256 in hex) of a file's end."""
    if not blob.startswith(END_MAGIC) or len(blob) != len(END_MAGIC) + _FILE_END.size:
        raise PayloadError("not a MegaTrace file end")
    index, size, digest = _FILE_END.unpack_from(blob, len(END_MAGIC))
    return index, size, digest.hex()


def pack_tail(index: int, entry: bytes) -> bytes:
    return TAIL_MAGIC + _TAIL_OF.pack(index) + entry


def is_tail(blob: bytes) -> bool:
    return blob.startswith(TAIL_MAGIC)


def unpack_tail(blob: bytes) -> tuple[int, bytes]:
    """(file index, tails-pack entry) of a tail message (the entry is checked where it is used)."""
    if not blob.startswith(TAIL_MAGIC) or len(blob) < len(TAIL_MAGIC) + _TAIL_OF.size:
        raise PayloadError("not a MegaTrace tail")
    return _TAIL_OF.unpack_from(blob, len(TAIL_MAGIC))[0], blob[len(TAIL_MAGIC) + _TAIL_OF.size:]
