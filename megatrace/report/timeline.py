"""Swimlanes of the incident window for an SVG: one lane per rank up to 64 ranks; beyond, one lane per
group kind (the share of ranks inside an operation of that kind, per time bin) plus the culprits' own
lanes and those of their groups' members."""

from __future__ import annotations

from typing import Any

MAX_RANK_LANES = 64  # beyond this world size the timeline aggregates by group kind
MAX_EXPANDED = 24  # rank lanes kept beside the aggregate lanes (culprits and their groups' members)
PLOT_W = 1000  # px of the time axis
LABEL_W = 170  # px of the lane labels
LANE_H, LANE_GAP = 16, 3
BINS = 250  # time bins of an aggregate lane
KINDS = ("tp", "pp", "dp", "world")  # colour classes; anything else is "other"


def _cls(kind: str) -> str:
    return kind if kind in KINDS else "other"


def _fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _ms(us: float) -> str:
    if abs(us) >= 1_000_000:
        return f"{us / 1e6:.2f} s"
    return f"{us / 1000:.1f} ms" if abs(us) >= 1000 else f"{us:.0f} µs"


def _op_title(tl: dict[str, Any], i: int, end_us: int) -> str:
    g = tl["groups"][tl["group"][i]]
    name = tl["ops"][tl["op"][i]]
    kind = g["kind"].upper() if g["kind"] in ("tp", "pp", "dp") else g["kind"]
    peer = tl["peer"][i]
    peer_txt = f" {'to' if name == 'send' else 'from'} rank {peer}" if name in ("send", "recv") and peer >= 0 else ""
    dur = tl["dur_us"][i]
    dur_txt = _ms(dur) if dur >= 0 else f"never completed (waiting {_ms(end_us - tl['start_us'][i])} at the end)"
    state = tl.get("states", {}).get(str(tl["state"][i]), str(tl["state"][i]))
    return (f"rank {tl['rank'][i]} · {kind} {name} #{tl['seq'][i]}{peer_txt} · {g['label']} · "
            f"{_fmt_bytes(tl['bytes'][i])} · {dur_txt} · {state} · starts at +{_ms(tl['start_us'][i])}")


def lanes(tl: dict[str, Any] | None, doc: dict[str, Any], culprits: list[Any]) -> dict[str, Any] | None:
    """The timeline's lanes, ticks and markers in px (None without exported operations)."""
    if not tl or not tl.get("rank"):
        return None
    n = len(tl["rank"])
    end_us = max(int(tl.get("end_us") or 0), 1)
    lo = min(tl["start_us"])
    span = max(end_us - lo, 1)
    scale = PLOT_W / span

    def x_of(us: float) -> float:
        return round(LABEL_W + (us - lo) * scale, 1)

    world = int((doc.get("trace") or {}).get("world_size") or 0)
    culprit_ranks = [c.rank for c in culprits if c.rank is not None]
    by_rank: dict[int, list[int]] = {}
    for i in range(n):
        by_rank.setdefault(tl["rank"][i], []).append(i)
    aggregated = world > MAX_RANK_LANES
    if aggregated:
        expanded: list[int] = []
        for r in culprit_ranks:
            if r not in expanded:
                expanded.append(r)
        for r in culprit_ranks:
            for i in by_rank.get(r, []):
                for m in tl["groups"][tl["group"][i]]["ranks"]:
                    if m not in expanded and len(expanded) < MAX_EXPANDED:
                        expanded.append(m)
        shown = expanded
    else:
        shown = sorted(by_rank)
    out_lanes: list[dict[str, Any]] = []
    y = 22
    if aggregated:
        for lane in _aggregate(tl, lo, span, x_of):
            lane["y"] = y
            out_lanes.append(lane)
            y += LANE_H + LANE_GAP
    ranks_info = ((doc.get("analysis") or {}).get("report") or {}).get("ranks") or {}
    for r in shown:
        rects = []
        for i in by_rank.get(r, []):
            s = tl["start_us"][i]
            d = tl["dur_us"][i]
            stuck = d < 0
            e = end_us if stuck else s + d
            state = tl["state"][i]
            cls = "stuck" if stuck else "failed" if str(state) == "3" else _cls(tl["groups"][tl["group"][i]]["kind"])
            rects.append({"x": x_of(s), "w": max(1.0, round((e - s) * scale, 1)), "cls": cls,
                          "title": _op_title(tl, i, end_us)})
        host = ""
        hosts, host_col = ranks_info.get("hosts") or [], ranks_info.get("host") or []
        if 0 <= r < len(host_col) and host_col[r] >= 0:
            host = f" · {hosts[host_col[r]]}"
        out_lanes.append({"label": f"rank {r}{host}", "y": y, "culprit": r in culprit_ranks, "rects": rects})
        y += LANE_H + LANE_GAP
    ticks = []
    ref = tl.get("incident_us")
    for k in range(9):
        us = lo + span * k / 8
        rel = us - ref if ref is not None else us
        ticks.append({"x": x_of(us), "label": ("+" if rel > 0 else "") + _ms(rel) if ref is not None else _ms(rel),
                      "anchor": "start" if k == 0 else "end" if k == 8 else "middle"})
    return {"lanes": out_lanes, "ticks": ticks, "width": LABEL_W + PLOT_W + 20, "height": y + 10,
            "label_w": LABEL_W, "lane_h": LANE_H, "incident_x": None if ref is None else x_of(ref),
            "end_x": x_of(end_us), "aggregated": aggregated, "world": world, "per_rank": tl.get("per_rank"),
            "shown_ranks": len(shown), "relative_to": "the incident" if ref is not None else "the window start"}


