"""Render ``findings.json`` into one self-contained ``report.html`` (and ``trace.json`` beside it).

The page fetches nothing: CSS, SVG and the script are inline, and its
Content-Security-Policy (``default-src 'none'``) allows only that one script, by
its hash, so nothing injected through a trace string could run even if it
escaped the (autoescaping) template.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from megatrace.files import write_atomic
from megatrace.report.model import ReportError, build, check_document

TEMPLATES = Path(__file__).with_name("templates")
REPORT_NAME, TRACE_NAME = "report.html", "trace.json"


def _environment() -> Any:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["pct"] = lambda v: f"{100 * float(v):.0f}%"
    return env


def render(doc: dict[str, Any], trace_json: str | None = None) -> str:
    """The report page of a findings document; ``trace_json``: the name of the exported trace to link."""
    model = build(check_document(doc), trace_json=trace_json)
    env = _environment()
    script = (TEMPLATES / "report.js").read_text()
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    csp = (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; img-src data:; "
           "base-uri 'none'; form-action 'none'")
    style = (TEMPLATES / "report.css").read_text()
    return env.get_template("report.html.j2").render(r=model, csp=csp, script=script, style=style)


def load_document(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a findings.json; :class:`ReportError` names the file on any problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ReportError(f"{path} is not JSON: {exc}") from None
    try:
        return check_document(doc)
    except ReportError as exc:
        raise ReportError(f"{path}: {exc}") from None


def write_report(findings: str | os.PathLike[str] | dict[str, Any], out: str | os.PathLike[str] | None = None,
                 trace: bool = True) -> tuple[Path, Path | None]:
    """Write the report (default: ``report.html`` beside the findings file) and, with ``trace``, the incident
    window as ``trace.json`` beside the report. Returns both paths (the trace's None when not written)."""
    from megatrace.report import perfetto

    if isinstance(findings, dict):
        doc = check_document(findings)
        if out is None:
            raise ValueError("out is required when findings is a document")
    else:
        doc = load_document(findings)
    html_path = Path(out) if out is not None else Path(findings).with_name(REPORT_NAME)  # type: ignore[arg-type]
    trace_path: Path | None = None
    events = perfetto.trace_events(doc) if trace else None
    if events is not None:
        trace_path = html_path.with_name(TRACE_NAME if html_path.name == REPORT_NAME
                                          else html_path.stem + "." + TRACE_NAME)
        write_atomic(trace_path, perfetto.dumps(events))
    write_atomic(html_path, render(doc, trace_json=trace_path.name if trace_path else None))
    return html_path, trace_path


__all__ = ["ReportError", "load_document", "render", "write_report"]
