"""Faults injected into a 3D-parallel job on the NCCL test double, traced by the NCCL interposer,
are analysed to the injected rank by ``megatrace analyze`` (the demo's fault kinds: hang,
crash, slow). Only the test knows the injected rank; the analyzer sees the rings, the layout
and ``procs.json`` (each rank's exit, as a launcher reports it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nccl_double.harness import Build, BuildUnavailable, build_all, run_job, write_procs

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.config import Layout, save_layout
from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_format import State
from megatrace.trace.ring_reader import read_ring

TP, PP, DP = 2, 2, 2
WORLD = TP * PP * DP
LAYOUT = Layout(world_size=WORLD, tp=TP, pp=PP, dp=DP, microbatches=4)

# name: (driver fault arguments, injected rank, expected kind, expected severity)
CASES = {
    "hang": (["--fault", "hang", "--fault-rank", "5", "--fault-step", "3"], 5, Kind.COMPUTE_HANG, Severity.CRITICAL),
    "crash": (["--fault", "crash", "--fault-rank", "2", "--fault-step", "2"], 2, Kind.CRASHED_PROCESS,
              Severity.CRITICAL),
    "slow": (["--fault", "slow", "--fault-rank", "6", "--fault-step", "1", "--factor", "3"], 6, Kind.STRAGGLER,
             Severity.WARNING),
}


@pytest.fixture(scope="module")
def nccl(tmp_path_factory: pytest.TempPathFactory) -> Build:
    try:
        return build_all(tmp_path_factory.mktemp("nccl-build"))
    except BuildUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_top_finding_names_the_injected_rank(nccl: Build, tmp_path: Path, case: str) -> None:
    args, rank, kind, severity = CASES[case]
    job = run_job(nccl, tmp_path, ["--tp", str(TP), "--pp", str(PP), "--dp", str(DP), "--steps", "6", *args],
                  stall_s=2.5, deadline_s=60)
    write_procs(tmp_path, job, WORLD)
    save_layout(LAYOUT, tmp_path / "layout.yaml")
    if case == "hang":
        assert job.stalled and not job.exits
        # the culprit's ring ends completed; its peers' rings end in a call that never completed
        assert read_ring(tmp_path / fmt.ring_name(rank)).records["state"][-1] == State.COMPLETED
        assert read_ring(tmp_path / fmt.ring_name(rank - 1)).records["state"][-1] == State.ENQUEUED
    elif case == "crash":
        assert job.exits == {rank: 128 + 6}  # SIGABRT; mpiexec killed the others
    else:
        assert job.exits == {r: 0 for r in range(WORLD)}, job.stderr

    result = analyze(tmp_path)
    findings = [f for f in result.findings if f.severity in (Severity.CRITICAL, Severity.ERROR, Severity.WARNING)
                and f.kind != Kind.TRACE_PROBLEM]
    top = findings[0]
    assert (top.kind, top.severity, top.subject.rank) == (kind, severity, rank), [f.verdict for f in result.findings]
    assert not [f for f in findings[1:] if f.severity == Severity.CRITICAL], [f.verdict for f in findings]
