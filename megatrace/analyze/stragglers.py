"""Stragglers and slow links: who keeps the others waiting, by how much time, and how sure we are.

*Stragglers.* Ranks doing the same work (same pipeline stage; the same TP
position too when there are enough such ranks) should spend the same compute
time per step (the time outside communication calls). Each rank's excess over
the median of its peers is taken per step; the median over the steady steps is
the effect, its MAD and the share of steps with a positive excess give the
confidence. A finer test catches smaller slowdowns (1.2x): the same calls of
ranks doing the same work are paired, and every compute interval (the time
before a call) is compared with the peers' median for that interval; a rank
slower in most of many intervals by a steady ratio is slow, whatever the
per-step noise. Blame is in time: for every collective instance, the arrival lag
(last enqueue − median enqueue, aligned clocks) is charged to the last
arrival, split into the part its own compute explains (its compute gap before
the call beyond its peers') and the rest (it came late from an earlier, slow
call).

The comparisons and their statistics are in :mod:`megatrace.analyze.straggler_stats`; slow links
and the delay matrix in :mod:`megatrace.analyze.links`. This module judges the ranks, runs both and
returns their findings.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from megatrace.analyze.context import AnalysisContext
from megatrace.analyze.critical_path import what_if
from megatrace.analyze.findings import Finding, Kind, Severity
from megatrace.analyze.index import RecordIndex, chunks, rows_by_key
from megatrace.analyze.iterations import Iterations, compute_gaps, iterations_of, perf_kind
from megatrace.analyze.links import PairStats, analyze_links, delay_matrix, link_finding, slow_rank_finding
from megatrace.analyze.match import Collectives
from megatrace.analyze.straggler_stats import (MAX_INTERVAL_P, MIN_CONSISTENCY, MIN_EXCESS_NS, MIN_EXCESS_REL,
                                               MIN_INTERVALS, MIN_STEP_SHARE, MIN_STEPS, SAME_SPEED_RATIO,
                                               RankStats, compare_calls, compare_intervals, compare_peers,
                                               interval_p, sign_tail, slow_by_intervals, straggler_confidence)
from megatrace.analyze.words import duration, rank_label, rank_subject
from megatrace.load.traceset import TraceSet, rank_list
from megatrace.trace.ring_format import Op, State

MAX_LISTED = 8  # ranks or links named one by one in a finding
MEMBER_CHUNK = 1 << 18  # instance members sorted at a time by the last-arrival pass (its temporaries: ~10 MiB)
# Bursts: a rank stopped now and then (throttled, descheduled, a periodic pause) computes as fast as its peers most
# of the time, so medians do not move; but it is the last arrival by far, often, and almost alone. A straggler in
# bursts arrived last by more than ...
LONG_LAG_STEP = 0.25  # ... a quarter of the median step (healthy demo and DDP ranks on 2 loaded cores: a handful
#                       of such lags per hundred steps, spread over the ranks; 50 ms stops of every 100 ms: hundreds)
MIN_LONG_LAGS = 10  # ... at least this many times,
BURST_SHARE = 0.75  # ... holds at least this share of such waiting among the ranks doing the same work,
MIN_BURST_RUN_SHARE = 0.05  # ... and it cost its peers at least 5% of the steady steps' time
WHOLE_TRACE_LONG_LAG = 10.0  # without steps, a lag is long at 10x the median lag of the last arrivals (and >= 5 ms)
# A rank arriving late at its collectives at its peers' speed waits on the next stage of its pipeline replica
# when it waited at their exchanges (beyond the same stages' wait in the other replicas) this many times as long
# as the other waited on it (a rank stopped from outside arrives late at both directions of its exchanges)
WAIT_DOMINANCE = 2.0


@dataclass
class StragglerResult:
    """Plain data for the report: per-rank statistics, the delay matrix and what was flagged."""

    steps: list[int]  # the steady steps used
    step_ns: int  # their median step time
    ranks: dict[int, RankStats]
    pairs: list[PairStats]
    delay: np.ndarray | None  # [world, world] excess transfer time (ns), NaN where unmeasured; None when large
    stragglers: list[int] = field(default_factory=list)  # flagged, worst first
    slow_ranks: list[int] = field(default_factory=list)  # ranks whose every pair is slow (row + column)
    slow_links: list[PairStats] = field(default_factory=list)  # cells not explained by a slow rank
    impact_ns: dict[int, int] = field(default_factory=dict)  # straggler -> step time it costs (critical path)
    explained: dict[int, int] = field(default_factory=dict)  # slower rank -> the straggler it waits on (no p2p)
    notes: list[str] = field(default_factory=list)
    long_lag_ns: int = 0  # a last arrival this far behind the median one is a long lag (bursts)

    def summary(self) -> dict[str, Any]:
        return {"steps": self.steps[:1] + self.steps[-1:], "step_ns": self.step_ns,
                "stragglers": self.stragglers, "slow_ranks": self.slow_ranks,
                "slow_links": [sorted((p.a, p.b)) for p in self.slow_links],
                "ranks": {r: {"excess_ns": s.excess_ns, "relative": round(s.relative, 3),
                              "consistency": round(s.consistency, 2), "lag_caused_ns": s.lag_caused_ns,
                              "interval_ratio": round(s.interval_ratio, 3), "intervals": s.intervals,
                              "intervals_slower": s.intervals_slower,
                              "confidence": round(s.confidence, 3)} for r, s in sorted(self.ranks.items())},
                "notes": self.notes}


# -- stragglers ------------------------------------------------------------------------------------------------


def _explain_neighbours(trace: TraceSet, stats: dict[int, RankStats], flagged: list[int],
                        notes: list[str]) -> tuple[list[int], dict[int, int]]:
    """Unflag ranks that a stronger straggler of their own pipeline explains; returns (flagged, rank -> straggler).

    Only for traces that do not show how long receives waited (no point-to-point records, or an arrival-only
    import): there a rank's wait in a pipeline receive counts as compute, so the other stages of a slow rank's
    pipeline replica look slow too (its neighbours, and through their TP peers the ranks beside those), by a
    smaller ratio call by call. A rank is explained
    when a flagged rank of the same replica (same DP coordinate, another stage) exceeds its peers call
    by call by more: in each replica the strongest flagged rank stays.
    """
    layout = trace.layout
    if layout is None or layout.pp < 2 or len(flagged) < 2 or _waits_seen(trace):
        return flagged, {}
    explained = {}
    for r in flagged:
        c = layout.coords(r)
        for q in flagged:
            cq = layout.coords(q)
            if (q != r and cq.dp == c.dp and cq.pp != c.pp and stats[r].intervals
                    and stats[q].intervals and stats[q].interval_ratio > stats[r].interval_ratio):
                explained[r] = q
                stats[r].straggler = False
                notes.append(f"rank {r} is slower than its peers, presumably waiting in receives from rank {q}")
                break
    return [r for r in flagged if r not in explained], explained


def _explain_late_downstream(trace: TraceSet, stats: dict[int, RankStats], flagged: list[int], by_compute: list[int],
                             explained: dict[int, int], notes: list[str],
                             waits: Callable[[], PipelineWaits]) -> list[int]:
    """Unflag ranks that arrive late only because a slow stage of their pipeline replica feeds them.

    A rank flagged for arriving last in bursts while it computes at its peers' speed, in the pipeline
    replica (same DP coordinate, another stage) of a flagged rank, waits on that rank when the other rank
    computes slower than its peers or, next stage to it, is the one its point-to-point exchanges wait for
    (a rank stopped from outside is often stopped inside a receive, so its slowness shows as lateness at
    its exchanges rather than as compute): its receives finish late, so its data-parallel collectives start
    late. The lateness is the straggler's, passed along the pipeline (``explained`` gains rank -> straggler)."""
    layout = trace.layout
    if layout is None or layout.pp < 2:
        return flagged

    def slower_itself(q: int) -> bool:
        return q in by_compute or (stats[q].excess_ns > 0 and stats[q].relative >= MIN_EXCESS_REL)

    for r in flagged:
        if not stats[r].bursty or slower_itself(r):
            continue
        c = layout.coords(r)
        replica = [q for q in flagged if q not in explained and q != r and layout.coords(q).dp == c.dp
                   and layout.coords(q).pp != c.pp]
        q = next((q for q in replica if slower_itself(q)), None)
        if q is None:
            q = next((q for q in replica if waits().waits_on(r, q)), None)
        if q is not None:
            explained[r] = q
            stats[r].straggler = False
            notes.append(f"rank {r} arrives late at its collectives at its peers' speed: it waits on rank {q} "
                         "of its pipeline replica")
    return [r for r in flagged if r not in explained]


