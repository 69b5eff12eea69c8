"""The demo's torch-API engines (ddp, fsdp, tp, pipeline) end to end, on real gloo ranks.

For each engine a healthy run is checked three ways: it trains (the loss falls) and writes what
the 3D demo writes; its rings hold every collective and point-to-point call the program made,
counted by torch itself (Flight Recorder and profiler, :mod:`helpers.comm_counts`); and its analysis
names no hang and no straggler. Each fault kind an engine supports is then injected once and its
signature looked for in the rings. Runs use 2 ranks (4 for tp, a 2 x 2 mesh) and few steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from megatrace.cli import main
from megatrace.config import load_layout
from megatrace.demo.engines import ENGINES
from megatrace.trace.ring_format import Op, State

torch = pytest.importorskip("torch")

from helpers.comm_counts import reference_counts, reference_disagreement, reference_env, ring_counts  # noqa: E402
from megatrace.demo.launcher import DemoOptions, DemoResult, run_local  # noqa: E402
from megatrace.trace.ring_reader import read_ring  # noqa: E402

ENTERED, COMPLETED = int(State.ENQUEUED), int(State.COMPLETED)
HEALTHY_STEPS = 8
SIZES = {"ddp": dict(dp=2), "fsdp": dict(dp=2), "tp": dict(tp=2, dp=2), "pipeline": dict(pp=2)}
FAULT_SIZES = {**SIZES, "tp": dict(tp=2, dp=1)}  # fault runs: 2 ranks each
COMMHANG_STEP = {"fsdp": 1}  # the step a commhang fault stops in (default 2; see the test)
# Healthy runs: each engine, and two pipelines of two stages (pipelining on a DeviceMesh's pp groups, DP
# all-reduces on its dp groups).
HEALTHY_SIZES = {**SIZES, "pipeline-dp": dict(pp=2, dp=2)}
ENGINE_OF = {"pipeline-dp": "pipeline"}
# What the layout must say each engine is: (world, tp, pp, dp).
LAYOUTS = {"ddp": (2, 1, 1, 2), "fsdp": (2, 1, 1, 2), "tp": (4, 2, 1, 2), "pipeline": (2, 1, 2, 1),
           "pipeline-dp": (4, 1, 2, 2)}
# The calls that make each engine what it is (beyond the counts, which torch's references check).
SIGNATURE_OPS = {"ddp": {"all_reduce", "reduce", "broadcast"}, "fsdp": {"all_gather", "reduce_scatter"},
                 "tp": {"all_reduce", "scatter", "broadcast"}, "pipeline": {"send", "recv"},
                 "pipeline-dp": {"send", "recv", "all_reduce"}}


def demo(out: Path, case: str, sizes: dict | None = None, **kwargs: object) -> DemoResult:
    """Run the demo's engine of ``case`` (an engine, or a named layout of one: HEALTHY_SIZES)."""
    opts: dict = dict(steps=4, stall_s=3.0, deadline_s=120.0, crash_grace_s=3.0, **(sizes or HEALTHY_SIZES[case]))
    opts.update(kwargs)
    return run_local(DemoOptions(engine=ENGINE_OF.get(case, case), out=out, **opts), log=print)


def fault_run(out: Path, engine: str, fault: str) -> DemoResult:
    """A 4-step, 2-rank run of ``engine`` with one fault; a hang is declared after 10 s without progress
    (DTensor's and FSDP's first step alone can take seconds on a loaded 2-core machine: at 6 s a full
    suite's run once declared FSDP stalled before the fault's step, inside a slow all_gather)."""
    stall_s = 10.0 if fault.split(":")[0] in ("hang", "commhang") else 60.0
    return demo(out, engine, FAULT_SIZES[engine], faults=(fault,), stall_s=stall_s)


def records(out: Path) -> dict[int, np.ndarray]:
    """Per rank, its communication records (no markers), sorted by seq."""
    result = {}
    for path in sorted((out / "rings").glob("rank-*.ring")):
        snap = read_ring(path)
        result[snap.header.rank] = snap.records[snap.records["op"] < int(Op.MARK_STEP)]
    return result


def closed_cleanly(out: Path, rank: int) -> bool:
    return read_ring(out / "rings" / f"rank-{rank:05d}.ring").header.closed_cleanly


def log_of(out: Path, rank: int) -> str:
    return (out / "logs" / f"rank-{rank:05d}.log").read_text()


def last_beats(out: Path) -> dict[str, str]:
    """Each rank's last heartbeat (its phase when the run ended): a failure's diagnosis."""
    return {p.stem: p.read_text().strip() for p in sorted((out / "logs").glob("rank-*.heartbeat"))}


