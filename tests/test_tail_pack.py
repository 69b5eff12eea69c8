"""The bundle's tails pack (issue 26): what a quick load reads of every ring, gathered by the collection into one
file, and read instead of the rings; never trusted beyond what it can vouch for."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from megatrace.collect.bundle import BundleWriter
from megatrace.collect.node import snapshot_node
from megatrace.load.directory import QUICK_TAIL, load_trace
from megatrace.trace import tail_pack
from megatrace.trace.ring_tail import batch_tails
from megatrace.trace.ring_writer import RingIdentity, RingWriter


def _rings(directory: Path, ranks: int = 4, records: int = 600, capacity: int = 256) -> Path:
    """Rings of a 4-rank all-reduce loop; with 600 records in 256 slots each has wrapped twice."""
    for r in range(ranks):
        w = RingWriter(directory, RingIdentity(rank=r, world_size=ranks, job_id="p", host="n1"), capacity=capacity,
                       use_native=False)
        w.write_meta("group", gid=1, name="0", desc="default_pg", ranks=list(range(ranks)), backend="gloo")
        for i in range(records - (r == 2)):  # rank 2 is one call behind: the quick pass has something to say
            w.complete(w.begin(1, 1, i + 1, 4096))
        w.close()
    return directory


def _columns(trace) -> dict[str, np.ndarray]:
    return {f.name: getattr(trace.records, f.name) for f in dataclasses.fields(trace.records)}


def _same(a, b) -> None:
    ca, cb = _columns(a), _columns(b)
    assert all(np.array_equal(ca[k], cb[k]) for k in ca), "records differ"
    assert a.rank_info == b.rank_info and a.groups == b.groups


def test_a_capture_fed_in_odd_pieces_holds_what_the_tail_load_reads(tmp_path: Path) -> None:
    path = _rings(tmp_path, ranks=1) / "rank-00000.ring"
    data = path.read_bytes()
    capture = tail_pack.TailCapture(path.name, len(data))
    for at in range(0, len(data), 1000):  # pieces that cut the header and records anywhere
        capture.feed(data[at:at + 1000])
    name, entry = tail_pack.single_entry(capture.entry())
    assert name == "rank-00000.ring" and entry.size == len(data) and entry.first == 600 + 1 - QUICK_TAIL
    from_file = batch_tails([path], QUICK_TAIL)[0]
    from_pack = batch_tails([path], QUICK_TAIL, {name: entry})[0]
    assert from_file.header == from_pack.header and len(from_file.records) == QUICK_TAIL
    assert from_file.records.tobytes() == from_pack.records.tobytes()
    assert (from_file.dropped, from_file.lost) == (from_pack.dropped, from_pack.lost)
    # a load asking for more records than the pack holds reads them from the file
    deeper = batch_tails([path], QUICK_TAIL + 32, {name: entry})[0]
    assert deeper.records.tobytes() == batch_tails([path], QUICK_TAIL + 32)[0].records.tobytes()
    assert len(deeper.records) == QUICK_TAIL + 32
    assert tail_pack.TailCapture(path.name, len(data)).entry() is None  # nothing fed: no entry


def _bundle(tmp_path: Path) -> Path:
    with snapshot_node(str(_rings(tmp_path / "node")), "n1", stacks=False, system=False) as snap:
        writer = BundleWriter(tmp_path / "bundle", "p")
        writer.add_node(snap)
    doc = writer.finish(analysis="none")
    assert doc["transfer"]["tails_packed"] == 8  # four rings, four meta files
    return writer.path


def test_a_quick_load_of_a_bundle_takes_the_tails_from_the_pack(tmp_path: Path, monkeypatch) -> None:
    bundle = _bundle(tmp_path)
    quick = load_trace(bundle, tail=QUICK_TAIL)
    monkeypatch.setattr(tail_pack.TailPack, "SCAN_BYTES", 777)  # the index built in blocks that cut entries
    _same(quick, load_trace(bundle, tail=QUICK_TAIL))
    (bundle / "tails.pack").rename(tmp_path / "pack")
    _same(quick, load_trace(bundle, tail=QUICK_TAIL))  # the same records and meta as from the rings
    (tmp_path / "pack").rename(bundle / "tails.pack")
    # The rings' record slots and meta files overwritten in place (rings/ itself unchanged): the quick load
    # still sees the records, so it did not read them from the rings.
    for ring in (bundle / "rings").glob("*.ring"):
        with open(ring, "r+b") as fh:
            fh.seek(4096)
            fh.write(bytes(ring.stat().st_size - 4096))
    for meta in (bundle / "rings").glob("*.meta.jsonl"):
        meta.write_bytes(b"")
    _same(quick, load_trace(bundle, tail=QUICK_TAIL))


def test_a_pack_older_than_rings_or_not_a_pack_is_not_used(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path)
    quick = load_trace(bundle, tail=QUICK_TAIL)
    pack = bundle / "tails.pack"
    good = pack.read_bytes()
    # hostile or damaged packs: garbage, a name outside the trace files, an entry cut short
    hostile = tail_pack.MAGIC + tail_pack.pack_entry("../../etc/shadow", 1, 0, b"", b"x")
    huge = tail_pack.MAGIC + tail_pack.pack_entry("rank-00000.meta.jsonl", 1, 0, b"", bytes(1 << 20))
    many = tail_pack.MAGIC + b"".join(tail_pack.pack_entry(f"rank-{r:05d}.meta.jsonl", 1, 0, b"", b"x")
                                      for r in range(9, 30))  # more entries than four ranks have files
    assert good.endswith(tail_pack.INDEX_MAGIC)  # (a reader reads the index, then only the entries it uses)
    index_at = int.from_bytes(good[-16:-8], "little")
    wild_index = good[:-16] + (len(good) * 2).to_bytes(8, "little") + tail_pack.INDEX_MAGIC  # points past the end
    bad_row = good[:index_at] + bytes(len(good) - 16 - index_at) + good[-16:]  # rows that name nothing: read through
    # an index whose rows point at the wrong entries, or into the middle of one: those files are read from rings/
    opened = tail_pack.TailPack(os.open(pack, os.O_RDONLY), 100)
    rows = dict(opened.index)
    opened.close()
    names = sorted(rows)
    ring_names = [n for n in names if n.endswith(".ring")]
    crossed = [(a, rows[b][0], rows[b][1]) for a, b in zip(ring_names, ring_names[1:] + ring_names[:1])]  # 0 -> 1
    shifted = [(n, rows[n][0] + 3, rows[n][1]) for n in names]
    misled = [good[:index_at] + tail_pack.pack_index(r, index_at) for r in (crossed, shifted)]
    for data in (b"garbage", hostile, huge, many, good[:len(good) // 2], wild_index, bad_row, *misled, b""):
        pack.write_bytes(data)
        _same(quick, load_trace(bundle, tail=QUICK_TAIL))  # read from the rings, or from the whole entries
    # a ring replaced after the pack was written: rings/ is newer than the pack, which is no longer trusted
    pack.write_bytes(good)
    os.utime(pack, ns=(1, 1))
    ring = bundle / "rings" / "rank-00001.ring"
    fresh = ring.with_name("fresh")
    fresh.write_bytes(ring.read_bytes()[:4096] + bytes(ring.stat().st_size - 4096))  # its records gone
    fresh.replace(ring)
    stale = load_trace(bundle, tail=QUICK_TAIL)
    assert stale.rank_info[1].n_records == 0 and quick.rank_info[1].n_records == QUICK_TAIL


def test_the_root_packs_only_a_tail_of_the_very_file_in_rings(tmp_path: Path) -> None:
    """A node's tail whose name, size or file is not the one rings/ holds never enters the pack."""
    from megatrace.collect.payload import FileEntry, NodeHeader

    writer = BundleWriter(tmp_path / "bundle", "p")
    sha = "ab" * 32
    head = NodeHeader("n9", files=[FileEntry("rank-00000.meta.jsonl", 3, sha, "rings/rank-00000.meta.jsonl"),
                                   FileEntry("rank-00001.meta.jsonl", 3, "cd" * 32, "rings/rank-00001.meta.jsonl")])
    writer.begin_node(head, 1)
    writer._sha["rank-00001.meta.jsonl"] = "ef" * 32  # (another node's copy of that name is the one in rings/)
    writer.add_tail(1, 0, tail_pack.pack_entry("rank-00001.meta.jsonl", 3, 0, b"", b"abc"))  # another name
    writer.add_tail(1, 0, tail_pack.pack_entry("rank-00000.meta.jsonl", 4, 0, b"", b"abcd"))  # another size
    writer.add_tail(1, 1, tail_pack.pack_entry("rank-00001.meta.jsonl", 3, 0, b"", b"abc"))  # not the file there
    writer.add_tail(1, 0, tail_pack.pack_entry("rank-00000.meta.jsonl", 3, 0, b"", b"abc") + b"x")  # not whole
    writer.add_tail(1, 0, tail_pack.pack_entry("rank-00000.meta.jsonl", 3, 0, b"", b"abc"))
    writer.add_tail(1, 0, tail_pack.pack_entry("rank-00000.meta.jsonl", 3, 0, b"", b"xyz"))  # one entry per name
    writer.end_node(1)
    doc = writer.finish(analysis="none")
    assert doc["transfer"]["tails_packed"] == 1
    got = tail_pack.parse_pack((writer.path / "tails.pack").read_bytes())
    assert list(got) == ["rank-00000.meta.jsonl"] and bytes(got["rank-00000.meta.jsonl"].body) == b"abc"
