"""The training dependency graph: one DAG per iteration, built from the layout, the schedule and the records.

Nodes (integer ids into :attr:`IterationGraph.nodes`, small frozen :class:`Node`
dataclasses) are, per data-parallel replica and pipeline stage, the step's
*head* (optimizer and data loading before the first exchange), the forward and
backward of each microbatch (the TP group as one unit), the *tail* before the
gradient sync, then one DP *sync* per stage, and the step's start and end.
Every node carries its measured duration; its edges carry the dependency
(:class:`Edge`: kind and weight). An edge's weight is its source node's
duration plus the communication it waits for once both sides are ready (the
p2p exchange before the target), so the longest path from start to end is the
critical path and its length the modelled step time.

Durations come from the records: an action's time runs from the completion of
the exchange before it to the enqueue of the exchange after it (see
:mod:`megatrace.analyze.segments`). For a TP group, each stretch of compute
between two of its TP collectives counts with its slowest member (who is
credited with it), and each TP collective with its time after the last
arrival.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from megatrace.analyze.iterations import Iterations
from megatrace.analyze.segments import RankSegments, SegmentError
from megatrace.config import Layout
from megatrace.errors import MegatraceError
from megatrace.schedule import Action


MAX_REPLICAS = 4  # DP replicas modelled per step beyond this many: those last at the gradient sync
NODE_BUDGET = 200_000  # graph nodes over all modelled steps: bounds time and memory at 16k ranks


class GraphError(MegatraceError, ValueError):
    """The graph of an iteration is not a valid DAG from start to end; the message says why."""


class NodeKind(str, enum.Enum):
    START = "start"  # the step begins (the previous step's end)
    HEAD = "head"  # before the first exchange: optimizer step of the previous iteration, data loading
    FORWARD = "forward"
    BACKWARD = "backward"
    RUN = "run"  # several actions with no communication between them (e.g. F0+B0 on the last stage)
    TAIL = "tail"  # after the last action, before the gradient sync
    SYNC = "dp-sync"  # the stage's data-parallel gradient sync
    END = "end"


class EdgeKind(str, enum.Enum):
    START = "start"  # step start -> a replica's head; weight: the replica's carry-over from the previous step
    COMPUTE = "compute"  # schedule order on one stage
    PP_ACTIVATION = "pp-activation"  # a forward's output to the next stage
    PP_GRADIENT = "pp-gradient"  # a backward's input gradient to the previous stage
    PP_READY = "pp-ready"  # a send completes once its receiver has posted the receive
    DP_SYNC = "dp-sync"  # a replica's tail -> its stage's gradient sync
    END = "end"


@dataclass(frozen=True)
class Node:
    """One unit of work of one iteration (times in ns)."""

    kind: NodeKind
    step: int
    stage: int = -1
    dp: int = -1
    actions: tuple[Action, ...] = ()
    ranks: tuple[int, ...] = ()  # who does it (the TP group; the DP groups of a stage for a sync)
    duration_ns: int = 0
    compute_ns: tuple[tuple[int, int], ...] = ()  # (rank, ns): who the duration's compute is credited to
    comm_ns: int = 0  # part of the duration spent in collectives after the last arrival (TP, or the DP sync)
    start_ns: int = 0  # measured: earliest start among the ranks
    end_ns: int = 0  # measured: latest end

    @property
    def label(self) -> str:
        if self.actions:
            return "+".join(f"{k}{mb}" for k, mb in self.actions)
        return self.kind.value


@dataclass(frozen=True)
class Edge:
    """A dependency: ``weight`` = the source's duration + ``comm_ns`` (exchange time after both sides were ready)."""

    kind: EdgeKind
    weight: int
    comm_ns: int = 0
    link: tuple[int, int] | None = None  # the ranks whose transfer set ``comm_ns``
    carry_ns: int = 0  # START edges: how much later than the step start this replica began


@dataclass
class IterationGraph:
    """The dependency DAG of one step."""

    step: int
    graph: nx.DiGraph  # node ids -> ``nodes``; edge attributes ``weight`` (int) and ``edge`` (:class:`Edge`)
    nodes: list[Node]
    start_ns: int  # measured step start and end (aligned ns)
    end_ns: int
    start: int = 0  # node ids of START and END
    end: int = 1
    notes: list[str] = field(default_factory=list)

    @property
    def wall_ns(self) -> int:
        return self.end_ns - self.start_ns

    def edge(self, u: int, v: int) -> Edge:
        return self.graph.edges[u, v]["edge"]


