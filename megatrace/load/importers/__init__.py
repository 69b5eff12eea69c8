"""Importers of foreign trace formats: Flight Recorder dumps, Megatrace NCCL-patch logs, NCCL Inspector lines,
job output logs.

Each importer turns its files into the same :class:`~megatrace.load.traceset.TraceSet` that
ring files give, so analysis does not know where a trace came from. ``load_trace(DIR, format=...)``
calls :func:`import_trace` when DIR holds no ring files (or a format is forced). See
docs/importers.md.
"""

from __future__ import annotations

from pathlib import Path

from megatrace.config import Layout
from megatrace.load.importers.detect import FORMATS, detect_format
from megatrace.load.traceset import TraceLoadError, TraceSet

__all__ = ["FORMATS", "detect_format", "import_trace", "not_a_trace"]


def not_a_trace(directory: Path) -> str:
    """The error for a directory in which no format was recognised: what was looked for, and where."""
    try:
        empty = not any(directory.iterdir())
    except OSError:
        empty = False
    return (f"{directory}: not a trace directory{' (it is empty)' if empty else ''}: found none of MegaTrace ring "
            f"files (rank-NNNNN.ring, in it or its rings/ subdirectory), PyTorch Flight Recorder dumps (pickle or "
            f"JSON files named with the rank at the end, e.g. nccl_trace_rank_0), Megatrace NCCL-patch logs "
            f"(rank_<R>.log of '[save_count N] ...' or '[SEC.NSEC] [Rank R] Fun ...' lines), NCCL Inspector JSON "
            f"lines (objects with header and coll_perf) or PyTorch profiler (Kineto) traces (*.json or *.json.gz "
            f"with distributedInfo or schemaVersion), in it or its subdirectories one level down; nor an NCCL RAS "
            f"report (ncclras output, text or JSON) or job output logs (slurm-<id>.out) in it (either may also be "
            f"given as the one file to read); --format FORMAT reads it as one format and says "
            f"what its files lack (FORMAT: {', '.join(f for f in FORMATS if f != 'auto')})")


def import_trace(directory: str | Path, fmt: str = "auto", layout: Layout | None = None) -> TraceSet:
    """Load ``directory`` in format ``fmt`` (``auto``: detected); raises TraceLoadError naming what is wrong."""
    directory = Path(directory)
    if fmt == "auto":
        fmt = detect_format(directory)
        if fmt is None:
            raise TraceLoadError(not_a_trace(directory))
    if fmt == "flight-recorder":
        from megatrace.load.importers.flight_recorder import load_flight_recorder

        return load_flight_recorder(directory, layout)
    if fmt == "nccl-log":
        from megatrace.load.importers.detect import check_nccl_log_files
        from megatrace.load.importers.nccl_log import load_nccl_logs

        notes = check_nccl_log_files(directory)  # a rank's log the loader would pass over: an error, or a warning
        trace = load_nccl_logs(directory, layout)
        trace.problems.extend(notes)
        return trace
    if fmt == "inspector":
        from megatrace.load.importers.inspector import load_inspector

        return load_inspector(directory, layout)
    if fmt == "kineto":
        from megatrace.load.importers.kineto import load_kineto

        return load_kineto(directory, layout)
    if fmt == "nccl-ras":
        from megatrace.load.importers.nccl_ras import load_nccl_ras

        return load_nccl_ras(directory, layout)
    if fmt == "job-log":
        from megatrace.load.importers.job_log import load_job_log

        return load_job_log(directory, layout)
    raise TraceLoadError(f"{directory}: unknown trace format {fmt!r} (one of {', '.join(FORMATS)})")
