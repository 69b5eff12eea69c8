"""Stragglers from arrival times alone: the rank its TP and DP peers wait for, step by step.

Foreign formats with enqueue times only (NCCL-patch logs, gloo Flight Recorder dumps) hide how long a
call took, but not who came last: in each collective instance the last arrival kept every other member
waiting from the second-last arrival on (its *lag*). A rank that slows down for a while is the last
arrival of its tensor-parallel *and* data-parallel collectives in the step where it slowed, by far more
than any other rank is last of anything in that step. A rank that only waits for it (its pipeline
neighbours, the other members of its data-parallel group in other stages) comes last in one kind of
group at most: taking, per rank and step, the smaller of its two largest lags (tensor- and data-parallel)
keeps the waiting ranks out. :func:`arrival_lag_stragglers` names the rank and the step, with the lag. A
trace without steps after the first (warm-up) is not judged, nor one that ends in a hang (the stuck ranks'
last lags are the hang's, and it comes first).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from megatrace.analyze.findings import Finding, Kind, Severity
from megatrace.analyze.index import RecordIndex
from megatrace.analyze.iterations import Iterations
from megatrace.analyze.words import duration, rank_label, rank_subject
from megatrace.load.traceset import TraceSet
from megatrace.trace.ring_format import Op

KINDS = ("tp", "dp")  # the peers a straggler keeps waiting (a waiting rank is last in one of them at most)
LAG_FAR = 10.0  # the straggler's lag is at least 10x the next rank's in the same step: healthy steps of the
#                 real 64-rank Megatron-LM logs have several ranks within 2x of the largest lag
MIN_LAG_SHARE = 0.5  # ... and at least half the median step: a demo rank descheduled on 2 loaded cores keeps its
#                       peers waiting a quarter of a short step now and then; the real slowdown: 1.9 steps
WARMUP_STEPS = 1  # the first step (allocator, connection setup) is not judged
REMEDIATION = ("Look at what this rank did in that step: its log and the node's (a garbage collection, a checkpoint "
               "write, data loading, a GPU throttling or an XID error, another process on the node); if it recurs, "
               "check its GPU and host against its peers and drain the node when it is degraded.")


@dataclass(frozen=True)
class ArrivalLag:
    """One step in which one rank kept its TP and DP peers waiting by far the longest."""

    rank: int
    step: int  # the step number (Iterations.steps)
    lag_ns: int  # the smaller of its largest TP and DP lags in the step
    lags_ns: dict[str, int]  # kind -> its largest lag of that kind in the step
    next_rank: int  # the rank with the next largest lag in the step (-1: none)
    next_lag_ns: int
    step_ns: int  # the median step time (0 when unknown)
    this_step_ns: int = 0  # how long this step took (0 when unknown)


def arrival_lag_stragglers(trace: TraceSet, ix: RecordIndex, it: Iterations, te: np.ndarray) -> list[ArrivalLag]:
    """The (rank, step) pairs of :mod:`arrival_lag`'s module docstring, largest lag first."""
    rec = trace.records
    kind_of = {gid: KINDS.index(g.desc) for gid, g in trace.groups.items() if g.desc in KINDS and len(g.ranks) > 1}
    if not kind_of or not len(rec) or it.n_steps <= WARMUP_STEPS:  # (a lag is judged against its own step)
        return []
    gid = ix.group_ids[ix.inst_gidx]  # per instance
    inst_kind = np.array([kind_of.get(int(g), -1) for g in gid], np.int64) if len(gid) else np.empty(0, np.int64)
    rows = np.flatnonzero((ix.inst >= 0) & (rec.op < Op.SEND))
    rows = rows[inst_kind[ix.inst[rows]] >= 0] if len(rows) else rows
    if len(rows) < 2:
        return []
    rows = rows[np.lexsort((te[rows], ix.inst[rows]))]
    inst = ix.inst[rows]
    last = np.flatnonzero(np.r_[inst[1:] != inst[:-1], True])
    last = last[(last > 0) & (inst[np.maximum(last - 1, 0)] == inst[last])]  # instances of two arrivals or more
    lag = te[rows[last]] - te[rows[last - 1]]
    who = np.searchsorted(trace.ranks, rec.rank[rows[last]])
    kind = inst_kind[inst[last]]
    steps = it.steps
    step_of = it.record_step[rows[last]]
    col = np.searchsorted(steps, step_of)
    ok = (col < len(steps)) & (steps[np.minimum(col, len(steps) - 1)] == step_of) & (step_of >= steps[0] +
                                                                                    WARMUP_STEPS)
    worst = np.zeros((len(trace.ranks), len(steps), len(KINDS)), np.int64)
    np.maximum.at(worst, (who[ok], col[ok], kind[ok]), lag[ok])
    member = np.zeros((len(trace.ranks), len(KINDS)), bool)  # the kinds each rank has peers in
    for g in trace.groups.values():
        if g.gid in kind_of:
            pos = np.searchsorted(trace.ranks, [r for r in g.ranks if trace.has(r)])
            member[pos, kind_of[g.gid]] = True
    score = np.where(member[:, None, :], worst, np.iinfo(np.int64).max).min(axis=2)
    score[~member.any(axis=1)] = 0
    step_ns = int(np.median(it.step_ns))
    floor = MIN_LAG_SHARE * step_ns
    out = []
    for s in range(len(steps)):
        order = np.argsort(score[:, s])[::-1]
        top = int(score[order[0], s])
        nxt = int(score[order[1], s]) if len(order) > 1 else 0
        if top > 0 and top >= floor and top >= LAG_FAR * nxt:
            r = int(trace.ranks[order[0]])
            lags = {k: int(worst[order[0], s, i]) for i, k in enumerate(KINDS) if member[order[0], i]}
            out.append(ArrivalLag(r, int(steps[s]), top, lags, int(trace.ranks[order[1]]) if len(order) > 1 else -1,
                                  nxt, step_ns, int(it.step_ns[s])))
    return sorted(out, key=lambda a: -a.lag_ns)


