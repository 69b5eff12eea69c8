"""Importers of foreign trace formats: Flight Recorder dumps, Megatrace NCCL-patch logs, NCCL Inspector lines.

Each importer turns its files into the same :class:`~megatrace.analyze.traceset.TraceSet` that
ring files give, so analysis does not know where a trace came from. ``load_trace(DIR, format=...)``
calls :func:`import_trace` when DIR holds no ring files (or a format is forced). See
docs/importers.md.
"""

from __future__ import annotations

from pathlib import Path

from megatrace.analyze.importers.detect import FORMATS, detect_format
from megatrace.analyze.traceset import TraceLoadError, TraceSet
from megatrace.config import Layout

__all__ = ["FORMATS", "detect_format", "import_trace"]


def import_trace(directory: str | Path, fmt: str = "auto", layout: Layout | None = None) -> TraceSet:
    """Load ``directory`` in format ``fmt`` (``auto``: detected); raises TraceLoadError naming what is wrong."""
    directory = Path(directory)
    if fmt == "auto":
        fmt = detect_format(directory)
        if fmt is None:
            raise TraceLoadError(
                f"{directory}: not a trace directory: no ring files (rank-NNNNN.ring), Flight Recorder dumps, "
                f"Megatrace NCCL logs (rank_<R>.log) or NCCL Inspector JSON lines in it or its subdirectories "
                f"(--format forces a format)")
    if fmt == "flight-recorder":
        from megatrace.analyze.importers.flight_recorder import load_flight_recorder

        return load_flight_recorder(directory, layout)
    if fmt == "nccl-log":
        from megatrace.analyze.importers.nccl_log import load_nccl_logs

        return load_nccl_logs(directory, layout)
    if fmt == "inspector":
        from megatrace.analyze.importers.inspector import load_inspector

        return load_inspector(directory, layout)
    raise TraceLoadError(f"{directory}: unknown trace format {fmt!r} (one of {', '.join(FORMATS)})")
