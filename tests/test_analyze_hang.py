"""Hang analysis on hand-built traces: wait-for chains, root causes and their classes."""

from __future__ import annotations

from pathlib import Path

from helpers.analysis_factory import TraceBuilder

from megatrace.analyze.engine import AnalysisResult, analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.config import Layout
from megatrace.trace.ring_format import Flag, Op

KILLED = {"exit_code": None, "signal": "SIGTERM", "killed_by_launcher": True}


def pipeline4() -> tuple[TraceBuilder, dict]:
    """4 ranks: TP groups [0,1], [2,3]; pipeline stages 0 -> 2 and 1 -> 3; 5 healthy steps."""
    b = TraceBuilder(world=4)
    g = {"tp01": b.group("tp", [0, 1]), "tp23": b.group("tp", [2, 3]),
         "pp02": b.group("pp", [0, 2]), "pp13": b.group("pp", [1, 3])}
    for step in range(5):
        t = 1.0 + 10 * step
        b.collective(g["tp01"], at=t)
        b.p2p(0, 2, g["pp02"], at=t + 2)
        b.p2p(1, 3, g["pp13"], at=t + 2)
        b.collective(g["tp23"], at=t + 4)
        b.p2p(2, 0, g["pp02"], at=t + 6)
        b.p2p(3, 1, g["pp13"], at=t + 6)
    return b, g


def top(result: AnalysisResult):
    return result.findings[0]


def kinds(result: AnalysisResult) -> list[str]:
    return [f.kind.value for f in result.findings]


def test_a_chain_through_p2p_leads_to_the_stopped_rank(tmp_path: Path) -> None:
    b, g = pipeline4()
    # Rank 3 stops at 60 ms. Rank 2 waits in TP all_reduce #6 for it; rank 0 waits in a recv from rank 2.
    b.collective(g["tp23"], at=1500.0, skip=(3,), stuck=(2,))
    b.pending(0, Op.RECV, g["pp02"], at=1200.0, peer=2)
    b.collective(g["tp01"], at=1100.0, skip=(0,), stuck=(1,))
    b.write(tmp_path, layout=Layout(world_size=4, tp=2, pp=2, dp=1, order="tp-pp-dp"))
    result = analyze(tmp_path)
    f = top(result)
    assert f.kind == Kind.COMPUTE_HANG and f.severity == Severity.CRITICAL and f.subject.rank == 3
    assert f.subject.host == "node0" and f.subject.local_rank == 3 and f.subject.coords == {"pp": 1, "dp": 0, "tp": 1}
    assert f.data["chain"] == [
        "rank 1 waits in TP all_reduce #6 (group [0, 1]) for rank 0",
        "rank 0 waits in PP recv #6 from rank 2",
        "rank 2 waits in TP all_reduce #6 (group [2, 3]) for rank 3",
        "rank 3 never entered it; its last op, PP send #5 to rank 1, completed 1.5 s before the end of the trace",
    ]
    assert f.verdict.startswith("rank 3 (host node0, GPU 3, pp=1 dp=0 tp=1) stopped outside communication 1.5 s")
    assert "3 ranks wait for it" in f.verdict
    assert f.impact == 4 and f.confidence >= 0.85
    assert sum(x.severity == Severity.CRITICAL for x in result.findings) == 1


def test_everyone_entered_and_nobody_completed_is_a_communication_hang(tmp_path: Path) -> None:
    b, g = pipeline4()
    b.hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    b.collective(g["tp23"], at=60.0, stuck_all=True)
    b.pending(0, Op.RECV, g["pp02"], at=900.0, peer=2)
    b.write(tmp_path)
    f = top(analyze(tmp_path))
    assert f.kind == Kind.COMM_HANG and f.severity == Severity.CRITICAL
    assert f.subject.ranks == (2, 3) and f.subject.hosts == ("b",) and f.subject.group["desc"] == "tp"
    assert f.verdict.startswith("communication hang in TP all_reduce #6 (group [2, 3]) on host b: all 2 members "
                                "entered and none completed")
    assert f.data["chain"][-1] == "every member entered it and none completed"


def test_a_collective_entered_behind_a_stuck_call_waits_for_that_call(tmp_path: Path) -> None:
    """Rank 0 waits in a send to the stopped rank 2; its launch of the next TP all_reduce is queued behind that
    send (as an importer of enqueue-only logs records it). Every member "entered" the all_reduce, but it is no
    communication hang: rank 1 waits in it for rank 0, and rank 0 for rank 2."""
    b, g = pipeline4()
    b.pending(0, Op.SEND, g["pp02"], at=1000.0, peer=2)
    b.collective(g["tp01"], at=1010.0, stuck_all=True, override={0: {"flags": int(Flag.ASYNC)}})
    b.collective(g["tp23"], at=1000.0, skip=(2,), stuck=(3,))
    b.write(tmp_path)
    result = analyze(tmp_path)
    f = top(result)
    assert f.kind == Kind.COMPUTE_HANG and f.subject.rank == 2, f.verdict
    assert "rank 1 waits in TP all_reduce #6 (group [0, 1]) for rank 0" in f.data["chain"], f.data["chain"]
    assert Kind.COMM_HANG not in [x.kind for x in result.findings]


