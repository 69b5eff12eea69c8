"""The hang's wait-for graph: a small directed graph of plain dicts, with the two searches the root finding needs.

Nodes are ranks (ints), collective instances (``("inst", i)``) and links (``("link", src, dst)``); an edge
``a -> b`` says a waits for b and may carry the :class:`~megatrace.analyze.hang_roots.Wait` it was made from.
It offers the part of networkx's ``DiGraph`` interface the hang analysis uses, in the same iteration orders
(nodes as first added, a node's neighbours as their edges were added), so the components, chains and report
come out in the same order; it is its own module so that the quick pass (``megatrace analyze --quick``) does not
import networkx (a tenth of a second, a tenth of the whole command at 4,096 ranks).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Any


class _Edges:
    """``graph.edges``: ``edges[u, v]`` is the edge's attribute dict; called, every ``(u, v[, attrs])``."""

    def __init__(self, succ: dict[Hashable, dict[Hashable, dict[str, Any]]]) -> None:
        self._succ = succ

    def __getitem__(self, uv: tuple[Hashable, Hashable]) -> dict[str, Any]:
        return self._succ[uv[0]][uv[1]]

    def __call__(self, data: bool = False) -> Iterator[tuple]:
        for u, out in self._succ.items():
            for v, attrs in out.items():
                yield (u, v, attrs) if data else (u, v)


class WaitGraph:
    """Directed graph: ``succ[u][v]`` and ``pred[v][u]`` hold the same attribute dict of edge ``u -> v``."""

    def __init__(self) -> None:
        self.succ: dict[Hashable, dict[Hashable, dict[str, Any]]] = {}
        self.pred: dict[Hashable, dict[Hashable, dict[str, Any]]] = {}
        self.edges = _Edges(self.succ)

    def add_node(self, n: Hashable) -> None:
        if n not in self.succ:
            self.succ[n], self.pred[n] = {}, {}

    def add_edge(self, u: Hashable, v: Hashable, **attrs: Any) -> None:
        """Add ``u -> v`` (and its nodes); on an edge already there, ``attrs`` update its attributes."""
        self.add_node(u)
        self.add_node(v)
        data = self.succ[u].get(v)
        if data is None:
            data = self.succ[u][v] = self.pred[v][u] = {}
        data.update(attrs)

    def __contains__(self, n: object) -> bool:
        return n in self.succ

    def __len__(self) -> int:
        return len(self.succ)

    @property
    def nodes(self) -> Iterable[Hashable]:
        return self.succ.keys()

    def number_of_nodes(self) -> int:
        return len(self.succ)

    def successors(self, n: Hashable) -> Iterator[Hashable]:
        return iter(self.succ[n])

    def predecessors(self, n: Hashable) -> Iterator[Hashable]:
        return iter(self.pred[n])

    def in_edges(self, v: Hashable, data: bool = False) -> Iterator[tuple]:
        for u, attrs in self.pred[v].items():
            yield (u, v, attrs) if data else (u, v)

    def ancestors(self, n: Hashable) -> set[Hashable]:
        """Every node with a path to ``n`` (``n`` itself left out)."""
        seen = {n}
        stack = [n]
        while stack:
            for u in self.pred[stack.pop()]:
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
        seen.discard(n)
        return seen

    def strongly_connected_components(self) -> Iterator[set[Hashable]]:
        """The strongly connected components, each a set, in the order networkx yields them (its non-recursive
        Tarjan, after Nuutila and Soisalon-Soininen: a component comes only after every component it reaches)."""
        preorder: dict[Hashable, int] = {}
        lowlink: dict[Hashable, int] = {}
        found: set[Hashable] = set()
        pending: list[Hashable] = []
        counter = 0
        neighbours = {v: iter(out) for v, out in self.succ.items()}
        for source in self.succ:
            if source in found:
                continue
            queue = [source]
            while queue:
                v = queue[-1]
                if v not in preorder:
                    counter += 1
                    preorder[v] = counter
                done = True
                for w in neighbours[v]:
                    if w not in preorder:
                        queue.append(w)
                        done = False
                        break
                if not done:
                    continue
                low = preorder[v]
                for w in self.succ[v]:
                    if w not in found:
                        low = min(low, lowlink[w] if preorder[w] > preorder[v] else preorder[w])
                lowlink[v] = low
                queue.pop()
                if low == preorder[v]:
                    component = {v}
                    while pending and preorder[pending[-1]] > preorder[v]:
                        component.add(pending.pop())
                    found.update(component)
                    yield component
                else:
                    pending.append(v)