def validate(g: IterationGraph) -> None:
    """Raise :class:`GraphError` unless the graph is acyclic, every node lies between START and END, weights >= 0."""
    graph = g.graph
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise GraphError(f"step {g.step}: the dependency graph has a cycle through "
                         f"{', '.join(g.nodes[u].label for u, _ in cycle[:6])}")
    reach = nx.descendants(graph, g.start) | {g.start}
    back = nx.ancestors(graph, g.end) | {g.end}
    stray = [n for n in graph.nodes if n not in reach or n not in back]
    if stray:
        names = ", ".join(f"{g.nodes[n].label} (stage {g.nodes[n].stage}, dp {g.nodes[n].dp})" for n in stray[:6])
        raise GraphError(f"step {g.step}: {len(stray)} nodes are not on a path from start to end: {names}")
    bad = [(u, v) for u, v, w in graph.edges(data="weight") if w is None or w < 0]
    if bad:
        raise GraphError(f"step {g.step}: {len(bad)} edges have a negative or missing weight")


@dataclass
class _Unit:
    """A TP group (one replica's stage) with its members' schedule matches."""

    dp: int
    stage: int
    ranks: tuple[int, ...]
    segs: list[RankSegments]
    node_of_action: dict[int, int] = field(default_factory=dict)  # action index -> node id
    chain: list[int] = field(default_factory=list)  # node ids in order: head, actions..., tail


class _Builder:
    def __init__(self, it: Iterations, layout: Layout, te: np.ndarray, tc: np.ndarray, step: int) -> None:
        self.it, self.layout, self.te, self.tc, self.step = it, layout, te, tc, step
        self.graph = nx.DiGraph()
        self.nodes: list[Node] = []

    def add(self, node: Node) -> int:
        self.nodes.append(node)
        self.graph.add_node(len(self.nodes) - 1)
        return len(self.nodes) - 1

    def link(self, u: int, v: int, kind: EdgeKind, comm: int = 0, link: tuple[int, int] | None = None,
             carry: int = 0) -> None:
        weight = self.nodes[u].duration_ns + comm + carry
        old = self.graph.get_edge_data(u, v)
        if old is not None and old["weight"] >= weight:
            return
        self.graph.add_edge(u, v, weight=weight, edge=Edge(kind, weight, comm, link, carry))

    def work(self, unit: _Unit, si: int, acts: list[int]) -> Node:
        """The node of actions ``acts`` (consecutive) of a unit."""
        segs = unit.segs
        starts = [int(s.act_start[si, acts[0]]) for s in segs]
        ends = [int(s.act_end[si, acts[-1]]) for s in segs]
        inner = [(int(s.act_lo[si, acts[0]]), int(s.act_hi[si, acts[-1]])) for s in segs]
        sizes = {hi - lo for lo, hi in inner}
        credit: dict[int, int] = {}
        comm = 0
        if len(sizes) == 1:
            gaps = []
            inop = []
            for (lo, hi), s0, e0 in zip(inner, starts, ends):
                te, tc = self.te[lo:hi], self.tc[lo:hi]
                tc = np.where(tc > 0, tc, te)
                gaps.append(np.maximum(np.diff(np.concatenate([[s0], np.ravel(np.column_stack([te, tc])), [e0]]))
                                       [::2], 0))
                inop.append(np.maximum(tc - te, 0))
            gap = np.array(gaps)
            who = gap.argmax(axis=0)
            for k, m in enumerate(who.tolist()):
                credit[unit.ranks[m]] = credit.get(unit.ranks[m], 0) + int(gap[m, k])
            comm = int(np.array(inop).min(axis=0).sum()) if inop and len(inop[0]) else 0
            duration = sum(credit.values()) + comm
        else:  # members disagree on their inner records: the slowest member's span
            spans = [e - s for s, e in zip(starts, ends)]
            m = int(np.argmax(spans))
            credit[unit.ranks[m]] = max(spans[m], 0)
            duration = credit[unit.ranks[m]]
        kinds = {segs[0].actions[j][0] for j in acts}
        kind = NodeKind.RUN if len(acts) > 1 else NodeKind.FORWARD if kinds == {"F"} else NodeKind.BACKWARD
        return Node(kind, self.step, unit.stage, unit.dp, tuple(segs[0].actions[j] for j in acts), unit.ranks,
                    duration, tuple(sorted(credit.items())), comm, min(starts), max(ends))

    def block_cost(self, unit: _Unit, si: int, j: int) -> tuple[int, tuple[int, int] | None]:
        """Exchange time of block ``j`` after both sides were ready: the slowest member's, and its link."""
        costs = [int(s.blk_done[si, j] - s.blk_ready[si, j]) if s.blk_present[si, j] else 0 for s in unit.segs]
        m = int(np.argmax(costs))
        peer = int(unit.segs[m].blk_peer[si, j])
        return max(costs[m], 0), (unit.ranks[m], peer) if peer >= 0 and costs[m] > 0 else None


