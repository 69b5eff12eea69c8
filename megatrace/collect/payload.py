"""The bytes a node sends: its snapshot, framed and zlib-compressed; and the frame a group leader forwards.

Node payload (compressed as a whole with zlib)::

    b"MTNODE1\\n" | u64 length of the JSON | JSON {node, error, facts, files: [[name, size], ...]} | file bytes...

Leader frame (not compressed again: it carries its members' compressed payloads)::

    b"MTLEAD1\\n" | u64 length of the JSON | JSON {members: [{mpi_rank, status, size, reason}, ...]} | payloads...

No pickle: a payload is data, and the root may run as root.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

from megatrace.collect.node import TRACE_FILE_RE, NodeSnapshot
from megatrace.errors import MegatraceError

NODE_MAGIC = b"MTNODE1\n"
LEADER_MAGIC = b"MTLEAD1\n"
_LEN = struct.Struct("<Q")
COMPRESS_LEVEL = 1  # rings are mostly zeros or repetitive records: level 1 gets most of the gain, fast
MAX_UNPACKED = 1 << 40


class PayloadError(MegatraceError, ValueError):
    """A payload or frame that cannot be decoded."""


def pack_node(snap: NodeSnapshot) -> bytes:
    names = sorted(snap.files)
    head = json.dumps({"node": snap.node, "error": snap.error, "facts": snap.facts,
                       "files": [[n, len(snap.files[n])] for n in names]}, default=str).encode()
    comp = zlib.compressobj(COMPRESS_LEVEL)
    parts = [comp.compress(NODE_MAGIC + _LEN.pack(len(head)) + head)]
    for n in names:
        parts.append(comp.compress(snap.files[n]))
    parts.append(comp.flush())
    return b"".join(parts)


def unpack_node(blob: bytes) -> NodeSnapshot:
    try:
        raw = zlib.decompress(blob)
    except zlib.error as exc:
        raise PayloadError(f"node payload does not decompress: {exc}") from None
    if not raw.startswith(NODE_MAGIC) or len(raw) < len(NODE_MAGIC) + _LEN.size:
        raise PayloadError("not a MegaTrace node payload")
    pos = len(NODE_MAGIC)
    (n,) = _LEN.unpack_from(raw, pos)
    pos += _LEN.size
    try:
        head: dict[str, Any] = json.loads(raw[pos:pos + n])
    except ValueError as exc:
        raise PayloadError(f"node payload header is not JSON: {exc}") from None
    pos += n
    files: dict[str, bytes] = {}
    for name, size in head.get("files", []):
        if not isinstance(name, str) or not TRACE_FILE_RE.match(name) or not isinstance(size, int) or size < 0:
            raise PayloadError(f"node payload names an unexpected file {name!r}")
        if pos + size > len(raw):
            raise PayloadError(f"node payload is short: {name} cut")
        files[name] = raw[pos:pos + size]
        pos += size
    return NodeSnapshot(str(head.get("node", "?")), files, head.get("facts") or {}, head.get("error"))


def pack_leader(members: list[tuple[dict[str, Any], bytes | None]]) -> bytes:
    """One frame of ``(info, payload)`` pairs; ``payload`` None for a member that did not report."""
    infos = []
    for info, payload in members:
        infos.append({**info, "size": len(payload) if payload is not None else -1})
    head = json.dumps({"members": infos}).encode()
    return b"".join([LEADER_MAGIC, _LEN.pack(len(head)), head] + [p for _, p in members if p is not None])


def unpack_leader(frame: bytes) -> list[tuple[dict[str, Any], bytes | None]]:
    if not frame.startswith(LEADER_MAGIC) or len(frame) < len(LEADER_MAGIC) + _LEN.size:
        raise PayloadError("not a MegaTrace leader frame")
    pos = len(LEADER_MAGIC)
    (n,) = _LEN.unpack_from(frame, pos)
    pos += _LEN.size
    try:
        head = json.loads(frame[pos:pos + n])
    except ValueError as exc:
        raise PayloadError(f"leader frame header is not JSON: {exc}") from None
    pos += n
    out: list[tuple[dict[str, Any], bytes | None]] = []
    for info in head.get("members", []):
        size = int(info.get("size", -1))
        if size < 0:
            out.append((info, None))
            continue
        if pos + size > len(frame):
            raise PayloadError("leader frame is short")
        out.append((info, frame[pos:pos + size]))
        pos += size
    return out
