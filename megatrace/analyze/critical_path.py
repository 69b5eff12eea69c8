"""The critical path of every iteration, who holds it, and whether steps got slower than the healthy ones.

For each analysed step the dependency DAG (:mod:`megatrace.analyze.depgraph`)
is validated and its longest path taken. The path's length is the modelled
step time (close to the measured one when the model fits; both are reported).
Each stretch of the path is credited: the compute of a forward/backward to the
TP member that was slowest in it, TP and DP collectives to their groups,
exchange time after both sides were ready to the link, a replica starting late
to the carry-over from the previous step.

The expected step time is learned from the first healthy iterations: the
median of the steps after the warm-up step and before the change point where
later steps become slower (if any). A slowdown is reported with the rank (or
link) whose critical-path time grew the most.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from megatrace.analyze.context import AnalysisContext
from megatrace.analyze.depgraph import GraphError, IterationGraph, NodeKind, build_graphs, validate
from megatrace.analyze.findings import Finding, Severity, Subject
from megatrace.analyze.iterations import Iterations, iterations_of, perf_kind
from megatrace.analyze.peers import peer_groups
from megatrace.analyze.words import duration, rank_label, rank_subject
from megatrace.load.traceset import TraceSet

WARMUP_STEPS = 1  # the first step (allocator, connection setup, autograd warm-up) never counts as healthy
BASELINE_MAX_STEPS = 5  # at most this many early steps make the expected step time (their median)
MIN_SIDE_STEPS = 3  # a change point needs this many steps on each side (two noisy steps are not a trend)
SLOWDOWN_RATIO = 1.2  # steps this much slower than expected (median after the change point) are a slowdown;
#                       healthy demo runs on a loaded 2-core machine differ by up to ~10% between parts of a run
SEPARATION = 0.75  # and at least this share of the later steps is slower than every baseline step
MIN_EFFECT_NS = 5_000_000  # and slower by at least 5 ms: below that, timer and scheduler noise
MIN_EFFECT_FRAC = 0.10  # and by at least 10% of the expected step time
MIN_EXPLAINED = 0.5  # a slowdown is a warning only when one rank or link explains this share of it; a diffuse
#                     one (every rank slower: machine load, a shared filesystem, the network) is reported as info
MAX_GRAPHS = 16  # iterations whose graph is built (evenly spaced; every step still has its measured time)
TOP_LISTED = 5  # ranks / links / stages listed in evidence


@dataclass
class IterationPath:
    """One step's critical path and what it is made of (ns)."""

    step: int
    wall_ns: int  # measured step time
    length_ns: int  # modelled: the critical path's length
    path: list[int]  # node ids of the graph
    labels: list[str]  # e.g. "stage 1 dp 0 F2 (12.1 ms)"
    by_category: dict[str, int]  # compute, head, tail, tp-comm, pp-comm, dp-sync, carry
    by_stage: dict[int, int]
    by_rank: dict[int, int]  # compute credited to each rank
    by_link: dict[tuple[int, int], int]  # exchange time after both sides were ready

    def share(self, ns: int) -> float:
        return ns / self.length_ns if self.length_ns else 0.0


@dataclass
class Slowdown:
    onset_step: int  # first slow step
    expected_ns: int  # median of the healthy steps before it
    observed_ns: int  # median from the onset on
    baseline_steps: list[int]
    culprit: str  # "rank" or "link" (or "" when nothing stands out)
    rank: int | None = None
    link: tuple[int, int] | None = None
    growth_ns: int = 0  # how much more the culprit's time per step grew than its peers' (see _culprit)

    @property
    def ratio(self) -> float:
        return self.observed_ns / self.expected_ns if self.expected_ns else 0.0

    @property
    def explained(self) -> float:
        """Share of the step-time increase that the culprit's growth on the critical path accounts for."""
        extra = self.observed_ns - self.expected_ns
        return min(1.0, self.growth_ns / extra) if extra > 0 and self.culprit else 0.0


