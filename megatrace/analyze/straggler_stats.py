"""Ranks against the ranks doing the same work: the comparisons and the statistics that judge them.

Holds the thresholds a straggler must clear, the per-rank statistics (:class:`RankStats`) and the three ways they
are measured: per steady step (:func:`compare_peers`: compute time per step against the peers' median), call by
call within the steady steps (:func:`compare_intervals`: paired compute intervals) and call by call over the whole
trace when no step can be told apart (:func:`compare_calls`); then the tests on them: the sign test
(:func:`sign_tail`), the signed-rank test, the chance that a rank's intervals are this long
(:func:`interval_p`, :func:`slow_by_intervals`) and the confidence of a verdict (:func:`straggler_confidence`).
:mod:`megatrace.analyze.stragglers` judges the ranks with them and writes the findings.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatrace.analyze.iterations import Iterations
from megatrace.analyze.peers import peer_groups
from megatrace.analyze.segments import MARKER
from megatrace.load.traceset import TraceSet
from megatrace.trace.ring_format import State

WARMUP_STEPS = 1  # the first step is excluded: allocator, connection setup and autograd warm-up dominate it
SMALL_GROUP = 16  # up to this many peers the reference leaves the rank itself out (exact); beyond, it is noise
# A straggler must compute, per step, at least ...
MIN_EXCESS_NS = 5_000_000  # ... 5 ms more than its peers (healthy demo ranks on 2 loaded cores: up to ~7 ms)
MIN_EXCESS_REL = 0.2  # ... and 20% more: healthy demo ranks on a loaded machine reach 11%, a 1.5x slow rank 30%+
#                       (half of it, 10%, suffices when the rank was slower in so many steps that chance explains
#                       it with p < MAX_INTERVAL_P: ten steady steps or more, a noisy rank's sign flips)
MIN_STEP_SHARE = 0.03  # ... and the excess is at least 3% of the step time (else it cannot matter)
MIN_CONSISTENCY = 0.8  # ... in at least 80% of the steady steps (noise flips sign; a slow GPU does not)
MIN_STEPS = 3  # steady steps needed for any verdict
# Paired compute intervals (the finer test). Healthy demo ranks on 2 loaded cores: median ratio 0.96-1.02,
# slower in 37-58% of intervals; a 1.2x slow rank: ratio 1.22, slower in 74-76% of ~80 intervals.
MIN_INTERVAL_NS = 1_000_000  # intervals shorter than this on the peers are call overhead, not compute
MIN_INTERVALS = 30  # intervals needed for the finer test
MIN_INTERVAL_RATIO = 1.07  # the rank's median interval is at least 7% longer than its peers' ...
MAX_INTERVAL_P = 1e-3  # ... and it is slower in so many intervals that chance explains it with p < 0.1%
SAME_SPEED_RATIO = 1.05  # call by call within 5% of its peers over enough intervals: the rank computes as fast as
#                          they do, and a per-step excess comes from elsewhere (short gaps, waits): not a straggler


@dataclass
class RankStats:
    """One rank against the ranks doing the same work (ns; medians over the steady steps)."""

    rank: int
    group: tuple[int, ...]  # the ranks doing the same work, this one included
    compute_ns: int  # per step
    peer_compute_ns: int  # median of the peers, per step
    excess_ns: int  # median over steps of (own − peers' median)
    mad_ns: int  # median absolute deviation of that excess
    steps_slower: int  # steps with a positive excess
    steps: int
    lag_caused_ns: int = 0  # arrival lag charged to this rank as the last arrival (all steady collectives)
    lag_own_ns: int = 0  # the part its own compute before the call explains
    last_arrivals: int = 0
    collectives: int = 0
    confidence: float = 0.0
    straggler: bool = False
    long_lags: int = 0  # times it arrived last by more than LONG_LAG_STEP of a step
    long_lag_ns: int = 0  # the waiting those arrivals cost its peers
    bursty: bool = False  # a straggler by its bursts of long lags (see LONG_LAG_STEP)
    intervals: int = 0  # paired compute intervals compared (0: calls not comparable with the peers')
    intervals_slower: int = 0  # of them, those where this rank took longer than its peers' median
    interval_ratio: float = 1.0  # median of (own interval / peers' median interval)
    whole_trace: bool = False  # no steps: compared call by call over the whole trace (steps == 0)
    interval_rank_p: float = 1.0  # whole trace: signed-rank test of the log ratios (chance of so many long ones)

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(r for r in self.group if r != self.rank)

    @property
    def relative(self) -> float:
        return self.excess_ns / self.peer_compute_ns if self.peer_compute_ns else 0.0

    @property
    def consistency(self) -> float:
        return self.steps_slower / self.steps if self.steps else 0.0


def straggler_confidence(s: RankStats, n_peers: int) -> float:
    """Sign-test certainty that the excess is not noise, scaled by how far the effect clears the thresholds.

    The better of the two tests counts: per step, or per paired compute interval.
    """
    if (not s.steps and not s.whole_trace) or s.excess_ns <= 0:
        return 0.0
    certain, effect = 0.0, 0.0
    if s.steps:
        certain = 1.0 - sign_tail(s.steps_slower, s.steps)  # P(>= k positive | no effect)
        effect = min(1.0, s.excess_ns / (2 * MIN_EXCESS_NS), s.relative / (2 * MIN_EXCESS_REL))
    if s.intervals >= MIN_INTERVALS and s.interval_ratio > 1.0:
        fine = 1.0 - interval_p(s)
        fine_effect = min(1.0, (s.interval_ratio - 1.0) / (2 * (MIN_INTERVAL_RATIO - 1.0)))
        if fine * (0.5 + 0.5 * fine_effect) > certain * (0.5 + 0.5 * effect):
            certain, effect = fine, fine_effect
    peers = 1.0 if n_peers >= 2 else 0.85  # one peer: which of the two is slow rests on the sign alone
    return round(max(0.0, min(0.98, certain * (0.5 + 0.5 * effect) * peers)), 3)


@functools.lru_cache(maxsize=1024)
def sign_tail(k: int, n: int) -> float:
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


def compare_intervals(trace: TraceSet, it: Iterations, gap: np.ndarray, steps: list[int],
                      stats: dict[int, RankStats]) -> None:
    """The finer test: pair the compute intervals of ranks doing the same work, call by call.

    Ranks of one peer group run the same program: in every steady step they make the same calls, so the
    ``k``-th call of a step on one rank matches the ``k``-th on another. Only steps where every member made
    the same number of calls are paired; only intervals of at least :data:`MIN_INTERVAL_NS` on the peers
    count. Fills ``intervals``, ``intervals_slower`` and ``interval_ratio`` of ``stats``.
    """
    if not steps:
        return
    index = it.step_index(steps)
    ranks = trace.ranks.tolist()
    for group in peer_groups(trace):
        members = [ranks[i] for i in group.tolist()]
        if len(group) < 2 or any(r not in stats for r in members):
            continue
        rows, columns = [], []
        for i in group.tolist():
            lo, hi = int(trace.starts[i]), int(trace.starts[i + 1])
            column = _steady_column(it, index, lo, hi)
            mine = np.flatnonzero(column >= 0)
            rows.append(lo + mine)
            columns.append(column[mine])
        counts = np.stack([np.bincount(c, minlength=len(steps)) for c in columns])
        same = (counts == counts[0]).all(axis=0)
        if not same.any():
            continue
        g = np.stack([gap[r[same[c]]].astype(np.float64) for r, c in zip(rows, columns)])  # [members, paired calls]
        ratios = [ratio for _, ratio in _paired_ratios(g)]
        for r, ratio, median in zip(members, ratios, _medians_of(ratios), strict=True):
            _fill_intervals(stats[r], ratio, median)


def _steady_column(it: Iterations, index: Callable[[np.ndarray], np.ndarray], lo: int, hi: int) -> np.ndarray:
    """For records ``lo:hi`` (one rank's): the index in the steady steps (``index``: their
    :meth:`~Iterations.step_index`) of each one's step when it is a call (not a marker) of one of them, else -1."""
    column = index(it.record_step[lo:hi])  # (a new array)
    column[it.roles[lo:hi] == MARKER] = -1
    return column


