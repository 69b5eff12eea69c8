"""Which format a trace directory holds: ring files, Flight Recorder dumps, NCCL-patch logs, Inspector lines.

Cheap sniffing only (names and the first bytes of a few files); the importer then reads and
validates everything. Rings win when present; the others are tried in a fixed order.
"""

from __future__ import annotations

import re
from pathlib import Path

from megatrace.load.discovery import trace_files
from megatrace.load.importers.common import MAX_RANKS, ImportFormatError
from megatrace.load.importers.flight_recorder import find_dumps
from megatrace.load.importers.kineto import looks_like_kineto
from megatrace.load.importers.nccl_log_lines import parse_log
from megatrace.load.importers.sniff import (NCCL_LOG_LIKE, NCCL_LOG_RE, SNIFF_BYTES, files_in, looks_like_inspector,
                                            looks_like_nccl_log, looks_like_nccl_ras, places)
from megatrace.load.traceset import LoadProblem, TraceLoadError

FORMATS = ("auto", "rings", "flight-recorder", "nccl-log", "inspector", "kineto", "nccl-ras", "job-log")
SLURM_OUTPUT = re.compile(r"^slurm-\d+(?:_\d+)?\.out$")  # sbatch's default output file name


def detect_format(directory: Path) -> str | None:
    """``rings``, ``flight-recorder``, ``nccl-log``, ``inspector``, ``kineto``, ``nccl-ras``, ``job-log`` or None
    (nothing recognised).

    Job output logs are recognised by sbatch's file name (``slurm-<id>.out``) and only where no trace is: the
    lines that matter come at a log's end, past what sniffing reads.

    Ring files win (a demo directory also holds the dumps of its opt-in Flight Recorder hook); two
    foreign formats side by side are an error: the user says which one with ``--format``.
    """
    if trace_files(directory).rings:
        return "rings"
    found = []
    where_to_look = places(directory)
    if any(any(looks_like_nccl_log(p) for p in files_in(w)) for w in where_to_look):
        found.append("nccl-log")
    if find_dumps(directory):
        found.append("flight-recorder")
    if any(any(looks_like_inspector(p) for p in files_in(w)) for w in where_to_look):
        found.append("inspector")
    if any(any(looks_like_kineto(p) for p in files_in(w)) for w in where_to_look):
        found.append("kineto")
        if "flight-recorder" in found and all(looks_like_kineto(p) for p in find_dumps(directory)):
            found.remove("flight-recorder")  # (a Kineto trace's distributedInfo holds pg_config, as dumps do)
    if any(looks_like_nccl_ras(p) for p in files_in(directory)):
        found.append("nccl-ras")
    if not found and any(SLURM_OUTPUT.match(p.name) for p in files_in(directory)):
        found.append("job-log")
    if len(found) > 1:
        raise TraceLoadError(f"{directory}: more than one trace format in it ({', '.join(found)}); analyse one "
                             f"at a time: --format {' or --format '.join(found)}")
    return found[0] if found else None


def nccl_log_place(directory: Path) -> Path | None:
    """Where the NCCL-patch logs are: the directory, or the first subdirectory, holding a ``rank_<R>.log`` that
    starts like one (what :func:`nccl_log.load_nccl_logs` reads)."""
    for where in places(directory):
        if any(looks_like_nccl_log(p) for p in files_in(where)):
            return where
    return None


def check_nccl_log_files(directory: Path) -> list[LoadProblem]:
    """Every file named like a rank's log beside the NCCL-patch logs must be one: the loader reads only those
    whose name gives the rank and whose first bytes are log lines, and a rank missed that way changes the verdict.

    Raises :class:`ImportFormatError` (naming the file, and the line when one is at fault) for a name without a
    rank number, a rank out of range, or a file whose content is not NCCL log lines; returns a warning for each
    file without any call (empty: the rank is analysed as missing).
    """
    where = nccl_log_place(directory)
    notes: list[LoadProblem] = []
    if where is None:
        return notes
    for path in sorted(p for p in files_in(where) if NCCL_LOG_LIKE.match(p.name)):
        named = NCCL_LOG_RE.match(path.name)
        if not named:
            raise ImportFormatError(f"{path}: named like a Megatrace NCCL log, but not rank_<R>.log with R the rank's "
                                    f"number: its calls cannot be given a rank (rename it, or move it out of "
                                    f"{where})")
        if int(named.group(1)) >= MAX_RANKS:
            raise ImportFormatError(f"{path}: rank {named.group(1)} in the name: expected a rank below {MAX_RANKS}")
        if looks_like_nccl_log(path):
            continue  # read (and checked line by line) by the loader
        _, calls = parse_log(path, [])  # not a log from its first bytes: says which line is wrong
        if calls:
            raise ImportFormatError(f"{path}: its first NCCL log line comes after the first {SNIFF_BYTES} bytes "
                                    f"(blank lines before it?), where the logs are recognised; remove what precedes it")
        notes.append(LoadProblem("warning", "nccl-log-empty", f"{path}: no calls in it (empty: the rank logged "
                                 f"nothing, or its log was lost); rank {int(named.group(1))} is analysed as missing",
                                 paths=(str(path),)))
    return notes
