"""Which format a trace directory holds: ring files, Flight Recorder dumps, NCCL-patch logs, Inspector lines.

Cheap sniffing only (names and the first bytes of a few files); the importer then reads and
validates everything. Rings win when present; the others are tried in a fixed order.
"""

from __future__ import annotations

import re
from pathlib import Path

from megatrace.analyze.traceset import TraceLoadError

FORMATS = ("auto", "rings", "flight-recorder", "nccl-log", "inspector")
NCCL_LOG_RE = re.compile(r"^rank_(\d+)\.log$")
NCCL_LINE = b"[save_count "
SNIFF_BYTES = 4096


def _head(path: Path) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(SNIFF_BYTES)
    except OSError:
        return b""


def _places(directory: Path) -> list[Path]:
    """The directory, then its subdirectories one level down."""
    try:
        subdirs = sorted(p for p in directory.iterdir() if p.is_dir())
    except OSError:
        return [directory]
    return [directory] + subdirs


def looks_like_inspector(path: Path) -> bool:
    """A file that starts with a JSON object with NCCL Inspector's ``header`` (and ``coll_perf`` or its
    format version) in its first bytes."""
    head = _head(path).lstrip()
    return head.startswith(b"{") and b'"header"' in head and (b'"coll_perf"' in head or
                                                               b'"inspector_output_format_version"' in head)


def detect_format(directory: Path) -> str | None:
    """``rings``, ``flight-recorder``, ``nccl-log``, ``inspector`` or None (nothing recognised).

    Ring files win (a demo directory also holds the dumps of its opt-in Flight Recorder hook); two
    foreign formats side by side are an error: the user says which one with ``--format``.
    """
    from megatrace.analyze.importers.flight_recorder import find_dumps
    from megatrace.analyze.load import _ring_files

    if _ring_files(directory)[0]:
        return "rings"
    found = []
    places = _places(directory)
    if any(any(NCCL_LOG_RE.match(p.name) and NCCL_LINE in _head(p) for p in _files(w)) for w in places):
        found.append("nccl-log")
    if find_dumps(directory):
        found.append("flight-recorder")
    if any(any(looks_like_inspector(p) for p in _files(w)) for w in places):
        found.append("inspector")
    if len(found) > 1:
        raise TraceLoadError(f"{directory}: more than one trace format in it ({', '.join(found)}); analyse one "
                             f"at a time: --format {' or --format '.join(found)}")
    return found[0] if found else None


def _files(where: Path) -> list[Path]:
    try:
        return [p for p in where.iterdir() if p.is_file()]
    except OSError:
        return []