def _aggregate(tl: dict[str, Any], lo: int, span: int, x_of: Any) -> list[dict[str, Any]]:
    """One lane per group kind, and one of operations never completed: per bin, the share of ranks in one."""
    end_us = lo + span
    kinds: dict[str, list[int]] = {}
    ranks_of: dict[str, set[int]] = {}
    stuck = [0] * (BINS + 1)
    for i in range(len(tl["rank"])):
        g = tl["groups"][tl["group"][i]]
        k = _cls(g["kind"])
        diff = kinds.setdefault(k, [0] * (BINS + 1))
        ranks_of.setdefault(k, set()).add(tl["rank"][i])
        s = tl["start_us"][i]
        d = tl["dur_us"][i]
        e = end_us if d < 0 else s + d
        b0 = min(BINS - 1, int((s - lo) * BINS / span))
        b1 = min(BINS, max(b0 + 1, int((e - lo) * BINS / span + 0.999)))
        target = stuck if d < 0 else diff
        target[b0] += 1
        target[b1] -= 1
    all_ranks = len(set(tl["rank"]))
    out = []
    series = [(k, kinds[k], len(ranks_of[k]), k) for k in sorted(kinds)]
    series.append(("blocked", stuck, all_ranks, "stuck"))
    bin_us = span / BINS
    for name, diff, total, cls in series:
        rects, level = [], 0
        for b in range(BINS):
            level += diff[b]
            if level <= 0:
                continue
            share = min(1.0, level / max(total, 1))
            label = name.upper() if name in ("tp", "pp", "dp") else name
            rects.append({"x": x_of(lo + b * bin_us), "w": round(PLOT_W / BINS + 0.3, 1), "cls": cls,
                          "opacity": round(0.15 + 0.85 * share, 2),
                          "title": f"{label}: {level} of {total} ranks in an operation "
                                   f"{'that never completed' if name == 'blocked' else 'of this kind'} "
                                   f"at +{_ms(b * bin_us)}"})
        out.append({"label": f"all {name.upper() if name in ('tp', 'pp', 'dp') else name} ({total} ranks)",
                    "culprit": False, "rects": rects, "aggregate": True})
    return out
