"""Quick (hang-only) analysis: ``analyze(DIR, mode="hang")`` names the same culprit as the full analysis.

The hand-built traces are long enough (hundreds of records per rank) that the
quick mode really loads only tails; one real demo run checks the same on gloo.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.analysis_factory import TraceBuilder

from megatrace.analyze import engine
from megatrace.analyze.engine import AnalysisResult, analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.config import Layout
from megatrace.load import QUICK_TAIL, load_trace
from megatrace.load.traceset import COLUMNS
from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_format import Op

STEPS = 80  # x 3 records per rank and step: well beyond QUICK_TAIL


def pipeline4(steps: int = STEPS) -> tuple[TraceBuilder, dict]:
    """4 ranks: TP groups [0,1], [2,3]; pipeline stages 0 -> 2 and 1 -> 3; ``steps`` healthy steps."""
    b = TraceBuilder(world=4, capacity=4096, hosts={0: "a", 1: "a", 2: "b", 3: "b"})
    g = {"tp01": b.group("tp", [0, 1]), "tp23": b.group("tp", [2, 3]),
         "pp02": b.group("pp", [0, 2]), "pp13": b.group("pp", [1, 3])}
    for step in range(steps):
        t = 1.0 + 10 * step
        b.collective(g["tp01"], at=t)
        b.p2p(0, 2, g["pp02"], at=t + 2)
        b.p2p(1, 3, g["pp13"], at=t + 2)
        b.collective(g["tp23"], at=t + 4)
        b.p2p(2, 0, g["pp02"], at=t + 6)
        b.p2p(3, 1, g["pp13"], at=t + 6)
    return b, g


def _essence(result: AnalysisResult) -> list[tuple]:
    """Every finding, as compared between the modes. The "no hang" findings count the collectives and
    pairs seen, which in the quick mode are those of the tails: their numbers are left out."""
    def verdict(f):
        return re.sub(r"\d+", "N", f.verdict) if f.kind in (Kind.HEALTHY, Kind.POSSIBLE_HANG) else f.verdict

    return [(f.kind, f.severity, f.subject, verdict(f), f.data.get("chain"), round(f.confidence, 6), f.impact)
            for f in result.findings]


def assert_same_verdicts(tmp_path: Path, *, tail_only: bool = True) -> tuple[AnalysisResult, AnalysisResult]:
    """The quick analysis gives the full analysis's verdict, and every finding of the same stages."""
    full = analyze(tmp_path)
    same_stages = analyze(tmp_path, stages=[(n, s) for n, s in engine.STAGES if n in engine.HANG_MODE_STAGES])
    quick = analyze(tmp_path, mode="hang")
    assert quick.trace.tail == QUICK_TAIL and full.trace.tail is None
    if tail_only:
        assert any(i.unread for i in quick.trace.rank_info), "the trace is too short to test tails"
        assert len(quick.trace.records) < len(full.trace.records)
    assert _essence(quick) == _essence(same_stages)
    assert _essence(quick)[0] == _essence(full)[0]
    return full, quick


def test_chain_through_p2p(tmp_path: Path) -> None:
    b, g = pipeline4()
    end = 10.0 * STEPS
    b.collective(g["tp23"], at=end + 500, skip=(3,), stuck=(2,))
    b.pending(0, Op.RECV, g["pp02"], at=end + 200, peer=2)
    b.collective(g["tp01"], at=end + 100, skip=(0,), stuck=(1,))
    b.write(tmp_path)
    full, quick = assert_same_verdicts(tmp_path)
    top = quick.findings[0]
    assert top.kind == Kind.COMPUTE_HANG and top.subject.rank == 3 and top.severity == Severity.CRITICAL
    assert quick.results["mode"] == "hang" and full.results["mode"] == "full"
    doc = quick.document()
    assert doc["analysis"]["mode"]["name"] == "hang" and doc["analysis"]["mode"]["tail_records"] == QUICK_TAIL


