"""What the HTML report needs beyond the findings, as plain JSON: ``findings.json`` → ``analysis.report``.

The report (:mod:`megatrace.report`) renders from ``findings.json`` alone, so the
analysis exports here, in a compact columnar form (schema in
docs/findings-schema.md, section ``analysis.report``):

* ``ranks``: per rank (index = rank) its host, GPU and end-of-trace status;
* ``wait_for``: the hang wait-for graph, nearest the root causes first, capped;
* ``timeline``: each rank's last operations (the incident window), aligned clocks;
* ``delay``: the rank × rank excess transfer time matrix (small worlds only);
* ``job``: the traced command line, versions and the recorded NCCL_/SLURM_ settings.

Sizes are bounded so that the export stays a few MB at 16,384 ranks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Any

import numpy as np

from megatrace.analyze.index import op_name
from megatrace.analyze.iterations import rank_chunks
from megatrace.load.traceset import TraceSet, per_row
from megatrace.redact import redact_argv
from megatrace.trace.environment import filter_env
from megatrace.trace.ring_format import Op, State

REPORT_DATA_VERSION = 1
TIMELINE_BUDGET = 32_000  # operations exported in the timeline over all ranks ...
TIMELINE_MIN_OPS, TIMELINE_MAX_OPS = 2, 48  # ... as each rank's last N, N in this range; the culprits and the
#                                             ranks nearest them in the wait-for graph always get the maximum
MAX_GRAPH_NODES = 48  # wait-for graph nodes exported, nearest the root causes first
MAX_GROUP_RANKS = 64  # members listed per group in the timeline's group table (size is always given)
DELAY_MAX_RANKS = 256  # the delay matrix is exported up to this world size
JOB_ENV_PREFIXES = ("NCCL_", "SLURM_", "TORCH_", "CUDA_", "GLOO_", "MEGATRACE_", "MASTER_", "WORLD_SIZE", "OMP_")
STATE_NAMES = {int(State.ENQUEUED): "enqueued", int(State.COMPLETED): "completed", int(State.FAILED): "failed"}


def report_data(trace: TraceSet, clock: Any, results: dict[str, Any]) -> dict[str, Any]:
    """The ``analysis.report`` object (see the module docstring)."""
    hang = results.get("hang")
    wait_for = _wait_for(hang)
    focus = {int(n["id"][1:]) for n in (wait_for or {}).get("nodes", []) if n["kind"] == "rank"}
    focus |= {r for root in (hang.roots if hang is not None else []) for r in root.ranks}
    out: dict[str, Any] = {"version": REPORT_DATA_VERSION, "ranks": _ranks(trace, hang),
                           "wait_for": wait_for, "timeline": _timeline(trace, clock, hang, focus),
                           "delay": _delay(results.get("stragglers")), "job": _job(trace)}
    if results.get("command"):
        out["command"] = str(results["command"])
    return out


def _ranks(trace: TraceSet, hang: Any) -> dict[str, Any]:
    """Per rank of the world: host, GPU and status, as indices into the ``hosts`` and ``statuses`` lists (each in
    order of first appearance by rank). Built from the ranks something is known of (loaded, in the layout, given a
    status): a world named by one file of a million-rank job costs array fills, not a loop over every rank."""
    world = trace.world_size
    status = hang.status if hang is not None else {}
    known = sorted({int(r) for r in trace.ranks} | set(trace.layout.ranks if trace.layout is not None else ())
                   | {r for r, st in status.items() if st.value != "missing"})
    known = [r for r in known if 0 <= r < world]
    host_of = {r: trace.host_of(r) for r in known}
    gpu_col = np.full(world, -1, np.int64)
    for r in known:
        g = trace.gpu_of(r)
        gpu_col[r] = -1 if g is None else int(g)
    names_of = np.array(["unknown"], object).repeat(world) if world else np.empty(0, object)
    for r in known:
        st = status.get(r)
        names_of[r] = st.value if st is not None else "unknown"
    missing = np.fromiter((r for r in trace.missing_ranks if 0 <= r < world), np.int64)
    names_of[missing] = "missing"
    missing_status = [r for r, st in status.items() if st.value == "missing" and 0 <= r < world]
    names_of[np.asarray(missing_status, np.int64)] = "missing"
    return {**_first_seen("hosts", "host", {r: h for r, h in host_of.items() if h is not None}, world),
            "gpu": gpu_col.tolist(), **_indexed("statuses", "status", names_of)}


def _first_seen(names_key: str, col_key: str, values: dict[int, str], world: int) -> dict[str, Any]:
    """``values`` (rank -> name, for some ranks) as a column of indices into a list of names (-1: none)."""
    col = np.full(world, -1, np.int64)
    names: list[str] = []
    index: dict[str, int] = {}
    for r in sorted(values):
        col[r] = index.setdefault(values[r], len(names))
        if col[r] == len(names):
            names.append(values[r])
    return {names_key: names, col_key: col.tolist()}


def _indexed(names_key: str, col_key: str, names_of: np.ndarray) -> dict[str, Any]:
    """A column of names (one per rank) as indices into the list of distinct names, in order of first rank."""
    if not len(names_of):
        return {names_key: [], col_key: []}
    uniq, first, inverse = np.unique(names_of.astype(str), return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank_of = np.empty(len(order), np.int64)
    rank_of[order] = np.arange(len(order))
    return {names_key: [str(u) for u in uniq[order]], col_key: rank_of[inverse.reshape(-1)].tolist()}


def _node_id(node: Hashable) -> str:
    if isinstance(node, (int, np.integer)):
        return f"r{int(node)}"
    if isinstance(node, tuple) and node and node[0] == "inst":
        return f"i{node[1]}"
    if isinstance(node, tuple) and node and node[0] == "link":
        return f"l{node[1]}-{node[2]}"
    return "n" + "-".join(map(str, node)) if isinstance(node, tuple) else f"n{node}"


def _wait_for(hang: Any) -> dict[str, Any] | None:
    """Nodes (ranks, collective instances, links) and edges, breadth-first back from the root causes."""
    if hang is None or not hang.roots:
        return None
    g = hang.graph
    root_nodes: list[Hashable] = []
    for root in hang.roots:
        nodes = root.node if root.kind == "cycle" and isinstance(root.node, tuple) else (root.node,)
        root_nodes += [n for n in nodes if n in g]
    waited_in: dict[Hashable, Any] = {}  # an instance or link -> the first wait in it (labelled if it is shown)
    for waits in hang.waits.values():
        for w in waits:
            if w.target is not None and not isinstance(w.target, (int, np.integer)):
                waited_in.setdefault(w.target, w)
    seen: list[Hashable] = []
    queue = deque(root_nodes)
    visited = set(root_nodes)
    while queue and len(seen) < MAX_GRAPH_NODES:
        n = queue.popleft()
        seen.append(n)
        for p in sorted(g.predecessors(n), key=str):
            if p not in visited:
                visited.add(p)
                queue.append(p)
    keep = set(seen)
    roots = set(root_nodes)
    nodes = []
    for n in seen:
        if isinstance(n, (int, np.integer)):
            kind, label = "rank", f"rank {int(n)}"
        elif isinstance(n, tuple) and n[0] == "link":
            kind, label = "link", f"link {n[1]} → {n[2]}"
        else:
            kind, label = "instance", waited_in[n].label if n in waited_in else str(n)
        nodes.append({"id": _node_id(n), "kind": kind, "label": label, "root": n in roots})
    edges = []
    for a, b, attrs in g.edges(data=True):
        if a in keep and b in keep:
            w = attrs.get("wait")
            edges.append({"src": _node_id(a), "dst": _node_id(b), "label": w.label if w is not None else "not entered"})
    return {"nodes": nodes, "edges": edges, "omitted": max(0, g.number_of_nodes() - len(nodes))}


def _timeline(trace: TraceSet, clock: Any, hang: Any, focus: set[int]) -> dict[str, Any] | None:
    """Each rank's last N operations (markers excluded; ``focus`` ranks: the last ``TIMELINE_MAX_OPS``),
    times in µs from the window start."""
    rec = trace.records
    if not len(rec):
        return None
    per_rank = max(TIMELINE_MIN_OPS, min(TIMELINE_MAX_OPS, TIMELINE_BUDGET // max(1, len(trace.ranks))))
    # (by rank position: ranks missing from the trace hold no row)
    focused = np.isin(trace.ranks, np.fromiter(focus, np.int64)) if focus and per_rank < TIMELINE_MAX_OPS else None
    positions = np.arange(len(trace.ranks), dtype=np.int64)
    parts = []
    for i0, i1 in rank_chunks(trace):  # whole ranks at a time: no temporary as long as the records
        lo, hi = int(trace.starts[i0]), int(trace.starts[i1])
        kept = np.flatnonzero(rec.op[lo:hi] < Op.MARK_STEP)
        pos = per_row(positions, trace.starts, slice(lo, hi))[kept] - i0  # each operation's rank, from i0
        ends = np.cumsum(np.bincount(pos, minlength=i1 - i0))
        from_end = ends[pos] - 1 - np.arange(len(kept))  # the rank's operations after this one
        keep = from_end < per_rank
        if focused is not None:
            keep |= focused[i0:i1][pos] & (from_end < TIMELINE_MAX_OPS)
        parts.append(lo + kept[keep])
    sel = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if not len(sel):
        return None
    te, tc = clock.t_enqueue[sel], clock.t_complete[sel]
    t0 = int(te.min())
    end = int(max(te.max(), tc.max()))
    if hang is not None and hang.end_ns:
        end = max(end, int(hang.end_ns))
    incident = None
    if hang is not None and hang.roots:
        stops = [r.stop_ns for r in hang.roots if r.stop_ns is not None]
        incident = min(stops) if stops else int(hang.end_ns)
    gids = rec.group_id[sel]
    uniq, gidx = np.unique(gids, return_inverse=True)
    groups = []
    for gid in uniq.tolist():
        g = trace.groups.get(int(gid))
        members = list(g.ranks) if g is not None else []
        groups.append({"gid": int(gid), "kind": g.kind if g is not None else f"group {gid}",
                       "size": len(members), "ranks": members[:MAX_GROUP_RANKS],
                       "label": trace.group_label(int(gid))})
    ops_u, opx = np.unique(rec.op[sel], return_inverse=True)
    done = (tc > 0) & (rec.state[sel] != State.ENQUEUED)
    dur = np.where(done, (tc - te) // 1000, -1)
    return {"t0_ns": t0, "end_us": (end - t0) // 1000, "incident_us": None if incident is None else
            (int(incident) - t0) // 1000, "per_rank": int(per_rank), "groups": groups,
            "ops": [op_name(int(o)) for o in ops_u.tolist()], "states": STATE_NAMES,
            "rank": rec.rank[sel].tolist(), "group": gidx.tolist(), "op": opx.tolist(),
            "seq": rec.group_seq[sel].tolist(), "peer": rec.peer[sel].tolist(), "bytes": rec.nbytes[sel].tolist(),
            "start_us": ((te - t0) // 1000).tolist(), "dur_us": dur.tolist(), "state": rec.state[sel].tolist()}


def _delay(res: Any) -> dict[str, Any] | None:
    """Excess transfer time per rank pair (µs; null where unmeasured), from the straggler analysis."""
    if res is None or res.delay is None or len(res.delay) > DELAY_MAX_RANKS or not np.isfinite(res.delay).any():
        return None
    m = res.delay
    cells = [[None if not np.isfinite(v) else int(v // 1000) for v in row] for row in m.tolist()]
    return {"excess_us": cells, "slow_ranks": list(res.slow_ranks),
            "slow_links": [sorted((p.a, p.b)) for p in res.slow_links], "step_ns": int(res.step_ns)}


def _job(trace: TraceSet) -> dict[str, Any]:
    """Rank 0's (or the first loaded rank's) command line, versions and runtime settings from its meta file."""
    out: dict[str, Any] = {}
    metas = trace.meta
    for rank in sorted(metas)[:1]:
        for entry in metas[rank]:
            if entry.get("kind") == "process":
                for key in ("argv", "torch", "backend"):
                    if entry.get(key):
                        out[key] = entry[key]
                if isinstance(out.get("argv"), list):
                    out["argv"] = redact_argv(out["argv"])
            elif entry.get("kind") == "env" and isinstance(entry.get("vars"), dict):
                # filter_env again: a trace written by an older tracer (or by hand) may hold credentials
                out["env"] = {k: v for k, v in sorted(filter_env(entry["vars"]).items())
                              if k.startswith(JOB_ENV_PREFIXES)}
    return out
