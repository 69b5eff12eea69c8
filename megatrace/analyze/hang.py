"""Hang analysis: who waits for whom at the end of the trace, and the root causes.

At the end of the trace (aligned clocks) each rank is *blocked* (its last
operations were entered and never completed, or failed), *stopped* (its last
operation completed: it computes, is wedged, or is dead), *finished* (its
tracer closed cleanly), *empty* or *missing*. A wait-for graph (networkx)
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
dependency the trace does not show: :func:`_fold_consequences`); stopped ranks
that one collective waits for together are one root (:func:`_merge_co_missing`).
:mod:`megatrace.analyze.explain` turns them into findings.

Liveness (:mod:`megatrace.analyze.liveness`: heartbeats, this host's process table) decides
three things the records alone cannot: when the trace ends (the last moment the job was seen,
not its last record, so a rank stopped for 30 s is a 30 s stop), which ranks stopped running
(a stopped or wedged process waits for nothing: the collectives it entered wait for it), and
whether a job whose processes all went at once was ended as a whole (a time limit: no culprit).
A job that is alive but silent everywhere, far longer than usual, is a *stall*.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from megatrace.analyze.clock import ClockAlignment
from megatrace.analyze.liveness import Liveness, assess
from megatrace.analyze.match import InstanceDetail, MatchResult, instance_details
from megatrace.analyze.words import record_label
from megatrace.load.traceset import TraceSet
from megatrace.trace.ring_format import Flag, Op, State

STALL_FACTOR = 4.0  # a stop is a hang once it lasts this many times the usual gap between calls (p95) ...
QUIET_FACTOR = 2.0  # ... or twice that gap when the whole job is quiet (every rank blocked or stopped) ...
WHOLE_JOB_FACTOR = 1.0  # ... or once it exceeds that gap in a log of enqueue times only where the whole job waits
# for it: such a log ends at its last enqueue, when the waiters had all blocked, so the stop measured is a lower
# bound of how long it lasted (often a few gaps, whatever the hang's length), and the whole job waiting on one
# rank is the evidence (a cut of a running job leaves several ranks computing, each with its own waiters)
MIN_STALL_NS = 5_000_000  # ... and in both cases at least 5 ms: below that it is scheduling noise
STALLED_OUTCOMES = ("stalled",)  # launcher / agent verdicts (procs.json "outcome") that confirm a stop
# A snapshot of a job that was still running (collected before its time limit, say): nodes are read a
# moment apart, so a rank read first seems to stop while the others go on. Only a long stop is a hang then.
RUNNING_OUTCOMES = ("running",)
RUNNING_MIN_STALL_NS = 30_000_000_000
ENDED_TOGETHER_MIN_STALL_NS = 1_000_000_000  # killed as a whole: a stop this long is no call in flight (launchers
#                                              declare a stall after seconds; a cut job's ranks stop for ms)
STALL_MIN_NS = 5_000_000_000  # a live job silent everywhere for this long (and STALL_FACTOR x its usual gap) stalls
GAP_WINDOW = 1000  # recent records of a rank used for its usual gap between calls
TAIL = 64  # last records per rank read for what it waits in (and its last activity): a rank waits in one place;
#            a longer run of calls that never completed adds its oldest call in front (see _tails)
MAX_PHANTOM_INSTANCES = 5000  # instances checked for completions that cannot be real
MAX_UNTRACED = 64  # members without a trace that one collective waits for, named one by one (the first ones): a
#                    group of a million ranks of which one file is present must not make a graph of a million nodes
PHANTOM_OPS = (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL, Op.BARRIER)
NONE = np.iinfo(np.int64).min


class RankStatus(str, enum.Enum):
    BLOCKED = "blocked"  # waits in an operation that never completed, or failed
    STOPPED = "stopped"  # last operation completed; not waiting in communication
    FINISHED = "finished"  # tracer closed cleanly and nothing pending
    EMPTY = "empty"  # ring without records
    MISSING = "missing"  # no ring


@dataclass(frozen=True)
class Wait:
    """One operation a blocked rank waits in, and what it waits for."""

    rank: int
    row: int
    label: str  # "TP all_reduce #49 (group [4, 5])", "PP recv #13 from rank 4"
    since_ns: int  # aligned enqueue time
    failed: bool  # the call raised (e.g. a timeout)
    outstanding_async: bool  # not the rank's last call: an async op it probably waits on
    target: Hashable | None  # graph node it points at


@dataclass
class RootCause:
    """A sink of the wait-for graph that blocked ranks depend on."""

    node: Hashable  # rank (int), ("inst", id), ("link", src, dst) or a tuple of cycle nodes
    kind: str  # "rank", "instance", "link", "cycle", "blocked-unknown"
    ranks: tuple[int, ...]  # the culprit rank(s)
    waiters: tuple[int, ...]  # ranks that wait on it, directly or through others
    first_wait: Wait | None  # the wait of a direct waiter (what the culprit did not enter)
    stop_ns: int | None  # when it stopped: last activity, or the last arrival in the stuck op
    silence_ns: int | None  # end of trace - stop
    usual_gap_ns: int | None  # what "normal" looks like for it
    confirmed: bool  # the stop is long compared with the usual gap, or corroborated by failures
    chain: list[str] = field(default_factory=list)  # the longest wait chain, step by step
    chain_wait: Wait | None = None  # the last wait of that chain (the one pointing at the root)
    detail: InstanceDetail | None = None


@dataclass
class HangAnalysis:
    end_ns: int
    finished: bool  # every rank's tracer closed cleanly, nothing failed: the job ended normally
    status: dict[int, RankStatus]
    last_activity: dict[int, int]  # aligned ns, ranks with records
    last_row: dict[int, int]  # last non-marker record per rank
    waits: dict[int, list[Wait]]
    graph: nx.DiGraph
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
    pair = t.take(ix.pair, -1)
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
    pair, inst = ix.pair[cand], ix.inst[cand]
    other = np.where(rec.op[cand] == Op.SEND, _at(ix.recv_row, pair), _at(ix.send_row, pair))
    c = m.collectives
    never = ((pair >= 0) & (other < 0)) | ((inst >= 0) & (_at(c.n_entered, inst, 0) < _at(c.n_members, inst, 0)))
    outstanding = cand[never]
    return np.union1d(t.rows[waiting], outstanding), outstanding


def _usual_gap(trace: TraceSet, te: np.ndarray, tc: np.ndarray, rank: int) -> int:
    """p95 of the rank's recent time outside communication (from its latest completion to its next call)."""
    rows = trace.rows(rank)
    window = slice(max(rows.start, rows.stop - GAP_WINDOW), rows.stop)
    busy_until = np.maximum.accumulate(np.maximum(te[window], tc[window]))
    gaps = np.clip(te[window][1:] - busy_until[:-1], 0, None)
    return int(np.percentile(gaps, 95)) if len(gaps) >= 3 else 0