@dataclass
class CriticalPathResult:
    """Per-step critical paths and step-time facts, plain data for the report."""

    iterations: Iterations
    paths: list[IterationPath]
    graphs: list[IterationGraph]
    expected_ns: int | None  # the healthy step time
    baseline_steps: list[int]
    slowdown: Slowdown | None
    problems: list[str] = field(default_factory=list)

    @property
    def steady(self) -> list[IterationPath]:
        """Paths of the steps after the warm-up (all of them if that leaves none)."""
        first = int(self.iterations.steps[0]) + WARMUP_STEPS if self.iterations.n_steps else 0
        kept = [p for p in self.paths if p.step >= first]
        return kept or self.paths

    def median_share(self, what: str) -> dict[Any, float]:
        """Median share of the critical path per key of ``by_<what>`` over the steady steps."""
        paths = self.steady
        keys = {k for p in paths for k in getattr(p, f"by_{what}")}
        return {k: float(np.median([p.share(getattr(p, f"by_{what}").get(k, 0)) for p in paths])) for k in keys}

    def summary(self) -> dict[str, Any]:
        it = self.iterations
        steady = self.steady
        out: dict[str, Any] = {
            "iterations": it.summary(), "steps": it.steps.tolist(), "step_ns": it.step_ns.tolist(),
            "expected_step_ns": self.expected_ns, "baseline_steps": self.baseline_steps,
            "modelled_ns": [p.length_ns for p in self.paths], "modelled_steps": [p.step for p in self.paths],
            "share_by_category": _rounded(self.median_share("category")),
            "share_by_stage": _rounded(self.median_share("stage")),
            "share_by_rank": _rounded(self.median_share("rank")),
            "share_by_link": {f"{a}-{b}": v for (a, b), v in _rounded(self.median_share("link")).items()},
            "fit": round(float(np.median([p.length_ns / p.wall_ns for p in steady if p.wall_ns])), 3)
            if steady else None, "problems": self.problems}
        if self.slowdown is not None:
            s = self.slowdown
            out["slowdown"] = {"onset_step": s.onset_step, "expected_ns": s.expected_ns, "observed_ns": s.observed_ns,
                               "ratio": round(s.ratio, 3), "culprit": s.culprit, "rank": s.rank,
                               "link": list(s.link) if s.link else None, "growth_ns": s.growth_ns,
                               "explained": round(s.explained, 3)}
        return out


def _rounded(d: dict) -> dict:
    return {k: round(v, 4) for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v > 0}


def _add(d: dict, key: Any, ns: int) -> None:
    if ns:
        d[key] = d.get(key, 0) + int(ns)


def critical_path(g: IterationGraph) -> IterationPath:
    """Validate ``g``, take its longest path (start to end) and credit every stretch of it."""
    validate(g)
    path = nx.dag_longest_path(g.graph, weight="weight")
    if path and path[-1] != g.end:  # the rest to END weighs nothing; any route will do
        path = path + nx.shortest_path(g.graph, path[-1], g.end)[1:]
    if not path or path[0] != g.start:
        path = [g.start] + nx.shortest_path(g.graph, g.start, path[0])[1:-1] + path if path else [g.start, g.end]
    cat: dict[str, int] = {}
    stage: dict[int, int] = {}
    rank: dict[int, int] = {}
    link: dict[tuple[int, int], int] = {}
    labels = []
    length = 0
    for u, v in zip(path, path[1:]):
        node, edge = g.nodes[u], g.edge(u, v)
        length += edge.weight
        if node.kind == NodeKind.SYNC:
            _add(cat, "dp-sync", node.duration_ns)
        elif node.kind in (NodeKind.HEAD, NodeKind.TAIL):
            _add(cat, node.kind.value, node.duration_ns)
        else:
            _add(cat, "compute", node.duration_ns - node.comm_ns)
            _add(cat, "tp-comm", node.comm_ns)
        for r, ns in node.compute_ns:
            _add(rank, r, ns)
        if node.stage >= 0:
            _add(stage, node.stage, node.duration_ns)
        _add(cat, "pp-comm", edge.comm_ns)
        _add(cat, "carry", edge.carry_ns)
        if edge.link is not None:
            _add(link, tuple(sorted(edge.link)), edge.comm_ns)
        if node.kind not in (NodeKind.START, NodeKind.END):
            where = f"stage {node.stage}" + (f" dp {node.dp}" if node.dp >= 0 else "")
            labels.append(f"{where} {node.label} ({duration(node.duration_ns)})")
    return IterationPath(g.step, g.wall_ns, length, path, labels, cat, stage, rank, link)


