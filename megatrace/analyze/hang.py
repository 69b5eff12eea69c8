"""Hang analysis: who waits for whom at the end of the trace, and the root causes.

At the end of the trace (aligned clocks) each rank is *blocked* (its last
operations were entered and never completed, or failed), *stopped* (its last
operation completed: it computes, is wedged, or is dead), *finished* (its
tracer closed cleanly), *empty* or *missing*. A wait-for graph (:mod:`megatrace.analyze.wait_graph`)
links each blocked rank to what it waits for:

* in a collective: an instance node, which points at the members that never
  entered it (a node with no successor: everyone entered, nobody completed);
* in a send or recv: the peer, when the peer never posted the matching op, or
  a link node when both sides entered and neither completed.

The sink components of that graph, reached from blocked ranks, are the root
causes: stopped ranks (compute hang, crash, early exit, no trace), stuck
instances or links (communication hang, collective mismatch) and cycles
(deadlock). Two refinements: a stuck instance or link that every member
entered is folded into a confirmed stopped rank that one of its members waits
for elsewhere (a device runs a rank's calls in order across its groups, a
dependency the trace does not show: :mod:`megatrace.analyze.hang_roots`); stopped ranks
that one collective waits for together are one root.
:mod:`megatrace.analyze.explain` turns them into findings.

Liveness (:mod:`megatrace.analyze.liveness`: heartbeats, this host's process table) decides
three things the records alone cannot: when the trace ends (the last moment the job was seen,
not its last record, so a rank stopped for 30 s is a 30 s stop), which ranks stopped running
(a stopped or wedged process waits for nothing: the collectives it entered wait for it), and
whether a job whose processes all went at once was ended as a whole (a time limit: no culprit).
A job that is alive but silent everywhere, far longer than usual, is a *stall*.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from megatrace.analyze.clock import ClockAlignment
from megatrace.analyze.hang_roots import (RUNNING_OUTCOMES, STALL_FACTOR, RankStatus, RootCause, Wait, confirm_roots,
                                          drop_ended_by_launcher, find_roots, fold_consequences, merge_co_missing,
                                          usual_gap)
from megatrace.analyze.index import pair_ids
from megatrace.analyze.liveness import Liveness, assess
from megatrace.analyze.match import InstanceDetail, MatchResult, instance_details
from megatrace.analyze.wait_graph import WaitGraph
from megatrace.analyze.words import record_label
from megatrace.load.traceset import TraceSet
from megatrace.trace.ring_format import Flag, Op, State

STALL_MIN_NS = 5_000_000_000  # a live job silent everywhere for this long (and STALL_FACTOR x its usual gap) stalls
TAIL = 64  # last records per rank read for what it waits in (and its last activity): a rank waits in one place;
#            a longer run of calls that never completed adds its oldest call in front (see _tails)
MAX_PHANTOM_INSTANCES = 5000  # instances checked for completions that cannot be real
MAX_UNTRACED = 64  # members without a trace that one collective waits for, named one by one (the first ones): a
#                    group of a million ranks of which one file is present must not make a graph of a million nodes
PHANTOM_OPS = (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL, Op.BARRIER)
NONE = np.iinfo(np.int64).min


@dataclass
class HangAnalysis:
    end_ns: int
    finished: bool  # every rank's tracer closed cleanly, nothing failed: the job ended normally
    status: dict[int, RankStatus]
    last_activity: dict[int, int]  # aligned ns, ranks with records
    last_row: dict[int, int]  # last non-marker record per rank
    waits: dict[int, list[Wait]]
    graph: WaitGraph
    roots: list[RootCause]
    details: dict[int, InstanceDetail]
    progressing: list[int] = field(default_factory=list)  # still active while others were stuck
    leftover_pending: int = 0  # ops never completed in a cleanly finished job (tracer artefacts)
    t_enqueue: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # aligned, per record
    liveness: Liveness = field(default_factory=Liveness)
    stall: Stall | None = None  # alive but silent everywhere, with no rank to blame

    @property
    def blocked(self) -> list[int]:
        return sorted(r for r, s in self.status.items() if s == RankStatus.BLOCKED)

    def summary(self) -> dict:
        counts: dict[str, int] = {}
        for s in self.status.values():
            counts[s.value] = counts.get(s.value, 0) + 1
        return {"end_ns": self.end_ns, "finished": self.finished, "ranks": counts,
                "root_causes": len(self.roots), "progressing": len(self.progressing)}


@dataclass(frozen=True)
class Stall:
    """Every rank silent for far longer than its usual gap while the job's processes are alive."""

    silence_ns: dict[int, int]  # rank -> time since its last record
    usual_gap_ns: int  # the largest usual gap (p95) among the ranks
    blocked: tuple[int, ...]  # ranks waiting inside communication (the rest compute, or sit outside it)