def test_communication_hang(tmp_path: Path) -> None:
    b, g = pipeline4()
    end = 10.0 * STEPS
    b.collective(g["tp23"], at=end + 60, stuck_all=True)
    b.pending(0, Op.RECV, g["pp02"], at=end + 900, peer=2)
    b.write(tmp_path)
    _, quick = assert_same_verdicts(tmp_path)
    assert quick.findings[0].kind == Kind.COMM_HANG and quick.findings[0].subject.ranks == (2, 3)


def test_crashed_process(tmp_path: Path) -> None:
    b, g = pipeline4()
    end = 10.0 * STEPS
    b.collective(g["tp23"], at=end + 900, skip=(3,), failed=(2,))
    b.pending(0, Op.RECV, g["pp02"], at=end + 950, peer=2)
    b.collective(g["tp01"], at=end + 960, skip=(0,), stuck=(1,))
    b.write(tmp_path, procs={3: {"exit_code": 1}}, outcome="failed")
    _, quick = assert_same_verdicts(tmp_path)
    assert quick.findings[0].kind == Kind.CRASHED_PROCESS and quick.findings[0].subject.rank == 3


def test_healthy_run(tmp_path: Path) -> None:
    b, _ = pipeline4()
    b.write(tmp_path, closed=True)
    _, quick = assert_same_verdicts(tmp_path)
    assert all(not f.severity.at_least(Severity.WARNING) for f in quick.findings)


def test_a_rank_that_stopped_long_before_the_others(tmp_path: Path) -> None:
    """Rank 3 stops after step 60; the others go on for 200 more calls among themselves, then wait for it."""
    b, g = pipeline4(steps=60)
    t = 700.0
    for _ in range(200):
        b.collective(g["tp01"], at=t)
        b.p2p(0, 2, g["pp02"], at=t + 1)
        t += 5.0
    b.collective(g["tp23"], at=t + 10, skip=(3,), stuck=(2,))
    b.pending(0, Op.RECV, g["pp02"], at=t + 20, peer=2)
    b.collective(g["tp01"], at=t + 30, skip=(0,), stuck=(1,))
    b.write(tmp_path)
    quick_trace = load_trace(tmp_path, tail=QUICK_TAIL)
    assert quick_trace.info(3).n_records == QUICK_TAIL and quick_trace.info(3).unread > 0
    _, quick = assert_same_verdicts(tmp_path)
    top = quick.findings[0]
    assert top.kind == Kind.COMPUTE_HANG and top.subject.rank == 3
    assert "1.1 s before the end of the trace" in top.verdict, top.verdict  # its last op: step 60, at 598 ms


def test_a_partner_posted_its_side_before_its_tail_reads_further_back(tmp_path: Path) -> None:
    """Rank 2's send to rank 0 completed (eagerly) 300 calls ago; rank 0 still waits in the matching recv.

    Rank 2's tail does not reach back to that send: read alone, rank 0 would seem to wait for a send
    rank 2 never posted. The quick mode must notice and read rank 2 further back, and then name the
    link as the full analysis does.
    """
    b, g = pipeline4()
    end = 10.0 * STEPS
    b.records[2].append(_send(2, 0, g["pp02"], b, at=end + 10))
    b.pending(0, Op.RECV, g["pp02"], at=end + 11, peer=2)
    t = end + 20
    for _ in range(300):
        b.collective(g["tp23"], at=t)
        t += 2.0
    b.collective(g["tp01"], at=end + 30, skip=(0,), stuck=(1,))
    b.write(tmp_path)
    full, quick = assert_same_verdicts(tmp_path)
    assert quick.trace.info(2).n_records > QUICK_TAIL  # read further back
    assert quick.document()["analysis"]["mode"]["ranks_read_deeper"] >= 1
    assert "widen" in quick.timings
    top = quick.findings[0]
    assert top.kind == Kind.COMM_HANG and "the link rank 2 → rank 0" in top.verdict, top.verdict


