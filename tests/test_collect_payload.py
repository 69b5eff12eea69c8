"""Node payloads and leader frames: what travels through the MPI gather (no pickle)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrace.collect.node import snapshot_node
from megatrace.collect.payload import PayloadError, pack_leader, pack_node, unpack_leader, unpack_node


def test_node_payloads_and_leader_frames_round_trip(tmp_path: Path) -> None:
    (tmp_path / "rank-00000.ring").write_bytes(b"\x00" * 5000 + b"x")
    (tmp_path / "rank-00000.meta.jsonl").write_bytes(b'{"kind":"process"}\n')
    (tmp_path / "notes.txt").write_text("not a trace file")
    snap = snapshot_node(str(tmp_path), "nodeA", stacks=False, system=False)
    assert set(snap.files) == {"rank-00000.ring", "rank-00000.meta.jsonl"}
    assert "error" in snap.facts["rings"][0]  # not a ring: described, not raised
    back = unpack_node(pack_node(snap))
    assert back.files == snap.files and back.node == "nodeA"
    frame = pack_leader([({"mpi_rank": 0, "status": "ok"}, b"abc"), ({"mpi_rank": 1, "status": "missing"}, None)])
    assert unpack_leader(frame) == [({"mpi_rank": 0, "status": "ok", "size": 3}, b"abc"),
                                    ({"mpi_rank": 1, "status": "missing", "size": -1}, None)]


def test_a_payload_naming_a_file_outside_the_trace_names_is_refused() -> None:
    import json
    import struct
    import zlib

    head = json.dumps({"node": "x", "files": [["../../etc/passwd", 1]]}).encode()
    blob = zlib.compress(b"MTNODE1\n" + struct.pack("<Q", len(head)) + head + b"x")
    with pytest.raises(PayloadError, match="unexpected file"):
        unpack_node(blob)
    with pytest.raises(PayloadError):
        unpack_node(b"not zlib")
