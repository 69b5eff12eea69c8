"""The performance half of the demo's fault matrix, on real gloo runs: healthy, slow ranks, a slow link.

Only these tests read ``fault.json`` (the ground truth); the analysis never does. Each run is a 4-rank
TP2 x PP2 job of 8 steps (about 10 s on two cores), one 8-rank TP2 x PP2 x DP2 run checks the DP path.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatrace.analyze import engine
from megatrace.analyze.critical_path import MIN_EXPLAINED, critical_path_stage
from megatrace.analyze.findings import Severity
from megatrace.analyze.stragglers import straggler_stage
from megatrace.trace.ring_format import Op

pytest.importorskip("torch")

from megatrace.demo.launcher import DemoOptions, run_local  # noqa: E402

PERF_STAGES = [("critical_path", critical_path_stage), ("stragglers", straggler_stage)]


def _analyze(out: Path) -> engine.AnalysisResult:
    names = {name for name, _ in engine.STAGES}
    extra = [s for s in PERF_STAGES if s[0] not in names]  # until the engine lists these stages itself
    return engine.analyze(out, stages=engine.STAGES[:-1] + extra + engine.STAGES[-1:])


def _demo(tmp_path: Path, name: str, fault: str | None, tp: int = 2, pp: int = 2, dp: int = 1,
          markers: bool = False, steps: int = 8) -> Path:
    out = tmp_path / name
    run_local(DemoOptions(tp=tp, pp=pp, dp=dp, steps=steps, faults=(fault,) if fault else (), out=out, markers=markers),
              log=lambda msg: None)
    return out


def _truth(out: Path) -> dict:
    faults = json.loads((out / "fault.json").read_text())["faults"]
    return faults[0] if faults else {}


@pytest.mark.slow
def test_a_healthy_run_gives_nothing_above_info_and_its_steps_match_the_markers(tmp_path: Path) -> None:
    out = _demo(tmp_path, "healthy", None, markers=True)
    result = _analyze(out)
    assert not result.at_least(Severity.WARNING), [f.verdict for f in result.at_least(Severity.WARNING)]
    it = result.results["iterations"]
    assert it.steps.tolist() == list(range(8))
    rec = result.trace.records
    for i in range(len(result.trace.ranks)):  # markers only cross-check what was inferred without them
        rows = np.arange(result.trace.starts[i], result.trace.starts[i + 1])
        marked = np.maximum.accumulate(np.where(rec.op[rows] == Op.MARK_STEP, rec.group_seq[rows], -1))
        calls = (rec.op[rows] < Op.MARK_STEP) & (it.record_step[rows] >= 0)
        assert (it.record_step[rows][calls] == marked[calls]).all()
    cp = result.results["critical_path"]
    # The machine's load may change during the run: any slowdown must then be spread over the job (info).
    assert cp.paths and (cp.slowdown is None or cp.slowdown.explained < MIN_EXPLAINED), cp.slowdown
    fit = np.median([p.length_ns / p.wall_ns for p in cp.steady])
    assert 0.85 < fit < 1.15  # the modelled step time is close to the measured one


@pytest.mark.slow
@pytest.mark.parametrize("factor", [1.2, 1.5, 2.0])
def test_a_slow_rank_is_named_by_the_top_finding(tmp_path: Path, factor: float) -> None:
    # 1.2x on two loaded cores is a 12-17% excess per step: it takes more steps than 8 to tell it from noise
    out = _demo(tmp_path, f"slow-{factor}", f"slow:rank=1,factor={factor}", steps=16 if factor < 1.5 else 8)
    rank = _truth(out)["rank"]
    result = _analyze(out)
    top = result.findings[0]
    why = f"{top.verdict}; {result.results['stragglers'].summary()['ranks']}"
    assert top.severity == Severity.WARNING and top.kind.value == "straggler", why
    assert top.subject.rank == rank, why
    assert [f.subject.rank for f in result.at_least(Severity.WARNING)] == [rank], why
    if factor >= 1.5:  # at 1.2 the rank's extra compute is real but need not dominate the critical path
        shares = result.results["critical_path"].median_share("rank")
        assert max(shares, key=shares.get) == rank, shares


@pytest.mark.slow
def test_a_slow_rank_with_data_parallel_replicas(tmp_path: Path) -> None:
    out = _demo(tmp_path, "slow-dp", "slow:rank=5,factor=1.5", dp=2)
    result = _analyze(out)
    top = result.findings[0]
    assert top.kind.value == "straggler" and top.subject.rank == _truth(out)["rank"], top.verdict
    assert result.results["iterations"].method == "dp-sync"


@pytest.mark.slow
def test_a_slow_link_is_named_as_the_pair_not_a_slow_rank(tmp_path: Path) -> None:
    out = _demo(tmp_path, "slowlink", "slowlink:ranks=0-2,delay_ms=40")
    a, b = sorted(_truth(out)["ranks"])
    result = _analyze(out)
    warnings = result.at_least(Severity.WARNING)
    assert [f.id for f in warnings] == [f"slow-link:{a}-{b}"], [f.verdict for f in warnings]
    assert result.findings[0].subject.link == (a, b)
    assert not result.results["stragglers"].stragglers
