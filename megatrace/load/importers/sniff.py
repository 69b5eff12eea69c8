"""Cheap sniffing of foreign trace files: their names and first bytes, never more.

Shared by :mod:`.detect` (which format a directory holds) and the importers (which files to read).
"""

from __future__ import annotations

import re
from pathlib import Path

from megatrace.files import open_input_file

NCCL_LOG_RE = re.compile(r"^rank_(\d+)\.log$")
NCCL_LOG_LIKE = re.compile(r"^rank_.*\.log$")  # named like a rank's NCCL log (maybe without a usable rank)
NCCL_LINE = b"[save_count "
OLD_NCCL_LINE = re.compile(rb"(?:^|\n)\[\d+\.\d+\] \[Rank \d+\] Fun \w+ Data \d+ stream ")  # the older format
SNIFF_BYTES = 4096


def head(path: Path) -> bytes:
    """The first bytes of ``path`` (nothing when it cannot be read)."""
    try:
        with open_input_file(path) as fh:  # a FIFO or another user's link is no trace (and never blocks)
            return fh.read(SNIFF_BYTES)
    except OSError:
        return b""


def files_in(where: Path) -> list[Path]:
    """The regular files of ``where`` (none when it cannot be listed)."""
    try:
        return [p for p in where.iterdir() if p.is_file()]
    except OSError:
        return []


def places(directory: Path) -> list[Path]:
    """The directory, then its subdirectories one level down."""
    try:
        subdirs = sorted(p for p in directory.iterdir() if p.is_dir())
    except OSError:
        return [directory]
    return [directory] + subdirs


def looks_like_nccl_log(path: Path) -> bool:
    """A ``rank_<R>.log`` whose first bytes hold a line of either Megatrace NCCL-patch format."""
    if not NCCL_LOG_RE.match(path.name):
        return False
    first = head(path)
    return NCCL_LINE in first or OLD_NCCL_LINE.search(first) is not None


def looks_like_inspector(path: Path) -> bool:
    """A file that starts with a JSON object with NCCL Inspector's ``header`` (and ``coll_perf`` or its
    format version) in its first bytes."""
    first = head(path).lstrip()
    return first.startswith(b"{") and b'"header"' in first and (b'"coll_perf"' in first or
                                                             b'"inspector_output_format_version"' in first)


RAS_TEXT = re.compile(rb"^\s*NCCL version \S+ compiled with CUDA \S+\r?\n(?:.*\n){0,8}?"
                      rb"(?:Job summary|Communicators\.\.\.)", re.M)  # ncclras's first lines (NCCL src/ras/client_support.cc, rasClientRunInit)


def looks_like_nccl_ras(path: Path) -> bool:
    """A file whose first bytes are an NCCL RAS report: ncclras's text header, or its JSON (``nccl_version`` and
    ``communicators`` keys)."""
    first = head(path)
    if first.lstrip().startswith(b"{"):
        return b'"nccl_version"' in first and b'"communicators' in first
    return RAS_TEXT.search(first) is not None
