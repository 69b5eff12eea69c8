"""The report's view model: findings.json in, plain values for the template out.

Nothing here reads a trace: every value comes from the findings document
(``analysis.report`` holds what the analysis exported for the report, see
docs/findings-schema.md). Strings from the trace stay plain strings; the
template (autoescaped) turns them into text.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Any

from megatrace.analyze.words import duration
from megatrace.errors import MegatraceError

HEADLINES = {  # finding kind -> the banner's first word(s)
    "compute-hang": "HANG", "comm-hang": "COMMUNICATION HANG", "crashed-process": "CRASH",
    "exited-early": "EARLY EXIT", "no-trace": "HANG (NO TRACE)",
    "startup-hang": "HANG AT START-UP", "collective-mismatch": "COLLECTIVE MISMATCH",
    "deadlock": "DEADLOCK", "possible-hang": "POSSIBLE HANG", "partial-stop": "PARTIAL STOP",
    "straggler": "STRAGGLER", "slow-link": "SLOW LINK", "slow-rank-network": "SLOW NETWORK",
    "step-slowdown": "SLOWDOWN", "healthy": "HEALTHY", "critical-path": "HEALTHY", "trace-problem": "TRACE PROBLEM",
    "clock": "CLOCK", "rule": "RULE", "rule-error": "RULE ERROR", "stall": "STALL",
}
HANG_KINDS = {"compute-hang", "comm-hang", "crashed-process", "exited-early", "no-trace", "startup-hang",
              "collective-mismatch", "deadlock", "possible-hang"}
CULPRIT_KINDS = HANG_KINDS | {"straggler", "slow-link", "slow-rank-network"}  # findings whose subject is to blame
MAX_CULPRITS = 16  # rows in the culprit table
MAX_STEPS_SHOWN = 120  # per-iteration bars: the most recent steps
DELAY_FLOOR = 0.1  # delay-matrix colours saturate at the worst cell, or at this share of a step if more


class ReportError(MegatraceError):
    """The input is not a findings document this report can render."""


@dataclass
class Banner:
    headline: str
    sentence: str
    severity: str
    when: str | None
    when_label: str  # "Incident" (a root cause's stop) or "Trace ends"
    confidence: float | None
    action: str
    healthy: bool


@dataclass
class Culprit:
    rank: int | None
    host: str
    gpu: str
    coords: str
    last_op: str
    state: str
    why: str


@dataclass
class Report:
    """Everything the template shows, in order."""

    title: str
    banner: Banner
    culprits: list[Culprit]
    findings: list[dict[str, Any]]
    facts: list[tuple[str, str]]
    env: list[tuple[str, str]]
    command: str
    critical_path: dict[str, Any] | None
    timeline: dict[str, Any] | None
    graph: dict[str, Any] | None
    heat: dict[str, Any] | None
    delay: dict[str, Any] | None
    preflight: list[dict[str, Any]] = field(default_factory=list)
    trace_json: str | None = None


def check_document(doc: Any) -> dict[str, Any]:
    """Raise :class:`ReportError` unless ``doc`` is a version-1 findings document."""
    if not isinstance(doc, dict) or doc.get("schema") != "megatrace.findings":
        raise ReportError("not a MegaTrace findings document (its \"schema\" is not \"megatrace.findings\")")
    if doc.get("version") != 1:
        raise ReportError(f"findings schema version {doc.get('version')!r} is not supported (this report reads 1)")
    if not isinstance(doc.get("findings"), list):
        raise ReportError("the findings document has no \"findings\" list")
    return doc


def utc(ns: Any) -> str | None:
    """ns since the epoch → ``2026-12-02 12:43:33.123 UTC`` (None when unknown or not a wall time)."""
    if not isinstance(ns, int) or ns < 10**17:
        return None
    t = _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d} UTC"


def _coords(c: Any) -> str:
    if not isinstance(c, dict):
        return "—"
    return " ".join(f"{k.upper()} {c[k]}" for k in ("pp", "tp", "dp") if k in c)


def _banner(doc: dict[str, Any], top: dict[str, Any] | None) -> Banner:
    if top is None:
        return Banner("NO FINDINGS", "the analysis produced no findings", "info", None, "Trace ends", None, "", True)
    kind, sev = str(top.get("kind", "")), str(top.get("severity", "info"))
    # An unfinished trace with no rank blocked is not a healthy run: it had not ended when it was read.
    healthy = kind in ("healthy", "critical-path") or (sev == "info" and kind not in HANG_KINDS)
    headline = HEADLINES.get(kind, kind.upper() or "FINDING")
    if healthy:
        headline = "HEALTHY"
    elif kind == "possible-hang" and sev == "info":
        headline = "NOT FINISHED"
    data = top.get("data") or {}
    when = utc(data.get("stop_ns")) or utc(((doc.get("analysis") or {}).get("hang") or {}).get("end_ns"))
    when_label = "Incident" if utc(data.get("stop_ns")) and not healthy else "Trace ends"
    action = str(top.get("remediation") or "")
    if healthy and not action:
        action = "Nothing to do: no rank stopped and nothing was slow beyond its peers. The step-time breakdown is below."
    conf = top.get("confidence")
    return Banner(headline, str(top.get("verdict", "")), sev if not healthy else "info", when, when_label,
                  float(conf) if isinstance(conf, (int, float)) else None, action, healthy)


def _last_ops(report: dict[str, Any]) -> dict[int, tuple[str, str]]:
    """rank → (its last operation, its state) from the exported timeline."""
    tl = report.get("timeline") or {}
    out: dict[int, tuple[str, str]] = {}
    if not tl:
        return out
    groups, ops, states = tl["groups"], tl["ops"], tl.get("states", {})
    for i, r in enumerate(tl["rank"]):
        g = groups[tl["group"][i]]
        name = ops[tl["op"][i]]
        peer = tl["peer"][i]
        label = f"{g['kind'].upper() if g['kind'] in ('tp', 'pp', 'dp') else g['kind']} {name} #{tl['seq'][i]}"
        if name in ("send", "recv") and peer >= 0:
            label += f" {'to' if name == 'send' else 'from'} rank {peer}"
        out[r] = (label, str(states.get(str(tl["state"][i]), tl["state"][i])))
    return out


def _culprits(doc: dict[str, Any], report: dict[str, Any]) -> list[Culprit]:
    last = _last_ops(report)
    ranks = report.get("ranks") or {}
    status_names = ranks.get("statuses", [])
    out: list[Culprit] = []
    seen: set[int] = set()
    for f in doc["findings"]:
        if f.get("severity") == "info" or f.get("kind") not in CULPRIT_KINDS:
            continue
        subj = f.get("subject") or {}
        rank_list = [subj["rank"]] if isinstance(subj.get("rank"), int) else \
            [r for r in subj.get("ranks", []) if isinstance(r, int)][:4]
        for r in rank_list:
            if r in seen or len(out) >= MAX_CULPRITS:
                continue
            seen.add(r)
            host = subj.get("host") if subj.get("rank") == r else None
            gpu = subj.get("local_rank") if subj.get("rank") == r else None
            if host is None and 0 <= r < len(ranks.get("host", [])) and ranks["host"][r] >= 0:
                host = ranks["hosts"][ranks["host"][r]]
            if gpu is None and 0 <= r < len(ranks.get("gpu", [])) and ranks["gpu"][r] >= 0:
                gpu = ranks["gpu"][r]
            status = status_names[ranks["status"][r]] if 0 <= r < len(ranks.get("status", [])) else ""
            op, state = last.get(r, ("—", ""))
            out.append(Culprit(r, str(host) if host is not None else "—", str(gpu) if gpu is not None else "—",
                               _coords(subj.get("coords") if subj.get("rank") == r else _grid_coords(doc, r)),
                               op, f"{status}{' · ' if status and state else ''}{('last op ' + state) if state else ''}",
                               str(f.get("kind", ""))))
    return out


def _grid_coords(doc: dict[str, Any], rank: int) -> dict[str, int] | None:
    layout = (doc.get("trace") or {}).get("layout")
    if not isinstance(layout, dict):
        return None
    return rank_coords(layout, rank)


def rank_coords(layout: dict[str, Any], rank: int) -> dict[str, int] | None:
    """TP/PP/DP coordinates of ``rank`` for the layout's ``order`` (fastest-varying first)."""
    try:
        sizes = {"tp": int(layout["tp"]), "pp": int(layout["pp"]), "dp": int(layout["dp"])}
        order = str(layout.get("order") or "tp-dp-pp").split("-")
    except (KeyError, TypeError, ValueError):
        return None
    if sorted(order) != ["dp", "pp", "tp"]:
        return None
    out, r = {}, rank
    for k in order:
        out[k] = r % sizes[k]
        r //= sizes[k]
    return out


