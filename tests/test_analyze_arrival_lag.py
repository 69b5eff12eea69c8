"""Stragglers from arrival times alone (``analyze/arrival_lag.py``) on hand-built traces: the rank its TP and DP
peers wait for in one step is named with that step; the ranks that only wait for it, and jitter, are not."""

from __future__ import annotations

from pathlib import Path

from helpers.analysis_factory import TraceBuilder

from megatrace.analyze.arrival_lag import arrival_lag_stragglers
from megatrace.analyze.clock import align_clocks
from megatrace.analyze.index import index_records
from megatrace.analyze.iterations import infer_iterations
from megatrace.load import load_trace

STEPS, PERIOD = 8, 100.0  # ms


def _trace(tmp_path: Path, late: dict[tuple[int, int], float]) -> Path:
    """TP2 x DP2 (ranks 0-3), each step three TP all-reduces then a DP one; ``late``: (rank, step) -> ms that
    rank arrives late at every call of that step (its peers wait for it)."""
    b = TraceBuilder(world=4)
    tp = [b.group("tp", [0, 1]), b.group("tp", [2, 3])]
    dp = [b.group("dp", [0, 2]), b.group("dp", [1, 3])]
    for step in range(STEPS):
        t = 1.0 + step * PERIOD
        jitter = {r: 0.05 * ((r * 7 + step * 3) % 5) for r in range(4)}  # sub-ms noise, all ranks
        for k, g in enumerate(tp * 3):
            at = t + 10.0 * (k // 2)
            b.collective(g, at=at, enter={r: at + jitter[r] + late.get((r, step), 0.0) for r in g.ranks})
        for g in dp:
            at = t + 40.0
            b.collective(g, at=at, enter={r: at + jitter[r] + late.get((r, step), 0.0) for r in g.ranks})
    return b.write(tmp_path / "trace")


def _lags(path: Path, spans: dict | None = None) -> list:
    """The arrival-lag stragglers; ``spans`` receives step -> (start, end) in ms after the trace's first call."""
    trace = load_trace(path)
    ix = index_records(trace)
    clock = align_clocks(trace, ix, in_place=True)
    it = infer_iterations(trace, ix, clock.t_enqueue, clock.t_complete)
    assert it.n_steps >= STEPS - 1, it.summary()
    t0 = int(clock.t_enqueue.min())
    if spans is not None:
        spans.update({int(s): ((a - t0) / 1e6, (b - t0) / 1e6) for s, a, b in zip(it.steps, it.start_ns, it.end_ns)})
    return arrival_lag_stragglers(trace, ix, it, clock.t_enqueue)


def test_the_rank_late_in_one_step_is_named_with_that_step(tmp_path: Path) -> None:
    spans: dict = {}
    (found,) = _lags(_trace(tmp_path, {(2, 5): 55.0}), spans)
    assert found.rank == 2 and found.lags_ns.keys() == {"tp", "dp"}
    assert found.lag_ns >= 50e6 and found.lag_ns >= 10 * found.next_lag_ns
    start, end = spans[found.step]  # the step named holds the late calls (5 periods after the first call)
    assert start < 5 * PERIOD + 60.0 <= end + 1.0, (found.step, spans)


def test_jitter_and_a_rank_waiting_for_another_are_not_named(tmp_path: Path) -> None:
    assert _lags(_trace(tmp_path / "healthy", {})) == []
    # rank 3 late in TP only (its DP peer 1 is as late: the pair waits for someone upstream): not a straggler
    assert _lags(_trace(tmp_path / "one-kind", {(3, 5): 55.0, (1, 5): 55.0})) == []