def what_if(g: IterationGraph, scale: dict[int, float]) -> int:
    """The critical path's length if each rank ``r``'s credited compute took ``scale[r]`` times as long."""
    weight: dict[tuple[int, int], int] = {}
    for u, v, e in g.graph.edges(data="edge"):
        node = g.nodes[u]
        cut = sum(ns * (1.0 - scale[r]) for r, ns in node.compute_ns if r in scale)
        weight[(u, v)] = max(0, int(e.weight - cut))
    nx.set_edge_attributes(g.graph, weight, "what_if")
    try:
        return int(nx.dag_longest_path_length(g.graph, weight="what_if"))
    finally:
        for _, _, d in g.graph.edges(data=True):
            d.pop("what_if", None)


def _change_point(steps: np.ndarray, step_ns: np.ndarray) -> tuple[int | None, int, list[int]]:
    """(onset index or None, expected ns, baseline steps): the split maximising later/earlier medians."""
    first = min(WARMUP_STEPS, max(len(steps) - 1, 0))
    ns = step_ns[first:]
    best, best_ratio = None, 0.0
    for c in range(MIN_SIDE_STEPS, len(ns) - MIN_SIDE_STEPS + 1):
        before, after = np.median(ns[:c]), np.median(ns[c:])
        if before > 0 and after / before > best_ratio:
            best, best_ratio = c, after / before
    if best is not None:
        expected = float(np.median(ns[:best][:BASELINE_MAX_STEPS]))
        after = float(np.median(ns[best:]))
        above = float(np.mean(ns[best:] > ns[:best][:BASELINE_MAX_STEPS].max()))
        if after >= SLOWDOWN_RATIO * expected and after - expected >= max(MIN_EFFECT_NS, MIN_EFFECT_FRAC * expected) \
                and above >= SEPARATION:
            return first + best, int(expected), steps[first:first + best][:BASELINE_MAX_STEPS].tolist()
    base = ns[:BASELINE_MAX_STEPS] if len(ns) else step_ns
    return None, int(np.median(base)) if len(base) else 0, steps[first:first + len(base)].tolist()


def _culprit(trace: TraceSet, it: Iterations, paths: list[IterationPath], onset: int, baseline: list[int],
             ) -> tuple[str, int | None, tuple[int, int] | None, int]:
    """The rank or link whose time per step grew the most from the healthy steps to those from ``onset`` on.

    A rank's growth is its compute per step against its peers' growth (a machine-wide slowdown grows everyone's
    and cancels out); a link's is its exchange time on the critical path against the other links'.
    """

    before, after = np.isin(it.steps, baseline), it.steps >= onset
    rank_growth = np.zeros(len(trace.ranks))
    if before.any() and after.any():
        growth = np.median(it.compute[:, after], axis=1) - np.median(it.compute[:, before], axis=1)
        for group in peer_groups(trace):
            if len(group) > 1:
                rank_growth[group] = growth[group] - np.median(growth[group])
    r_best = int(np.argmax(rank_growth)) if len(rank_growth) else -1
    link_growth: dict[tuple[int, int], float] = {}
    early = [p for p in paths if p.step in set(baseline)]
    late = [p for p in paths if p.step >= onset]
    if early and late:
        keys = {k for p in paths for k in p.by_link}
        raw = {k: float(np.median([p.by_link.get(k, 0) for p in late]) - np.median([p.by_link.get(k, 0)
                                                                                    for p in early]))
               for k in keys}
        typical = float(np.median(list(raw.values()))) if len(raw) > 1 else 0.0
        link_growth = {k: v - typical for k, v in raw.items()}
    lk = max(link_growth, key=link_growth.get, default=None)
    if lk is not None and link_growth[lk] > 0 and (r_best < 0 or link_growth[lk] > rank_growth[r_best]):
        return "link", None, lk, int(link_growth[lk])
    if r_best >= 0 and rank_growth[r_best] > 0:
        return "rank", int(trace.ranks[r_best]), None, int(rank_growth[r_best])
    return "", None, None, 0