def _facts(doc: dict[str, Any], report: dict[str, Any]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    t = doc.get("trace") or {}
    job = report.get("job") or {}
    env = job.get("env") or {}
    layout = t.get("layout")
    facts: list[tuple[str, str]] = [("job id", str(t.get("job_id", "—")))]
    for key, name in (("SLURM_JOB_ID", "Slurm job"), ("SLURM_STEP_ID", "Slurm step"),
                      ("SLURM_JOB_NODELIST", "Slurm nodes")):
        if key in env:
            facts.append((name, env[key]))
    facts.append(("world size", f"{t.get('world_size', '?')} ranks ({t.get('ranks_loaded', '?')} traced"
                  + (f", missing {len(t.get('missing_ranks') or [])})" if t.get("missing_ranks") else ")")))
    if isinstance(layout, dict):
        facts.append(("layout", f"TP {layout.get('tp')} × PP {layout.get('pp')} × DP {layout.get('dp')}, "
                      f"{layout.get('microbatches')} microbatches, {layout.get('schedule')} schedule, "
                      f"rank order {layout.get('order')}"))
    hosts = [str(h) for h in t.get("hosts") or []]
    facts.append(("nodes", f"{len(hosts)}: " + ", ".join(hosts[:16]) + (f" … {len(hosts) - 16} more"
                                                                       if len(hosts) > 16 else "")))
    facts.append(("records", str(t.get("records", "—"))))
    mode = (doc.get("analysis") or {}).get("mode") or {}
    if mode.get("name") == "hang":
        facts.append(("analysis mode", "quick: hang localisation from each rank's newest records; not run: "
                      + (", ".join(str(x) for x in mode.get("skipped_stages") or []) or "—")))
    facts.append(("trace directory", str(t.get("path", "—"))))
    if job.get("argv"):
        facts.append(("traced command", " ".join(str(a) for a in job["argv"])))
    versions = [str(doc.get("generator", ""))]
    if job.get("torch"):
        versions.append(f"torch {job['torch']}")
    if job.get("backend"):
        versions.append(f"backend {job['backend']}")
    facts.append(("versions", ", ".join(v for v in versions if v)))
    for p in t.get("problems") or []:
        facts.append(("input problem", str(p)))
    return facts, [(k, str(v)) for k, v in sorted(env.items())]


def _command(doc: dict[str, Any], report: dict[str, Any]) -> str:
    import shlex

    if report.get("command"):
        return str(report["command"])
    t = doc.get("trace") or {}
    cmd = ["megatrace", "analyze", str(t.get("path", "TRACE_DIR"))]
    if ((doc.get("analysis") or {}).get("mode") or {}).get("name") == "hang":
        cmd.append("--quick")
    return shlex.join(cmd)


def _critical_path(doc: dict[str, Any]) -> dict[str, Any] | None:
    cp = next((f for f in doc["findings"] if f.get("kind") == "critical-path"), None)
    if cp is None:
        return None
    d = cp.get("data") or {}
    steps, step_ns = list(d.get("steps") or []), list(d.get("step_ns") or [])
    if not steps or len(steps) != len(step_ns):
        return {"verdict": cp.get("verdict", ""), "evidence": cp.get("evidence", []), "bars": [], "shares": []}
    expected = d.get("expected_step_ns") or 0
    steps, step_ns = steps[-MAX_STEPS_SHOWN:], step_ns[-MAX_STEPS_SHOWN:]
    top = max(max(step_ns), expected or 0, 1)
    bars = [{"step": s, "ns": ns, "w": ns / top, "label": duration(ns),
             "slow": bool(expected) and ns > 1.2 * expected} for s, ns in zip(steps, step_ns)]
    shares = []
    for title, key, prefix in (("by kind", "share_by_category", ""), ("by pipeline stage", "share_by_stage", "stage "),
                               ("by link", "share_by_link", "link ")):
        items = sorted(((str(k), float(v)) for k, v in (d.get(key) or {}).items()), key=lambda kv: -kv[1])
        if items:
            shares.append({"title": title, "items": [(prefix + k, v) for k, v in items[:12]]})
    return {"verdict": cp.get("verdict", ""), "evidence": cp.get("evidence", []), "bars": bars,
            "expected": expected, "expected_w": (expected or 0) / top, "expected_label": duration(expected or 0),
            "shares": shares, "fit": d.get("fit")}


def _heat(doc: dict[str, Any], report: dict[str, Any], culprits: list[Culprit]) -> dict[str, Any] | None:
    """Data for the rank grid (drawn on a canvas by the page's script): blame share and status per rank."""
    t = doc.get("trace") or {}
    world = int(t.get("world_size") or 0)
    if world <= 0:
        return None
    cp = next((f for f in doc["findings"] if f.get("kind") == "critical-path"), None)
    shares = ((cp or {}).get("data") or {}).get("share_by_rank") or {}
    blame = [0.0] * world
    for k, v in shares.items():
        try:
            r = int(k)
        except ValueError:
            continue
        if 0 <= r < world:
            blame[r] = round(float(v), 4)
    for f in doc["findings"]:  # stragglers: their excess shows even when the path was not modelled
        if f.get("kind") in ("straggler", "slow-rank-network") and isinstance((f.get("subject") or {}).get("rank"), int):
            r = f["subject"]["rank"]
            if 0 <= r < world:
                blame[r] = max(blame[r], 0.5)
    ranks = report.get("ranks") or {}
    layout = t.get("layout") if isinstance(t.get("layout"), dict) else None
    return {"world": world, "blame": blame, "status": ranks.get("status", []), "statuses": ranks.get("statuses", []),
            "culprits": sorted({c.rank for c in culprits if c.rank is not None}),
            "layout": None if layout is None else {k: layout.get(k) for k in ("tp", "pp", "dp", "order")},
            "modelled": bool(shares)}


def _delay(report: dict[str, Any]) -> dict[str, Any] | None:
    d = report.get("delay")
    if not d or not d.get("excess_us"):
        return None
    worst = max((v for row in d["excess_us"] for v in row if isinstance(v, (int, float))), default=0)
    # the colour scale saturates at the worst cell, but never below DELAY_FLOOR of a step: noise stays pale
    scale_us = max(int(worst), int(DELAY_FLOOR * int(d.get("step_ns") or 0) / 1000), 1)
    return {"excess_us": d["excess_us"], "slow_ranks": d.get("slow_ranks", []), "slow_links": d.get("slow_links", []),
            "scale_us": scale_us, "scale_label": duration(scale_us * 1000)}


def build(doc: dict[str, Any], trace_json: str | None = None) -> Report:
    """The view model of one findings document (see :class:`Report`)."""
    from megatrace.report import graph, timeline

    check_document(doc)
    report = (doc.get("analysis") or {}).get("report") or {}
    findings = [f for f in doc["findings"] if isinstance(f, dict)]
    top = findings[0] if findings else None
    if top is not None and top.get("kind") == "critical-path":  # info-only runs: say healthy first
        top = next((f for f in findings if f.get("kind") == "healthy"), top)
    banner = _banner(doc, top)
    culprits = _culprits(doc, report)
    facts, env = _facts(doc, report)
    t = doc.get("trace") or {}
    return Report(
        title=f"MegaTrace · {banner.headline} · {t.get('job_id', '')}",
        banner=banner, culprits=culprits,
        findings=[{"severity": str(f.get("severity", "info")), "kind": str(f.get("kind", "")),
                   "verdict": str(f.get("verdict", "")), "remediation": str(f.get("remediation", "")),
                   "evidence": [e if isinstance(e, str) else str(e) for e in (f.get("evidence") or [])],
                   "confidence": f.get("confidence"), "id": str(f.get("id", ""))} for f in findings],
        facts=facts, env=env, command=_command(doc, report), critical_path=_critical_path(doc),
        timeline=timeline.lanes(report.get("timeline"), doc, culprits),
        graph=graph.layout(report.get("wait_for")), heat=_heat(doc, report, culprits), delay=_delay(report),
        preflight=[p for p in (doc.get("preflight") or []) if isinstance(p, dict)], trace_json=trace_json)