def _units(segs: dict[int, RankSegments], layout: Layout, replicas: list[int]) -> list[_Unit]:
    units = []
    for stage in range(layout.pp):
        for dp in replicas:
            ranks = tuple(layout.rank_of(stage, dp, t) for t in range(layout.tp))
            missing = [r for r in ranks if r not in segs]
            if missing:
                raise GraphError(f"ranks {missing} have no schedule match (missing or unmatched ring)")
            units.append(_Unit(dp, stage, ranks, [segs[r] for r in ranks]))
    return units


def _index(seg: RankSegments, step: int) -> int:
    """Position of ``step`` in a match's steps (-1 if absent or not matched)."""
    i = int(np.searchsorted(seg.steps, step))
    return i if i < len(seg.steps) and seg.steps[i] == step and seg.ok[i] else -1


def build_graph(it: Iterations, layout: Layout, te: np.ndarray, tc: np.ndarray, step: int,
                segs: dict[int, RankSegments], replicas: list[int] | None = None) -> IterationGraph:
    """The dependency DAG of one analysed step over ``replicas`` (default: all DP replicas), validated.

    ``segs``: schedule matches of every rank of those replicas covering ``step``, with ``prev_end`` set.
    """
    if it.schedule_problem:
        raise GraphError(it.schedule_problem)
    replicas = list(range(layout.dp)) if replicas is None else replicas
    units = _units(segs, layout, replicas)
    b = _Builder(it, layout, te, tc, step)
    k = int(np.searchsorted(it.steps, step))
    start_ns, end_ns = int(it.start_ns[k]), int(it.end_ns[k])
    start = b.add(Node(NodeKind.START, step, start_ns=start_ns, end_ns=start_ns))
    end = b.add(Node(NodeKind.END, step, start_ns=end_ns, end_ns=end_ns))
    for unit in units:
        si = _index(unit.segs[0], step)
        if si < 0 or any(_index(s, step) != si for s in unit.segs):
            raise GraphError(f"step {step} is not matched on ranks {list(unit.ranks)}")
        runs = unit.segs[0].act_run[si]
        if any(not np.array_equal(s.act_run[si], runs) for s in unit.segs[1:]):
            raise GraphError(f"step {step}: the TP group {list(unit.ranks)} split its actions differently")
        prev_end = [int(s.prev_end[si]) for s in unit.segs]
        head_start = max(prev_end) if min(prev_end) > 0 else max(int(s.act_start[si, 0]) for s in unit.segs)
        heads = [max(0, int(s.blk_first[si, 0]) - head_start) if s.blk_present[si, 0] and min(prev_end) > 0 else 0
                 for s in unit.segs]
        head = b.add(_gap_node(NodeKind.HEAD, step, unit, heads, head_start))
        b.link(start, head, EdgeKind.START, carry=max(0, head_start - start_ns))
        unit.chain.append(head)
        j = 0
        n_act = len(runs)
        while j < n_act:
            acts = [j]
            while acts[-1] + 1 < n_act and runs[acts[-1] + 1] == runs[j]:
                acts.append(acts[-1] + 1)
            node = b.add(b.work(unit, si, acts))
            for a in acts:
                unit.node_of_action[a] = node
            unit.chain.append(node)
            j = acts[-1] + 1
        segs = unit.segs
        last_blk = n_act if segs[0].blk_present[si, n_act] else None
        after = max(int(s.blk_done[si, n_act]) if last_blk is not None else int(s.act_end[si, n_act - 1])
                    for s in segs)
        tails = [max(0, int(s.dp_first[si]) - after) if s.dp_first[si] > 0 else 0 for s in segs]
        tail = b.add(_gap_node(NodeKind.TAIL, step, unit, tails, after))
        unit.chain.append(tail)
    _edges(b, units, step)
    _syncs(b, units, layout, step, end)
    g = IterationGraph(step, b.graph, b.nodes, start_ns, end_ns, start, end)
    if len(replicas) < layout.dp:
        g.notes.append(f"{len(replicas)} of {layout.dp} DP replicas modelled (those last at the gradient sync)")
    try:
        validate(g)
    except GraphError:
        ready = [(u, v) for u, v, e in g.graph.edges(data="edge") if e.kind == EdgeKind.PP_READY]
        if not ready:
            raise
        g.graph.remove_edges_from(ready)
        g.notes.append("rendezvous (pp-ready) edges made a cycle and were left out")
        validate(g)
    return g