@dataclass
class _Tails:
    """The last ``TAIL`` rows of every rank as an (R, K) matrix, oldest first; ``valid`` masks the padding."""

    rows: np.ndarray
    valid: np.ndarray

    def take(self, column: np.ndarray, fill: int = 0) -> np.ndarray:
        return np.where(self.valid, column[self.rows], fill)


def _at(table: np.ndarray, idx: np.ndarray, fill: int = -1) -> np.ndarray:
    """``table[idx]`` where ``idx >= 0``, else ``fill`` (safe for an empty table)."""
    if not len(table):
        return np.full(idx.shape, fill, np.int64)
    return np.where(idx >= 0, table[np.clip(idx, 0, len(table) - 1)], fill)


def _tails(trace: TraceSet) -> _Tails:
    """The last ``TAIL`` rows of every rank; in front of them, for a rank whose final run of calls that never
    completed starts before those rows (more calls queued behind a stuck one than ``TAIL``), the oldest call
    of that run: the one it waits in, whatever came after it."""
    counts = np.diff(trace.starts)
    k = int(min(TAIL, counts.max())) if len(counts) and counts.max() > 0 else 1
    idx = trace.starts[1:, None] - k + np.arange(k)[None, :]
    valid = idx >= trace.starts[:-1, None]
    rows = np.where(valid, idx, 0)
    head = _oldest_pending(trace, rows, valid)
    if head is not None:
        rows = np.concatenate([np.maximum(head, 0)[:, None], rows], axis=1)
        valid = np.concatenate([(head >= 0)[:, None], valid], axis=1)
    return _Tails(rows, valid)


def _blocking_rows(rec, rows: np.ndarray) -> np.ndarray:
    """Calls (not markers) that never completed, or failed, unless they record no completion at all."""
    state = rec.state[rows]
    return (rec.op[rows] < Op.MARK_STEP) & ((state == State.ENQUEUED) | (state == State.FAILED)) \
        & ((rec.flags[rows] & Flag.NO_COMPLETION) == 0)


def _progress_rows(rec, rows: np.ndarray, blocking: np.ndarray) -> np.ndarray:
    """Rows that show the rank moved on: a completed synchronous call, or a marker."""
    return ~blocking & (((rec.flags[rows] & Flag.ASYNC) == 0) | (rec.op[rows] >= Op.MARK_STEP))


def _oldest_pending(trace: TraceSet, rows: np.ndarray, valid: np.ndarray) -> np.ndarray | None:
    """Per rank, the oldest call of its final run of calls that never completed (the rows after its last
    progress, see :func:`_pending`) when that call lies before the tail ``rows``; -1 elsewhere; None when
    no rank needs it. Vectorized: only the ranks whose whole tail is such a run are scanned further back,
    as one concatenated array cut into segments (``reduceat``)."""
    rec = trace.records
    if not len(rec) or not valid.any():
        return None
    n_ranks = len(rows)
    first_col = np.argmax(valid, axis=1)
    tail_start = rows[np.arange(n_ranks), first_col]
    lo = trace.starts[:-1]
    blocking = _blocking_rows(rec, rows) & valid
    progress = _progress_rows(rec, rows, blocking) & valid
    cand = np.flatnonzero(valid.any(axis=1) & (tail_start > lo) & blocking.any(axis=1) & ~progress.any(axis=1))
    if not len(cand):
        return None
    seg_lo, seg_hi = lo[cand], tail_start[cand]  # the rows older than the tail
    lens = seg_hi - seg_lo
    offsets = np.cumsum(lens) - lens
    older = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(offsets - seg_lo, lens)
    b = _blocking_rows(rec, older)
    last_progress = np.maximum.reduceat(np.where(_progress_rows(rec, older, b), older, -1), offsets)
    after = b & (older > np.repeat(last_progress, lens))
    first = np.minimum.reduceat(np.where(after, older, np.iinfo(np.int64).max), offsets)
    head = np.full(n_ranks, -1, np.int64)
    head[cand] = np.where(first < seg_hi, first, -1)
    return head if (head >= 0).any() else None


