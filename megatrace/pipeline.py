"""The pipeline's last steps on a collected bundle: analyze it, then write the report (collect → analyze → report).

The collector (``megatrace collect``, run by the agent on a hang and by the epilog at the job's end) writes the
bundle and hands it here through ``BundleWriter.finish(analyse=analyze_bundle)``; collection itself never
imports analysis or report.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from megatrace.collect.bundle import BundleWriter


def analyze_bundle(writer: BundleWriter, mode: str, report: bool) -> dict[str, Any]:
    """Analyse the bundle ``writer`` wrote (``mode``: "full" or "quick"), write findings.json, summary.txt and,
    if ``report``, report.html into it; returns the analysis's entry of collection.json. Never raises: an
    analysis that fails is an ``error`` in that entry (it must never lose the collection)."""
    from megatrace.analyze.engine import analyze
    from megatrace.analyze.summary import render_summary

    t0 = time.perf_counter()
    out: dict[str, Any] = {"ran": True, "mode": mode}
    try:
        # Root reads through its own descriptor: a link put in place of the directory is not followed.
        where = writer.out.fd_path if os.geteuid() == 0 else str(writer.path)
        result = analyze(where, mode="hang" if mode == "quick" else "full")
        doc = result.document()
        trace = doc.setdefault("trace", {})
        trace["path"] = str(writer.path)
        # What the collection could not bring, in the words every reader of findings.json shows.
        trace.setdefault("problems", []).extend(writer.collection_problems())
        text = json.dumps(doc, indent=2, ensure_ascii=False, default=_plain) + "\n"
        writer.out.write("findings.json", text.encode(), replace=True)
        summary = render_summary(result, writer.path)
        writer.out.write("summary.txt", summary.encode() + b"\n", replace=True)
        out["findings"] = "findings.json"
        out["verdict"] = doc.get("verdict")
        if doc.get("findings"):
            top = doc["findings"][0]
            out["verdict_finding"] = {k: top.get(k) for k in ("id", "severity", "kind", "subject")}
        if report:
            out["report"] = _report(writer, text)
    except Exception as exc:  # analysis must never lose the collection
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _report(writer: BundleWriter, findings_text: str) -> str | None:
    """report.html (rendered in a private directory, then copied into the bundle)."""
    from megatrace.report.render import write_report

    tmp = tempfile.mkdtemp(prefix="megatrace-report-")
    try:
        src = Path(tmp) / "findings.json"
        src.write_text(findings_text, encoding="utf-8")
        html, trace = write_report(src)
        for p in (html, trace):
            if p is not None:
                writer.out.write(Path(p).name, Path(p).read_bytes(), replace=True)
        return Path(html).name
    except Exception as exc:
        writer.problems.append(f"report not written: {type(exc).__name__}: {exc}")
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    return str(value)