def test_a_crashed_process_is_named_from_procs_json_and_the_launcher_kill_is_not_a_crash(tmp_path: Path) -> None:
    b, g = pipeline4()
    b.collective(g["tp23"], at=900.0, skip=(3,), stuck=(2,))
    b.write(tmp_path, procs={0: KILLED, 1: KILLED, 2: KILLED, 3: {"exit_code": 1}}, outcome="failed")
    result = analyze(tmp_path)
    f = top(result)
    assert f.kind == Kind.CRASHED_PROCESS and f.subject.rank == 3
    assert "its process exited with status 1" in f.data["chain"][-1]
    assert kinds(result).count("crashed-process") == 1  # ranks 0-2 were killed by the launcher: no crash


def test_a_hang_killed_by_the_launcher_is_a_compute_hang_not_a_crash(tmp_path: Path) -> None:
    b, g = pipeline4()
    b.collective(g["tp23"], at=900.0, skip=(3,), stuck=(2,))
    b.write(tmp_path, procs={r: KILLED for r in range(4)}, outcome="stalled")
    result = analyze(tmp_path)
    assert top(result).kind == Kind.COMPUTE_HANG and top(result).subject.rank == 3
    assert "crashed-process" not in kinds(result)


def test_a_healthy_run_has_no_finding_above_info(tmp_path: Path) -> None:
    b, _ = pipeline4()
    b.write(tmp_path, closed=True, procs={}, outcome="ok")
    result = analyze(tmp_path)
    assert all(f.severity == Severity.INFO for f in result.findings)
    assert top(result).kind == Kind.HEALTHY and top(result).verdict.startswith("no hang: all 4 traced ranks")
    assert result.hang is not None and result.hang.finished and not result.hang.roots


def test_a_rank_without_trace_that_others_wait_for_is_named_with_low_confidence(tmp_path: Path) -> None:
    b, g = pipeline4()
    b.collective(g["tp23"], at=900.0, skip=(3,), stuck=(2,))
    b.write(tmp_path, skip_ranks=(3,))
    result = analyze(tmp_path)
    f = top(result)
    assert f.kind == Kind.NO_TRACE and f.subject.rank == 3 and f.confidence < 0.5
    assert "it has no trace" in f.data["chain"][-1]
    assert any(x.id.startswith("trace-problem:missing-ranks") and "[3]" in x.verdict for x in result.findings)


def test_a_rank_that_exited_while_others_wait_exited_early(tmp_path: Path) -> None:
    b, g = pipeline4()
    b.collective(g["tp23"], at=900.0, skip=(3,), stuck=(2,))
    b.write(tmp_path, closed={3})
    f = top(analyze(tmp_path))
    assert f.kind == Kind.EXITED_EARLY and f.subject.rank == 3 and f.severity == Severity.CRITICAL


def test_ranks_waiting_on_each_other_are_a_deadlock(tmp_path: Path) -> None:
    b, g = pipeline4()
    b.pending(0, Op.RECV, g["pp02"], at=100.0, peer=2)  # 0 waits for a send from 2 ...
    b.pending(2, Op.RECV, g["pp02"], at=100.0, peer=0)  # ... which waits for a send from 0
    b.collective(g["tp01"], at=900.0, skip=(0,), stuck=(1,))
    b.write(tmp_path)
    f = top(analyze(tmp_path))
    assert f.kind == Kind.DEADLOCK and f.subject.ranks == (0, 2)
    assert "1 more wait on them" in f.verdict


def test_members_calling_different_collectives_are_a_mismatch_not_a_network_hang(tmp_path: Path) -> None:
    b, g = pipeline4()
    b.collective(g["tp23"], at=60.0, stuck_all=True, override={3: {"op": int(Op.ALL_GATHER)}})
    b.write(tmp_path)
    result = analyze(tmp_path)
    assert top(result).kind == Kind.COLLECTIVE_MISMATCH and top(result).severity == Severity.CRITICAL
    assert any(f.kind == Kind.COLLECTIVE_MISMATCH and f.severity == Severity.ERROR for f in result.findings)


def test_ranks_still_progressing_are_a_partial_stop(tmp_path: Path) -> None:
    b = TraceBuilder(world=4)
    tp01, tp23 = b.group("tp", [0, 1]), b.group("tp", [2, 3])
    b.healthy_steps([tp01, tp23], steps=3)
    b.collective(tp01, at=40.0, skip=(1,), stuck=(0,))  # rank 1 stops; rank 0 waits
    for k in range(100):  # ranks 2 and 3 go on for another second
        b.collective(tp23, at=40.0 + 10 * k)
    b.write(tmp_path)
    result = analyze(tmp_path)
    assert top(result).kind == Kind.COMPUTE_HANG and top(result).subject.rank == 1
    partial = next(f for f in result.findings if f.kind == Kind.PARTIAL_STOP)
    assert partial.subject.ranks == (2, 3) and partial.severity == Severity.WARNING


