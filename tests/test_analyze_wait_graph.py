"""The hang's wait-for graph against networkx's DiGraph: the same components in the same order, the same
ancestors, neighbours and edges in the same order (the root causes, chains and report follow these orders)."""

from __future__ import annotations

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from megatrace.analyze.wait_graph import WaitGraph

# Nodes as the hang analysis makes them: ranks, collective instances and links.
NODES = st.one_of(st.integers(0, 12), st.tuples(st.just("inst"), st.integers(0, 4)),
                  st.tuples(st.just("link"), st.integers(0, 3), st.integers(0, 3)))
EDGES = st.lists(st.tuples(NODES, NODES, st.one_of(st.none(), st.integers(0, 99))), max_size=60)


def _both(edges: list, lone: list) -> tuple[WaitGraph, nx.DiGraph]:
    ours, theirs = WaitGraph(), nx.DiGraph()
    for n in lone:
        ours.add_node(n)
        theirs.add_node(n)
    for u, v, w in edges:
        attrs = {} if w is None else {"wait": w}
        ours.add_edge(u, v, **attrs)
        theirs.add_edge(u, v, **attrs)
    return ours, theirs


@settings(max_examples=300, deadline=None)
@given(EDGES, st.lists(NODES, max_size=5))
def test_same_as_networkx(edges: list, lone: list) -> None:
    ours, theirs = _both(edges, lone)
    assert list(ours.nodes) == list(theirs.nodes)
    assert ours.number_of_nodes() == theirs.number_of_nodes() == len(ours)
    assert list(ours.strongly_connected_components()) == list(nx.strongly_connected_components(theirs))
    assert list(ours.edges(data=True)) == list(theirs.edges(data=True))
    for n in theirs.nodes:
        assert n in ours
        assert list(ours.successors(n)) == list(theirs.successors(n))
        assert list(ours.predecessors(n)) == list(theirs.predecessors(n))
        assert list(ours.in_edges(n, data=True)) == list(theirs.in_edges(n, data=True))
        assert ours.ancestors(n) == nx.ancestors(theirs, n)
    for u, v in theirs.edges:
        assert ours.edges[u, v] == theirs.edges[u, v]
    assert ("inst", 99) not in ours


def test_cycle_and_sink() -> None:
    """A deadlock (0 -> 1 -> 2 -> 0) that rank 3 waits on, and a rank 4 waiting on a stopped rank 5."""
    g = WaitGraph()
    for u, v in ((3, 0), (0, 1), (1, 2), (2, 0), (4, 5)):
        g.add_edge(u, v, wait=f"{u}->{v}")
    g.add_edge(0, 1, other=True)  # (an edge added again keeps its attributes and gains the new ones)
    comps = list(g.strongly_connected_components())
    assert {0, 1, 2} in comps and {5} in comps and {3} in comps
    assert comps.index({0, 1, 2}) < comps.index({3})  # a component comes after every one it reaches
    assert g.ancestors(0) == {1, 2, 3} and g.ancestors(5) == {4} and g.ancestors(3) == set()
    assert g.edges[0, 1] == {"wait": "0->1", "other": True}


def test_long_chain_is_not_recursive() -> None:
    """A wait chain of 100,000 ranks (deeper than Python's recursion limit) in one component each."""
    g = WaitGraph()
    for r in range(100_000):
        g.add_edge(r, r + 1)
    comps = list(g.strongly_connected_components())
    assert len(comps) == 100_001 and comps[0] == {100_000}
    assert len(g.ancestors(100_000)) == 100_000