def _phantoms(trace: TraceSet, m: MatchResult, t: _Tails, tc: np.ndarray, last_by_rank: np.ndarray) -> np.ndarray:
    """(R, K) mask of completions that cannot be real: a recv whose send was never posted, or a collective a
    member never entered, completed after that partner had stopped (error completions after a peer died)."""
    rec, ix, c = trace.records, m.index, m.collectives
    state, op, done_at = t.take(rec.state), t.take(rec.op), t.take(tc)
    pair = pair_ids(t.take(ix.inst, -1))
    peer = np.clip(t.take(rec.peer, -1), 0, max(trace.world_size - 1, 0))
    last_by_rank = last_by_rank.copy()  # a rank whose records end early did not stop there: nothing is a phantom of it
    last_by_rank[[i.rank for i in trace.rank_info if i.ended_early]] = NONE
    peer_last = last_by_rank[peer]
    phantom = ((pair >= 0) & (state == State.COMPLETED) & (op == Op.RECV) & (_at(ix.send_row, pair) < 0)
               & (peer_last != NONE) & (peer_last < done_at))
    inst = t.take(ix.inst, -1)
    cand = (inst >= 0) & (state == State.COMPLETED) & np.isin(op, PHANTOM_OPS) \
        & (_at(c.n_entered, inst, 0) < _at(c.n_members, inst, 0))
    insts = np.unique(inst[cand])[:MAX_PHANTOM_INSTANCES]
    rows: set[int] = set()
    for d in instance_details(trace, ix, insts).values():
        stopped = [last_by_rank[r] for r in d.never_entered if last_by_rank[r] != NONE]
        if stopped:
            rows.update(d.rows[r] for r in d.completed if tc[d.rows[r]] > min(stopped))
    if rows:
        phantom |= t.valid & np.isin(t.rows, np.fromiter(rows, np.int64))
    return phantom