@dataclass
class PipelineWaits:
    """How long each rank waited at its point-to-point exchanges for each peer (ns, over the steady steps).

    A pair's earlier arrival waits for the later one, sender or receiver alike; a pipeline's shape makes
    some stages wait on others by design, so a pair's wait is judged against the same pair of stages in
    the other pipeline replicas."""

    layout: Any
    wait: dict[tuple[int, int], int]

    def excess(self, waiter: int, awaited: int) -> int:
        """``waiter``'s wait for ``awaited`` beyond the median of the same stages' pairs in other replicas."""
        a, b = self.layout.coords(waiter), self.layout.coords(awaited)
        others = [self.wait.get((self.layout.rank_of(a.pp, dp, a.tp), self.layout.rank_of(b.pp, dp, b.tp)), 0)
                  for dp in range(self.layout.dp) if dp != a.dp]
        return self.wait.get((waiter, awaited), 0) - (int(np.median(others)) if others else 0)

    def waits_on(self, r: int, q: int) -> bool:
        """``r`` waited for ``q`` at their exchanges (beyond the pipeline's shape), and twice as long as the reverse."""
        there = self.excess(r, q)
        return there > 0 and there >= WAIT_DOMINANCE * max(self.excess(q, r), 0)


def pipeline_waits(trace: TraceSet, ix: RecordIndex, it: Iterations, te: np.ndarray, steps: list[int]) -> PipelineWaits:
    """Per ordered pair (waiter, awaited), the time ``waiter`` entered their matched exchanges first."""
    s, r = ix.send_row, ix.recv_row
    both = np.flatnonzero((s >= 0) & (r >= 0))
    s, r = s[both], r[both]
    keep = it.in_steps(steps)(it.record_step[r]) & (te[s] > 0) & (te[r] > 0)
    s, r = s[keep], r[keep]
    rank = trace.records.rank
    lag = te[r].astype(np.int64) - te[s].astype(np.int64)  # > 0: the sender arrived first and waited
    sender, receiver = rank[s].astype(np.int64), rank[r].astype(np.int64)  # (only these rows' ranks, in int64)
    waiter = np.where(lag > 0, sender, receiver)
    awaited = np.where(lag > 0, receiver, sender)
    keys, inverse = np.unique(waiter * trace.world_size + awaited, return_inverse=True)
    sums = np.bincount(inverse, weights=np.abs(lag), minlength=len(keys))
    wait = {(int(k) // trace.world_size, int(k) % trace.world_size): int(v) for k, v in zip(keys, sums)}
    return PipelineWaits(trace.layout, wait)


def _waits_seen(trace: TraceSet) -> bool:
    """A receive's wait is communication, not compute: the trace records point-to-point calls and when they
    completed (an arrival-only import infers a send's completion from its receiver, so waits leak into compute)."""
    return trace.completion_times == "observed" and _has_p2p(trace)


def _has_p2p(trace: TraceSet) -> bool:
    """The trace records point-to-point calls (a receive's wait is then not counted as compute)."""
    op = trace.records.op
    return any(bool(((op[sl] == Op.SEND) | (op[sl] == Op.RECV)).any()) for sl in chunks(len(op)))


def _last_arrivals(trace: TraceSet, ix: RecordIndex, c: Collectives, it: Iterations, te: np.ndarray,
                   gap: np.ndarray, steps: list[int] | None) -> tuple[np.ndarray, ...] | None:
    """Per complete collective instance of ``steps`` (None: the whole trace) with two or more members: its last
    arrival's rank, its lag behind the median arrival, the part its own compute explains; and every member row."""
    rec = trace.records
    good = c.complete & (c.n_members >= 2)  # per instance
    if not good.any():
        return None

    in_steps = it.in_steps(steps) if steps is not None else None

    def wanted(sl: slice) -> np.ndarray:
        inst = ix.inst[sl]
        return (inst >= 0) & good[np.maximum(inst, 0)] & (rec.state[sl] == State.COMPLETED) \
            & (in_steps(it.record_step[sl]) if in_steps is not None else True)

    # each instance's members together, in row order
    rows, starts, sizes = rows_by_key(len(rec), wanted, lambda r: ix.inst[r], ix.n_instances)
    if not len(rows):
        return None
    last = np.empty(len(starts), rows.dtype)
    lag = np.empty(len(starts), te.dtype)
    own = np.empty(len(starts), np.float64)
    # The instances of one size as a matrix, a row each, sorted along the rows (a stable sort keeps row order
    # among equal times: the last arrival of a tie is the last member row); a handful of sizes (group sizes).
    for k in np.unique(sizes).tolist():
        of_size = np.flatnonzero(sizes == k)
        for lo in range(0, len(of_size), max(1, MEMBER_CHUNK // k)):  # (temporaries of MEMBER_CHUNK rows at most)
            which = of_size[lo:lo + max(1, MEMBER_CHUNK // k)]
            member = rows[starts[which][:, None] + np.arange(k)]
            t = te[member]
            by_time = np.argsort(t, axis=1, kind="stable")
            each = np.arange(len(which))
            mine = member[each, by_time[:, -1]]
            last[which] = mine
            lag[which] = te[mine] - t[each, by_time[:, (k - 1) // 2]]  # behind the (lower) median arrival
            # The last arrival's own compute before the call, beyond the (lower) median compute gap of the members.
            own[which] = np.clip(gap[mine] - np.sort(gap[member], axis=1)[:, (k - 1) // 2], 0, lag[which])
    return rec.rank[last], lag, own, rows


def arrival_lags(trace: TraceSet, ix: RecordIndex, c: Collectives, it: Iterations, te: np.ndarray, gap: np.ndarray,
                 steps: list[int] | None, long_ns: int | None) -> tuple[dict[int, tuple[int, ...]], int]:
    """Per rank: (lag caused as last arrival, part explained by its own compute, times last, instances entered,
    times last by more than ``long_ns``, the lag of those); and ``long_ns``. ``long_ns=None``: WHOLE_TRACE_LONG_LAG
    times the median lag (and at least MIN_EXCESS_NS), for a trace without steps to measure a long lag by."""
    got = _last_arrivals(trace, ix, c, it, te, gap, steps)
    if got is None:
        return {}, long_ns or MIN_EXCESS_NS
    who, lag, own, rows = got
    if long_ns is None:
        long_ns = max(MIN_EXCESS_NS, int(WHOLE_TRACE_LONG_LAG * float(np.median(lag))))
    out: dict[int, tuple[int, int, int, int, int, int]] = {}
    world = trace.world_size
    entered = np.zeros(world, np.int64)
    for sl in chunks(len(rows)):  # (bincount takes int64: the member rows' ranks at once were 12 bytes a row)
        entered += np.bincount(trace.records.rank[rows[sl]], minlength=world)
    caused = np.bincount(who, weights=lag, minlength=world)
    owned = np.bincount(who, weights=own, minlength=world)
    times = np.bincount(who, minlength=world)
    long = lag > long_ns if long_ns > 0 else np.zeros(len(lag), bool)
    long_times = np.bincount(who[long], minlength=world)
    long_lag = np.bincount(who[long], weights=lag[long], minlength=world)
    for r in trace.ranks.tolist():
        out[r] = (int(caused[r]), int(owned[r]), int(times[r]), int(entered[r]), int(long_times[r]), int(long_lag[r]))
    return out, long_ns


def take_arrival_lags(stats: dict[int, RankStats], lags: dict[int, tuple[int, ...]]) -> None:
    """Put :func:`arrival_lags`' figures into each rank's stats."""
    for r, (caused, own, times, entered, long_times, long_lag) in lags.items():
        if r in stats:
            s = stats[r]
            s.lag_caused_ns, s.lag_own_ns, s.last_arrivals, s.collectives = caused, own, times, entered
            s.long_lags, s.long_lag_ns = long_times, long_lag


def judge_bursts(stats: dict[int, RankStats], run_ns: int) -> list[int]:
    """Flag the stragglers in bursts (see LONG_LAG_STEP), most waiting caused first; sets ``bursty``."""
    flagged = []
    group_longs: dict[tuple[int, ...], int] = {}  # (one sum per group: its members share it)
    for s in stats.values():
        group_long = group_longs.get(s.group)
        if group_long is None:
            group_long = group_longs[s.group] = sum(stats[r].long_lag_ns for r in s.group if r in stats)
        s.bursty = (s.long_lags >= MIN_LONG_LAGS and s.long_lag_ns >= BURST_SHARE * group_long
                    and s.long_lag_ns >= MIN_BURST_RUN_SHARE * run_ns)
        if s.bursty:
            s.straggler = True
            s.confidence = max(s.confidence, round(min(0.95, 0.5 + 0.5 * s.long_lag_ns / max(group_long, 1)), 3))
            flagged.append(s.rank)
    return sorted(flagged, key=lambda r: -stats[r].long_lag_ns)


def judge(stats: dict[int, RankStats], step_ns: int) -> list[int]:
    """Flag stragglers (worst excess first) and set each rank's confidence."""
    flagged = []
    for s in stats.values():
        s.confidence = straggler_confidence(s, len(s.group) - 1)
        same_speed = s.intervals >= MIN_INTERVALS and s.interval_ratio < SAME_SPEED_RATIO
        per_step = (s.excess_ns >= MIN_EXCESS_NS and s.consistency >= MIN_CONSISTENCY and not same_speed
                    and (s.relative >= MIN_EXCESS_REL
                         or (s.relative >= MIN_EXCESS_REL / 2 and sign_tail(s.steps_slower, s.steps) < MAX_INTERVAL_P)))
        if s.whole_trace:  # step_ns: the length of the trace
            s.straggler = slow_by_intervals(s) and s.excess_ns >= max(MIN_EXCESS_NS, MIN_STEP_SHARE * step_ns)
        else:
            s.straggler = (s.steps >= MIN_STEPS and s.excess_ns >= MIN_STEP_SHARE * step_ns
                           and (per_step or slow_by_intervals(s)))
        if s.straggler:
            flagged.append(s.rank)
    return sorted(flagged, key=lambda r: -stats[r].excess_ns)


# -- the analysis ----------------------------------------------------------------------------------------------

def analyze_stragglers(trace: TraceSet, ix: RecordIndex, c: Collectives, it: Iterations, te: np.ndarray,
                       tc: np.ndarray) -> StragglerResult:
    """Straggler statistics, arrival-lag blame, the delay matrix and slow links over the steady steps."""
    if not it.n_steps:
        return _whole_trace_stragglers(trace, ix, c, it, te, tc)
    stats, steps = compare_peers(trace, it)
    step_cols = np.isin(it.steps, steps)
    step_ns = int(np.median(it.step_ns[step_cols]))
    gap = it.gap if it.gap is not None else compute_gaps(trace, it.roles, te, tc)
    compare_intervals(trace, it, gap, steps, stats)
    if not any(s.intervals for s in stats.values()):  # too few steps to pair calls within them: pair them all
        for r, whole in compare_calls(trace, it.roles, gap).items():
            if r in stats:
                stats[r].intervals, stats[r].intervals_slower = whole.intervals, whole.intervals_slower
                stats[r].interval_ratio = whole.interval_ratio
    lags, long_ns = arrival_lags(trace, ix, c, it, te, gap, steps, int(LONG_LAG_STEP * step_ns))
    take_arrival_lags(stats, lags)
    notes: list[str] = []
    by_compute = judge(stats, step_ns)
    bursts = [r for r in judge_bursts(stats, int(step_ns * len(steps))) if r not in by_compute]
    flagged, explained = _explain_neighbours(trace, stats, by_compute + bursts, notes)
    waits = functools.cache(lambda: pipeline_waits(trace, ix, it, te, steps))
    flagged = _explain_late_downstream(trace, stats, flagged, by_compute, explained, notes, waits)
    pairs, delay, slow_ranks, slow_links = analyze_links(trace, ix, c, it, te, tc, steps)
    if len(steps) < MIN_STEPS:
        notes.append(f"only {len(steps)} steady steps: too few to judge stragglers")
    return StragglerResult(steps, step_ns, stats, pairs, delay, flagged, slow_ranks, slow_links, notes=notes,
                           long_lag_ns=long_ns,
                           explained=explained)


def _whole_trace_stragglers(trace: TraceSet, ix: RecordIndex, c: Collectives, it: Iterations, te: np.ndarray,
                            tc: np.ndarray) -> StragglerResult:
    """No step could be told apart: compare the ranks call by call over the whole trace."""
    world = trace.world_size
    gap = compute_gaps(trace, it.roles, te, tc)
    stats = compare_calls(trace, it.roles, gap)
    if not any(s.intervals for s in stats.values()):
        return StragglerResult([], 0, stats, [], delay_matrix([], world),
                               notes=["no complete step: nothing to compare"])
    done = tc > 0
    span = int(tc[done].max() - te[done].min()) if done.any() else 0
    flagged = judge(stats, span)
    lags, long_ns = arrival_lags(trace, ix, c, it, te, gap, None, None)
    take_arrival_lags(stats, lags)
    flagged += [r for r in judge_bursts(stats, span) if r not in flagged]
    notes = ["no step could be told apart: ranks doing the same work compared call by call over the whole trace"]
    flagged, explained = _explain_neighbours(trace, stats, flagged, notes)
    return StragglerResult([], span, stats, [], delay_matrix([], world), flagged, notes=notes, explained=explained,
                           long_lag_ns=long_ns)


def _impact(ctx: AnalysisContext, result: StragglerResult) -> None:
    """Per straggler, the step time it costs: critical paths re-run at its peers' speed (when available)."""
    cp = ctx.results.get("critical_path")
    if cp is None or not cp.graphs:
        return
    length = {p.step: p.length_ns for p in cp.paths}
    graphs = [g for g in cp.graphs if g.step in set(result.steps) and g.step in length]
    for r in result.stragglers:
        s = result.ranks[r]
        scale = {r: s.peer_compute_ns / s.compute_ns} if s.compute_ns else {}
        saved = [length[g.step] - what_if(g, scale) for g in graphs]
        if saved:
            result.impact_ns[r] = max(0, int(np.median(saved)))


def _neighbour_evidence(trace: TraceSet, res: StragglerResult, r: int) -> list[str]:
    """What a trace blind to receive waits leaves open about the other stages of ``r``'s replica."""
    out = [f"rank {q} of its pipeline replica arrives last at its collectives too ({res.ranks[q].long_lags} times "
           f"by more than {duration(res.long_lag_ns)}) while it computes at its peers' speed: it waits on rank {r}"
           if res.ranks[q].bursty else
           f"rank {q} of its pipeline replica is slower too, by {res.ranks[q].interval_ratio:.2f}x call by call: "
           f"presumably its receives waiting on rank {r} (this trace does not show how long receives waited)"
           for q, by in res.explained.items() if by == r]
    layout = trace.layout
    if layout is not None and layout.pp > 1 and not _waits_seen(trace):
        c = layout.coords(r)
        same = [q for q in res.stragglers if q != r and layout.coords(q).dp == c.dp and layout.coords(q).pp != c.pp]
        if same:
            who = f"rank {same[0]} is" if len(same) == 1 else f"ranks {rank_list(same)} are"
            out.append(f"{who} flagged in another stage of its pipeline replica too; where a trace does not show "
                       "how long receives waited, a rank waiting in one looks slow, so one of them may only be waiting")
    return out


def _straggler_finding(trace: TraceSet, res: StragglerResult, r: int) -> Finding:
    s = res.ranks[r]
    peers = rank_list(list(s.peers))
    # Per step when that holds: the percentage then matches the time quoted beside it. Call by call otherwise
    # (its median misses a slowdown that comes in bursts: most intervals of a throttled rank are untouched).
    per_step = s.excess_ns > 0 and s.relative >= MIN_EXCESS_REL
    slower = s.relative if per_step or not slow_by_intervals(s) else s.interval_ratio - 1.0
    per = "in the whole trace" if s.whole_trace else "per step"
    arrivals = trace.completion_times == "arrivals"  # transfer times count as everyone's compute: a lower bound
    if s.bursty and not (s.excess_ns > 0 and s.relative >= MIN_EXCESS_REL):
        others = sum(res.ranks[q].long_lags for q in s.peers if q in res.ranks)
        long = "a quarter step" if res.steps else f"{WHOLE_TRACE_LONG_LAG:g}x the median lag"
        run_ns = res.step_ns * len(res.steps) if res.steps else res.step_ns  # whole trace: step_ns is its length
        verdict = (f"{rank_label(trace, r)} keeps the ranks doing the same work waiting in bursts: it arrived last "
                   f"by more than {long} ({duration(res.long_lag_ns)}) {s.long_lags} times, "
                   f"{duration(s.long_lag_ns)} of waiting in all ({s.long_lag_ns / max(run_ns, 1):.0%} of the "
                   f"{'steps' if res.steps else 'trace'}' time); {peers} together, {others} times")
    else:
        verdict = (f"{rank_label(trace, r)} computes {'at least ' if arrivals else ''}{slower:.0%} slower than the "
                   f"ranks doing the same work ({duration(s.excess_ns)} more {per} than {peers})")
    impact = res.impact_ns.get(r)
    if impact:
        verdict += f"; at their speed steps would take {duration(impact)} ({impact / res.step_ns:.0%}) less"
    if s.whole_trace:
        evidence: list[str | dict[str, Any]] = [
            f"compute (outside communication calls) over the whole trace: rank {r} {duration(s.compute_ns)}, its "
            f"peers {peers} {duration(s.peer_compute_ns)}; no step could be told apart, so each call was paired "
            "with the same call of the peers"]
    else:
        evidence = [
            f"compute per step (outside communication calls): rank {r} {duration(s.compute_ns)}, its peers "
            f"{peers} {duration(s.peer_compute_ns)} (median over steps {res.steps[0]}–{res.steps[-1]})",
            f"slower than its peers in {s.steps_slower} of {s.steps} steps (spread of the excess: MAD "
            f"{duration(s.mad_ns)})"]
    if s.intervals:
        evidence.append(f"call by call: {s.interval_ratio:.2f}x its peers' compute before the same call (median), "
                        f"slower in {s.intervals_slower} of {s.intervals} paired compute intervals"
                        + (f" (p = {interval_p(s):.0e} that chance alone did it)" if s.whole_trace else ""))
    if arrivals:
        evidence.append("this trace has no completion times: each call counts as complete at its last member's "
                        "arrival, so the transfer after it counts as compute for every member alike and the "
                        "slowdown quoted is a lower bound")
    if s.collectives:
        evidence.append(f"arrived last in {s.last_arrivals} of its {s.collectives} collectives, keeping the other "
                        f"members waiting {duration(s.lag_caused_ns)} in total "
                        f"({duration(s.lag_own_ns)} of it explained by its own compute before the call)")
    evidence += _neighbour_evidence(trace, res, r)
    return Finding(
        id=f"straggler:rank-{r}", severity=Severity.WARNING, kind=perf_kind("STRAGGLER"),
        subject=rank_subject(trace, r), verdict=verdict, evidence=evidence,
        remediation=("Check this rank's GPU and host against its peers: clocks and throttling (nvidia-smi -q -d "
                     "PERFORMANCE, temperature, power), other processes on the node, CPU binding and data "
                     "loading; drain the node if its GPU is degraded."),
        confidence=s.confidence * trace.coverage, impact=len(trace.ranks),
        data={"excess_ns": s.excess_ns, "relative": round(s.relative, 3), "compute_ns": s.compute_ns,
              "peer_compute_ns": s.peer_compute_ns, "peers": list(s.peers)[:MAX_LISTED],
              "consistency": round(s.consistency, 2), "lag_caused_ns": s.lag_caused_ns, "lag_own_ns": s.lag_own_ns,
              "interval_ratio": round(s.interval_ratio, 3), "intervals": s.intervals,
              "intervals_slower": s.intervals_slower,
              "impact_ns": impact})


def straggler_findings(trace: TraceSet, res: StragglerResult) -> list[Finding]:
    found = [_straggler_finding(trace, res, r) for r in res.stragglers[:MAX_LISTED]]
    found += [slow_rank_finding(trace, res.pairs, res.steps, r) for r in res.slow_ranks[:MAX_LISTED]]
    found += [link_finding(trace, res.pairs, res.steps, p) for p in res.slow_links[:MAX_LISTED]]
    return found


def _fold_slowdown(earlier: list[Finding], found: list[Finding]) -> None:
    """A step slowdown that a straggler explains is that straggler's story: its onset joins the straggler's
    evidence and the slowdown stays as context (info), so the cause, not its symptom, comes first."""
    for i, slow in enumerate(earlier):
        if slow.kind != Kind.STEP_SLOWDOWN or slow.severity != Severity.WARNING or slow.subject.rank is None:
            continue
        cause = next((f for f in found if f.kind == Kind.STRAGGLER and f.subject.rank == slow.subject.rank), None)
        if cause is None:
            continue
        d = slow.data
        onset = f"step time {d['ratio']:.2f}× the expected {duration(d['expected_ns'])} from step {d['onset_step']}"
        cause.evidence.append(f"the job's {onset}, and this rank's compute accounts for the most of it "
                              f"({d['explained']:.0%} of the increase)")
        earlier[i] = replace(slow, severity=Severity.INFO, verdict=f"{onset}: the straggler, rank "
                             f"{slow.subject.rank}, accounts for {d['explained']:.0%} of it")


def straggler_stage(ctx: AnalysisContext) -> list[Finding]:
    """Engine stage: stragglers and slow links into ``ctx.results["stragglers"]``, and their findings."""
    it = iterations_of(ctx)
    res = analyze_stragglers(ctx.trace, ctx.match.index, ctx.match.collectives, it, ctx.clock.t_enqueue,
                             ctx.clock.t_complete)
    _impact(ctx, res)
    ctx.results["stragglers"] = res
    found = straggler_findings(ctx.trace, res)
    hang = ctx.results.get("hang")
    if ctx.trace.completion_times != "observed" and not (hang is not None and hang.roots):  # enqueue times only:
        # who came last, step by step (not in a job that hung: its last lags are the hang's)
        from megatrace.analyze.arrival_lag import arrival_lag_findings, arrival_lag_stragglers

        lags = arrival_lag_stragglers(ctx.trace, ctx.match.index, it, ctx.clock.t_enqueue)
        known = {f.subject.rank: f for f in found if f.kind == Kind.STRAGGLER and f.subject.rank is not None}
        more = arrival_lag_findings(ctx.trace, lags, known)
        found = [f for f in found if not (f.kind == Kind.STRAGGLER and f.subject.rank in {g.subject.rank
                                                                                          for g in more})] + more
    _fold_slowdown(ctx.findings, found)
    return found