# -- healthy runs --------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=list(HEALTHY_SIZES))
def healthy(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, DemoResult]:
    engine = request.param
    root = tmp_path_factory.mktemp(f"healthy-{engine}")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in reference_env(root / "reference").items():
            mp.setenv(key, value)
        return engine, demo(root / "run", engine, steps=HEALTHY_STEPS, stall_s=10.0)


@pytest.mark.slow
def test_healthy_run_trains_and_writes_what_the_3d_demo_writes(healthy: tuple[str, DemoResult]) -> None:
    engine, result = healthy
    assert result.ok, result.message
    out = result.out
    layout = load_layout(out / "layout.yaml")
    assert (layout.world_size, layout.tp, layout.pp, layout.dp) == LAYOUTS[engine]
    assert set(layout.ranks) == set(range(layout.world_size))
    assert json.loads((out / "fault.json").read_text()) == {"faults": []}
    assert json.loads((out / "procs.json").read_text())["outcome"] == "ok"
    for rank in range(layout.world_size):
        lines = [json.loads(line) for line in (out / "metrics" / f"rank-{rank:05d}.jsonl").read_text().splitlines()]
        assert [m["step"] for m in lines] == list(range(HEALTHY_STEPS))
        assert all(m["compute_s"] > 0 for m in lines)
        assert (out / "logs" / f"rank-{rank:05d}.heartbeat").read_text() == "done\n"
    losses = result.losses
    assert len(losses) == HEALTHY_STEPS
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.slow
def test_rings_hold_every_call_torch_counted(healthy: tuple[str, DemoResult]) -> None:
    engine, result = healthy
    ring_dir, ref_dir = result.out / "rings", result.out.parent / "reference"
    ours, theirs = ring_counts(ring_dir), reference_counts(ref_dir)
    world = LAYOUTS[engine][0]
    assert sorted(ours) == sorted(theirs) == list(range(world))
    assert not reference_disagreement(ref_dir), "the Flight Recorder and the profiler disagree"
    for rank in range(world):
        assert ours[rank].collectives == theirs[rank].collectives, f"rank {rank}: collectives per (group, op)"
        assert ours[rank].p2p == theirs[rank].p2p, f"rank {rank}: point-to-point calls"
        recs = records(result.out)[rank]
        assert (recs["state"] == COMPLETED).all() and closed_cleanly(result.out, rank)
        assert SIGNATURE_OPS[engine] <= {Op(int(op)).label for op in recs["op"]}


@pytest.mark.slow
def test_healthy_analysis_names_no_hang_and_no_straggler(healthy: tuple[str, DemoResult], tmp_path: Path) -> None:
    _, result = healthy
    findings = _analyse(result.out)
    kinds = {f["kind"] for f in findings}
    assert not {k for k in kinds if "hang" in k or "stall" in k}, kinds
    slow = _stragglers(findings)
    if slow:
        # On a shared 2-core host a healthy rank can be kept off the CPU for a whole run (CI saw one compute
        # 16% slower in 7 of 7 steps): the trace shows it slower, rightly. A false positive of the analysis
        # would name it again on the same engine's next healthy run; the host's scheduler picks anew.
        engine = healthy[0]
        with pytest.MonkeyPatch.context() as mp:
            for key, value in reference_env(tmp_path / "reference").items():
                mp.setenv(key, value)
            again = demo(tmp_path / "again", engine, steps=HEALTHY_STEPS, stall_s=10.0)
        assert again.ok, again.message
        assert not slow & _stragglers(_analyse(again.out)), (slow, kinds)


def _analyse(out: Path) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "megatrace.cli", "analyze", str(out), "--no-report"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "findings.json").read_text())["findings"]


def _stragglers(findings: list[dict]) -> set[int]:
    """The ranks the straggler findings name."""
    out: set[int] = set()
    for f in findings:
        if "straggler" in f["kind"]:
            subject = f.get("subject") or {}
            out.update([subject["rank"]] if subject.get("rank") is not None else subject.get("ranks") or [-1])
    return out


