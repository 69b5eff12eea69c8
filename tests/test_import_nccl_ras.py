"""NCCL RAS reports: `megatrace analyze` on the output of `ncclras` (text) and `ncclras -f json`.

No NCCL here, so the reports are written from the format strings of NVIDIA/nccl ``src/ras/client_support.cc``
(NCCL 2.32.3, commit 12df1a11; the text lines are those of 2.24+): ``rasClientRunInit`` ("NCCL version %s compiled
with CUDA %s", "Job summary", the "(total)" table, "Communicators..."), ``rasClientRunComms`` (" (%.3fs)", the
"Group Comms ..." table with ``"%5d  %8d  %8d  %8s  %8d  %8d  %8s  %6s"``, "DEAD" / "  %d job process%s considered
dead (unreachable via the RAS network)" / "  Process %d on node %s managing GPU%s %s", "#%d-%d (%016lx) INCOMPLETE"
/ "  Rank %d -- GPU %s managed by process %d on node %s", "#%d-%d (%016lx) MISMATCH" / "  Communicator ranks have
different %s operation counts" / "  %d ranks have launched up to operation %ld" / "  Rank %d has launched up to
operation %ld -- GPU %s managed by process %d on node %s") and the JSON writers (``jsonWriteHeader``,
``jsonStartCommunicator``, ``jsonWriteRankData``, ``jsonWriteMissingRank``, ``jsonWriteFooter``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.load.importers import detect_format
from megatrace.load.traceset import TraceLoadError

HASH = "27a079b828ff1a75"
PID0 = 3487000


def node(r: int) -> str:
    return f"172.16.64.{200 + r // 4}"


def head(world: int, errors: str) -> list[str]:
    return ["NCCL version 2.24.3 compiled with CUDA 12.6", "CUDA runtime version 12060, driver version 12040", "",
            "Job summary", "===========", "",
            "  Nodes  Processes         GPUs  Processes     GPUs",
            "(total)   per node  per process    (total)  (total)",
            "%7d  %9d  %11d  %9d  %7d" % (world // 4, 4, 1, world, world), "",
            "Communicators... (0.012s)", "=============", "",
            "Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors",
            "    #  in group  per comm  per node  per comm  in group",
            "%5d  %8d  %8d  %8s  %8d  %8d  %8s  %6s" % (0, 1, world // 4, "4", world, world, "RUNNING", errors), "",
            "Errors", "======", ""]


def who(r: int) -> str:
    return f"GPU {r % 4} managed by process {PID0 + r} on node {node(r)}"


def text_report(tmp_path: Path, world: int = 8, dead: int | None = None, behind: int | None = None,
                name: str = "ras.txt") -> Path:
    errors = "INCOMPLETE" if dead is not None else "MISMATCH" if behind is not None else "OK"
    lines = head(world, errors)
    if dead is not None:
        lines += ["DEAD", "  1 job process is considered dead (unreachable via the RAS network)",
                  f"  Process {PID0 + dead} on node {node(dead)} managing GPU {dead % 4}", "",
                  f"#0-0 ({HASH}) INCOMPLETE", "  Missing communicator data from 1 rank",
                  f"  Rank {dead} -- {who(dead)}", ""]
    lines += ["Warnings", "========", ""]
    if behind is not None:
        lines += [f"#0-0 ({HASH}) MISMATCH", "  Communicator ranks have different AllReduce operation counts",
                  f"  {world - 1} ranks have launched up to operation 812",
                  f"  Rank {behind} has launched up to operation 811 -- {who(behind)}", ""]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def json_report(tmp_path: Path, counts: dict[int, int], world: int = 8, sub: list[int] | None = None,
                sub_counts: dict[int, int] | None = None, dead: int | None = None) -> Path:
    def rank(r: int, g: int, n: int) -> dict:
        return {"rank": r, "host": node(g), "pid": PID0 + g, "cuda_dev": g % 4, "nvml_dev": g % 4,
                "status": {"init_state": 0, "async_error": 0, "finalize_called": False, "destroy_flag": False,
                           "abort_flag": False},
                "collective_counts": {"Broadcast": 2, "Reduce": 0, "AllGather": 0, "ReduceScatter": 0,
                                      "AllReduce": n}}
    comms = [{"hash": f"0x{HASH}", "secondary_hash": "0x1:0x2", "size": world,
              "ranks": [rank(r, r, counts.get(r, 100)) for r in range(world) if r != dead],
              "missing_ranks": [] if dead is None else [
                  {"rank": dead, "host": node(dead), "pid": PID0 + dead, "cuda_dev": dead % 4, "nvml_dev": dead % 4,
                   "status": {"unresponsive": True, "considered_dead": True}}]}]
    if sub:
        comms.append({"hash": "0x5ee5", "secondary_hash": "0x1:0x3", "size": len(sub),
                      "ranks": [rank(i, g, (sub_counts or {}).get(i, 40)) for i, g in enumerate(sub)],
                      "missing_ranks": []})
    for c in comms:
        c["ranks_count"], c["missing_ranks_count"] = len(c["ranks"]), len(c["missing_ranks"])
    doc = {"nccl_version": "2.28.3", "cuda_runtime_version": 12080, "cuda_driver_version": 12080,
           "timestamp": "2025-11-04 10:00:00", "communicators_count": len(comms), "communicators": comms,
           "ras": {"collection_time_sec": 0.012, "timeouts_count": 0}}
    path = tmp_path / "ras.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


def test_a_dead_process_is_named_first_with_its_node(tmp_path: Path) -> None:
    path = text_report(tmp_path, dead=5)
    assert detect_format(tmp_path) == "nccl-ras"
    top = analyze(path).findings[0]
    assert top.subject.rank == 5 and top.severity == Severity.CRITICAL, top.verdict
    assert top.kind in (Kind.CRASHED_PROCESS, Kind.NO_TRACE)
    text = top.verdict + " ".join(map(str, top.evidence))
    assert "dead (unreachable via the RAS network)" in text and node(5) in text and str(PID0 + 5) in text, text


def test_the_rank_behind_in_a_communicator_is_named(tmp_path: Path) -> None:
    top = analyze(text_report(tmp_path, behind=3)).findings[0]
    assert top.subject.rank == 3, top.verdict
    assert "#812" in top.verdict and "7 ranks wait" in top.verdict, top.verdict


def test_json_report_names_the_rank_behind_in_a_sub_communicator(tmp_path: Path) -> None:
    # TP communicator of job ranks 4-7: its rank 2 (job rank 6) launched one AllReduce fewer
    path = json_report(tmp_path, {}, sub=[4, 5, 6, 7], sub_counts={2: 39})
    top = analyze(path).findings[0]
    assert top.subject.rank == 6, top.verdict
    dead = analyze(json_report(tmp_path, {}, dead=2)).findings[0]
    assert dead.subject.rank == 2 and dead.severity == Severity.CRITICAL, dead.verdict


def test_all_consistent_is_nothing_wrong_seen_by_ras(tmp_path: Path) -> None:
    result = analyze(json_report(tmp_path, {}))
    assert not [f for f in result.findings if f.severity == Severity.CRITICAL], [f.verdict for f in result.findings]
    with pytest.raises(TraceLoadError, match="NCCL RAS saw nothing wrong"):
        analyze(text_report(tmp_path))


@pytest.mark.parametrize("content", [
    b"NCCL version 2.24.3 compiled with CUDA 12.6\nCUDA runtime version 12060, driver version 12040\n\nJob summary\n",
    b"NCCL version 2.24.3 compiled with CUDA 12.6\n\nJob summary\n" + b"\xff\xfe garbage\n",
    b'{"nccl_version": "2.28.3", "communicators": [{"hash": "0x1", "size": ',
    b'{"nccl_version": "2.28.3", "communicators": [{"hash": "0x1", "size": 4, "ranks": [{"rank": 9}]}]}',
])
def test_bad_input_is_one_clear_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "ras.txt"
    path.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "megatrace.cli", "analyze", "--format", "nccl-ras", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "ras.txt" in proc.stderr, proc.stderr


def test_huge_and_foreign_lines_are_refused_by_name(tmp_path: Path) -> None:
    from megatrace.load.importers import nccl_ras_lines

    path = text_report(tmp_path, behind=1)
    with open(path, "ab") as fh:
        fh.write(b"x" * (nccl_ras_lines.MAX_LINE + 1) + b"\n")
    with pytest.raises(TraceLoadError, match=r"ras\.txt:\d+: a line of"):
        analyze(path)
    big = tmp_path / "big" / "ras.txt"
    big.parent.mkdir()
    big.write_text(text_report(tmp_path, behind=1).read_text())
    with open(big, "ab") as fh:
        fh.truncate(nccl_ras_lines.MAX_BYTES + 1)
    with pytest.raises(TraceLoadError, match="at most 64 MiB"):
        analyze(big)
