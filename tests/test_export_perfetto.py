"""``megatrace export DIR --perfetto``: every record of real demo traces (rings and an NCCL-patch log import),
checked the way a trace viewer reads it: slices nest on every thread, flows bind to the slices of the
members of each collective instance, every rank is a named process, a hung call is there and says so.

Two real demo runs per module (TP2 x PP2, three steps; one with step/phase markers, one with rank 1
hanging at step 2); nothing of MegaTrace is mocked.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # real multi-process torch runs

from megatrace.analyze.engine import analyze  # noqa: E402
from megatrace.cli import main  # noqa: E402
from megatrace.demo.launcher import DemoOptions, run_local  # noqa: E402
from megatrace.load import load_trace  # noqa: E402
from megatrace.pipeline import export_trace  # noqa: E402
from megatrace.report.perfetto import PID_BASE, assign_lanes, dumps, trace_events  # noqa: E402
from megatrace.trace.ring_format import Op, State  # noqa: E402
from helpers.nccl_logs import write_nccl_logs  # noqa: E402  (the NCCL-patch log writer)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    run_local(DemoOptions(tp=2, pp=2, dp=1, steps=3, markers=True, out=root / "ok"), log=lambda msg: None)
    hang = run_local(DemoOptions(tp=2, pp=2, dp=1, steps=3, faults=("hang:rank=1,step=2",), out=root / "hang",
                                 stall_s=2.0), log=lambda msg: None)
    assert hang.outcome == "stalled", hang.message
    return {"ok": root / "ok", "hang": root / "hang"}


def _ns(us: float) -> int:
    return round(us * 1000)


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


def _export(trace_dir: Path, out: Path, *extra: str) -> dict[str, Any]:
    before = _snapshot(trace_dir)
    result = CliRunner().invoke(main, ["export", str(trace_dir), "--perfetto", "-o", str(out), *extra])
    assert result.exit_code == 0, result.output
    assert _snapshot(trace_dir) == before  # nothing written into (or changed in) the input directory
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert next(iter(doc)) == "traceEvents"  # first: a viewer that stops at an unknown key still reads the events
    return doc


def check_nesting(slices: list[dict[str, Any]]) -> None:
    """Slices on one thread (pid, tid) nest: sorted by start (longest first), none ends inside another."""
    by_track: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for e in slices:
        by_track[(e["pid"], e["tid"])].append((_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])))
    for track, spans in by_track.items():
        stack: list[int] = []
        for start, end in sorted(spans, key=lambda se: (se[0], -se[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], f"slices overlap without nesting on {track}"
            stack.append(end)


def check_trace(doc: dict[str, Any]) -> dict[str, Any]:
    """What a viewer needs of the document; returns its parts for further checks."""
    events = doc["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    instants = [e for e in events if e["ph"] == "i"]
    flows = [e for e in events if e["ph"] in "stf"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    check_nesting(slices)
    # Threads are named and belong to one process; no pid or tid is 0 (Perfetto's idle "swapper").
    meta = [e for e in events if e["ph"] == "M"]
    thread_names = {e["tid"]: e for e in meta if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in slices + instants} <= {(e["pid"], t) for t, e in thread_names.items()}
    assert all(e["pid"] > 0 and e["tid"] > 0 for e in events)
    # Flows: one id per flow, "s" first and "f" last with the same id, category and name.
    by_id: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in flows:
        assert e["bp"] == "e"
        by_id[e["id"]].append(e)
    for fid, chain in by_id.items():
        phases = "".join(e["ph"] for e in sorted(chain, key=lambda e: "stf".index(e["ph"])))
        assert phases == "s" + "t" * (len(chain) - 2) + "f", (fid, phases)
        assert len({(e["cat"], e["name"]) for e in chain}) == 1
    # Each flow event lies inside exactly the slice it binds to (the innermost at its ts on its thread).
    bound: dict[int, list[dict[str, Any]]] = defaultdict(list)
    track_slices: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in slices:
        track_slices[(e["pid"], e["tid"])].append(e)
    for e in flows:
        t = _ns(e["ts"])
        inside = [s for s in track_slices[(e["pid"], e["tid"])] if _ns(s["ts"]) <= t <= _ns(s["ts"]) + _ns(s["dur"])]
        assert len(inside) == 1, e  # lanes never overlap, so exactly one
        bound[e["id"]].append(inside[0])
    return {"events": events, "slices": slices, "instants": instants, "flows": by_id, "bound": bound,
            "meta": meta, "threads": thread_names}


def check_flows_join_instances(parts: dict[str, Any]) -> None:
    """Every collective instance with two or more members is one flow through all of them (its own id),
    and every matched send/recv pair one flow from the send to the recv."""
    instances: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for s in parts["slices"]:
        if s["cat"].startswith("collective"):
            instances[(s["args"]["gid"], s["args"]["seq"])].append(s)
    ids_of: dict[tuple[int, int], set[int]] = defaultdict(set)
    for fid, members in parts["bound"].items():
        kinds = {m["cat"].split(",")[0] for m in members}
        assert len(kinds) == 1
        keys = {(m["args"]["gid"], m["args"]["seq"]) for m in members}
        assert len(keys) == 1, f"flow {fid} joins slices of different instances: {keys}"
        if kinds == {"collective"}:
            ids_of[keys.pop()].add(fid)
            assert len({m["pid"] for m in members}) == len(members)  # one member per rank
        else:
            assert [m["args"]["op"] for m in members] == ["send", "recv"] or \
                sorted(m["args"]["op"] for m in members) == ["recv", "send"]
            send, recv = sorted(members, key=lambda m: m["args"]["op"] != "send")
            assert send["args"]["peer"] == recv["args"]["rank"] and recv["args"]["peer"] == send["args"]["rank"]
    joined = 0
    for key, members in instances.items():
        if len(members) < 2:
            continue
        (fid,) = ids_of[key]  # exactly one flow id per instance
        assert {m["pid"] for m in parts["bound"][fid]} == {m["pid"] for m in members}
        # in arrival order: the flow starts at the first member to enter and ends at the last
        chain = parts["flows"][fid]
        start = next(e for e in chain if e["ph"] == "s")
        end = next(e for e in chain if e["ph"] == "f")
        first = min(members, key=lambda m: (m["ts"], m["args"]["rank"]))
        last = max(members, key=lambda m: (m["ts"], m["args"]["rank"]))
        assert start["pid"] == first["pid"] and end["pid"] == last["pid"]
        joined += 1
    assert joined and len(ids_of) == joined  # ids are unique per instance, no instance left out


def test_every_record_of_a_healthy_run_is_exported_nested_and_joined(runs: dict[str, Path], tmp_path: Path) -> None:
    trace = load_trace(runs["ok"])
    doc = _export(runs["ok"], tmp_path / "trace.json")
    parts = check_trace(doc)
    rec = trace.records
    markers = int((rec.op >= Op.MARK_STEP).sum())
    assert markers and len(parts["instants"]) == markers
    assert len(parts["slices"]) + len(parts["instants"]) == len(rec)  # every record, none twice
    assert sorted((e["args"]["rank"], e["args"]["record"]) for e in parts["slices"] + parts["instants"]) == \
        sorted(zip(rec.rank.tolist(), rec.seq.tolist(), strict=True))
    check_flows_join_instances(parts)
    assert any(e["cat"] == "p2p" for chain in parts["flows"].values() for e in chain)
    # every rank of the world is a named process (pid = rank + 1) with its host and GPU
    procs = {e["pid"]: e["args"]["name"] for e in parts["meta"] if e["name"] == "process_name"}
    assert {p - PID_BASE for p in procs} == set(range(trace.world_size))
    for r in range(trace.world_size):
        assert procs[r + PID_BASE] == f"rank {r} ({trace.host_of(r)}, GPU {trace.local_rank_of(r)})"
    assert all(e["pid"] == e["args"]["rank"] + PID_BASE for e in parts["slices"])
    # lanes: a group's collectives, its send/recv (the demo's batched isend/irecv overlap: a second lane)
    names = {t["args"]["name"] for t in parts["threads"].values()}
    assert {"tp group [0, 1]", "pp group [0, 2] send/recv", "steps and phases"} <= names
    assert any(n.endswith(" (2)") for n in names)
    # args: op, group, seq, bytes, state and µs times with their sub-µs decimals
    s = next(e for e in parts["slices"] if e["args"]["op"] == "all_reduce")
    assert {"op", "group", "seq", "bytes", "dtype", "state", "enqueue_us", "complete_us"} <= set(s["args"])
    assert s["args"]["state"] == "completed" and s["args"]["enqueue_us"] == s["ts"]
    assert _ns(s["args"]["complete_us"]) == _ns(s["ts"]) + _ns(s["dur"])
    other = doc["otherData"]
    assert other["records"] == len(rec) and other["size_unit"] == "bytes"
    assert any(_ns(e["ts"]) % 1000 for e in parts["slices"])  # ns precision kept, not rounded to µs


def test_a_hung_run_shows_the_calls_that_never_completed(runs: dict[str, Path], tmp_path: Path) -> None:
    trace = load_trace(runs["hang"])
    parts = check_trace(_export(runs["hang"], tmp_path / "hang.json"))
    rec = trace.records
    assert len(parts["slices"]) + len(parts["instants"]) == len(rec)
    check_flows_join_instances(parts)
    open_rows = np.flatnonzero(rec.state == State.ENQUEUED)
    stuck = [e for e in parts["slices"] if e["name"].endswith("(never completed)")]
    assert open_rows.size and len(stuck) == open_rows.size
    assert {(e["args"]["rank"], e["args"]["record"]) for e in stuck} == \
        set(zip(rec.rank[open_rows].tolist(), rec.seq[open_rows].tolist(), strict=True))
    end = max(_ns(e["ts"]) + _ns(e["dur"]) for e in parts["slices"])
    for e in stuck:  # last until the end of the trace, clearly marked
        assert e["args"]["state"] == "enqueued, never completed" and e["args"]["complete_us"] is None
        assert "incomplete" in e["cat"] and _ns(e["ts"]) + _ns(e["dur"]) == end
    # the ranks that wait for rank 1 wait in a TP collective or a PP transfer
    assert {e["args"]["rank"] for e in stuck} - {1}


def test_an_nccl_log_import_exports_element_counts(runs: dict[str, Path], tmp_path: Path) -> None:
    written = write_nccl_logs(load_trace(runs["hang"]), tmp_path / "logs", group_hash=True)
    imported = load_trace(tmp_path / "logs")
    doc = _export(tmp_path / "logs", tmp_path / "nccl.json")
    parts = check_trace(doc)
    assert len(parts["slices"]) == len(imported.records) == sum(map(len, written.values()))
    check_flows_join_instances(parts)
    assert all("count" in e["args"] and "bytes" not in e["args"] for e in parts["slices"])  # `Data` is a count
    assert doc["otherData"]["format"] == "nccl-log" and doc["otherData"]["size_unit"].startswith("elements")
    assert any(e["name"].endswith("(never completed)") for e in parts["slices"])
    assert not (tmp_path / "logs" / "job.yaml").exists()


def test_lanes_split_overlapping_calls_and_keep_sequential_ones_together() -> None:
    # the audit's case: a PP recv [25309, 36485] and a PP send [25481, 36501] of one rank, then more calls
    start = np.array([25309, 25481, 36501, 40000, 40000, 41000, 0], np.int64)
    end = np.array([36485, 36501, 38000, 45000, 40000, 42000, 100], np.int64)
    rank = np.array([0, 0, 0, 0, 0, 0, 1], np.int32)
    key = np.array([3, 3, 3, 3, 3, 3, 3], np.int64)
    lane = assign_lanes(rank, key, start, end).tolist()
    assert lane[0] != lane[1]  # overlapping: two lanes
    assert lane[2] == 0 and lane[6] == 0  # the lowest free lane; another rank's track is its own
    assert lane[3] != lane[5] and lane[4] != lane[3]  # inside another slice: not in its lane either
    seq = np.arange(5, dtype=np.int64) * 10
    assert assign_lanes(np.zeros(5, np.int32), np.zeros(5, np.int64), seq, seq + 10).tolist() == [0] * 5


def test_the_export_cannot_write_gives_one_error_line(runs: dict[str, Path], tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory\n")
    runner = CliRunner()
    for out in (blocker / "trace.json", tmp_path / "no" / "such" / "trace.json"):
        result = runner.invoke(main, ["export", str(runs["ok"]), "--perfetto", "-o", str(out)])
        assert result.exit_code == 1 and "Traceback" not in result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"Error: cannot write {out}: "), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no temporary file left behind
    missing = runner.invoke(main, ["export", str(tmp_path / "nothing"), "--perfetto", "-o", str(tmp_path / "t.json")])
    assert missing.exit_code == 1 and missing.output.startswith("Error:") and not (tmp_path / "t.json").exists()


def test_the_export_streams_and_reports_its_size(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    stats = export_trace(runs["ok"], out)
    assert stats.bytes == os.path.getsize(out) and stats.records == stats.slices + stats.instants
    assert stats.flow_events >= 2 * stats.flows and stats.ranks == 4 and stats.lanes >= 4 * 3
    result = CliRunner().invoke(main, ["export", str(runs["ok"]), "--perfetto", "-o", str(out)])
    assert result.exit_code == 0 and f"{stats.records} records of 4 ranks" in result.output


def test_a_gz_name_writes_the_same_trace_gzipped(runs: dict[str, Path], tmp_path: Path) -> None:
    plain = export_trace(runs["hang"], tmp_path / "t.json")
    packed = export_trace(runs["hang"], tmp_path / "t.json.gz")
    assert packed.bytes < plain.bytes / 4
    assert gzip.decompress((tmp_path / "t.json.gz").read_bytes()) == (tmp_path / "t.json").read_bytes()


def test_the_reports_incident_window_nests_too(runs: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "ok"  # (the analysis writes job.yaml beside the trace: not into the shared run)
    shutil.copytree(runs["ok"], copy)
    trace = json.loads(dumps(trace_events(json.loads(json.dumps(analyze(copy).document())))))
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    check_nesting(slices)
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert threads[1] == "rank 1" and "rank 1 (2)" in threads.values()  # the batched send/recv overlap