def _usual_duration(trace: TraceSet, m: MatchResult, te: np.ndarray, tc: np.ndarray, gidx: int) -> int:
    rows = np.flatnonzero((m.index.gidx == gidx) & (trace.records.state == State.COMPLETED))[-GAP_WINDOW:]
    d = tc[rows] - te[rows]
    return int(np.percentile(d, 95)) if len(d) >= 3 else 0


def analyze_hangs(trace: TraceSet, clock: ClockAlignment, m: MatchResult) -> HangAnalysis:
    """Build the wait-for graph at the end of the trace and find its root causes."""
    rec, ix = trace.records, m.index
    te, tc = clock.t_enqueue, clock.t_complete
    if not len(rec):  # no rank recorded anything: nothing waits on anything
        status = {r: RankStatus.MISSING for r in trace.missing_ranks}
        status.update({i.rank: RankStatus.EMPTY for i in trace.rank_info})
        finished = all(i.closed_cleanly for i in trace.rank_info)
        return HangAnalysis(0, finished, status, {}, {}, {}, nx.DiGraph(), [], {})
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
    graph = nx.DiGraph()
    if finished:
        return HangAnalysis(end, True, status, last_activity, last_row, {}, graph, [], {},
                            leftover_pending=len(pending))
    live = assess(trace.rank_info, [int(o) for o in clock.rank_offset_ns], clock.host_offset_ns, last_activity,
                  trace.facts.probe)
    for r, p in trace.facts.procs.items():  # the launcher's word on whom it ended outranks timing
        if p.killed_by_launcher:
            live.crashed.pop(r, None)
    end = max(end, live.observed_ns or end)
    culprits = live.culprits()

    pending_insts = np.unique(ix.inst[pending][ix.inst[pending] >= 0])
    details = instance_details(trace, ix, pending_insts)
    out_set = set(outstanding.tolist())
    first_wait: dict[int, int] = {}  # rank -> the oldest row it waits in (kept only when that call is synchronous)
    for row in sorted(pending.tolist()):
        first_wait.setdefault(int(rec.rank[row]), row)
    first_wait = {r: row for r, row in first_wait.items() if not rec.flags[row] & Flag.ASYNC}
    waits: dict[int, list[Wait]] = {}
    for row in pending.tolist():
        rank = int(rec.rank[row])
        if rank in culprits:  # it stopped running: it waits for nothing, the others wait for it
            continue
        status[rank] = RankStatus.BLOCKED
        graph.add_node(rank)
        target: Hashable | None = None
        i, p = int(ix.inst[row]), int(ix.pair[row])
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
            is_send = rec.op[row] == Op.SEND
            other = int(ix.recv_row[p] if is_send else ix.send_row[p])
            peer = int(rec.peer[row])
            if other < 0 or peer in culprits:
                target = peer
            else:
                target = ("link", rank, peer) if is_send else ("link", peer, rank)
        wait = Wait(rank, row, record_label(trace, row), int(te[row]), bool(rec.state[row] == State.FAILED),
                    row in out_set, target)
        waits.setdefault(rank, []).append(wait)
        if target is not None:
            graph.add_edge(rank, target, wait=wait)
    for node in graph.nodes:
        if isinstance(node, int) and node not in status:
            status[node] = RankStatus.MISSING  # a peer outside the loaded world (bad peer field)

    roots = _roots(trace, m, graph, waits, details, status, last_activity, end, te, tc, live)
    onset = min((r.stop_ns for r in roots if r.stop_ns is not None), default=end)
    named = {r for root in roots for r in root.ranks} | culprits
    progressing = sorted(r for r, s in status.items()
                         if s == RankStatus.STOPPED and r not in named and roots
                         and live.seen_ns.get(r, last_activity.get(r, NONE)) > onset + (end - onset) // 2
                         and last_activity.get(r, NONE) > onset + (end - onset) // 2)
    _confirm(trace, roots, waits, quiet=not progressing, live=live)
    if trace.facts.outcome in RUNNING_OUTCOMES or live.ended_together:  # what was in flight at the end is no hang
        roots = [root for root in roots if root.confirmed]
        progressing = progressing if roots else []
    crashed = {r for r, p in trace.facts.procs.items() if p.crashed} | set(live.crashed)
    roots = _drop_ended_by_launcher(_merge_co_missing(graph, _fold_consequences(roots, m), crashed), trace, status,
                                    crashed)
    stall = None if roots else _stall(trace, status, last_activity, end, te, tc, live)
    return HangAnalysis(end, False, status, last_activity, last_row, waits, graph, roots, details, progressing,
                        t_enqueue=te, liveness=live, stall=stall)


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
    gap = max(_usual_gap(trace, te, tc, r) for r in silence)
    if min(silence.values()) < max(STALL_MIN_NS, STALL_FACTOR * gap):
        return None
    blocked = tuple(sorted(r for r in silence if status.get(r) == RankStatus.BLOCKED))
    return Stall(silence, gap, blocked)


def _confirm(trace: TraceSet, roots: list[RootCause], waits: dict[int, list[Wait]], quiet: bool,
             live: Liveness) -> None:
    """Decide whether each root's stop is a hang rather than an operation in flight when the trace ended.

    Corroboration: a waiter's call failed (a timeout), the culprit crashed or exited, or the launcher /
    agent reported the job stalled. Otherwise the stop must be long against the usual gap between calls:
    ``STALL_FACTOR`` times it, or ``QUIET_FACTOR`` times it when no rank was still progressing; and at
    least ``RUNNING_MIN_STALL_NS`` in a snapshot of a job that was still running, and
    ``ENDED_TOGETHER_MIN_STALL_NS`` in a job whose processes all ended together.
    """
    stalled = trace.facts.outcome in STALLED_OUTCOMES
    for root in roots:
        if root.confirmed or root.kind == "cycle":
            root.confirmed = True
            continue
        # (a job ended as a whole fails the collectives of the ranks that go last: no proof of a hang then)
        failed = not live.ended_together and any(w.failed for r in root.waiters + root.ranks for w in waits.get(r, ()))
        proc = [trace.facts.procs.get(r) for r in root.ranks]
        crashed = any(p is not None and p.crashed for p in proc)
        stopped_running = any(r in live.culprits() for r in root.ranks)  # the process itself says so
        if failed or crashed or stalled or stopped_running:
            root.confirmed = True
        elif root.silence_ns is not None:
            factor = QUIET_FACTOR if quiet else STALL_FACTOR
            if quiet and trace.completion_times == "arrivals" and _whole_job_waits(trace, root):
                factor = WHOLE_JOB_FACTOR
            # a snapshot of a running job is cut while it runs: only a long stop is a hang; a job whose
            # processes all ended together (a time limit, a cancel, a launcher's kill of a stalled job) may
            # have been cut while it ran too: a stop of milliseconds is work in flight then, not a hang
            if trace.facts.outcome in RUNNING_OUTCOMES:
                floor = RUNNING_MIN_STALL_NS
            else:
                floor = ENDED_TOGETHER_MIN_STALL_NS if live.ended_together else MIN_STALL_NS
            root.confirmed = root.silence_ns >= max(floor, factor * (root.usual_gap_ns or 0))


def _whole_job_waits(trace: TraceSet, root: RootCause) -> bool:
    """Every rank with a trace (but those whose logs ended early) waits for this root, directly or not."""
    waiting = set(root.waiters) | set(root.ranks)
    return all(i.rank in waiting for i in trace.rank_info if i.n_records and not i.ended_early)


def _roots(trace: TraceSet, m: MatchResult, graph: nx.DiGraph, waits: dict[int, list[Wait]],
           details: dict[int, InstanceDetail], status: dict[int, RankStatus], last_activity: dict[int, int],
           end: int, te: np.ndarray, tc: np.ndarray, live: Liveness) -> list[RootCause]:
    if not graph.number_of_nodes():
        return []
    cond = nx.condensation(graph)
    members = nx.get_node_attributes(cond, "members")
    roots: list[RootCause] = []
    for scc in cond.nodes:
        if cond.out_degree(scc):
            continue
        nodes = members[scc]
        up = set().union(*(nx.ancestors(graph, n) for n in nodes)) - set(nodes)
        waiters = tuple(sorted(r for r in up if isinstance(r, int)))
        inside_blocked = [n for n in nodes if isinstance(n, int) and status.get(n) == RankStatus.BLOCKED]
        if not waiters and not inside_blocked:
            continue  # an idle rank nobody waits for
        preds = _direct_waits(graph, nodes)
        first_wait = min(preds, key=lambda w: w.since_ns) if preds else None
        if len(nodes) > 1:
            ranks = tuple(sorted(n for n in nodes if isinstance(n, int)))
            root = RootCause(tuple(sorted(nodes, key=str)), "cycle", ranks, waiters, first_wait,
                             None, None, None, True)
        else:
            (node,) = nodes
            root = _single_root(trace, m, node, waiters, first_wait, details, status, last_activity, end,
                                te, tc, waits, live)
        root.chain, root.chain_wait = _chain(graph, nodes)
        roots.append(root)
    return roots


def _direct_waits(graph: nx.DiGraph, nodes: set[Hashable] | frozenset) -> list[Wait]:
    """The waits that point at ``nodes`` directly, or through an instance node."""
    out: list[Wait] = []
    for n in nodes:
        for u in graph.predecessors(n):
            if isinstance(u, int):
                out.append(graph.edges[u, n]["wait"])
            else:
                out.extend(d["wait"] for _, _, d in graph.in_edges(u, data=True) if "wait" in d)
    return out


def _single_root(trace: TraceSet, m: MatchResult, node: Hashable, waiters: tuple[int, ...],
                 first_wait: Wait | None, details: dict[int, InstanceDetail], status: dict[int, RankStatus],
                 last_activity: dict[int, int], end: int, te: np.ndarray, tc: np.ndarray,
                 waits: dict[int, list[Wait]], live: Liveness) -> RootCause:
    if isinstance(node, int) and status.get(node) != RankStatus.BLOCKED:
        stop = last_activity.get(node)
        if node in live.culprits():  # it was seen alive (heartbeat) after its last record
            stop = live.seen_ns.get(node, stop)
        gap = _usual_gap(trace, te, tc, node) if stop is not None else None
        silence = end - stop if stop is not None else None
        exited = status.get(node) == RankStatus.FINISHED  # its process left while others wait: no doubt
        return RootCause(node, "rank", (node,), waiters, first_wait, stop, silence, gap, exited)
    if isinstance(node, int):  # blocked, but in something whose partners are unknown
        w = waits[node][0]
        return RootCause(node, "blocked-unknown", (node,), waiters, w, w.since_ns, end - w.since_ns, None, False)
    if node[0] == "inst":
        i = node[1]
        d = details[i]
        stop = int(m.collectives.last_enter[i])
        gap = _usual_duration(trace, m, te, tc, int(m.index.inst_gidx[i]))
        group = trace.groups.get(int(m.index.group_ids[m.index.inst_gidx[i]]))
        # can never complete: no doubt it is stuck (unless its calls were only assigned to one group by inference)
        mismatched = bool(m.collectives.mismatch[i]) and not (group is not None and group.assigned)
        return RootCause(node, "instance", tuple(d.entered), waiters, first_wait, stop, end - stop, gap,
                         mismatched, detail=d)
    _, src, dst = node
    stop = first_wait.since_ns if first_wait else None
    gap = _usual_gap(trace, te, tc, src) if trace.has(src) else None
    return RootCause(node, "link", (src, dst), waiters, first_wait, stop, None if stop is None else end - stop,
                     gap, False)


def _named_absentees(trace: TraceSet, never_entered: tuple[int, ...]) -> list[int]:
    """The members a collective waits for that get a node: every one with a trace, and the first
    :data:`MAX_UNTRACED` of those without (the trace-problem finding counts the missing ranks)."""
    traced = [r for r in never_entered if trace.has(r)]
    if len(never_entered) - len(traced) <= MAX_UNTRACED:
        return list(never_entered)
    return sorted(traced + [r for r in never_entered if not trace.has(r)][:MAX_UNTRACED])


def _chain(graph: nx.DiGraph, nodes: set[Hashable] | frozenset) -> tuple[list[str], Wait | None]:
    """The longest wait chain ending at the root, as words, one step per element (one breadth-first search back
    from the root: the path to the farthest waiting rank follows the search's own steps)."""
    rev = graph.reverse(copy=False)
    best: tuple[int, int] | None = None
    best_path: list[Hashable] = []
    for start in sorted(nodes, key=str):
        parent: dict[Hashable, Hashable] = {start: start}
        dist = {start: 0}
        queue = [start]
        for n in queue:  # (grows while it is read: a breadth-first search)
            for p in rev.successors(n):
                if p not in dist:
                    dist[p], parent[p] = dist[n] + 1, n
                    queue.append(p)
        far = [(d, -n) for n, d in dist.items() if isinstance(n, int) and n not in nodes]
        if far and (best is None or max(far) > best):
            best = max(far)
            path = [-best[1]]
            while path[-1] != start:
                path.append(parent[path[-1]])
            best_path = path
    steps: list[str] = []
    wait: Wait | None = None
    for k, a in enumerate(best_path[:-1]):
        if not isinstance(a, int):
            continue
        wait = graph.edges[a, best_path[k + 1]]["wait"]
        text = f"rank {a} waits in {wait.label}"
        nxt = best_path[k + 2] if k + 2 < len(best_path) else None
        if isinstance(best_path[k + 1], tuple) and best_path[k + 1][0] == "inst" and isinstance(nxt, int):
            text += f" for rank {nxt}"
        if wait.failed:
            text += " (the call failed)"
        steps.append(text)
    return steps, wait


def _fold_consequences(roots: list[RootCause], m: MatchResult) -> list[RootCause]:
    """Fold each stuck instance or link that every participant entered and none completed (not a mismatch)
    into the confirmed stopped-rank roots that one of its participants also waits for: its members wait for
    that rank in other calls, and a rank's device runs its calls in order across groups (NCCL: one stream per
    communicator, fed by compute that needs the stopped rank's data), so such a call is held up by the stop,
    not by the network. Its participants and waiters join the rank root's waiters. Without a confirmed
    stopped rank that its participants wait for, it stays a root."""
    stopped = [r for r in roots if r.kind == "rank" and r.confirmed]
    if not stopped:
        return roots
    kept = []
    for root in roots:
        own = root.kind == "link" or (root.kind == "instance" and root.detail is not None
                                      and not root.detail.completed and not _mismatch(m, root))
        members = set(root.detail.members if root.detail is not None else root.ranks)
        hosts = [r for r in stopped if members & set(r.waiters)] if own else []
        if not hosts:
            kept.append(root)
        for r in hosts:
            r.waiters = tuple(sorted((set(r.waiters) | members | set(root.waiters)) - set(r.ranks)))
    return kept


def _mismatch(m: MatchResult, root: RootCause) -> bool:
    """The root is a stuck instance whose members disagree, in a group whose calls are known to be its own."""
    g = root.detail.group if root.detail is not None else None
    return bool(m.collectives.mismatch[root.node[1]]) and not (g is not None and g.assigned)


def _drop_ended_by_launcher(roots: list[RootCause], trace: TraceSet, status: dict[int, RankStatus],
                            crashed: set[int]) -> list[RootCause]:
    """Without a trace of their own, ranks the launcher ended after another rank crashed are no root: their
    "never entered" is unobserved, and their end is the crash's consequence (srun --kill-on-bad-exit, torchrun
    stopping the job). Kept when no crashed rank is a root (then they are all that is known)."""
    if not any(r in crashed for root in roots for r in root.ranks):
        return roots

    def ended(r: int) -> bool:
        p = trace.facts.procs.get(r)
        return status.get(r) == RankStatus.MISSING and p is not None and p.killed_by_launcher

    return [root for root in roots if not (root.kind == "rank" and root.ranks and all(map(ended, root.ranks)))]


def _merge_co_missing(graph: nx.DiGraph, roots: list[RootCause], crashed: set[int]) -> list[RootCause]:
    """One root for the stopped ranks that one collective waits for together (its members that never entered
    it, when each is a root of the same standing: both confirmed or not, both crashed or not): torchfrtrace's
    "missing ranks" of that collective. Other stopped ranks stay roots of their own (a crashed process is named
    apart from a silent one that waited beside it)."""
    rank_roots = {r.node: r for r in roots if r.kind == "rank" and isinstance(r.node, int)}
    if len(rank_roots) < 2:
        return roots
    parent = {n: n for n in rank_roots}

    def find(n: int) -> int:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node in graph.nodes:
        if isinstance(node, tuple) and node[0] == "inst":
            together = [m for m in graph.successors(node) if m in rank_roots]
            for m in together[1:]:
                a, b = find(together[0]), find(m)
                if a != b and rank_roots[a].confirmed == rank_roots[b].confirmed \
                        and (together[0] in crashed) == (m in crashed):
                    parent[b] = a
    merged: dict[int, list[RootCause]] = {}
    for n in rank_roots:
        merged.setdefault(find(n), []).append(rank_roots[n])
    out = []
    for root in roots:
        if root.kind != "rank" or not isinstance(root.node, int) or root.node not in parent:
            out.append(root)
        elif find(root.node) == root.node:
            out.append(_merged(merged[root.node]) if len(merged[root.node]) > 1 else root)
    return out


def _merged(parts: list[RootCause]) -> RootCause:
    ranks = tuple(sorted(r for p in parts for r in p.ranks))
    waits = [p for p in parts if p.first_wait is not None]
    lead = min(waits, key=lambda p: p.first_wait.since_ns) if waits else parts[0]
    stops = [p.stop_ns for p in parts]
    silences = [p.silence_ns for p in parts if p.silence_ns is not None]
    gaps = [p.usual_gap_ns for p in parts if p.usual_gap_ns is not None]
    return RootCause(lead.node, "rank", ranks, tuple(sorted(set().union(*(p.waiters for p in parts)) - set(ranks))),
                     lead.first_wait, None if None in stops else min(stops), max(silences) if silences else None,
                     max(gaps) if gaps else None, all(p.confirmed for p in parts), lead.chain, lead.chain_wait)