def test_a_member_entered_the_collective_before_its_tail_reads_further_back(tmp_path: Path) -> None:
    """Rank 3 entered TP all_reduce #81 and saw it complete, then made 300 calls with rank 1; rank 2 is
    still in it. Read alone, rank 3's tail says it never entered: the quick mode must read further back."""
    b, g = pipeline4()
    end = 10.0 * STEPS
    b.collective(g["tp23"], at=end + 10, stuck=(2,))
    t = end + 20
    for _ in range(300):
        b.p2p(3, 1, g["pp13"], at=t)
        t += 2.0
    b.write(tmp_path)
    trace = load_trace(tmp_path, tail=QUICK_TAIL)
    assert 81 not in trace.records.group_seq[trace.rows(3)][trace.records.group_id[trace.rows(3)] == g["tp23"].gid]
    _, quick = assert_same_verdicts(tmp_path)
    assert quick.trace.info(3).n_records > QUICK_TAIL and quick.trace.info(0).n_records == QUICK_TAIL


def _send(src: int, dst: int, g, b: TraceBuilder, at: float):
    from helpers.analysis_factory import Rec

    return Rec(at, int(Op.SEND), g.gid, b._next(("s", src, g.gid, dst)), 2048, dst, done=at + 0.5)


def test_the_mode_selects_the_stages(tmp_path: Path) -> None:
    b, g = pipeline4(steps=10)
    b.collective(g["tp23"], at=500.0, skip=(3,), stuck=(2,))
    b.write(tmp_path)
    ran: list[str] = []

    def whole_iterations(ctx):  # an analyzer that needs every record: never called in hang mode
        ran.append("critical_path")  # (the name it would have)
        return []

    stages = [*engine.STAGES, ("my_iterations", whole_iterations)]
    quick = analyze(tmp_path, mode="hang", stages=stages)
    assert ran == [] and "my_iterations" in quick.results["skipped_stages"]
    assert {"critical_path", "stragglers"} <= set(quick.results["skipped_stages"])
    assert [n for n in quick.timings if n in dict(stages)] == [n for n, _ in stages if n in engine.HANG_MODE_STAGES]
    analyze(tmp_path, stages=stages)
    assert ran == ["critical_path"]
    with pytest.raises(ValueError, match="mode"):
        analyze(tmp_path, mode="fast")