def _pending(trace: TraceSet, m: MatchResult, t: _Tails, blocking: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows each rank waits in at its end, which of them are older outstanding async ops).

    A rank runs one thread of calls, so it waits in one place: its last synchronous call when that
    call never completed; else the batch of async calls it issued last and never saw complete. A
    rank whose last call completed may still wait on an older async op (e.g. an irecv overlapped
    with compute), but only ops whose counterpart never entered count: a completion that was just
    not observed must not invent a wait.
    """
    rec, ix = trace.records, m.index
    col = np.arange(t.rows.shape[1])[None, :]
    is_async = (t.take(rec.flags) & Flag.ASYNC) != 0
    progress = t.valid & _progress_rows(rec, t.rows, blocking)
    tail = blocking & (col > np.where(progress, col, -1).max(axis=1, keepdims=True))
    last_sync = np.where(tail & ~is_async, col, -1).max(axis=1, keepdims=True)
    waiting = tail & ((last_sync < 0) | (col == last_sync))
    cand = t.rows[blocking & is_async & ~tail.any(axis=1, keepdims=True)]
    inst = ix.inst[cand]
    pair = pair_ids(inst)
    other = np.where(rec.op[cand] == Op.SEND, _at(ix.recv_row, pair), _at(ix.send_row, pair))
    c = m.collectives
    never = ((pair >= 0) & (other < 0)) | ((inst >= 0) & (_at(c.n_entered, inst, 0) < _at(c.n_members, inst, 0)))
    outstanding = cand[never]
    return np.union1d(t.rows[waiting], outstanding), outstanding


def analyze_hangs(trace: TraceSet, clock: ClockAlignment, m: MatchResult) -> HangAnalysis:
    """Build the wait-for graph at the end of the trace and find its root causes."""
    rec = trace.records
    te, tc = clock.t_enqueue, clock.t_complete
    if not len(rec):  # no rank recorded anything: nothing waits on anything
        status = {r: RankStatus.MISSING for r in trace.missing_ranks}
        status.update({i.rank: RankStatus.EMPTY for i in trace.rank_info})
        finished = all(i.closed_cleanly for i in trace.rank_info)
        return HangAnalysis(0, finished, status, {}, {}, {}, WaitGraph(), [], {})
    t = _tails(trace)
    last_pos = np.where(t.valid, np.maximum(te[t.rows], tc[t.rows]), NONE).max(axis=1)
    last_by_rank = np.full(trace.world_size, NONE, np.int64)
    last_by_rank[trace.ranks] = last_pos
    end = int(last_pos.max()) if (last_pos != NONE).any() else 0
    last_row_pos = np.where(t.valid & (t.take(rec.op) < Op.MARK_STEP), t.rows, -1).max(axis=1)
    last_row = {int(r): int(p) for r, p in zip(trace.ranks, last_row_pos, strict=True) if p >= 0}

    incomplete = t.valid & _blocking_rows(rec, t.rows)
    blocking = incomplete | _phantoms(trace, m, t, tc, last_by_rank)
    pending, outstanding = _pending(trace, m, t, blocking)
    finished = all(i.closed_cleanly for i in trace.rank_info) and not (rec.state[pending] == State.FAILED).any()

    status: dict[int, RankStatus] = {r: RankStatus.MISSING for r in trace.missing_ranks}
    for info in trace.rank_info:
        status[info.rank] = (RankStatus.EMPTY if info.n_records == 0 else
                             RankStatus.FINISHED if info.closed_cleanly else RankStatus.STOPPED)
    last_activity = {int(r): int(v) for r, v in zip(trace.ranks, last_pos, strict=True) if v != NONE}
    if finished:
        return HangAnalysis(end, True, status, last_activity, last_row, {}, WaitGraph(), [], {},
                            leftover_pending=len(pending))
    live = assess(trace.rank_info, [int(o) for o in clock.rank_offset_ns], clock.host_offset_ns, last_activity,
                  trace.facts.probe)
    for r, p in trace.facts.procs.items():  # the launcher's word on whom it ended outranks timing
        if p.killed_by_launcher:
            live.crashed.pop(r, None)
    end = max(end, live.observed_ns or end)
    culprits = live.culprits()
    graph, waits, details = _wait_for_graph(trace, m, te, pending, outstanding, culprits, status)

    roots = find_roots(trace, m, graph, waits, details, status, last_activity, end, te, tc, live)
    onset = min((r.stop_ns for r in roots if r.stop_ns is not None), default=end)
    named = {r for root in roots for r in root.ranks} | culprits
    progressing = sorted(r for r, s in status.items()
                         if s == RankStatus.STOPPED and r not in named and roots
                         and live.seen_ns.get(r, last_activity.get(r, NONE)) > onset + (end - onset) // 2
                         and last_activity.get(r, NONE) > onset + (end - onset) // 2)
    confirm_roots(trace, roots, waits, quiet=not progressing, live=live)
    if trace.facts.outcome in RUNNING_OUTCOMES or live.ended_together:  # what was in flight at the end is no hang
        roots = [root for root in roots if root.confirmed]
        progressing = progressing if roots else []
    crashed = {r for r, p in trace.facts.procs.items() if p.crashed} | set(live.crashed)
    roots = drop_ended_by_launcher(merge_co_missing(graph, fold_consequences(roots, m), crashed), trace, status,
                                    crashed)
    stall = None if roots else _stall(trace, status, last_activity, end, te, tc, live)
    return HangAnalysis(end, False, status, last_activity, last_row, waits, graph, roots, details, progressing,
                        t_enqueue=te, liveness=live, stall=stall)


def _wait_for_graph(trace: TraceSet, m: MatchResult, te: np.ndarray, pending: np.ndarray, outstanding: np.ndarray,
                    culprits: set[int], status: dict[int, RankStatus],
                    ) -> tuple[WaitGraph, dict[int, list[Wait]], dict[int, InstanceDetail]]:
    """The wait-for graph of the rows the ranks wait in (``pending``), the waits of each rank, and the details of
    the instances they wait in; marks each waiting rank blocked in ``status`` (a rank that stopped running, one of
    ``culprits``, waits for nothing: the others wait for it)."""
    rec, ix = trace.records, m.index
    graph = WaitGraph()
    pending_insts = np.unique(ix.inst[pending][ix.inst[pending] >= 0])
    details = instance_details(trace, ix, pending_insts)
    out_set = set(outstanding.tolist())
    # rank -> the oldest row it waits in (kept only when that call is synchronous)
    order = np.sort(pending)
    ranks, first = np.unique(rec.rank[order], return_index=True)  # (a rank's rows are contiguous, in seq order)
    sync = (rec.flags[order[first]] & int(Flag.ASYNC)) == 0
    first_wait = dict(zip(ranks[sync].tolist(), order[first][sync].tolist(), strict=True))
    waits: dict[int, list[Wait]] = {}
    label_of = functools.partial(record_label, trace)
    # (the pending rows' fields as Python lists: tens of thousands of rows at large scale, read one by one)
    columns = zip(pending.tolist(), rec.rank[pending].tolist(), ix.inst[pending].tolist(), ix.pair_of(pending).tolist(),
                  (rec.op[pending] == Op.SEND).tolist(), rec.peer[pending].tolist(), te[pending].tolist(),
                  (rec.state[pending] == State.FAILED).tolist(), strict=True)
    blocked = RankStatus.BLOCKED
    for row, rank, i, p, is_send, peer, t_entered, failed in columns:
        if rank in culprits:  # it stopped running: it waits for nothing, the others wait for it
            continue
        status[rank] = blocked
        graph.add_node(rank)
        target: Hashable | None = None
        if i >= 0:
            target = ("inst", i)
            if target not in graph:
                for member in _named_absentees(trace, details[i].never_entered):
                    graph.add_edge(target, member)
                for member in culprits.intersection(details[i].stuck):  # entered, then stopped running inside it
                    graph.add_edge(target, member)
                for member in _queued_behind(details[i], first_wait, culprits):
                    graph.add_edge(target, member)
        elif p >= 0:
            other = int(ix.recv_row[p] if is_send else ix.send_row[p])
            if other < 0 or peer in culprits:
                target = peer
            else:
                target = ("link", rank, peer) if is_send else ("link", peer, rank)
        wait = Wait(rank, row, t_entered, failed, row in out_set, target, label_of)
        waits.setdefault(rank, []).append(wait)
        if target is not None:
            graph.add_edge(rank, target, wait=wait)
    for node in graph.nodes:
        if isinstance(node, int) and node not in status:
            status[node] = RankStatus.MISSING  # a peer outside the loaded world (bad peer field)
    return graph, waits, details


def _queued_behind(detail: InstanceDetail, first_wait: dict[int, int], culprits: set[int]) -> list[int]:
    """Members that entered the instance only behind an older synchronous call of their own that never
    completed (the member blocks in that call; its later entries are queued behind it, as an importer of
    enqueue-only logs records them): the instance waits for them. (Behind an older asynchronous call, as on
    NCCL's streams of other communicators, the instance may run on its own and is judged by itself.)"""
    return [r for r in detail.stuck if r not in culprits and first_wait.get(r, detail.rows[r]) < detail.rows[r]]


def _stall(trace: TraceSet, status: dict[int, RankStatus], last_activity: dict[int, int], end: int,
           te: np.ndarray, tc: np.ndarray, live: Liveness) -> Stall | None:
    """A live job whose every rank has been silent far longer than usual, with no rank to blame."""
    if not live.alive or not last_activity:
        return None
    silence = {r: end - t for r, t in last_activity.items() if status.get(r) != RankStatus.FINISHED}
    if not silence:
        return None
    gap = max(usual_gap(trace, te, tc, r) for r in silence)
    if min(silence.values()) < max(STALL_MIN_NS, STALL_FACTOR * gap):
        return None
    blocked = tuple(sorted(r for r in silence if status.get(r) == RankStatus.BLOCKED))
    return Stall(silence, gap, blocked)


def _named_absentees(trace: TraceSet, never_entered: tuple[int, ...]) -> list[int]:
    """The members a collective waits for that get a node: every one with a trace, and the first
    :data:`MAX_UNTRACED` of those without (the trace-problem finding counts the missing ranks)."""
    traced = [r for r in never_entered if trace.has(r)]
    if len(never_entered) - len(traced) <= MAX_UNTRACED:
        return list(never_entered)
    return sorted(traced + [r for r in never_entered if not trace.has(r)][:MAX_UNTRACED])