def arrival_lag_findings(trace: TraceSet, lags: list[ArrivalLag], known: dict[int, Finding]) -> list[Finding]:
    """A straggler finding per rank of ``lags`` (its largest lag; the other steps in the evidence); for a rank
    already named a straggler (``known``: rank -> its finding), that finding with the lag added to its evidence."""
    by_rank: dict[int, list[ArrivalLag]] = {}
    for a in lags:
        by_rank.setdefault(a.rank, []).append(a)
    out = []
    for rank, mine in by_rank.items():
        a = mine[0]
        where = f"step {a.step}"
        took = (f" (the trace's steps counted from 0; it took {duration(a.this_step_ns)}, steps take "
                f"{duration(a.step_ns)})")
        per_kind = ", ".join(f"{k.upper()} {duration(v)}" for k, v in a.lags_ns.items())
        evidence = [f"{where}: its {' and '.join(k.upper() for k in a.lags_ns)} peers waited for it as the last "
                    f"arrival ({per_kind}; the smaller counts); the next rank, {a.next_rank}, kept anyone waiting "
                    f"{duration(a.next_lag_ns)} at most in that step"
  ]
        evidence += [f"also step {b.step}: {duration(b.lag_ns)} (next rank: {duration(b.next_lag_ns)})" for b in mine[1:]]
        if rank in known:
            f = known[rank]
            out.append(dataclasses.replace(f, evidence=f.evidence + evidence))
            continue
        steps = ", ".join(str(b.step) for b in mine)
        verdict = (f"{rank_label(trace, rank)} kept its TP and DP peers waiting {duration(a.lag_ns)} in {where}{took}"
                   + (f", and in steps {steps}" if len(mine) > 1 else "") + f": by far the last arrival there (the "
                   f"next rank {duration(a.next_lag_ns)}); this rank slowed down")
        out.append(Finding(
            id=f"straggler:rank-{rank}-lag", severity=Severity.WARNING, kind=Kind.STRAGGLER,
            subject=rank_subject(trace, rank), verdict=verdict, evidence=evidence, remediation=REMEDIATION,
            confidence=min(0.99, 1.0 - a.next_lag_ns / a.lag_ns) * trace.coverage, impact=len(trace.ranks),
            data={"steps": [b.step for b in mine], "lag_ns": a.lag_ns, "lags_ns": a.lags_ns,
                  "next_rank": a.next_rank, "next_lag_ns": a.next_lag_ns, "step_ns": a.step_ns}))
    return out
