"""Which format a trace directory holds: ring files, Flight Recorder dumps, NCCL-patch logs, Inspector lines.

Cheap sniffing only (names and the first bytes of a few files); the importer then reads and
validates everything. Rings win when present; the others are tried in a fixed order.
"""

from __future__ import annotations

import re
from pathlib import Path

from megatrace.analyze.traceset import LoadProblem, TraceLoadError
from megatrace.files import open_input_file

FORMATS = ("auto", "rings", "flight-recorder", "nccl-log", "inspector", "kineto", "nccl-ras", "job-log")
SLURM_OUTPUT = re.compile(r"^slurm-\d+(?:_\d+)?\.out$")  # sbatch's default output file name
NCCL_LOG_RE = re.compile(r"^rank_(\d+)\.log$")
NCCL_LOG_LIKE = re.compile(r"^rank_.*\.log$")  # named like a rank's NCCL log (maybe without a usable rank)
NCCL_LINE = b"[save_count "
OLD_NCCL_LINE = re.compile(rb"(?:^|\n)\[\d+\.\d+\] \[Rank \d+\] Fun \w+ Data \d+ stream ")  # the older format
SNIFF_BYTES = 4096


def _head(path: Path) -> bytes:
    try:
        with open_input_file(path) as fh:  # a FIFO or another user's link is no trace (and never blocks)
            return fh.read(SNIFF_BYTES)
    except OSError:
        return b""


def looks_like_nccl_log(path: Path) -> bool:
    """A ``rank_<R>.log`` whose first bytes hold a line of either Megatrace NCCL-patch format."""
    if not NCCL_LOG_RE.match(path.name):
        return False
    head = _head(path)
    return NCCL_LINE in head or OLD_NCCL_LINE.search(head) is not None


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


RAS_TEXT = re.compile(rb"^\s*NCCL version \S+ compiled with CUDA \S+\r?\n(?:.*\n){0,8}?"
                      rb"(?:Job summary|Communicators\.\.\.)", re.M)  # ncclras's first lines (NCCL src/ras/client_support.cc, rasClientRunInit)


def looks_like_nccl_ras(path: Path) -> bool:
    """A file whose first bytes are an NCCL RAS report: ncclras's text header, or its JSON (``nccl_version`` and
    ``communicators`` keys)."""
    head = _head(path)
    if head.lstrip().startswith(b"{"):
        return b'"nccl_version"' in head and b'"communicators' in head
    return RAS_TEXT.search(head) is not None


def detect_format(directory: Path) -> str | None:
    """``rings``, ``flight-recorder``, ``nccl-log``, ``inspector``, ``kineto``, ``nccl-ras``, ``job-log`` or None
    (nothing recognised).

    Job output logs are recognised by sbatch's file name (``slurm-<id>.out``) and only where no trace is: the
    lines that matter come at a log's end, past what sniffing reads.

    Ring files win (a demo directory also holds the dumps of its opt-in Flight Recorder hook); two
    foreign formats side by side are an error: the user says which one with ``--format``.
    """
    from megatrace.analyze.importers.flight_recorder import find_dumps
    from megatrace.analyze.load import _ring_files

    if _ring_files(directory)[0]:
        return "rings"
    found = []
    places = _places(directory)
    if any(any(looks_like_nccl_log(p) for p in _files(w)) for w in places):
        found.append("nccl-log")
    if find_dumps(directory):
        found.append("flight-recorder")
    if any(any(looks_like_inspector(p) for p in _files(w)) for w in places):
        found.append("inspector")
    from megatrace.analyze.importers.kineto import looks_like_kineto

    if any(any(looks_like_kineto(p) for p in _files(w)) for w in places):
        found.append("kineto")
        if "flight-recorder" in found and all(looks_like_kineto(p) for p in find_dumps(directory)):
            found.remove("flight-recorder")  # (a Kineto trace's distributedInfo holds pg_config, as dumps do)
    if any(looks_like_nccl_ras(p) for p in _files(directory)):
        found.append("nccl-ras")
    if not found and any(SLURM_OUTPUT.match(p.name) for p in _files(directory)):
        found.append("job-log")
    if len(found) > 1:
        raise TraceLoadError(f"{directory}: more than one trace format in it ({', '.join(found)}); analyse one "
                             f"at a time: --format {' or --format '.join(found)}")
    return found[0] if found else None


def _files(where: Path) -> list[Path]:
    try:
        return [p for p in where.iterdir() if p.is_file()]
    except OSError:
        return []


def nccl_log_place(directory: Path) -> Path | None:
    """Where the NCCL-patch logs are: the directory, or the first subdirectory, holding a ``rank_<R>.log`` that
    starts like one (what :func:`nccl_log.load_nccl_logs` reads)."""
    for where in _places(directory):
        if any(looks_like_nccl_log(p) for p in _files(where)):
            return where
    return None


def check_nccl_log_files(directory: Path) -> list[LoadProblem]:
    """Every file named like a rank's log beside the NCCL-patch logs must be one: the loader reads only those
    whose name gives the rank and whose first bytes are log lines, and a rank missed that way changes the verdict.

    Raises :class:`ImportFormatError` (naming the file, and the line when one is at fault) for a name without a
    rank number, a rank out of range, or a file whose content is not NCCL log lines; returns a warning for each
    file without any call (empty: the rank is analysed as missing).
    """
    from megatrace.analyze.importers.common import MAX_RANKS, ImportFormatError
    from megatrace.analyze.importers.nccl_log_lines import parse_log

    where = nccl_log_place(directory)
    notes: list[LoadProblem] = []
    if where is None:
        return notes
    for path in sorted(p for p in _files(where) if NCCL_LOG_LIKE.match(p.name)):
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
