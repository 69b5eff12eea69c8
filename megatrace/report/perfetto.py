"""The incident window as a Chrome / Perfetto trace (JSON trace-event format): ``trace.json`` beside the report.

One process per host, one thread per rank, one complete event ("X") per operation; an operation that never
completed lasts until the end of the trace and is named with a ``(never completed)`` suffix. Times are µs
from the window start (``metadata.t0_ns``, aligned wall clock).
"""

from __future__ import annotations

import json
from typing import Any


def trace_events(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The trace-event document of the exported timeline, or None when the analysis exported none."""
    report = (doc.get("analysis") or {}).get("report") or {}
    tl = report.get("timeline")
    if not tl or not tl.get("rank"):
        return None
    ranks = report.get("ranks") or {}
    hosts, host_col = ranks.get("hosts") or [], ranks.get("host") or []
    end_us = int(tl.get("end_us") or 0)
    events: list[dict[str, Any]] = []
    pids: dict[int, int] = {}

    def pid_of(rank: int) -> int:
        return (host_col[rank] + 1) if 0 <= rank < len(host_col) and host_col[rank] >= 0 else 0

    for i, rank in enumerate(tl["rank"]):
        g = tl["groups"][tl["group"][i]]
        name = tl["ops"][tl["op"][i]]
        kind = g["kind"].upper() if g["kind"] in ("tp", "pp", "dp") else g["kind"]
        dur = tl["dur_us"][i]
        pid = pid_of(rank)
        pids.setdefault(pid, rank)
        args = {"group": g["label"], "seq": tl["seq"][i], "bytes": tl["bytes"][i],
                "state": tl.get("states", {}).get(str(tl["state"][i]), tl["state"][i])}
        if tl["peer"][i] >= 0:
            args["peer"] = tl["peer"][i]
        events.append({"name": f"{kind} {name} #{tl['seq'][i]}" + (" (never completed)" if dur < 0 else ""),
                       "cat": g["kind"], "ph": "X", "ts": tl["start_us"][i], "pid": pid, "tid": rank,
                       "dur": dur if dur >= 0 else max(0, end_us - tl["start_us"][i]), "args": args})
    meta: list[dict[str, Any]] = []
    for pid in sorted(pids):
        meta.append({"name": "process_name", "ph": "M", "pid": pid,
                     "args": {"name": hosts[pid - 1] if 0 < pid <= len(hosts) else "unknown host"}})
    for rank in sorted(set(tl["rank"])):
        meta.append({"name": "thread_name", "ph": "M", "pid": pid_of(rank), "tid": rank,
                     "args": {"name": f"rank {rank}"}})
    if tl.get("incident_us") is not None:
        meta.append({"name": "incident", "ph": "i", "s": "g", "ts": tl["incident_us"], "pid": 0, "tid": 0})
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "metadata": {"t0_ns": tl.get("t0_ns"), "job_id": (doc.get("trace") or {}).get("job_id"),
                         "generator": doc.get("generator")}}


def dumps(trace: dict[str, Any]) -> str:
    return json.dumps(trace, separators=(",", ":"), ensure_ascii=False)
