"""The root causes of a hang: the sinks of the wait-for graph and what is done with them.

Holds the graph's vocabulary (:class:`RankStatus`, :class:`Wait`, :class:`RootCause`), the search for its sink
components reached from blocked ranks (:func:`find_roots`, each with its longest wait chain), the decision whether
a root's stop is a hang rather than an operation in flight (:func:`confirm_roots`, against a rank's usual gap
between calls: :func:`usual_gap`), and the refinements of the roots found: a stuck instance or link folded into a
stopped rank its members wait for (:func:`fold_consequences`), stopped ranks one collective waits for together made
one root (:func:`merge_co_missing`), ranks the launcher ended after a crash dropped
(:func:`drop_ended_by_launcher`). :mod:`megatrace.analyze.hang` builds the graph and calls them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from megatrace.analyze.liveness import Liveness
from megatrace.analyze.match import InstanceDetail, MatchResult
from megatrace.analyze.wait_graph import WaitGraph
from megatrace.load.traceset import TraceSet
from megatrace.trace.ring_format import Op, State

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
GAP_WINDOW = 1000  # recent records of a rank used for its usual gap between calls


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
    since_ns: int  # aligned enqueue time
    failed: bool  # the call raised (e.g. a timeout)
    outstanding_async: bool  # not the rank's last call: an async op it probably waits on
    target: Hashable | None  # graph node it points at
    labeller: Callable[[int], str] = field(repr=False, compare=False)  # a row's label (words.record_label)

    @cached_property
    def label(self) -> str:
        """"TP all_reduce #49 (group [4, 5])", "PP recv #13 from rank 4": made when shown (thousands of ranks
        wait, a few are named)."""
        return self.labeller(self.row)


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


def usual_gap(trace: TraceSet, te: np.ndarray, tc: np.ndarray, rank: int) -> int:
    """p95 of the rank's recent time outside communication (from its latest completion to its next call)."""
    rows = trace.rows(rank)
    window = slice(max(rows.start, rows.stop - GAP_WINDOW), rows.stop)
    busy_until = np.maximum.accumulate(np.maximum(te[window], tc[window]))
    gaps = np.clip(te[window][1:] - busy_until[:-1], 0, None)
    return int(np.percentile(gaps, 95)) if len(gaps) >= 3 else 0


def usual_duration(trace: TraceSet, m: MatchResult, te: np.ndarray, tc: np.ndarray, gidx: int) -> int:
    rec = trace.records  # (the group's records: its id, and no marker's)
    rows = np.flatnonzero((rec.group_id == m.index.group_ids[gidx]) & (rec.op < Op.MARK_STEP)
                          & (rec.state == State.COMPLETED))[-GAP_WINDOW:]
    d = tc[rows] - te[rows]
    return int(np.percentile(d, 95)) if len(d) >= 3 else 0


def confirm_roots(trace: TraceSet, roots: list[RootCause], waits: dict[int, list[Wait]], quiet: bool,
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


def find_roots(trace: TraceSet, m: MatchResult, graph: WaitGraph, waits: dict[int, list[Wait]],
           details: dict[int, InstanceDetail], status: dict[int, RankStatus], last_activity: dict[int, int],
           end: int, te: np.ndarray, tc: np.ndarray, live: Liveness) -> list[RootCause]:
    if not graph.number_of_nodes():
        return []
    roots: list[RootCause] = []
    # The sink components (no wait leaves them), in the order Tarjan's search finds them (as networkx's); no condensed
    # graph is built (at 16,384 ranks that cost more than finding the components).
    for nodes in graph.strongly_connected_components():
        if any(s not in nodes for n in nodes for s in graph.successors(n)):
            continue
        up = set().union(*(graph.ancestors(n) for n in nodes)) - set(nodes)
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


def _direct_waits(graph: WaitGraph, nodes: set[Hashable] | frozenset) -> list[Wait]:
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
        gap = usual_gap(trace, te, tc, node) if stop is not None else None
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
        gap = usual_duration(trace, m, te, tc, int(m.index.inst_gidx[i]))
        group = trace.groups.get(int(m.index.group_ids[m.index.inst_gidx[i]]))
        # can never complete: no doubt it is stuck (unless its calls were only assigned to one group by inference)
        mismatched = bool(m.collectives.mismatch[i]) and not (group is not None and group.assigned)
        return RootCause(node, "instance", tuple(d.entered), waiters, first_wait, stop, end - stop, gap,
                         mismatched, detail=d)
    _, src, dst = node
    stop = first_wait.since_ns if first_wait else None
    gap = usual_gap(trace, te, tc, src) if trace.has(src) else None
    return RootCause(node, "link", (src, dst), waiters, first_wait, stop, None if stop is None else end - stop,
                     gap, False)


def _chain(graph: WaitGraph, nodes: set[Hashable] | frozenset) -> tuple[list[str], Wait | None]:
    """The longest wait chain ending at the root, as words, one step per element (one breadth-first search back
    from the root: the path to the farthest waiting rank follows the search's own steps)."""
    best: tuple[int, int] | None = None
    best_path: list[Hashable] = []
    for start in sorted(nodes, key=str):
        parent: dict[Hashable, Hashable] = {start: start}
        dist = {start: 0}
        queue = [start]
        for n in queue:  # (grows while it is read: a breadth-first search)
            for p in graph.predecessors(n):
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


def fold_consequences(roots: list[RootCause], m: MatchResult) -> list[RootCause]:
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


def drop_ended_by_launcher(roots: list[RootCause], trace: TraceSet, status: dict[int, RankStatus],
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


def merge_co_missing(graph: WaitGraph, roots: list[RootCause], crashed: set[int]) -> list[RootCause]:
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