def test_cli_quick(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from megatrace.cli import main

    b, g = pipeline4()
    b.collective(g["tp23"], at=10.0 * STEPS + 100, skip=(3,), stuck=(2,))
    b.write(tmp_path)
    out = tmp_path / "quick.json"
    res = CliRunner().invoke(main, ["analyze", str(tmp_path), "--quick", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "rank 3" in res.output.splitlines()[1] or "rank 3" in res.output
    doc = json.loads(out.read_text())
    assert doc["analysis"]["mode"]["name"] == "hang"
    assert doc["findings"][0]["kind"] == "compute-hang"


# ---------------------------------------------------------------------------
# Loading tails: the same facts and problems as the full load, and each rank's newest records.
# ---------------------------------------------------------------------------
def _bad_input(tmp_path: Path, case: str) -> Path:
    b, g = pipeline4(steps=60)
    b.collective(g["tp23"], at=700.0, skip=(3,), stuck=(2,))
    rings = tmp_path / "rings"
    if case == "healthy":
        b.write(tmp_path, closed=True, layout=Layout(world_size=4, tp=2, pp=2, dp=1, order="tp-pp-dp"))
    elif case == "missing-rank":
        b.write(tmp_path, skip_ranks=(2,))
    elif case == "other-job":
        b.write(tmp_path, job_ids={3: "job-2"})
    elif case == "duplicate-rank":
        b.write(tmp_path)
        shutil.copy(rings / "rank-00001.ring", rings / "rank-00007.ring")
    elif case == "renamed":
        b.write(tmp_path)
        (rings / "rank-00003.ring").rename(rings / "rank-00009.ring")
    elif case == "empty-ring":
        b.write(tmp_path, empty_ranks=(1,))
    elif case == "layout-misfit":
        b.write(tmp_path, layout=Layout(world_size=8, tp=2, pp=2, dp=2))
    elif case == "group-disagreement":
        b.write(tmp_path)
        meta = rings / "rank-00001.meta.jsonl"
        meta.write_text(meta.read_text().replace('"ranks":[0,1]', '"ranks":[0,1,2]'))
    elif case == "no-meta":
        b.write(tmp_path, no_meta=(0, 1, 2, 3))
    elif case == "torn-meta":
        b.write(tmp_path)
        meta = rings / "rank-00002.meta.jsonl"
        meta.write_bytes(meta.read_bytes() + b'{"kind": "gro')
    elif case == "bad-meta-line":
        b.write(tmp_path)
        meta = rings / "rank-00002.meta.jsonl"
        meta.write_bytes(b"not json\n" + meta.read_bytes())
    elif case == "damaged-record":
        b.write(tmp_path)
        path = rings / "rank-00000.ring"
        n = len(b.records[0])
        with open(path, "r+b") as fh:  # a record among the newest: inside every tail
            fh.seek(fmt.HEADER_SIZE + (n - 5) * fmt.RECORD_SIZE + 20)
            fh.write(b"\xff\xfe")
    elif case == "unreadable-ring":
        b.write(tmp_path)
        (rings / "rank-00002.ring").write_bytes(b"garbage" * 1000)
    elif case == "small-rings":
        b.capacity = 100  # wrapped, and smaller than the tail: read whole
        b.write(tmp_path)
    return tmp_path


BAD_INPUT = ["healthy", "missing-rank", "other-job", "duplicate-rank", "renamed", "empty-ring", "layout-misfit",
             "group-disagreement", "no-meta", "torn-meta", "bad-meta-line", "damaged-record", "unreadable-ring",
             "small-rings"]


@pytest.mark.parametrize("case", BAD_INPUT)
def test_tails_load_like_the_full_load(tmp_path: Path, case: str) -> None:
    directory = _bad_input(tmp_path, case)
    full, tails = load_trace(directory), load_trace(directory, tail=QUICK_TAIL)
    problems = [(p.severity, p.code, p.message, p.ranks, p.paths) for p in full.problems]
    assert [(p.severity, p.code, p.message, p.ranks, p.paths) for p in tails.problems] == problems
    assert (tails.job_id, tails.world_size, tails.missing_ranks, tails.layout, tails.facts) == \
        (full.job_id, full.world_size, full.missing_ranks, full.layout, full.facts)
    assert tails.ranks.tolist() == full.ranks.tolist() and tails.groups == full.groups
    assert tails.meta == full.meta
    for a, b in zip(full.rank_info, tails.rank_info, strict=True):
        assert dataclasses.replace(b, n_records=a.n_records, unread=0) == a
        window = min(QUICK_TAIL, a.n_records + a.lost)  # sequence numbers in the tail (the ring's, if smaller)
        assert b.n_records + b.lost == window and b.unread == a.n_records + a.lost - window
        rows_full, rows_tail = full.rows(a.rank), tails.rows(a.rank)
        seq_full = full.records.seq[rows_full]
        newest = seq_full > (seq_full[-1] - window if len(seq_full) else 0)
        for name in COLUMNS:
            want = getattr(full.records, name)[rows_full][newest]
            assert np.array_equal(getattr(tails.records, name)[rows_tail], want), (a.rank, name)
    same_stages = [(n, s) for n, s in engine.STAGES if n in engine.HANG_MODE_STAGES]
    assert _essence(analyze(directory, mode="hang")) == _essence(analyze(directory, stages=same_stages))


# ---------------------------------------------------------------------------
# A real demo run (gloo ranks): the hang is late enough that every rank's tail is partial.
# ---------------------------------------------------------------------------
@pytest.mark.slow
def test_quick_and_full_agree_on_a_demo_run(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    spec = "hang:rank=3,step=6,phase=backward"  # ~10 s; commhang and crash: the hand-built traces above
    from megatrace.demo.launcher import DemoOptions, run_local

    out = tmp_path / "demo"
    run_local(DemoOptions(tp=2, pp=2, dp=1, steps=8, microbatches=8, faults=(spec,), out=out, stall_s=2.0,
                          crash_grace_s=2.0), log=lambda msg: None)
    (fault,) = json.loads((out / "fault.json").read_text())["faults"]
    full, quick = assert_same_verdicts(out)
    top = quick.findings[0]
    assert top.severity == Severity.CRITICAL
    assert fault["rank"] == top.subject.rank or fault["rank"] in (top.subject.ranks or ()), top.verdict
