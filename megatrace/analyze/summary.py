"""The terminal summary of an analysis: the verdict first, then the evidence and the other findings."""

from __future__ import annotations

from pathlib import Path

from megatrace.analyze.engine import AnalysisResult
from megatrace.analyze.findings import Severity
from megatrace.analyze.jobconfig import describe
from megatrace.load.traceset import plural

MAX_OTHER = 10  # other findings listed by the terminal summary (all are in findings.json)
MAX_EVIDENCE = 4  # evidence lines shown under the verdict


def render_verdict(result: AnalysisResult) -> str:
    """The verdict's lines: the first finding, its kind, confidence, evidence and what to do."""
    top = result.verdict
    if top is None:
        return "VERDICT: no findings"
    lines = [f"VERDICT [{top.severity.value}] {top.verdict}",
             f"  kind {top.kind.value}, confidence {top.confidence:.2f}"]
    lines += [f"  - {item}" for item in top.evidence[:MAX_EVIDENCE]]
    if top.remediation:
        lines.append(f"  what to do: {top.remediation}")
    return "\n".join(lines)


def render_summary(result: AnalysisResult, shown_path: Path | None = None, out_dir: Path | None = None) -> str:
    """Plain text for a terminal; the first line is the verdict. ``shown_path``: the trace directory's
    name for people, when the analysis read it through another path (a descriptor under /proc); ``out_dir``:
    where job.yaml was written (default: the trace directory)."""
    lines = [render_verdict(result)]
    t = result.trace
    where = shown_path or t.path
    m = result.match.summary()
    lines.append("")
    lines.append(f"trace {where}: job {t.job_id}, {len(t.ranks)} of {t.world_size} ranks on "
                 f"{plural(len(t.hosts), 'host')}, {len(t.records):,} records; "
                 f"{m['collective_instances']:,} collectives ({m['incomplete_instances']} incomplete), "
                 f"{m['p2p_pairs']:,} point-to-point pairs; "
                 f"analysed in {result.timings.get('total', 0.0):.2f} s")
    job = result.results.get("job")
    if job is not None:
        lines.append(f"job: {describe(job)} (all fields and sources: {(out_dir or where) / 'job.yaml'})")
    others = result.findings[1:]
    shown = [f for f in others if f.severity != Severity.INFO][:MAX_OTHER] or others[:MAX_OTHER]
    if shown:
        lines.append("other findings:")
        for f in shown:
            lines.append(f"  [{f.severity.value}] {f.verdict}")
        if len(others) > len(shown):
            lines.append(f"  … {len(others) - len(shown)} more in findings.json")
    return "\n".join(lines)