def _paired_ratios(g: np.ndarray) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Per member of ``g`` ([members, paired calls] compute before each call): (its peers' reference
    intervals, its ratios to them over the intervals long enough to count; None when too few)."""
    whole = np.median(g, axis=0) if len(g) > SMALL_GROUP else None  # one rank barely moves it
    out = []
    for k in range(len(g)):
        ref = whole if whole is not None else np.median(np.delete(g, k, axis=0), axis=0)
        long = ref >= MIN_INTERVAL_NS
        out.append((ref, g[k][long] / ref[long] if long.sum() >= MIN_INTERVALS else None))
    return out


def _medians_of(ratios: list[np.ndarray | None]) -> list[float | None]:
    """``np.median`` of each array (None for None): of all at once when they are as long (a large group's members
    share one reference), instead of one call per rank."""
    if ratios and all(r is not None and len(r) == len(ratios[0]) for r in ratios):
        return np.median(np.stack(ratios), axis=1).tolist()
    return [None if r is None else float(np.median(r)) for r in ratios]


def _fill_intervals(s: RankStats, ratio: np.ndarray | None, median: float | None = None) -> None:
    """The call-by-call fields of ``s`` from its ratios to its peers (nothing when there are too few); ``median``:
    theirs, when known."""
    if ratio is not None:
        s.intervals, s.intervals_slower = len(ratio), int((ratio > 1.0).sum())
        s.interval_ratio = float(np.median(ratio)) if median is None else median


def compare_calls(trace: TraceSet, roles: np.ndarray, gap: np.ndarray) -> dict[int, RankStats]:
    """The finer test without steps: pair the calls of ranks doing the same work over the whole trace.

    For traces where no step can be told apart (collectives only and no data-parallel sync, as NCCL
    Inspector output of a DP=1 job): the ``k``-th call of one member matches the ``k``-th of another as long
    as their operations agree. The per-step fields stay 0; ``compute_ns`` is the rank's compute over the
    paired calls and ``excess_ns`` its excess over the peers' median.
    """
    rec = trace.records
    ranks = trace.ranks.tolist()
    out: dict[int, RankStats] = {}
    for group in peer_groups(trace):
        if len(group) < 2:
            continue
        rows = []
        for i in group.tolist():
            lo, hi = int(trace.starts[i]), int(trace.starts[i + 1])
            rows.append(lo + np.flatnonzero((roles[lo:hi] != MARKER) & (rec.state[lo:hi] == State.COMPLETED)))
        n = min(len(r) for r in rows)
        ops = np.stack([rec.op[r[:n]] for r in rows])
        differ = np.flatnonzero((ops != ops[0]).any(axis=0))
        n = int(differ[0]) if len(differ) else n  # the same program up to here
        if n < MIN_INTERVALS:
            continue
        g = np.stack([gap[r[:n]].astype(np.float64) for r in rows])
        g[:, 0] = 0.0  # the first call's "gap" is the time before tracing began
        members = tuple(ranks[i] for i in group.tolist())
        for k, (r, (ref, ratio)) in enumerate(zip(members, _paired_ratios(g))):
            own, peer = float(g[k].sum()), float(ref.sum())
            s = RankStats(r, members, int(own), int(peer), int(own - peer), 0, 0, 0, whole_trace=True)
            _fill_intervals(s, ratio)
            if ratio is not None:
                s.interval_rank_p = _signed_rank_p(np.log(np.maximum(ratio, 1e-9)))
            out[r] = s
    return out


def _signed_rank_p(d: np.ndarray) -> float:
    """One-sided Wilcoxon signed-rank p-value (normal approximation) that ``d`` centres above 0.

    Over a whole trace the intervals mix compute a slow rank stretches with calls it does not (a slow
    data loader, or the demo's padding at the end of an action): the sign test counts every interval
    alike, this one weighs the long excesses more.
    """
    d = d[d != 0]
    n = len(d)
    if n < MIN_INTERVALS:
        return 1.0
    ranks = np.argsort(np.argsort(np.abs(d), kind="stable"), kind="stable") + 1.0
    z = (ranks[d > 0].sum() - n * (n + 1) / 4) / math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
    return 0.5 * math.erfc(z / math.sqrt(2))


def interval_p(s: RankStats) -> float:
    """The chance that the rank's intervals are this often (whole trace: this much) longer by chance."""
    p = sign_tail(s.intervals_slower, s.intervals)
    return min(p, s.interval_rank_p) if s.whole_trace else p


def slow_by_intervals(s: RankStats) -> bool:
    return (s.intervals >= MIN_INTERVALS and s.interval_ratio >= MIN_INTERVAL_RATIO
            and interval_p(s) < MAX_INTERVAL_P)


def compare_peers(trace: TraceSet, it: Iterations) -> tuple[dict[int, RankStats], list[int]]:
    """Per rank compute vs its peers over the steady steps; returns the stats and the steady step numbers."""
    first = min(WARMUP_STEPS, max(it.n_steps - 1, 0)) if it.n_steps > MIN_STEPS else 0
    cols = np.arange(first, it.n_steps)
    compute = it.compute[:, cols].astype(np.float64)
    ranks = trace.ranks.tolist()
    out: dict[int, RankStats] = {}
    if not len(cols):
        return out, []
    for group in peer_groups(trace):
        if len(group) < 2:
            continue
        members = tuple(ranks[i] for i in group)
        mine = compute[group]
        if len(group) <= SMALL_GROUP:  # the peers' median without the rank itself
            ref = np.stack([np.median(np.delete(mine, k, axis=0), axis=0) for k in range(len(group))])
        else:  # one rank barely moves the median of many
            ref = np.broadcast_to(np.median(mine, axis=0), mine.shape)
        excess = mine - ref
        med = np.median(excess, axis=1)
        mad = np.median(np.abs(excess - med[:, None]), axis=1)
        slower = (excess > 0).sum(axis=1)
        own, peer = np.median(mine, axis=1), np.median(ref, axis=1)
        for k, i in enumerate(group.tolist()):
            out[ranks[i]] = RankStats(ranks[i], members, int(own[k]), int(peer[k]), int(med[k]), int(mad[k]),
                                      int(slower[k]), len(cols))
    return out, it.steps[cols].tolist()
