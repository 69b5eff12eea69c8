"""Iterations without markers, the training dependency graph and its critical path, on hand-built traces."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import numpy as np
import pytest
from helpers.pipeline_sim import PipelineSim

from megatrace.analyze.critical_path import critical_path, critical_path_stage, what_if
from megatrace.analyze.depgraph import Edge, EdgeKind, GraphError, IterationGraph, Node, NodeKind, validate
from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.analyze.iterations import smallest_period
from megatrace.analyze.stragglers import straggler_stage
from megatrace.trace.ring_format import Op

MS = 1_000_000
STAGES = [("critical_path", critical_path_stage), ("stragglers", straggler_stage)]


def _run(tmp_path: Path, sim: PipelineSim):
    sim.run()
    return analyze(sim.write(tmp_path), stages=STAGES)


# -- a known DAG -------------------------------------------------------------------------------------------------

def _known_graph() -> IterationGraph:
    """START -> A (stage 0, rank 0, 10 ms) -> B (stage 1, rank 2, 30 ms) -> END, with a shorter branch via C, D."""
    nodes = [Node(NodeKind.START, 3), Node(NodeKind.END, 3),
             Node(NodeKind.FORWARD, 3, 0, 0, (("F", 0),), (0,), 10 * MS, ((0, 10 * MS),)),
             Node(NodeKind.FORWARD, 3, 1, 0, (("F", 0),), (2,), 30 * MS, ((2, 30 * MS),)),
             Node(NodeKind.FORWARD, 3, 0, 1, (("F", 0),), (1,), 5 * MS, ((1, 5 * MS),)),
             Node(NodeKind.BACKWARD, 3, 1, 1, (("B", 0),), (3,), 8 * MS, ((3, 6 * MS),), comm_ns=2 * MS)]
    g = nx.DiGraph()
    g.add_nodes_from(range(len(nodes)))

    def edge(u: int, v: int, kind: EdgeKind, comm: int = 0, link: tuple[int, int] | None = None) -> None:
        w = nodes[u].duration_ns + comm
        g.add_edge(u, v, weight=w, edge=Edge(kind, w, comm, link))

    edge(0, 2, EdgeKind.START)
    edge(0, 4, EdgeKind.START)
    edge(2, 3, EdgeKind.PP_ACTIVATION, 2 * MS, (0, 2))
    edge(4, 5, EdgeKind.PP_ACTIVATION)
    edge(2, 5, EdgeKind.PP_ACTIVATION, 1 * MS, (0, 3))
    edge(3, 1, EdgeKind.END)
    edge(5, 1, EdgeKind.END)
    return IterationGraph(3, g, nodes, start_ns=0, end_ns=45 * MS)


def test_the_longest_path_of_a_known_dag_and_who_holds_it() -> None:
    path = critical_path(_known_graph())
    assert path.path == [0, 2, 3, 1]
    assert path.length_ns == 42 * MS
    assert path.by_rank == {0: 10 * MS, 2: 30 * MS}
    assert path.by_stage == {0: 10 * MS, 1: 30 * MS}
    assert path.by_link == {(0, 2): 2 * MS}
    assert path.by_category == {"compute": 40 * MS, "pp-comm": 2 * MS}
    assert path.share(path.by_rank[2]) == pytest.approx(30 / 42)


def test_what_if_a_rank_were_faster_shortens_the_path_until_another_branch_takes_over() -> None:
    g = _known_graph()
    assert what_if(g, {2: 0.5}) == 27 * MS  # B 15 ms: START-A-B-END = 12 + 15
    assert what_if(g, {2: 0.1}) == 19 * MS  # B 3 ms: now START-A-D-END = 11 + 8 is longer
    assert "what_if" not in next(iter(g.graph.edges(data=True)))[2]


def test_validation_rejects_a_cycle_and_a_node_off_the_start_to_end_paths() -> None:
    g = _known_graph()
    g.graph.add_edge(3, 2, weight=0, edge=Edge(EdgeKind.COMPUTE, 0))
    with pytest.raises(GraphError, match="cycle"):
        validate(g)
    g = _known_graph()
    g.nodes.append(Node(NodeKind.FORWARD, 3, 1, 0, (("F", 1),)))
    g.graph.add_node(len(g.nodes) - 1)
    with pytest.raises(GraphError, match="not on a path"):
        validate(g)


# -- iterations without markers -----------------------------------------------------------------------------------

def test_smallest_period_tolerates_a_prefix_and_a_tail() -> None:
    tokens = np.array([9] + [1, 2, 2, 3] * 30 + [7, 7])
    assert smallest_period(tokens) == 4
    assert smallest_period(np.arange(10)) is None


def test_records_steps_are_looked_up_among_the_steps_analysed() -> None:
    from megatrace.analyze.iterations import Iterations

    none = np.zeros((1, 0), np.int64)
    it = Iterations("dp-sync", np.array([3, 4, 7]), none, none, none, np.array([-1, 3, 5, 7, 2], np.int32),
                    np.zeros(5, np.int8))
    assert it.step_index([4, 7])(it.record_step).tolist() == [-1, -1, -1, 1, -1]
    assert it.in_steps([3, 7])(np.array([-5, -1, 3, 4, 7, 9])).tolist() == [False, False, True, False, True, False]
    assert not it.in_steps([])(it.record_step).any()


@pytest.mark.parametrize("layout", [dict(tp=2, pp=2, dp=2), dict(tp=2, pp=2, dp=1), dict(tp=1, pp=3, dp=2),
                                    dict(tp=2, pp=1, dp=2)])
def test_iterations_are_found_without_markers_and_agree_with_them(tmp_path: Path, layout: dict) -> None:
    sim = PipelineSim(**layout, steps=5, markers=True)
    res = _run(tmp_path, sim)
    it = res.results["iterations"]
    # dp == 1: the last step's trailing backward on the first stage has no record after it to end it
    expected = list(range(5)) if layout["dp"] > 1 else list(range(4))
    assert it.steps.tolist() == expected
    assert it.method == ("dp-sync" if layout["dp"] > 1 else "pipeline")
    rec = res.trace.records
    for i in range(len(res.trace.ranks)):
        rows = np.arange(res.trace.starts[i], res.trace.starts[i + 1])
        marker_step = np.maximum.accumulate(np.where(rec.op[rows] == Op.MARK_STEP, rec.group_seq[rows], -1))
        inferred = it.record_step[rows]
        calls = (rec.op[rows] < Op.MARK_STEP) & (inferred >= 0)
        assert calls.sum() > 0
        assert (inferred[calls] == marker_step[calls]).all()
    # Step times (after the first, whose start is unknown) match the simulation's.
    sim_ns = np.diff([0.0] + sim.step_end) * MS
    assert np.abs(it.step_ns[1:] - sim_ns[it.steps[1:]]).max() < 0.01 * MS


def test_microbatches_come_from_the_records_when_the_layout_says_fewer(tmp_path: Path) -> None:
    sim = PipelineSim(tp=2, pp=2, dp=2, microbatches=4, steps=4)
    sim.run()
    root = sim.write(tmp_path)
    text = (root / "layout.yaml").read_text().replace("microbatches: 4", "microbatches: 1")
    (root / "layout.yaml").write_text(text)
    res = analyze(root, stages=STAGES)
    it = res.results["iterations"]
    assert it.microbatches == 4
    assert any("4 microbatches" in n for n in it.notes)
    assert res.results["critical_path"].paths


# -- the dependency graph against the simulation ------------------------------------------------------------------

@pytest.mark.parametrize("layout", [dict(tp=2, pp=2, dp=1), dict(tp=2, pp=2, dp=2), dict(tp=1, pp=3, dp=2),
                                    dict(tp=2, pp=3, dp=1, microbatches=4), dict(tp=2, pp=4, dp=1, microbatches=6)])
def test_the_critical_path_is_the_simulated_step_time(tmp_path: Path, layout: dict) -> None:
    sim = PipelineSim(**layout, steps=4)
    res = _run(tmp_path, sim)
    cp = res.results["critical_path"]
    assert not cp.problems
    assert [p.step for p in cp.paths] == res.results["iterations"].steps.tolist()
    for p in cp.paths[1:]:  # the first step's start is not observable (nothing before it)
        assert abs(p.length_ns - p.wall_ns) < 0.01 * MS
        assert p.labels[0].startswith("stage 0")  # a 1F1B step starts on the first stage
        assert sum(p.by_category.values()) == p.length_ns
    summary = [f for f in res.findings if f.id == "critical-path:summary"]
    assert summary and summary[0].severity == Severity.INFO
    assert not res.at_least(Severity.WARNING)


def test_a_slow_rank_holds_the_critical_path(tmp_path: Path) -> None:
    res = _run(tmp_path, PipelineSim(tp=2, pp=2, dp=2, slow={5: 2.0}, steps=5))
    cp = res.results["critical_path"]
    shares = cp.median_share("rank")
    assert max(shares, key=shares.get) == 5
    assert shares[5] > 0.5
    assert cp.slowdown is None  # slow from the first step: no change against the healthy steps
    (summary,) = [f for f in res.findings if f.id == "critical-path:summary"]
    assert "rank 5's compute" in summary.verdict


def test_a_slowdown_from_a_later_step_is_measured_against_the_healthy_steps(tmp_path: Path) -> None:
    sim = PipelineSim(tp=2, pp=2, dp=1, slow={3: 2.0}, slow_from=4, steps=9)
    res = _run(tmp_path, sim)
    cp = res.results["critical_path"]
    assert cp.slowdown is not None
    s = cp.slowdown
    assert (s.onset_step, s.culprit, s.rank) == (4, "rank", 3)
    healthy = (sim.step_end[2] - sim.step_end[1]) * MS
    assert abs(s.expected_ns - healthy) < 0.01 * MS
    assert s.ratio > 1.3
    (f,) = [f for f in res.findings if f.id.startswith("step-slowdown")]
    assert f.severity == Severity.WARNING
    assert f.subject.rank == 3
    assert "from step 4" in f.verdict and "rank 3" in f.verdict


def test_a_slowdown_of_every_rank_is_stated_but_blames_no_one(tmp_path: Path) -> None:
    sim = PipelineSim(tp=2, pp=2, dp=2, slow={r: 1.6 for r in range(8)}, slow_from=4, steps=9, jitter=0.05, seed=2)
    res = _run(tmp_path, sim)
    s = res.results["critical_path"].slowdown
    assert s is not None and s.onset_step == 4 and s.explained < 0.5
    (f,) = [f for f in res.findings if f.id.startswith("step-slowdown")]
    assert f.severity == Severity.INFO and f.subject.rank is None
    assert "no rank or link accounts for it" in f.verdict
    assert not res.at_least(Severity.WARNING)


def test_noisy_healthy_steps_raise_no_slowdown(tmp_path: Path) -> None:
    res = _run(tmp_path, PipelineSim(tp=2, pp=2, dp=2, steps=10, jitter=0.15, seed=3))
    assert res.results["critical_path"].slowdown is None
    assert not res.at_least(Severity.WARNING), [f.verdict for f in res.at_least(Severity.WARNING)]


def test_an_unobservable_step_boundary_is_stated_not_guessed(tmp_path: Path) -> None:
    res = _run(tmp_path, PipelineSim(tp=1, pp=2, dp=1, steps=4))
    cp = res.results["critical_path"]
    assert not cp.paths
    assert any("not observable" in p for p in cp.problems)
    (summary,) = [f for f in res.findings if f.id == "critical-path:summary"]
    assert any("not observable" in str(e) for e in summary.evidence)


def test_without_a_layout_file_the_layout_is_inferred_and_the_graph_still_built(tmp_path: Path) -> None:
    sim = PipelineSim(tp=2, pp=2, dp=2, steps=4)
    sim.run()
    root = sim.write(tmp_path)
    (root / "layout.yaml").unlink()
    res = analyze(root, stages=STAGES)
    layout = res.trace.layout
    assert (layout.tp, layout.pp, layout.dp) == (2, 2, 2)  # from the process groups (megatrace.analyze.jobconfig)
    assert res.results["iterations"].method == "dp-sync"
    assert res.results["iterations"].n_steps == 4
    assert res.results["critical_path"].paths


def test_a_slowdown_a_straggler_explains_is_told_as_the_stragglers_story(tmp_path: Path) -> None:
    """The cause first: rank 5 slowed from step 4 is the straggler; the slowdown is its evidence, not a rival."""
    res = _run(tmp_path, PipelineSim(tp=2, pp=2, dp=2, slow={5: 2.0}, slow_from=4, steps=12))
    assert res.results["critical_path"].slowdown is not None
    top = res.findings[0]
    assert top.kind == Kind.STRAGGLER and top.subject.rank == 5, [f.verdict for f in res.findings[:3]]
    assert any("from step 4" in str(e) for e in top.evidence), top.evidence
    (slow,) = [f for f in res.findings if f.id.startswith("step-slowdown")]
    assert slow.severity == Severity.INFO and "the straggler, rank 5" in slow.verdict
