"""A rank's meta file (JSON lines: its groups and members), read the way the ring reader reads rings."""

from __future__ import annotations

import json
import os

from megatrace.files import read_input
from megatrace.trace.ring_header import ReadProblem

META_LIMIT = 64 << 20  # a meta file is a few KiB (a group line per group); refuse anything absurd


def read_meta(path: str | os.PathLike[str]) -> tuple[list[dict], list[ReadProblem]]:
    """Read a rank's meta file (JSON lines); a torn last line or a bad line is reported, not fatal."""
    path = str(path)
    entries: list[dict] = []
    problems: list[ReadProblem] = []
    try:
        data = read_input(path, META_LIMIT)
    except FileNotFoundError:
        return entries, [ReadProblem(path, 0, "meta file missing: group names and members unknown", "warning")]
    except OSError as exc:
        return entries, [ReadProblem(path, 0, f"meta file unreadable: {exc.strerror or exc}")]
    offset = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            problems.append(ReadProblem(path, offset, "last line is incomplete (writer stopped mid-line); "
                                                      "skipped", "warning"))
            break
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict) or "kind" not in entry:
                raise ValueError("not an object with a 'kind'")
            entries.append(entry)
        except ValueError as exc:
            problems.append(ReadProblem(path, offset, f"unreadable meta line: {exc}"))
        except RecursionError:  # nested deeper than the parser goes: hostile or broken, never a traceback
            problems.append(ReadProblem(path, offset, "unreadable meta line: nested too deeply"))
        offset += len(line)
    return entries, problems
