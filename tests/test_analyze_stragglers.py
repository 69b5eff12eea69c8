"""Stragglers (compute against peers, arrival lag in time) and slow links (the delay matrix) on hand-built traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.analysis_factory import TraceBuilder
from helpers.pipeline_sim import PipelineSim

from megatrace.analyze.critical_path import critical_path_stage
from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Severity
from megatrace.analyze.links import MIN_LINK_EXCESS_NS, PairStats, classify_delays
from megatrace.analyze.stragglers import straggler_stage

MS = 1_000_000
STAGES = [("critical_path", critical_path_stage), ("stragglers", straggler_stage)]


def _run(tmp_path: Path, sim: PipelineSim):
    sim.run()
    return analyze(sim.write(tmp_path), stages=STAGES)


def _warnings(res) -> list[str]:
    return [f.verdict for f in res.at_least(Severity.WARNING)]


# -- arrival lag ---------------------------------------------------------------------------------------------------

def test_arrival_lag_is_charged_in_time_to_the_last_arrival(tmp_path: Path) -> None:
    """A DP group of 4; rank 3 computes 8 ms longer before each collective from step 1 on, rank 1 once 2 ms."""
    b = TraceBuilder(world=4)
    dp = b.group("dp", [0, 1, 2, 3])
    t = 0.0
    for step in range(6):
        late = {3: t + 10.0 + (8.0 if step >= 1 else 0.0)}
        if step == 2:
            late[1] = t + 12.0
        b.collective(dp, at=t + 10.0, dur=1.0, enter=late)
        t = max(late.values()) + 1.0  # every member completes together
    res = analyze(b.write(tmp_path), stages=STAGES)
    it = res.results["iterations"]
    assert it.method == "dp-sync" and it.steps.tolist() == list(range(6))
    s = res.results["stragglers"].ranks
    # Steps 1-5 are the steady steps; in each rank 3 arrives 8 ms after the median arrival.
    assert s[3].last_arrivals == 5
    assert s[3].lag_caused_ns == pytest.approx(5 * 8 * MS, abs=1000)
    assert s[3].lag_own_ns == pytest.approx(5 * 8 * MS, abs=1000)  # all of it its own compute
    assert s[1].lag_caused_ns == 0  # never last: rank 3 was later still
    assert s[3].excess_ns == pytest.approx(8 * MS, abs=1000)
    assert s[3].steps_slower == 5 and s[3].straggler
    assert res.results["stragglers"].stragglers == [3]
    (f,) = [f for f in res.findings if f.id == "straggler:rank-3"]
    assert f.severity == Severity.WARNING and f.subject.rank == 3
    assert "keeping the other members waiting 40.0 ms" in " ".join(map(str, f.evidence))


def test_a_rank_late_because_its_previous_call_was_slow_owns_none_of_the_lag(tmp_path: Path) -> None:
    """Rank 1's p2p receive completes late (slow link); it then arrives last at the TP collective."""
    b = TraceBuilder(world=3)
    tp = b.group("tp", [0, 1])
    pp = b.group("pp", [1, 2])
    dp = b.group("dp", [0, 1, 2])  # a step-ending sync, so that steps are found
    t = 0.0
    for _ in range(5):
        b.p2p(2, 1, pp, at=t, dur=6.0)  # both enter at t, the transfer takes 6 ms
        b.collective(tp, at=t + 1.0, dur=1.0, enter={1: t + 7.0})  # rank 1 computes 1 ms after its receive
        b.collective(dp, at=t + 10.0, dur=1.0)
        t += 20.0
    res = analyze(b.write(tmp_path), stages=STAGES)
    s = res.results["stragglers"].ranks
    assert s[1].last_arrivals == 4  # the TP collective of every steady step
    assert s[1].lag_caused_ns == pytest.approx(4 * 6 * MS, abs=1000)
    assert s[1].lag_own_ns == 0


# -- stragglers against peers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("factor", [1.5, 2.0])
def test_a_slow_rank_is_the_straggler_and_nobody_else(tmp_path: Path, factor: float) -> None:
    res = _run(tmp_path, PipelineSim(tp=2, pp=2, dp=2, slow={5: factor}, steps=6, jitter=0.05, seed=1))
    st = res.results["stragglers"]
    assert st.stragglers == [5]
    assert st.ranks[5].relative == pytest.approx(factor - 1.0, abs=0.1)
    assert st.ranks[5].confidence > 0.8
    assert st.impact_ns[5] > 0
    assert not st.slow_links and not st.slow_ranks
    top = res.findings[0]
    assert top.id == "straggler:rank-5" and top.subject.rank == 5


