"""What a node sends through the gather: a header (its facts and file list), then its files' bytes in chunks.

A node's stream is a sequence of messages, each far below MPI's 2 GiB count limit and the issue's
256 MiB bound, so that neither a group leader nor the root ever holds more than one of them::

    header   b"MTHEAD2\\n" | zlib(JSON {node, error, facts, files: [{name, size, sha256, placed}, ...]})
    chunk    b"MTDATA2\\n" | u32 file index | u64 offset | zlib(at most CHUNK_BYTES of that file)

A file the node wrote into the bundle itself (a job directory every node sees: ``placed`` is its path
in the bundle) has no chunks; every other file follows the header, in the header's order, in chunks
of increasing offset. No pickle: a payload is data, and the root may run as root.
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

HEAD_MAGIC = b"MTHEAD2\n"
CHUNK_MAGIC = b"MTDATA2\n"
_CHUNK_AT = struct.Struct("<IQ")
CHUNK_BYTES = 16 << 20  # raw bytes per chunk: one message, compressed, stays below 17 MiB
MAX_HEAD_BYTES = 256 << 20  # a header's JSON: facts are a few MiB at most (stacks, kernel log)
COMPRESS_LEVEL = 1  # rings are mostly zeros or repetitive records: level 1 gets most of the gain, fast


class PayloadError(MegatraceError, ValueError):
    """A message that cannot be decoded."""


@dataclass
class FileEntry:
    """One trace file of a node: its size and sha256, and where the node wrote it itself (bundle-relative)."""

    name: str
    size: int
    sha256: str
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


def header_of(snap: NodeSnapshot, placed: dict[str, str] | None = None) -> NodeHeader:
    """The header of ``snap``; ``placed``: file name -> where in the bundle the node wrote it."""
    placed = placed or {}
    files = [FileEntry(n, len(snap.files[n]), hashlib.sha256(snap.files[n]).hexdigest(), placed.get(n))
             for n in sorted(snap.files)]
    return NodeHeader(snap.node, snap.error, snap.facts, files)


def messages(snap: NodeSnapshot, head: NodeHeader) -> Iterator[bytes]:
    """``head`` packed, then the chunks of every file it does not say was placed."""
    yield pack_header(head)
    for index, entry in head.streamed:
        data = memoryview(snap.files[entry.name])
        for offset in range(0, len(data), CHUNK_BYTES):
            yield pack_chunk(index, offset, data[offset:offset + CHUNK_BYTES])


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
        if not isinstance(size, int) or size < 0 or not isinstance(sha, str) or len(sha) != 64:
            raise PayloadError(f"node header: {name}: size or sha256 missing")
        if placed is not None and placed != f"rings/{name}":
            raise PayloadError(f"node header: {name} placed at an unexpected path {placed!r}")
        files.append(FileEntry(name, size, sha, placed))
    facts = doc.get("facts")
    return NodeHeader(str(doc.get("node", "?")), doc.get("error"), facts if isinstance(facts, dict) else {}, files)


def pack_chunk(index: int, offset: int, data: bytes | memoryview) -> bytes:
    return CHUNK_MAGIC + _CHUNK_AT.pack(index, offset) + zlib.compress(data, COMPRESS_LEVEL)


def unpack_chunk(blob: bytes) -> tuple[int, int, bytes]:
    """(file index, offset, bytes) of a chunk message."""
    if not blob.startswith(CHUNK_MAGIC) or len(blob) < len(CHUNK_MAGIC) + _CHUNK_AT.size:
        raise PayloadError("not a MegaTrace data chunk")
    index, offset = _CHUNK_AT.unpack_from(blob, len(CHUNK_MAGIC))
    return index, offset, _inflate(memoryview(blob)[len(CHUNK_MAGIC) + _CHUNK_AT.size:], CHUNK_BYTES, "data chunk")