def analyze_critical_path(trace: TraceSet, it: Iterations, te: np.ndarray, tc: np.ndarray) -> CriticalPathResult:
    """Critical paths of the analysed steps, the expected step time and any slowdown."""
    problems: list[str] = []
    graphs: list[IterationGraph] = []
    if trace.layout is None:
        problems.append("no layout: the dependency graph needs the TP/PP/DP sizes and the schedule")
    elif it.n_steps:
        graphs, problems = build_graphs(it, trace.layout, te, tc, trace.ranks, MAX_GRAPHS)
    paths = []
    for g in graphs:
        try:
            paths.append(critical_path(g))
        except (GraphError, nx.NetworkXException) as exc:
            problems.append(str(exc))
    onset_i, expected, baseline = _change_point(it.steps, it.step_ns) if it.n_steps else (None, 0, [])
    slowdown = None
    if onset_i is not None:
        onset = int(it.steps[onset_i])
        culprit, rank, link, growth = _culprit(trace, it, paths, onset, baseline)
        slowdown = Slowdown(onset, expected, int(np.median(it.step_ns[onset_i:])), baseline, culprit, rank, link,
                            growth)
    return CriticalPathResult(it, paths, graphs, expected or None, baseline, slowdown, problems)


# -- findings -------------------------------------------------------------------------------------------------

def _stage_text(shares: dict[int, float]) -> str:
    return ", ".join(f"stage {s} {v:.0%}" for s, v in sorted(shares.items()))