def test_a_short_stop_at_the_end_is_only_a_possible_hang(tmp_path: Path) -> None:
    b, g = pipeline4()
    b.collective(g["tp23"], at=52.0, skip=(3,), stuck=(2,))  # 1 ms after rank 3's last op: in flight
    b.write(tmp_path)
    f = top(analyze(tmp_path))
    assert f.kind == Kind.COMPUTE_HANG and f.severity == Severity.WARNING and not f.data["confirmed"]
    assert f.verdict.startswith("possible hang")


def test_a_snapshot_of_a_running_job_reports_no_hang_for_a_short_stop_but_does_for_a_long_one(tmp_path: Path) -> None:
    """Collected while the job ran (procs.json outcome "running", e.g. before the time limit): the nodes'
    rings were read a moment apart, so a short stop at the end is in flight, not even a possible hang."""
    b, g = pipeline4()
    b.collective(g["tp23"], at=52.0, skip=(3,), stuck=(2,))
    b.write(tmp_path / "short", outcome="running")
    result = analyze(tmp_path / "short")
    assert Kind.HEALTHY.value in kinds(result) and Kind.COMPUTE_HANG.value not in kinds(result), kinds(result)
    b, g = pipeline4()
    b.collective(g["tp23"], at=52.0, skip=(3,), stuck=(2,))
    b.collective(g["tp01"], at=40_052.0)  # ranks 0 and 1 go on for 40 s more: rank 3 has stopped for good
    b.write(tmp_path / "long", outcome="running")
    f = top(analyze(tmp_path / "long"))
    assert f.kind == Kind.COMPUTE_HANG and f.subject.rank == 3 and f.severity == Severity.CRITICAL


def test_failed_waits_confirm_even_a_short_stop(tmp_path: Path) -> None:
    b, g = pipeline4()
    b.collective(g["tp23"], at=52.0, skip=(3,), failed=(2,))
    b.write(tmp_path)
    f = top(analyze(tmp_path))
    assert f.subject.rank == 3 and f.severity == Severity.CRITICAL
    assert "(the call failed)" in f.data["chain"][-2]


def test_a_recv_that_completed_after_its_sender_died_still_waits_for_it(tmp_path: Path) -> None:
    b, g = pipeline4()
    # Rank 0 dies at ~51 ms; rank 2's recv from it "completes" with an error later, and rank 2 goes no further.
    b.p2p(0, 2, g["pp02"], at=800.0, dur=100.0, recv_only=True)
    b.collective(g["tp01"], at=900.0, skip=(0,), failed=(1,))
    b.write(tmp_path, procs={0: {"exit_code": 1}, 1: {"exit_code": 1}, 2: {"exit_code": 1}, 3: KILLED})
    result = analyze(tmp_path)
    f = top(result)
    assert f.kind == Kind.CRASHED_PROCESS and f.subject.rank == 0
    assert 2 in f.data["waiters"] and result.hang.status[2].value == "blocked"
    assert kinds(result).count("crashed-process") == 1  # ranks 1 and 2 failed because rank 0 died


def test_the_end_of_the_trace_is_measured_on_aligned_clocks(tmp_path: Path) -> None:
    hosts = {r: f"h{r // 2}" for r in range(4)}
    b = TraceBuilder(world=4, hosts=hosts, skew_ms={"h1": -5000.0})  # h1's wall clock is 5 s behind
    tp = [b.group("tp", [0, 1]), b.group("tp", [2, 3])]
    dp = [b.group("dp", [0, 2]), b.group("dp", [1, 3])]
    b.healthy_steps(tp + dp, steps=5)
    b.collective(dp[0], at=1000.0, skip=(0,), stuck=(2,))  # rank 0 (host h0) stopped at ~47 ms
    b.write(tmp_path)
    f = top(analyze(tmp_path))
    assert f.kind == Kind.COMPUTE_HANG and f.subject.rank == 0
    assert abs(f.data["silence_ns"] / 1e9 - 0.953) < 0.01  # not 5.95 s, nor negative


def test_a_wait_on_an_unknown_partner_is_reported_with_low_confidence(tmp_path: Path) -> None:
    b, g = pipeline4()
    b.pending(2, Op.SEND, g["pp02"], at=60.0, peer=99)  # a peer outside the world: a corrupt record
    b.collective(g["tp23"], at=900.0, skip=(2,), stuck=(3,))
    b.write(tmp_path)
    f = top(analyze(tmp_path))
    assert f.kind == Kind.COMM_HANG and f.subject.ranks == (2,) and "partners are unknown" in f.verdict
