"""The Kineto job of tests/test_import_kineto.py run live (torch, 3 processes; rank 1 throttled from outside): the
traces today's profiler writes are still imported call for call, and the throttled rank is named. The other Kineto
tests read the checked-in runs of the same job (tests/data/kineto/)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # a real multi-process torch run

from helpers.torch_runs import KINETO_WORLD as WORLD  # noqa: E402
from helpers.torch_runs import kineto_job  # noqa: E402

from megatrace.analyze.engine import analyze  # noqa: E402
from megatrace.analyze.findings import Kind  # noqa: E402
from megatrace.load import load_trace  # noqa: E402
from megatrace.load.importers import detect_format  # noqa: E402
from megatrace.load.importers.kineto import OPS, _key  # noqa: E402
from megatrace.trace.ring_format import Op, State  # noqa: E402

SLOW = 1
HANG_KINDS = {Kind.COMPUTE_HANG, Kind.COMM_HANG, Kind.CRASHED_PROCESS, Kind.EXITED_EARLY, Kind.DEADLOCK,
              Kind.POSSIBLE_HANG, Kind.STALL, Kind.PARTIAL_STOP, Kind.STARTUP_HANG, Kind.NO_TRACE}


def test_a_live_profiled_job_is_imported_and_its_throttled_rank_named(tmp_path: Path) -> None:
    out = kineto_job(tmp_path / "slow", 30, slow=SLOW)
    assert detect_format(out) == "kineto" and (out / "trace-rank0.json.gz").is_file()  # (both forms are read)
    trace = load_trace(out)
    assert trace.source_format == "kineto" and list(trace.ranks) == list(range(WORLD))
    for rank in range(WORLD):
        path = next(out.glob(f"trace-rank{rank}.json*"))
        data = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
        counted: dict[int, int] = {}
        for e in json.loads(data)["traceEvents"]:  # what the profiler recorded: one c10d:: op per call
            if e.get("cat") == "cpu_op" and e["name"].startswith("c10d::") and _key(e["name"]) in OPS:
                counted[OPS[_key(e["name"])]] = counted.get(OPS[_key(e["name"])], 0) + 1
        got: dict[int, int] = {}
        for op in trace.records.op[trace.rows(rank)].tolist():
            got[op] = got.get(op, 0) + 1
        assert got == counted and counted[Op.ALL_REDUCE] == 30, (rank, got, counted)
    assert (trace.records.state == State.COMPLETED).all()
    assert not [p for p in trace.problems if p.severity != "info"], trace.problems
    result = analyze(out)
    stragglers = [f.subject.rank for f in result.findings if f.kind == Kind.STRAGGLER]
    assert stragglers[:1] == [SLOW], [f.verdict for f in result.findings[:4]]
    assert not [f for f in result.findings if f.kind in HANG_KINDS]
