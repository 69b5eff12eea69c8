"""What travels through the MPI gather (a header, then bounded chunks; no pickle), how the root writes a
node's stream into the bundle, and how a node writes its own files into a bundle it shares with the root."""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

import pytest

from megatrace.collect import payload
from megatrace.collect.bundle import GATHER_MARK, BundleWriter, place_files
from megatrace.collect.node import NodeSnapshot, snapshot_node
from megatrace.collect.payload import (PayloadError, header_of, messages, pack_chunk, pack_header, unpack_chunk,
                                       unpack_end, unpack_header)
from megatrace.collect.run import _BundleReceiver


def _snap(tmp_path: Path, node: str = "nodeA", ring_bytes: int = 5_000_001) -> NodeSnapshot:
    src = tmp_path / node
    src.mkdir()
    (src / "rank-00000.ring").write_bytes(os.urandom(ring_bytes))
    (src / "rank-00000.meta.jsonl").write_bytes(b'{"kind":"process"}\n')
    (src / "notes.txt").write_text("not a trace file")
    return snapshot_node(str(src), node, stacks=False, system=False)


def _stream(snap: NodeSnapshot, writer: BundleWriter, rank: int, upto: int | None = None,
            placed: dict[str, payload.FileEntry] | None = None) -> list[bytes]:
    msgs = list(messages(snap, header_of(snap, placed)))
    receiver = _BundleReceiver(writer)
    for m in msgs[:upto]:
        receiver.message(rank, m)
    if upto is None:
        receiver.end(rank)
    else:
        receiver.missing(rank, "its stream stopped part-way within the deadline")
    return msgs