def critical_path_findings(trace: TraceSet, cp: CriticalPathResult) -> list[Finding]:
    it = cp.iterations
    if not it.n_steps:
        return []
    kind = perf_kind("CRITICAL_PATH")
    steady_ns = it.step_ns[min(WARMUP_STEPS, it.n_steps - 1):]
    median_ns = int(np.median(steady_ns))
    first, last = int(it.steps[min(WARMUP_STEPS, it.n_steps - 1)]), int(it.steps[-1])
    ranks = cp.median_share("rank")
    top = sorted(ranks.items(), key=lambda kv: -kv[1])[:TOP_LISTED]
    verdict = f"step time {duration(median_ns)} (median of steps {first}–{last}, from the records' {it.method})"
    evidence: list[str | dict[str, Any]] = [
        f"{it.n_steps} steps found without markers ({it.method}); step times: "
        + ", ".join(duration(x) for x in it.step_ns[:12]) + (" …" if it.n_steps > 12 else "")]
    if cp.paths:
        cats = cp.median_share("category")
        verdict += f"; critical path: {_stage_text(cp.median_share('stage'))}"
        links = sorted(cp.median_share("link").items(), key=lambda kv: -kv[1])
        if links and (not top or links[0][1] > top[0][1]):
            (a, b), v = links[0]
            verdict += f"; its largest part is p2p exchange time between ranks {a} and {b} ({v:.0%})"
        elif top:
            verdict += f"; its largest part is rank {top[0][0]}'s compute ({top[0][1]:.0%})"
        fit = np.median([p.length_ns / p.wall_ns for p in cp.steady if p.wall_ns])
        evidence.append("critical path by kind: " + ", ".join(f"{k} {v:.0%}" for k, v in
                                                               sorted(cats.items(), key=lambda kv: -kv[1]) if v > 0)
                        + f" (modelled step time = {fit:.0%} of the measured one)")
        evidence.append("share of the critical path by rank: " + ", ".join(f"rank {r} {v:.0%}" for r, v in top))
        if links and links[0][1] > 0:
            evidence.append("p2p exchange time on the path by link: "
                            + ", ".join(f"{a}–{b} {v:.0%}" for (a, b), v in links[:TOP_LISTED]))
        mid = sorted(cp.steady, key=lambda p: p.length_ns)[len(cp.steady) // 2]
        evidence.append(f"critical path of step {mid.step} ({duration(mid.length_ns)}): " + " → ".join(mid.labels))
    for p in cp.problems[:3]:
        evidence.append(f"no dependency graph: {p}")
    found = [Finding(id="critical-path:summary", severity=Severity.INFO, kind=kind, subject=Subject(),
                     verdict=verdict, evidence=evidence, confidence=0.8 * trace.coverage,
                     data=cp.summary())]
    if cp.slowdown is not None:
        found.append(_slowdown_finding(trace, cp))
    return found


def _slowdown_finding(trace: TraceSet, cp: CriticalPathResult) -> Finding:
    s = cp.slowdown
    assert s is not None
    after = [p for p in cp.paths if p.step >= s.onset_step]
    verdict = f"step time {s.ratio:.2f}× the expected {duration(s.expected_ns)} from step {s.onset_step}"
    subject = Subject()
    evidence: list[str | dict[str, Any]] = [
        f"expected step time {duration(s.expected_ns)}: median of the healthy steps "
        f"{s.baseline_steps[0]}–{s.baseline_steps[-1]}; from step {s.onset_step} the median is "
        f"{duration(s.observed_ns)}"]
    remediation = ("Compare the named rank's node with its peers (GPU clocks and temperature, CPU load, "
                   "throttling, data loading); see the straggler findings for its compute against its peers.")
    if s.culprit == "rank" and s.rank is not None:
        graphed = [p for p in after if p.by_rank]  # steps whose dependency graph was built
        if graphed:
            share = float(np.median([p.share(p.by_rank.get(s.rank, 0)) for p in graphed]))
            verdict += f"; {rank_label(trace, s.rank)} holds {share:.0%} of the critical path"
        else:
            verdict += f"; {rank_label(trace, s.rank)}'s compute grew the most"
        subject = rank_subject(trace, s.rank)
        evidence.append(f"rank {s.rank}'s compute per step grew by {duration(s.growth_ns)} more than its peers'")
    elif s.culprit == "link" and s.link is not None:
        a, b = s.link
        share = float(np.median([p.share(p.by_link.get(s.link, 0)) for p in after])) if after else 0.0
        verdict += f"; the link between ranks {a} and {b} holds {share:.0%} of the critical path"
        subject = Subject(ranks=(a, b), link=(a, b), hosts=tuple(h for h in {trace.host_of(a), trace.host_of(b)}
                                                                 if h))
        evidence.append(f"p2p exchange time between ranks {a} and {b} on the critical path grew by "
                        f"{duration(s.growth_ns)} per step more than on other links")
        remediation = ("Check the network path between these ranks' hosts (link errors, congestion, NCCL_DEBUG), "
                       "and see the slow-link findings.")
    confidence = min(0.95, 0.5 + 0.5 * min(1.0, (s.ratio - 1.0) / (2 * (SLOWDOWN_RATIO - 1.0))))
    severity = Severity.WARNING
    if s.explained < MIN_EXPLAINED:
        severity, subject = Severity.INFO, Subject()
        verdict = (f"step time {s.ratio:.2f}× the expected {duration(s.expected_ns)} from step {s.onset_step}, "
                   "spread over the job: no rank or link accounts for it (an external or machine-wide cause)")
        remediation = ("Look for what changed for every rank at that step: other jobs or load on the nodes, the "
                       "network or storage, data loading, a change in the training configuration.")
        confidence *= 0.6
    else:
        evidence.append(f"that accounts for {s.explained:.0%} of the increase")
    return Finding(id=f"step-slowdown:step-{s.onset_step}", severity=severity, kind=perf_kind("STEP_SLOWDOWN"),
                   subject=subject, verdict=verdict, evidence=evidence, remediation=remediation,
                   confidence=confidence * trace.coverage, impact=len(trace.ranks),
                   data={"onset_step": s.onset_step, "expected_ns": s.expected_ns, "observed_ns": s.observed_ns,
                         "ratio": round(s.ratio, 3), "growth_ns": s.growth_ns, "explained": round(s.explained, 3)})


def critical_path_stage(ctx: AnalysisContext) -> list[Finding]:
    """Engine stage: critical paths into ``ctx.results["critical_path"]``, and their findings."""
    it = iterations_of(ctx)
    cp = analyze_critical_path(ctx.trace, it, ctx.clock.t_enqueue, ctx.clock.t_complete)
    ctx.results["critical_path"] = cp
    return critical_path_findings(ctx.trace, cp)
