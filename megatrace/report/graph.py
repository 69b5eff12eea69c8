"""Lay out the exported wait-for graph as layers for an SVG: root causes on the left, waiters to the right."""

from __future__ import annotations

from collections import deque
from typing import Any

NODE_W, NODE_H = 200, 30  # px: one node box
COL_GAP, ROW_GAP = 46, 12  # px between layers and between nodes of one layer
MAX_LABEL = 32
MAX_PER_LAYER = 8  # boxes drawn per layer; the rest of a layer is one "… and N more" box  # characters of a node label drawn in its box (the full label is in its tooltip)


def _short(text: str) -> str:
    return text if len(text) <= MAX_LABEL else text[:MAX_LABEL - 1] + "…"


def layout(wait_for: dict[str, Any] | None) -> dict[str, Any] | None:
    """Node boxes and edge lines in px; None when there is no graph (nothing waited)."""
    if not wait_for or not wait_for.get("nodes"):
        return None
    nodes = {n["id"]: n for n in wait_for["nodes"]}
    edges = [e for e in wait_for.get("edges", []) if e["src"] in nodes and e["dst"] in nodes]
    preds: dict[str, list[str]] = {k: [] for k in nodes}
    for e in edges:
        preds[e["dst"]].append(e["src"])
    depth: dict[str, int] = {}
    queue = deque(k for k, n in nodes.items() if n.get("root"))
    for k in queue:
        depth[k] = 0
    while queue:
        k = queue.popleft()
        for p in preds[k]:
            if p not in depth:
                depth[p] = depth[k] + 1
                queue.append(p)
    for k in nodes:
        depth.setdefault(k, max(depth.values(), default=0) + 1)
    layers = max(depth.values()) + 1
    rows: dict[int, int] = {}
    boxes: dict[str, dict[str, Any]] = {}
    hidden: dict[int, int] = {}
    for k in list(nodes):  # exported nearest-the-root first: a stable, readable order
        d = depth[k]
        if rows.get(d, 0) >= MAX_PER_LAYER and not nodes[k].get("root"):
            hidden[d] = hidden.get(d, 0) + 1
            continue
        row = rows.get(d, 0)
        rows[d] = row + 1
        x = 10 + d * (NODE_W + COL_GAP)
        y = 10 + row * (NODE_H + ROW_GAP)
        n = nodes[k]
        boxes[k] = {"x": x, "y": y, "w": NODE_W, "h": NODE_H, "label": _short(str(n.get("label", k))),
                    "title": str(n.get("label", k)), "kind": str(n.get("kind", "")), "root": bool(n.get("root"))}
    for d, count in sorted(hidden.items()):  # one box stands for the rest of a crowded layer
        k = f"more-{d}"
        row = rows[d]
        rows[d] = row + 1
        boxes[k] = {"x": 10 + d * (NODE_W + COL_GAP), "y": 10 + row * (NODE_H + ROW_GAP), "w": NODE_W, "h": NODE_H,
                    "label": f"… and {count} more", "title": f"{count} more nodes at this distance from the root cause",
                    "kind": "more", "root": False}
    lines = []
    for e in edges:
        if e["src"] not in boxes or e["dst"] not in boxes:
            continue
        a, b = boxes[e["src"]], boxes[e["dst"]]
        forward = a["x"] < b["x"]
        x1 = a["x"] + (a["w"] if forward else 0)
        x2 = b["x"] + (0 if forward else b["w"])
        lines.append({"x1": x1, "y1": a["y"] + NODE_H / 2, "x2": x2, "y2": b["y"] + NODE_H / 2,
                      "title": f"{a['title']} waits for {b['title']}: {e.get('label', '')}",
                      "root": b["root"]})
    height = 20 + max(rows.values()) * (NODE_H + ROW_GAP)
    width = 20 + layers * NODE_W + (layers - 1) * COL_GAP
    return {"nodes": list(boxes.values()), "edges": lines, "width": width, "height": height,
            "omitted": int(wait_for.get("omitted") or 0)}