def test_a_node_stream_is_a_header_then_bounded_chunks_and_arrives_byte_for_byte(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    monkeypatch.setattr(payload, "CHUNK_BYTES", 1 << 20)  # a 5 MB ring in six chunks
    snap = _snap(tmp_path)
    assert set(snap.files) == {"rank-00000.ring", "rank-00000.meta.jsonl"}
    head = unpack_header(pack_header(header_of(snap)))
    assert [(f.name, f.size) for f in head.files] == [("rank-00000.meta.jsonl", 19), ("rank-00000.ring", 5_000_001)]
    writer = BundleWriter(tmp_path / "bundle", "j")
    msgs = _stream(snap, writer, 3)
    # the header; each file's chunks, then its end; the meta file's tail (random bytes are no ring: no tail)
    assert len(msgs) == 1 + (1 + 1 + 1) + (5 + 1)
    # the file's digest comes at its end (the node reads each file once, a chunk at a time)
    assert unpack_end(msgs[-1]) == (1, 5_000_001, hashlib.sha256(snap.files["rank-00000.ring"].read()).hexdigest())
    assert max(len(m) for m in msgs[1:]) <= (1 << 20) + 1024  # random bytes do not compress
    doc = writer.finish(analysis="none")
    for name, f in snap.files.items():
        assert (tmp_path / "bundle" / "rings" / name).read_bytes() == f.read()
    assert sorted(f["name"] for f in doc["files"]) == ["rings/rank-00000.meta.jsonl", "rings/rank-00000.ring"]
    assert doc["nodes"]["collected"] == ["nodeA"], doc
    assert [p for p in doc["problems"] if "not a MegaTrace ring" not in p] == []  # (random bytes: described)


def test_a_stream_cut_part_way_leaves_no_partial_ring_and_names_the_node(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(payload, "CHUNK_BYTES", 1 << 20)
    snap = _snap(tmp_path)
    writer = BundleWriter(tmp_path / "bundle", "j")
    _stream(snap, writer, 3, upto=6)  # the header, the meta file (its end and tail), two of five chunks of the ring
    doc = writer.finish(analysis="none")
    assert (tmp_path / "bundle" / "rings" / "rank-00000.meta.jsonl").exists()
    assert not (tmp_path / "bundle" / "rings" / "rank-00000.ring").exists()
    assert [f["name"] for f in doc["files"]] == ["rings/rank-00000.meta.jsonl"]
    assert doc["nodes"]["missing"] == [{"node": "nodeA", "reason": "its stream was cut: its stream stopped part-way "
                                                                   "within the deadline"}]
    assert any("rings/rank-00000.ring" in p and "did not arrive whole" in p for p in doc["problems"]), doc


def test_chunks_out_of_order_or_altered_are_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(payload, "CHUNK_BYTES", 1 << 20)
    snap = _snap(tmp_path)
    msgs = list(messages(snap, header_of(snap)))
    writer = BundleWriter(tmp_path / "bundle", "j")
    receiver = _BundleReceiver(writer)
    for m in msgs[:4] + [msgs[5], msgs[4]] + msgs[6:]:  # the ring's second chunk before its first
        receiver.message(5, m)
    receiver.end(5)
    index, offset, data = unpack_chunk(msgs[4])
    altered = pack_chunk(index, offset, bytes([data[0] ^ 1]) + data[1:])
    other = NodeSnapshot("nodeB", dict(snap.files), snap.facts)
    msgs_b = list(messages(other, header_of(other)))
    writer2 = BundleWriter(tmp_path / "bundle2", "j")
    receiver2 = _BundleReceiver(writer2)
    for m in msgs_b[:4] + [altered] + msgs_b[5:]:
        receiver2.message(6, m)
    receiver2.end(6)
    for w, what in ((writer, "bytes at 1048576 where 0 were expected"),
                    (writer2, "did not match the size and sha256")):
        doc = w.finish(analysis="none")
        assert not (w.path / "rings" / "rank-00000.ring").exists()
        assert any(what in p for p in doc["problems"]), doc["problems"]
        assert [f["name"] for f in doc["files"]] == ["rings/rank-00000.meta.jsonl"]  # its other file is kept


def test_a_header_naming_a_file_outside_the_trace_names_or_the_bundle_is_refused() -> None:
    def head(files: list) -> bytes:
        return payload.HEAD_MAGIC + zlib.compress(json.dumps({"node": "x", "files": files}).encode())

    sha = "0" * 64
    with pytest.raises(PayloadError, match="unexpected file"):
        unpack_header(head([{"name": "../../etc/passwd", "size": 1, "sha256": sha}]))
    with pytest.raises(PayloadError, match="unexpected path"):
        unpack_header(head([{"name": "rank-00000.ring", "size": 1, "sha256": sha, "placed": "../../x"}]))
    with pytest.raises(PayloadError, match="size or sha256"):
        unpack_header(head([{"name": "rank-00000.ring", "size": -1, "sha256": sha}]))
    with pytest.raises(PayloadError):
        unpack_header(b"not a header")
    with pytest.raises(PayloadError, match="inflates past"):  # a chunk that would inflate without bound
        unpack_chunk(payload.CHUNK_MAGIC + b"\0" * 12 + zlib.compress(b"\0" * (payload.CHUNK_BYTES + 1)))


def _shared_bundle(tmp_path: Path, nonce: str = "n0nce") -> BundleWriter:
    writer = BundleWriter(tmp_path / "bundle", "j")
    writer.out.write(GATHER_MARK, nonce.encode() + b"\n", replace=True)
    return writer


def test_a_node_that_sees_the_roots_bundle_writes_its_own_files_and_streams_only_its_header(tmp_path: Path) -> None:
    snap = _snap(tmp_path)
    writer = _shared_bundle(tmp_path)
    placed, why = place_files(snap, str(writer.path), "n0nce", None)
    assert why is None and {n: e.placed for n, e in placed.items()} == {n: f"rings/{n}" for n in snap.files}
    assert placed["rank-00000.ring"].sha256 == hashlib.sha256(snap.files["rank-00000.ring"].read()).hexdigest()
    msgs = _stream(snap, writer, 2, placed=placed)
    assert len(msgs) == 2  # the header, and the meta file's tail (random bytes are no ring: no tail)
    doc = writer.finish(analysis="none")
    assert doc["transfer"]["files_written_by_nodes"] == 2 and doc["transfer"]["files_written_by_root"] == 0
    assert doc["transfer"]["tails_packed"] == 1
    for name, f in snap.files.items():
        assert (writer.path / "rings" / name).read_bytes() == f.read()


def test_a_node_never_writes_into_a_directory_that_is_not_the_roots(tmp_path: Path) -> None:
    snap = _snap(tmp_path)
    writer = _shared_bundle(tmp_path)
    assert place_files(snap, str(writer.path), "another", None) == (
        {}, "the bundle directory seen from this node is not the root's (another filesystem)")
    placed, why = place_files(snap, str(tmp_path / "absent"), "n0nce", None)
    assert placed == {} and why.startswith("the bundle directory is not visible from this node")
    assert not (tmp_path / "absent").exists()
    # rings/ replaced by a link to somewhere else: refused, nothing written through it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rmdir(writer.path / "rings")
    os.symlink(elsewhere, writer.path / "rings")
    placed, why = place_files(snap, str(writer.path), "n0nce", None)
    assert placed == {} and why.startswith("rings/ of the bundle not writable") and not list(elsewhere.iterdir())


def test_a_file_planted_under_a_rings_name_is_not_taken_for_the_nodes(tmp_path: Path) -> None:
    snap = _snap(tmp_path)
    writer = _shared_bundle(tmp_path)
    (writer.path / "rings" / "rank-00000.ring").write_bytes(b"planted")
    placed, why = place_files(snap, str(writer.path), "n0nce", None)
    assert why is None and list(placed) == ["rank-00000.meta.jsonl"]
    assert (writer.path / "rings" / "rank-00000.ring").read_bytes() == b"planted"  # untouched; the bytes stream
    _stream(snap, writer, 2, placed=placed)
    doc = writer.finish(analysis="none")
    clash = writer.path / "nodes" / "nodeA" / "rank-00000.ring"
    assert clash.read_bytes() == snap.files["rank-00000.ring"].read()
    assert any("more than one node with different content" in p for p in doc["problems"]), doc["problems"]


def test_a_file_a_node_left_part_written_is_hidden_from_the_analysis_and_named(tmp_path: Path) -> None:
    """A node writes its files under a hidden name and links each to its own once whole; one stopped part-way
    leaves only the hidden file, which the bundle names."""
    snap = _snap(tmp_path)
    writer = _shared_bundle(tmp_path)
    placed, _ = place_files(snap, str(writer.path), "n0nce", None)
    assert sorted(p.name for p in (writer.path / "rings").iterdir()) == sorted(snap.files)  # no hidden file left
    (writer.path / "rings" / ".incoming.n0nce.nodeB.rank-00001.ring").write_bytes(b"part")  # a node stopped here
    _stream(snap, writer, 2, placed=placed)
    doc = writer.finish(analysis="none")
    assert any("left part-written" in p and ".incoming.n0nce.nodeB.rank-00001.ring" in p for p in doc["problems"])
    assert all(not f["name"].startswith("rings/.") for f in doc["files"])


def test_no_side_holds_a_whole_ring_whatever_its_size(tmp_path: Path, monkeypatch) -> None:
    """Issue 26: a node read each trace file whole before writing or sending it (8 rings of 1 M records: 512 MiB,
    past the 1 GiB target beyond ~1.5 M). Now a file is read, hashed, written and sent a chunk at a time."""
    import tracemalloc

    from megatrace.collect import node as node_mod

    monkeypatch.setattr(payload, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(node_mod, "READ_BYTES", 1 << 20)
    ring = 48 << 20
    src = tmp_path / "nodeA"
    src.mkdir()
    with open(src / "rank-00000.ring", "wb") as fh:  # (written a MiB at a time: nothing of it held here)
        for _ in range(ring >> 20):
            fh.write(os.urandom(1 << 20))
    (src / "rank-00000.meta.jsonl").write_bytes(b'{"kind":"process"}\n')
    writer = _shared_bundle(tmp_path)
    tracemalloc.start()
    try:
        snap = snapshot_node(str(src), "nodeA", stacks=False, system=False)  # the snapshot, then the node
        placed, _ = place_files(snap, str(writer.path), "n0nce", None)  # writes it into the bundle
        placing = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        other = BundleWriter(tmp_path / "streamed", "j")
        receiver = _BundleReceiver(other)
        for m in messages(snap, header_of(snap)):  # or streams it to the root, which writes it as it comes
            receiver.message(4, m)
        receiver.end(4)
        streaming = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert list(placed) == ["rank-00000.meta.jsonl", "rank-00000.ring"]
    assert placing < ring // 8 and streaming < ring // 8, (placing, streaming)
    digest = hashlib.sha256(snap.files["rank-00000.ring"].read()).hexdigest()
    assert placed["rank-00000.ring"].sha256 == digest
    doc = other.finish(analysis="none")
    assert [f["sha256"] for f in doc["files"] if f["name"] == "rings/rank-00000.ring"] == [digest]


def test_a_file_replaced_after_the_snapshot_is_dropped_and_named_never_read_in_its_place(tmp_path: Path) -> None:
    """A node holds no file open (a node with thousands of trace files would run out of descriptors): each is
    opened again to be read, and must be the very file the snapshot saw."""
    snap = _snap(tmp_path)
    ring = tmp_path / "nodeA" / "rank-00000.ring"
    planted = tmp_path / "nodeA" / "planted"
    planted.write_bytes(b"not the ring the snapshot saw")
    planted.replace(ring)
    writer = _shared_bundle(tmp_path)
    placed, _ = place_files(snap, str(writer.path), "n0nce", None)
    assert list(placed) == ["rank-00000.meta.jsonl"]  # the ring could not be read: left to the stream
    _stream(snap, writer, 2, placed=placed)
    doc = writer.finish(analysis="none")
    assert not (writer.path / "rings" / "rank-00000.ring").exists()
    assert [f["name"] for f in doc["files"]] == ["rings/rank-00000.meta.jsonl"]
    assert any("replaced since the snapshot" in p and "rank-00000.ring" in p for p in doc["problems"]), doc["problems"]
    assert sorted(p.name for p in (writer.path / "rings").iterdir()) == ["rank-00000.meta.jsonl"]  # nothing hidden


def test_a_node_with_more_trace_files_than_descriptors_collects_them_all(tmp_path: Path) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    src = tmp_path / "many"
    src.mkdir()
    for r in range(300):
        (src / f"rank-{r:05d}.meta.jsonl").write_bytes(b'{"kind":"process"}\n')
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64, hard))  # 64 more than now
    try:
        with snapshot_node(str(src), "n1", stacks=False, system=False) as snap:
            writer = BundleWriter(tmp_path / "bundle", "j")
            writer.add_node(snap)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    doc = writer.finish(analysis="none")
    assert len(doc["files"]) == 300 and doc["problems"] == [], doc["problems"][:3]
