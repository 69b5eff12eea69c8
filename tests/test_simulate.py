"""The trace simulator: its traces are causally sound, read cleanly, and the analysis names every injected fault.

Only these tests read ``fault.json`` (the ground truth); the analysis never does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.cli import main
from megatrace.config import Layout
from megatrace.demo.faults import parse_fault
from megatrace.simulate import SimOptions, simulate_job, steps_for_records
from megatrace.simulate.program import StepCosts
from megatrace.simulate.replicas import simulate
from megatrace.simulate.rings import MONO0_NS, WALL0_NS
from megatrace.trace.ring_format import State
from megatrace.trace.ring_reader import read_ring

TP, PP, DP = 2, 3, 2  # order tp-dp-pp: stage s holds ranks 4s..4s+3; replica d the ranks with (r // 2) % 2 == d
STAGE_RANK = {"first": 1, "middle": 6, "last": 9}

CASES = {
    **{f"hang-{phase}-{stage}": (f"hang:rank={rank},step=3,phase={phase}", Kind.COMPUTE_HANG)
       for phase in ("forward", "backward", "optimizer") for stage, rank in STAGE_RANK.items()},
    "commhang": ("commhang:rank=5,step=3", Kind.COMM_HANG),
    "crash": ("crash:rank=10,step=3", Kind.CRASHED_PROCESS),
    **{f"slow-{factor}": (f"slow:rank=7,factor={factor}", Kind.STRAGGLER) for factor in (1.2, 1.5, 2.0)},
    "slowlink": ("slowlink:ranks=2-6,delay_ms=8", Kind.SLOW_LINK),  # links.MIN_LINK_EXCESS_NS: 5 ms
}


def _sim(tmp_path: Path, name: str, *faults: str, seed: int = 0, **kw) -> Path:
    out = tmp_path / name
    simulate_job(SimOptions(tp=TP, pp=PP, dp=DP, out=out, steps=10, faults=faults, seed=seed, **kw))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_top_finding_names_the_injected_fault(tmp_path: Path, case: str) -> None:
    spec, kind = CASES[case]
    out = _sim(tmp_path, case, spec)
    (truth,) = json.loads((out / "fault.json").read_text())["faults"]
    result = analyze(out)
    top = result.findings[0]
    assert top.kind == kind, top.verdict
    if kind == Kind.SLOW_LINK:
        assert top.subject.link == tuple(sorted(truth["ranks"])), top.verdict
    elif kind == Kind.COMM_HANG:
        assert truth["rank"] in top.subject.ranks and top.subject.group["desc"] == "tp", top.verdict
    else:
        assert top.subject.rank == truth["rank"], top.verdict
    worse = Severity.CRITICAL if kind in (Kind.COMPUTE_HANG, Kind.COMM_HANG, Kind.CRASHED_PROCESS) else Severity.WARNING
    assert top.severity == worse, top.verdict
    assert len(result.at_least(worse)) == 1, [f.verdict for f in result.at_least(Severity.WARNING)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_healthy_run_gives_nothing_above_info(tmp_path: Path, seed: int) -> None:
    result = analyze(_sim(tmp_path, f"healthy-{seed}", seed=seed, jitter=0.3))
    assert not result.at_least(Severity.WARNING), [f.verdict for f in result.at_least(Severity.WARNING)]


def test_a_slow_factor_is_measured_back(tmp_path: Path) -> None:
    result = analyze(_sim(tmp_path, "slow", "slow:rank=7,factor=1.3,from_step=2"))
    stats = result.results["stragglers"].ranks[7]
    assert stats.interval_ratio == pytest.approx(1.3, abs=0.06)


def test_simulated_calls_are_causally_sound() -> None:
    """Every completion comes after its last member's arrival; a rank's calls never overlap its compute."""
    layout = Layout(world_size=TP * PP * DP, tp=TP, pp=PP, dp=DP, microbatches=4, layers_per_stage=2).validate()
    costs = StepCosts()
    classes = simulate(layout, 4, [parse_fault("slow:rank=7,factor=2"), parse_fault("slowlink:ranks=0-4,delay_ms=2")],
                       costs, 2)
    assert [len(r) for r in classes.replicas] == [1, 1]  # replica 0 holds the slow link, replica 1 the slow rank
    arrivals: dict[tuple, list[float]] = {}
    for traces in classes.traces:
        for tr in traces:
            assert tr.key and not tr.stopped
            for key, t in zip(tr.key, tr.t_enq):
                arrivals.setdefault(key, []).append(t)
            ends = np.maximum.accumulate([classes.done[k] for k in tr.key])
            starts = np.array(tr.t_enq[1:])
            blocked_until = ends[:-1]
            same_block = np.diff(tr.t_enq) < 0.0015
            assert (starts[~same_block] >= blocked_until[~same_block] - 1e-9).all()
    for key, times in arrivals.items():
        members = {"tp": TP, "dp": len(classes.replicas)}.get(key[0], 2)
        assert len(times) == members, key
        assert classes.done[key] >= max(times)
    link = [k for k in arrivals if k[0] == "p2p" and k[1] == 0 and {k[2], k[3]} == {0, 2}]
    assert link and all(classes.done[k] - max(arrivals[k]) == pytest.approx(costs.p2p_ms + 2) for k in link)


def test_rings_read_cleanly_and_collectives_undo_the_injected_clock_errors(tmp_path: Path) -> None:
    out = _sim(tmp_path, "clocks", skew_ms=3.0, gpus_per_node=1, seed=7)  # a host per rank
    skews = {}
    for path in sorted((out / "rings").glob("rank-*.ring")):
        snap = read_ring(path)
        assert not snap.problems and len(snap.records)
        assert (snap.records["state"] == State.COMPLETED).all()
        assert (np.diff(snap.records["t_enqueue"].astype(np.int64)) >= 0).all()
        skews[snap.header.rank] = snap.header.anchor_wall_ns - WALL0_NS
    clock = analyze(out).clock
    err = {int(h[4:]): off - (WALL0_NS - MONO0_NS) for h, off in clock.host_offset_ns.items()}
    # Collectives tie the hosts of one pipeline stage together (TP and DP groups); only point-to-point
    # calls cross stages, and the clock alignment uses collectives alone.
    for stage in range(PP):
        hosts = range(4 * stage, 4 * stage + 4)
        assert max(skews[h] for h in hosts) - min(skews[h] for h in hosts) > 300_000  # the hosts disagree ...
        assert max(err[h] for h in hosts) - min(err[h] for h in hosts) < 100_000, err  # ... and are aligned


def test_steps_for_records_gives_about_that_many_records(tmp_path: Path) -> None:
    layout = Layout(world_size=64, tp=4, pp=4, dp=4, microbatches=4, layers_per_stage=2).validate()
    steps = steps_for_records(layout, 600, 4, 2)
    result = simulate_job(SimOptions(tp=4, pp=4, dp=4, out=tmp_path / "n", steps=steps))
    busiest = max(len(read_ring(p).records) for p in (tmp_path / "n" / "rings").glob("rank-*.ring"))
    assert 500 <= busiest <= 640 and result.records > 64 * 300


def test_cli_writes_a_trace_and_rejects_bad_input(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(main, ["simulate", "--ranks", "16", "--tp", "2", "--pp", "2", "--records", "100",
                              "--fault", "hang:rank=3,step=1", "-o", str(tmp_path / "t")])
    assert ok.exit_code == 0, ok.output
    assert "16 ranks (TP2 x PP2 x DP4)" in ok.output
    assert len(list((tmp_path / "t" / "rings").glob("rank-*.ring"))) == 16
    bad = runner.invoke(main, ["simulate", "--ranks", "16", "--tp", "2", "--pp", "2", "--fault", "hang:rank=99,step=1",
                               "-o", str(tmp_path / "b")])
    assert bad.exit_code == 1 and "Error: --fault hang:rank=99,step=1: rank 99 is outside" in bad.output
    assert "Traceback" not in bad.output
    uneven = runner.invoke(main, ["simulate", "--ranks", "10", "--tp", "4", "--pp", "1", "-o", str(tmp_path / "u")])
    assert uneven.exit_code == 2 and "not divisible" in uneven.output