def test_healthy_jittery_runs_have_no_straggler_and_no_slow_link(tmp_path: Path) -> None:
    for seed in range(3):
        res = _run(tmp_path / str(seed), PipelineSim(tp=2, pp=2, dp=2, steps=8, jitter=0.2, seed=seed))
        assert not _warnings(res), _warnings(res)
        assert not res.results["stragglers"].stragglers


def test_too_few_steps_give_no_verdict(tmp_path: Path) -> None:
    res = _run(tmp_path, PipelineSim(tp=2, pp=2, dp=2, slow={5: 2.0}, steps=2))
    assert not res.results["stragglers"].stragglers


# -- the delay matrix -----------------------------------------------------------------------------------------------

def test_a_slow_link_is_one_cell_of_the_delay_matrix(tmp_path: Path) -> None:
    res = _run(tmp_path, PipelineSim(tp=2, pp=2, dp=2, link_ms={(1, 5): 10.0}, steps=5))
    st = res.results["stragglers"]
    d = st.delay
    assert d.shape == (8, 8)
    assert d[1, 5] == d[5, 1] == pytest.approx(10 * MS, abs=0.05 * MS)
    others = d.copy()
    others[1, 5] = others[5, 1] = np.nan
    assert np.nanmax(others) < 0.1 * MS
    assert st.slow_ranks == []
    assert [(p.a, p.b) for p in st.slow_links] in ([(1, 5)], [(5, 1)])
    assert not st.stragglers
    links = [f for f in res.findings if f.id.startswith("slow-link")]
    assert [f.id for f in links] == ["slow-link:1-5"]
    assert links[0].subject.link == (1, 5) and "node0" in links[0].verdict


def test_a_slow_rank_network_is_a_row_and_a_column(tmp_path: Path) -> None:
    res = _run(tmp_path, PipelineSim(tp=2, pp=2, dp=2, rank_net_ms={5: 10.0}, steps=5))
    st = res.results["stragglers"]
    d = st.delay
    slow = d >= MIN_LINK_EXCESS_NS
    assert set(zip(*np.nonzero(slow))) == {(5, 1), (1, 5), (5, 4), (4, 5), (5, 7), (7, 5)}  # row 5, column 5
    assert st.slow_ranks == [5]
    assert st.slow_links == []
    assert [f.id for f in res.at_least(Severity.WARNING)] == ["slow-rank-network:rank-5"]


def test_classify_separates_a_slow_rank_from_a_lone_slow_link() -> None:
    def pair(a: int, b: int, ms: float) -> PairStats:
        return PairStats(a, b, "pp p2p", 10, int(ms * MS), int(0.5 * MS), slow=ms > 5)

    pairs = [pair(0, 1, 20), pair(0, 2, 20), pair(0, 3, 20), pair(1, 2, 0.5), pair(2, 3, 0.5), pair(1, 3, 0.5),
             pair(4, 5, 30), pair(4, 6, 0.5), pair(5, 7, 0.5)]
    ranks, links = classify_delays(pairs)
    assert ranks == [0]
    assert [(p.a, p.b) for p in links] == [(4, 5)]


def test_a_pipeline_wait_is_judged_against_the_same_stages_in_the_other_replicas() -> None:
    """Stage 1 waits on stage 0 by the pipeline's shape in every replica; only replica 1's extra wait counts."""
    from megatrace.analyze.stragglers import PipelineWaits
    from megatrace.config import Layout

    layout = Layout(world_size=6, tp=1, pp=2, dp=3)  # tp-dp-pp: ranks 0-2 stage 0, 3-5 stage 1; replica d: d, d+3
    shape = {(3, 0): 4 * MS, (0, 3): 1 * MS, (5, 2): 4 * MS, (2, 5): 1 * MS}
    waits = PipelineWaits(layout, {**shape, (4, 1): 9 * MS, (1, 4): 1 * MS})
    assert waits.excess(4, 1) == 5 * MS and waits.excess(1, 4) == 0
    assert waits.waits_on(4, 1) and not waits.waits_on(1, 4)
    assert not waits.waits_on(3, 0)  # the shape alone is no one's lateness
    both = PipelineWaits(layout, {**shape, (4, 1): 9 * MS, (1, 4): 4 * MS})  # 5 ms against 3 ms: no one dominates
    assert not both.waits_on(4, 1) and not both.waits_on(1, 4)
