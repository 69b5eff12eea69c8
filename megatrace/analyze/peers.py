"""Ranks doing the same work, to be compared with each other: one pipeline stage (and TP position, when enough).

Used by the straggler analysis (who is slower than its peers) and the critical path's what-if (a rank at its
peers' speed).
"""

from __future__ import annotations

import numpy as np

from megatrace.load.traceset import TraceSet

MIN_PEERS_SAME_TP = 3  # compare with ranks of the same stage *and* TP position only when there are this many


def peer_groups(trace: TraceSet) -> list[np.ndarray]:
    """Positions (in ``trace.ranks``) of ranks doing the same work: one stage (and TP position, if enough)."""
    n = len(trace.ranks)
    layout = trace.layout
    if layout is None:
        return [np.arange(n)]
    inside = trace.ranks < layout.world_size
    coords = np.array([layout.coords(int(r)) if ok else (-1, -1, -1) for r, ok in zip(trace.ranks, inside)],
                      np.int64).reshape(n, 3)
    out = []
    for stage in np.unique(coords[inside, 0]).tolist():
        mine = np.flatnonzero(inside & (coords[:, 0] == stage))
        by_tp = [mine[coords[mine, 2] == t] for t in np.unique(coords[mine, 2]).tolist()]
        if all(len(g) >= MIN_PEERS_SAME_TP for g in by_tp):
            out += by_tp
        else:
            out.append(mine)
    return out
