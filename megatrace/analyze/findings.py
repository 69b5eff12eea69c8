"""Findings: what analysis concluded, as data, and ``findings.json`` (schema in docs/findings-schema.md).

Every finding has an id, a severity, a kind, a subject (rank, host, GPU,
group, link), a one-line verdict, evidence, a remediation and a confidence.
:func:`order_findings` sorts the most important first, so the first finding
is the verdict of the whole analysis.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from megatrace import __version__
from megatrace.files import write_atomic

SCHEMA = "megatrace.findings"
SCHEMA_VERSION = 1


class Severity(str, enum.Enum):
    """How urgent a finding is; ordered from most to least severe."""

    CRITICAL = "critical"  # the job is stopped or will not finish (hang, crash)
    ERROR = "error"  # wrong results or wasted work (mismatch, contradictory input)
    WARNING = "warning"  # degraded or incomplete (missing ranks, partial stop, slowness)
    INFO = "info"  # context; never a reason to fail

    @property
    def rank(self) -> int:
        """0 for critical ... 3 for info."""
        return list(Severity).index(self)

    def at_least(self, other: Severity) -> bool:
        return self.rank <= other.rank

    @classmethod
    def parse(cls, text: str) -> Severity:
        try:
            return cls(text.lower())
        except ValueError:
            raise ValueError(f"unknown severity {text!r} (one of {', '.join(s.value for s in cls)})") from None


class Kind(str, enum.Enum):
    """Finding kinds; docs/findings-schema.md describes each."""

    COMPUTE_HANG = "compute-hang"  # a rank stopped outside communication; others wait for it
    COMM_HANG = "comm-hang"  # every member entered a collective (or both sides a p2p), none completed
    CRASHED_PROCESS = "crashed-process"  # a rank's process died; others wait for it or it simply died
    EXITED_EARLY = "exited-early"  # a rank's process exited cleanly while others still wait for it
    COLLECTIVE_MISMATCH = "collective-mismatch"  # members disagree on op, size, dtype or root
    DEADLOCK = "deadlock"  # ranks wait on each other in a cycle (a program-order bug)
    NO_TRACE = "no-trace"  # others wait for a rank whose ring is missing: cause unknown
    STARTUP_HANG = "startup-hang"  # ranks stuck in (or before) init_process_group: communication never started
    POSSIBLE_HANG = "possible-hang"  # ranks blocked at the end, but not for long: maybe in flight
    STALL = "stall"  # every rank alive but silent far longer than usual, and no rank to blame
    PARTIAL_STOP = "partial-stop"  # some ranks were still progressing while others were stuck
    HEALTHY = "healthy"  # nothing stopped: the summary of a clean run
    TRACE_PROBLEM = "trace-problem"  # the input was incomplete or inconsistent
    CLOCK = "clock"  # clock alignment facts
    STRAGGLER = "straggler"  # a rank computes slower than the ranks doing the same work
    SLOW_LINK = "slow-link"  # transfers between two ranks take longer than the same transfers elsewhere
    SLOW_RANK_NETWORK = "slow-rank-network"  # every transfer of one rank is slow (its NIC or host)
    STEP_SLOWDOWN = "step-slowdown"  # steps became slower than the first healthy ones
    CRITICAL_PATH = "critical-path"  # the step-time breakdown (info)
    RULE = "rule"  # a rule of the rules engine matched
    RULE_ERROR = "rule-error"  # a rule file or a rule could not be used (the other rules still ran)
    CONFIG = "config"  # the job's configuration is inconsistent or partly unreadable (megatrace.analyze.jobconfig)


@dataclass(frozen=True)
class Subject:
    """What a finding is about. Unused fields stay None / empty."""

    rank: int | None = None
    host: str | None = None
    local_rank: int | None = None  # the GPU index on GPU nodes
    coords: dict[str, int] | None = None  # {"pp":, "dp":, "tp":} from the layout
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    group: dict[str, Any] | None = None  # {"gid", "name", "desc", "ranks"}
    link: tuple[int, int] | None = None  # (rank, rank)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in ("rank", "host", "local_rank", "coords", "group"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.ranks:
            out["ranks"] = list(self.ranks)
        if self.hosts:
            out["hosts"] = list(self.hosts)
        if self.link is not None:
            out["link"] = list(self.link)
        return out


@dataclass
class Finding:
    """One conclusion, with the evidence behind it."""

    id: str  # stable: kind plus subject, e.g. "compute-hang:rank-5"
    severity: Severity
    kind: Kind
    subject: Subject
    verdict: str  # one line, the first thing a person reads
    evidence: list[str | dict[str, Any]] = field(default_factory=list)
    remediation: str = ""
    confidence: float = 1.0  # 0..1
    impact: int = 0  # ranks affected (e.g. waiting on this root cause); orders findings of one severity
    data: dict[str, Any] = field(default_factory=dict)  # machine-readable details (times in ns)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "severity": self.severity.value, "kind": self.kind.value,
                "subject": self.subject.to_dict(), "verdict": self.verdict, "evidence": self.evidence,
                "remediation": self.remediation, "confidence": round(float(self.confidence), 3),
                "impact": self.impact, "data": self.data}


STOPPED_KINDS = (Kind.COMPUTE_HANG, Kind.CRASHED_PROCESS, Kind.EXITED_EARLY)  # hang roots that are a rank's stop


def _stopped_at(f: Finding) -> int | None:
    """When the rank a hang root names stopped (``data["stop_ns"]``, aligned ns), or None."""
    stop = f.data.get("stop_ns") if f.kind in STOPPED_KINDS else None
    return int(stop) if isinstance(stop, (int, float)) and not isinstance(stop, bool) else None


def order_findings(findings: list[Finding]) -> list[Finding]:
    """Most important first: severity, then ranks affected, then confidence, then id.

    Among the findings of one severity that name a rank which stopped (compute hang, crash, early exit:
    hang roots with ``data["stop_ns"]``), ties of impact go to the rank that stopped first, ahead of
    confidence and id: a rank that stopped later cannot have caused an earlier stop, while the earlier one
    may well have caused the later through waits the trace does not show (a Flight Recorder dump of gloo
    records no point-to-point call, so a pipeline neighbour stuck in a receive from the hung rank looks
    stopped too, with as many waiters). Those roots only trade places among themselves; the other findings
    keep theirs.
    """
    ordered = sorted(findings, key=lambda f: (f.severity.rank, -f.impact, -f.confidence, f.id))
    slots: dict[int, list[int]] = {}
    for i, f in enumerate(ordered):
        if _stopped_at(f) is not None:
            slots.setdefault(f.severity.rank, []).append(i)
    for places in slots.values():
        roots = sorted((ordered[i] for i in places),
                       key=lambda f: (-f.impact, _stopped_at(f), -f.confidence, f.id))
        for i, f in zip(places, roots):
            ordered[i] = f
    return ordered


def worst_severity(findings: list[Finding]) -> Severity | None:
    return min((f.severity for f in findings), key=lambda s: s.rank, default=None)


def findings_document(findings: list[Finding], trace: dict[str, Any],
                      analysis: dict[str, Any] | None = None) -> dict[str, Any]:
    """The findings.json document (see docs/findings-schema.md)."""
    ordered = order_findings(findings)
    return {"schema": SCHEMA, "version": SCHEMA_VERSION, "generator": f"megatrace {__version__}",
            "verdict": ordered[0].verdict if ordered else "no findings",
            "trace": trace, "analysis": analysis or {}, "findings": [f.to_dict() for f in ordered]}


def write_findings_json(path: str | os.PathLike[str], document: dict[str, Any]) -> Path:
    """Write ``document`` atomically (temporary file, then rename)."""
    return write_atomic(path, findings_text(document))


def findings_text(document: dict[str, Any], default: Callable[[Any], Any] | None = None) -> str:
    """``document`` as findings.json's text: indented for people, except ``analysis.report`` (what the HTML report
    draws: megabytes at thousands of ranks), written on one line by the C encoder, ten times faster. ``default``:
    what values JSON does not know become (default: numpy scalars and sets; anything else is an error)."""
    default = default or _plain
    analysis = document.get("analysis")
    if not isinstance(analysis, dict) or "report" not in analysis:
        return json.dumps(document, indent=2, ensure_ascii=False, default=default) + "\n"
    marker = f"report-{os.urandom(16).hex()}"  # (no string of the document can hold it)
    text = json.dumps({**document, "analysis": {**analysis, "report": marker}}, indent=2, ensure_ascii=False,
                      default=default)
    report = json.dumps(analysis["report"], ensure_ascii=False, default=default, separators=(",", ":"))
    return text.replace(f'"{marker}"', report, 1) + "\n"


def _plain(value: Any) -> Any:
    """JSON fallback for numpy scalars and tuples hidden in evidence."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
