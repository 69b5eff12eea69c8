"""The pipeline's last steps on a collected bundle: analyze it, then write the report (collect → analyze → report);
and the full export of a trace (load → analyze's clock alignment → report's Perfetto writer).

The collector (``megatrace collect``, run by the agent on a hang and by the epilog at the job's end) writes the
bundle and hands it here through ``BundleWriter.finish(analyse=analyze_bundle)``; collection itself never
imports analysis or report.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatrace.collect.bundle import BundleWriter

if TYPE_CHECKING:
    from megatrace.report.perfetto import ExportStats


def analyze_bundle(writer: BundleWriter, mode: str, report: bool) -> dict[str, Any]:
    """Analyse the bundle ``writer`` wrote (``mode``: "full" or "quick"), write findings.json, summary.txt and,
    if ``report``, report.html into it; returns the analysis's entry of collection.json. Never raises: an
    analysis that fails is an ``error`` in that entry (it must never lose the collection)."""
    from megatrace.analyze.engine import analyze
    from megatrace.analyze.findings import findings_text
    from megatrace.analyze.heap import tuned_for_analysis
    from megatrace.analyze.summary import render_summary

    t0 = time.perf_counter()
    out: dict[str, Any] = {"ran": True, "mode": mode}
    with tuned_for_analysis():
        try:
            # Root reads through its own descriptor: a link put in place of the directory is not followed.
            where = writer.out.fd_path if os.geteuid() == 0 else str(writer.path)
            result = analyze(where, mode="hang" if mode == "quick" else "full")
            doc = result.document()
            trace = doc.setdefault("trace", {})
            trace["path"] = str(writer.path)
            # What the collection could not bring, in the words every reader of findings.json shows.
            trace.setdefault("problems", []).extend(writer.collection_problems())
            text = findings_text(doc, default=_plain)
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


def export_trace(trace_dir: str | os.PathLike[str], out: str | os.PathLike[str],
                 format: str = "auto") -> ExportStats:  # noqa: A002 - load_trace's format
    """Load ``trace_dir`` (any format), match it and write every record to ``out``
    (:mod:`megatrace.report.perfetto`; ``megatrace export --perfetto``).

    Nothing is written into ``trace_dir`` (no analysis runs: loading, matching and clock alignment are all
    the export needs). A name ending in ``.gz`` is written gzipped; the file appears whole or not at all.
    Raises :class:`~megatrace.report.perfetto.ExportError` when ``out`` cannot be written (checked before the
    trace is loaded) and what :func:`~megatrace.load.load_trace` raises for an unreadable trace.
    """
    from megatrace.report.perfetto import write_trace_file

    return write_trace_file(out, lambda: _aligned_trace(trace_dir, format))


def _aligned_trace(trace_dir: str | os.PathLike[str], format: str) -> tuple[Any, Any, Any]:  # noqa: A002
    """(trace, its record index, its clock alignment) of ``trace_dir``, ready to export."""
    from megatrace.analyze.clock import align_clocks
    from megatrace.analyze.index import index_records
    from megatrace.load import load_trace
    from megatrace.load.traceset import TraceLoadError

    trace = load_trace(trace_dir, format=format)
    if not len(trace.records):
        raise TraceLoadError(f"{trace_dir}: no records to export")
    ix = index_records(trace)
    return trace, ix, align_clocks(trace, ix, in_place=True)


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
    """JSON fallback that never fails (the collector never loses a bundle over a value): anything unknown as text."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    return str(value)