def _gap_node(kind: NodeKind, step: int, unit: _Unit, spans: list[int], at: int) -> Node:
    """A head or tail: compute of each member from ``at``; the longest counts and is credited to its rank."""
    m = int(np.argmax(spans))
    return Node(kind, step, unit.stage, unit.dp, (), unit.ranks, spans[m], ((unit.ranks[m], spans[m]),) if spans[m]
                else (), 0, at, at + spans[m])


def _edges(b: _Builder, units: list[_Unit], step: int) -> None:
    """Schedule order within each unit, activations and gradients between stages, rendezvous of sends."""
    by_pos = {(u.dp, u.stage): u for u in units}
    for unit in units:
        segs = unit.segs
        si = _index(segs[0], step)
        actions = segs[0].actions
        n_act = len(actions)
        for prev, node in zip(unit.chain, unit.chain[1:]):
            acts = b.nodes[node].actions
            j = actions.index(acts[0]) if acts else n_act  # the tail sits after block n_act
            comm, link = b.block_cost(unit, si, j) if segs[0].blk_present[si, j] else (0, None)
            b.link(prev, node, EdgeKind.COMPUTE, comm, link)
            if not acts:
                continue
            kind, mb = acts[0]
            src_stage = unit.stage - 1 if kind == "F" else unit.stage + 1
            src = by_pos.get((unit.dp, src_stage))
            if src is not None:
                producer = src.node_of_action[src.segs[0].actions.index((kind, mb))]
                b.link(producer, node, EdgeKind.PP_ACTIVATION if kind == "F" else EdgeKind.PP_GRADIENT, comm, link)
        # Sends in block j complete once the receiver posted its receive: an edge from the receiver's node
        # before that receive to this unit's node after block j.
        for j in range(n_act + 1):
            if not segs[0].blk_present[si, j] or j == 0:
                continue
            kind, mb = actions[j - 1]
            dst = by_pos.get((unit.dp, unit.stage + 1 if kind == "F" else unit.stage - 1))
            if dst is None:
                continue
            consumer = dst.node_of_action[dst.segs[0].actions.index((kind, mb))]
            pos = dst.chain.index(consumer)
            nxt = unit.node_of_action.get(j, unit.chain[-1])
            comm, link = b.block_cost(unit, si, j)
            b.link(dst.chain[pos - 1], nxt, EdgeKind.PP_READY, comm, link)