# -- faults ---------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("engine", list(SIZES))
def test_hang_stops_the_rank_before_its_next_call(tmp_path: Path, engine: str) -> None:
    result = fault_run(tmp_path, engine, "hang:rank=1,step=2,phase=backward")
    assert result.outcome == "stalled", result.message
    r = records(tmp_path)
    assert len(r[1]) and not (r[1]["state"] == ENTERED).any(), "the hung rank stopped outside any call"
    assert (r[0]["state"] == ENTERED).any(), "its peer waits for it inside a call"
    assert "injected hang on rank 1 at step 2 (backward)" in log_of(tmp_path, 1)


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(SIZES))
def test_commhang_leaves_the_rank_inside_its_call(tmp_path: Path, engine: str) -> None:
    # FSDP's fault comes at step 1: twice on CI (2 cores, loaded) an FSDP run with the commhang kernels in place
    # on rank 1 stalled in step 1's backward, both ranks inside one collective and no call for 10 s, before a
    # fault at step 2 could fire (cause not found yet: no healthy FSDP run, without those kernels, ever stalled)
    step = COMMHANG_STEP.get(engine, 2)
    result = fault_run(tmp_path, engine, f"commhang:rank=1,step={step}")
    assert result.outcome == "stalled", result.message
    assert f"injected commhang on rank 1 at step {step}" in log_of(tmp_path, 1), (result.message, last_beats(tmp_path))
    r = records(tmp_path)
    stuck = {rank: recs[recs["state"] == ENTERED] for rank, recs in r.items()}
    assert len(stuck[1]) and len(stuck[0]), "both ranks are inside a call"
    if engine != "pipeline":  # a collective: the same instance is entered on both ranks
        first = stuck[1][0]
        assert ((stuck[0]["group_id"] == first["group_id"]) & (stuck[0]["group_seq"] == first["group_seq"])).any()


@pytest.mark.slow
def test_a_slow_phase_whose_calls_go_through_is_no_stall(tmp_path: Path) -> None:
    """The launcher takes a started call for progress, not only a heartbeat: FSDP's backward here runs 6 s
    between two heartbeats under a 2 s stall timeout, with an all_gather or reduce_scatter every second."""
    result = demo(tmp_path, "fsdp", steps=1, layers_per_stage=6, compute_ms=3000.0, stall_s=2.0)
    assert result.ok, (result.message, last_beats(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(SIZES))
def test_crash_exits_the_rank_without_closing_its_ring(tmp_path: Path, engine: str) -> None:
    result = fault_run(tmp_path, engine, "crash:rank=1,step=2")
    assert result.outcome == "failed", result.message
    procs = json.loads((tmp_path / "procs.json").read_text())["ranks"]
    assert procs["1"]["exit_code"] == 1 and not procs["1"]["killed_by_launcher"]
    r = records(tmp_path)
    assert not closed_cleanly(tmp_path, 1) and not (r[1]["state"] == ENTERED).any()
    assert "injected crash on rank 1 at step 2" in log_of(tmp_path, 1)


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(SIZES))
def test_slow_rank_computes_longer(tmp_path: Path, engine: str) -> None:
    result = fault_run(tmp_path, engine, "slow:rank=1,factor=3,from_step=1")
    assert result.ok, result.message
    compute = {rank: [json.loads(line)["compute_s"] for line in
                      (tmp_path / "metrics" / f"rank-{rank:05d}.jsonl").read_text().splitlines()]
               for rank in (0, 1)}
    assert np.mean(compute[1][1:]) > 2 * np.mean(compute[0][1:]), compute
    assert compute[1][0] < 1.5 * compute[0][0], compute  # not before from_step


@pytest.mark.slow
def test_slowlink_delays_the_pipeline_receives(tmp_path: Path) -> None:
    delay_ms = 40.0
    result = fault_run(tmp_path, "pipeline", f"slowlink:ranks=0-1,delay_ms={delay_ms:g}")
    assert result.ok, result.message
    for rank, recs in records(tmp_path).items():
        recv = recs[(recs["op"] == int(Op.RECV)) & (recs["state"] == COMPLETED)]
        waited_ms = np.median((recv["t_complete"] - recv["t_enqueue"]) / 1e6)
        assert waited_ms > delay_ms, (rank, waited_ms)


# -- options --------------------------------------------------------------------------------------------

def test_help_teaches_every_engine() -> None:
    res = CliRunner().invoke(main, ["demo", "--help"])
    assert res.exit_code == 0
    for engine in ENGINES.values():
        assert f"  {engine.name:<9} {engine.summary}" in res.output
    assert "--engine [3d|ddp|fsdp|tp|pipeline]" in res.output


def test_worker_rejects_a_bad_engine_layout_in_one_line(tmp_path: Path) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "3", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "megatrace.demo", "--engine", "tp", "-o", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("megatrace demo: error: 3 ranks (--ranks) are not divisible by "
                                   "tp*pp = 2*1 = 2")
