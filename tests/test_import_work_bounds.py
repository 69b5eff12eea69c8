"""Hostile inputs cost work in proportion to their size (issue 20, items 12-14), each one in a subprocess under a
time bound: a Flight Recorder dump whose entries share one huge list of shapes, or whose shape has thousands of
huge dimensions; NCCL Inspector files of many records; a two-line NCCL-patch log of a rank near the rank limit.

Each input here took minutes (or hours) before its fix; the bounds leave a loaded machine ten times the time a
fixed run needs.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest


def analyze_within(path: Path, bound_s: float) -> tuple[int, str, float]:
    """``megatrace analyze PATH`` in a subprocess that must end within ``bound_s``: (exit code, output, seconds)."""
    t0 = time.monotonic()
    try:
        run = subprocess.run([sys.executable, "-c", "from megatrace.cli import main; main()", "analyze", str(path),
                              "--no-report", "--json", str(path.parent / f"{path.name}.json")],
                             capture_output=True, text=True, timeout=bound_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"megatrace analyze {path} ran past {bound_s} s")
    out = run.stdout + run.stderr
    assert "Traceback" not in out, out
    return run.returncode, out, time.monotonic() - t0


def _entry(i: int, sizes: object, dtypes: object) -> dict:
    return {"record_id": i, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": i + 1,
            "p2p_seq_id": 0, "op_id": i + 1, "profiling_name": "gloo:all_reduce", "time_created_ns": 10**18 + i * 1000,
            "input_sizes": sizes, "input_dtypes": dtypes, "state": "scheduled", "retired": True, "is_p2p": False}


def _dump(entries: list[dict]) -> dict:
    return {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
            "pg_status": {}, "entries": entries}


def test_a_list_of_shapes_shared_by_every_entry_is_measured_once(tmp_path: Path) -> None:
    """100,000 shapes referenced by each of 2,000 entries (a pickle's memo: 350 KB): 33 s per 200 KB before."""
    shared = [[1, 2]] * 100_000
    (tmp_path / "fr").mkdir()
    for rank in range(2):
        entries = [_entry(i, shared, ["Float"]) for i in range(2000)]
        (tmp_path / "fr" / f"fr_rank_{rank}").write_bytes(pickle.dumps(_dump(entries)))
    assert (tmp_path / "fr" / "fr_rank_0").stat().st_size < 400_000
    code, out, took = analyze_within(tmp_path / "fr", 60)
    assert code == 0 and "imported 4000 records" in out, out
    findings = json.loads((tmp_path / "fr.json").read_text())
    assert findings["trace"]["records"] == 4000


def test_mixed_dtypes_over_a_shared_list_of_shapes_stay_bounded(tmp_path: Path) -> None:
    shared, mixed = [[3]] * 50_000, ["Float", "Half"] * 25_000  # (both lists shared by every entry)
    (tmp_path / "fr").mkdir()
    for rank in range(2):
        entries = [_entry(i, shared, mixed) for i in range(1000)]
        (tmp_path / "fr" / f"fr_rank_{rank}").write_bytes(pickle.dumps(_dump(entries)))
    code, out, _ = analyze_within(tmp_path / "fr", 60)
    assert code == 0, out


def test_a_shape_of_many_huge_dimensions_is_refused_at_once(tmp_path: Path) -> None:
    """50,000 dimensions of 2**62 in a JSON dump: 10.5 s of big-integer products before it was refused."""
    (tmp_path / "fr").mkdir()
    for rank in range(2):
        entries = [_entry(0, [[2**62] * 50_000], ["Float"])] + [_entry(i, [[4]], ["Float"]) for i in range(1, 10)]
        (tmp_path / "fr" / f"fr_rank_{rank}.json").write_text(json.dumps(_dump(entries)))
    code, out, took = analyze_within(tmp_path / "fr", 30)
    assert code == 1 and "fr_rank_0.json: entry 0 (record 0): field input_sizes[0]" in out, out
    assert took < 10, f"{took:.1f} s"
    (tmp_path / "fr" / "fr_rank_0.json").write_text(json.dumps(_dump(
        [_entry(0, [[2**40] * 60], ["Float"])] + [_entry(i, [[4]], ["Float"]) for i in range(1, 10)])))
    code, out, _ = analyze_within(tmp_path / "fr", 30)  # few dimensions, a product far past 2**63: same refusal
    assert code == 1 and "expected tensors of fewer than 2**63 bytes" in out, out


LINE = "[save_count 1] [1755590104.{ns:09d}] [Rank {rank}] Fun {fun} Data 1 stream 0x55919d27b4b0 opCount {op}\n"


@pytest.mark.parametrize("fun", ["AllReduce", "Send"])
def test_a_two_line_log_of_the_last_possible_rank_is_analysed_in_bounded_time(tmp_path: Path, fun: str) -> None:
    """One 212-byte log of rank 2**20-1: a world of a million ranks, all but one missing (300 s and 2 GB in
    repeated shortest paths of the wait-for graph before: a node per missing member, paths per waiting rank)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank_1048575.log").write_text(LINE.format(ns=1, rank=1048575, fun=fun, op=0)
                                           + LINE.format(ns=2, rank=1048575, fun=fun, op=1))
    code, out, _ = analyze_within(logs, 120)
    assert code == 0 and "nothing from 1048575 ranks of 1048576" in out, out


def test_a_collective_a_million_untraced_ranks_never_entered_names_a_bounded_few(tmp_path: Path) -> None:
    """Two logs (ranks 0 and 2**20-1) of one job-wide communicator: its collectives wait for a million ranks
    without a trace; the wait-for graph names the first of them, not a node each."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for rank, calls in ((0, 3), (1048575, 2)):
        (logs / f"rank_{rank}.log").write_text("".join(LINE.format(ns=k, rank=rank, fun="AllReduce", op=k)
                                                       for k in range(calls)))
    code, out, _ = analyze_within(logs, 120)
    assert code == 0, out
    doc = json.loads((tmp_path / "logs.json").read_text())
    graph = doc["analysis"]["report"]["wait_for"] or {"nodes": []}
    assert len(graph["nodes"]) <= 100


def _inspector_line(comm: str, rank: int, sn: int) -> str:
    t = 1_700_000_000_000_000 + sn * 100
    return json.dumps({"header": {"id": comm, "rank": rank, "n_ranks": 2, "nnodes": 1},
                       "metadata": {"inspector_output_format_version": "v4.2", "git_rev": "", "dump_timestamp_us": t + 50,
                                    "rec_mechanism": "nccl_profiler_interface", "hostname": "h", "pid": 100 + rank},
                       "coll_perf": {"coll": "AllReduce", "coll_sn": sn, "coll_msg_size_bytes": 1024,
                                     "coll_exec_time_us": 20, "coll_timing_source": "kernel_gpu", "coll_algobw_gbs": 1.0,
                                     "coll_busbw_gbs": 1.0, "coll_algo": "RING", "coll_proto": "LL"}})


def test_inspector_files_of_many_records_are_read_in_linear_time(tmp_path: Path) -> None:
    """40,000 records per rank: 329 s before (each object's line number counted from the file's first byte)."""
    where = tmp_path / "inspector"
    where.mkdir()
    for rank in range(2):
        (where / f"h-pid{100 + rank}-rank{rank}.log").write_text(
            "\n".join(_inspector_line("0x1", rank, sn) for sn in range(1, 40_001)) + "\n")
    code, out, took = analyze_within(where, 120)
    assert code == 0 and "imported 80000 collectives of 2 ranks" in out, out