def _syncs(b: _Builder, units: list[_Unit], layout: Layout, step: int, end: int) -> None:
    """One DP sync per stage (its time after the last arrival), or straight to END without DP."""
    for stage in range(layout.pp):
        mine = [u for u in units if u.stage == stage]
        si = _index(mine[0].segs[0], step)
        has_dp = all(s.dp_first[si] > 0 for u in mine for s in u.segs)
        if not has_dp or layout.dp == 1:
            for u in mine:
                b.link(u.chain[-1], end, EdgeKind.END)
            continue
        cost, ready_at, done_at = 0, 0, 0
        for t in range(layout.tp):
            segs = [u.segs[t] for u in mine]
            ready = max(int(s.dp_first[si]) for s in segs)
            done = max(int(s.dp_done[si]) for s in segs)
            if done - ready >= cost:
                cost, ready_at, done_at = max(done - ready, 0), ready, done
        ranks = tuple(sorted(r for u in mine for r in u.ranks))
        sync = b.add(Node(NodeKind.SYNC, step, stage, -1, (), ranks, cost, (), cost, ready_at, done_at))
        for u in mine:
            b.link(u.chain[-1], sync, EdgeKind.DP_SYNC)
        b.link(sync, end, EdgeKind.END)


def choose_steps(it: Iterations, layout: Layout, max_steps: int | None) -> list[int]:
    """Evenly spaced analysed steps, at most ``max_steps`` and within :data:`NODE_BUDGET` graph nodes."""
    steps = it.steps.tolist()
    per_step = min(layout.dp, MAX_REPLICAS) * layout.pp * (2 * (it.microbatches or layout.microbatches) + 2)
    limit = max(1, min(max_steps or len(steps), NODE_BUDGET // max(per_step, 1)))
    if len(steps) > limit:
        keep = np.unique(np.linspace(0, len(steps) - 1, limit).round().astype(int))
        steps = [steps[i] for i in keep]
    return steps


def choose_replicas(it: Iterations, layout: Layout, trace_ranks: np.ndarray, step: int) -> list[int]:
    """All DP replicas, or the :data:`MAX_REPLICAS` whose ranks arrived last at the step's gradient sync."""
    if layout.dp <= MAX_REPLICAS or it.dp_arrival is None:
        return list(range(layout.dp))
    k = int(np.searchsorted(it.steps, step))
    late = np.zeros(layout.dp, np.int64)
    for i, r in enumerate(trace_ranks.tolist()):
        if r < layout.world_size:
            d = layout.coords(r).dp
            late[d] = max(late[d], int(it.dp_arrival[i, k]))
    return sorted(np.argsort(-late, kind="stable")[:MAX_REPLICAS].tolist())


def _previous_ends(it: Iterations, segs: dict[int, RankSegments], trace_ranks: np.ndarray) -> None:
    """A matched step after a gap in the matched steps takes its start from the rank's previous step's end."""
    pos = {r: i for i, r in enumerate(trace_ranks.tolist())}
    where = {int(k): i for i, k in enumerate(it.steps.tolist())}
    for r, seg in segs.items():
        for i, k in enumerate(seg.steps.tolist()):
            prev = where.get(k - 1)
            if seg.prev_end[i] < 0 and prev is not None and r in pos:
                seg.prev_end[i] = it.rank_end[pos[r], prev]


def build_graphs(it: Iterations, layout: Layout, te: np.ndarray, tc: np.ndarray, trace_ranks: np.ndarray,
                 max_steps: int | None = None) -> tuple[list[IterationGraph], list[str]]:
    """Graphs of a sample of the analysed steps (see :func:`choose_steps`) and the problems that stopped any."""
    if it.schedule_problem:
        return [], [it.schedule_problem]
    steps = choose_steps(it, layout, max_steps)
    replicas = {s: choose_replicas(it, layout, trace_ranks, s) for s in steps}
    ranks = sorted({layout.rank_of(p, d, t) for reps in replicas.values() for d in reps
                    for p in range(layout.pp) for t in range(layout.tp)})
    present = set(trace_ranks.tolist())
    if not present.issuperset(ranks):
        missing = sorted(set(ranks) - present)
        return [], [f"no ring for ranks {missing[:12]}: the dependency graph needs every rank of a replica"]
    try:
        segs = it.segments_for(ranks, np.array(steps, np.int64))
    except SegmentError as exc:
        return [], [str(exc)]
    _previous_ends(it, segs, trace_ranks)
    problems: list[str] = []
    graphs: list[IterationGraph] = []
    for step in steps:
        try:
            graphs.append(build_graph(it, layout, te, tc, int(step), segs, replicas[step]))
        except GraphError as exc:
            problems.append(str(exc))
    return graphs, problems
