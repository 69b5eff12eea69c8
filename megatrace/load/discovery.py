"""Find what a trace directory holds: ring files, earlier attempts, start markers; pick one ring per rank.

Looks in ``DIR/rings``, then ``DIR``. Names and file types come from one ``scandir`` pass (no stat per
ring); another user's links are never followed. :func:`select_rings` keeps the majority job and one
file per rank and reports the rest as :class:`LoadProblem` entries.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from megatrace.files import open_input, trusted_owner
from megatrace.load.traceset import LoadProblem, name_list
from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_header import read_header_bytes
from megatrace.trace.ring_reader import RingHeader, parse_header

RING_RE = re.compile(r"^rank-(\d+)\.ring$")
MARKER_RE = re.compile(r"^rank-(\d+)\.init$")  # start markers (trace/init_marker.py, load/markers.py)
EARLIER_RE = re.compile(r"^rank-(\d+)\.ring\.\d+$")


def trusted_file(entry: os.DirEntry) -> bool:
    """A regular file, or a link to one that root or this user owns (another user's link is never followed)."""
    if entry.is_symlink():
        try:
            return trusted_owner(entry.stat(follow_symlinks=False).st_uid) and entry.is_file()
        except OSError:
            return False
    return entry.is_file(follow_symlinks=False)


@dataclass
class TraceFiles:
    """What a trace directory holds, from one ``scandir`` of ``DIR/rings`` (and of ``DIR`` only for what is not
    there). Ring paths are strings: thousands of ``Path`` objects cost more than the reads' Python (4 µs each)."""

    rings: list[str]  # paths of the ring files (rank-N.ring), sorted by name
    earlier: list[str]  # paths of earlier attempts' rings (rank-N.ring.K)
    marker_dir: Path  # where the start markers are (DIR when there are none)
    markers: list[str]  # the start markers' names (rank-N.init), sorted


def trace_files(directory: Path) -> TraceFiles:
    """The ring files (and earlier attempts) of the first of DIR/rings, DIR that holds rings, and the start
    markers of the first that holds markers."""
    found = TraceFiles([], [], directory, [])
    want_rings = want_markers = True
    for candidate in (directory / "rings", directory):
        if not (want_rings or want_markers) or not candidate.is_dir() or (
                candidate.is_symlink() and not trusted_owner(candidate.lstat().st_uid)):
            continue
        with os.scandir(candidate) as it:  # names and file types in one pass: no stat per ring
            names = [e.name for e in it if e.name.startswith("rank-") and trusted_file(e)]
        where = os.path.join(str(candidate), "")  # (the paths are where + name)
        rings = sorted(n for n in names if n.endswith(".ring") and RING_RE.match(n)) if want_rings else []
        if rings:
            want_rings = False
            found.rings = [where + n for n in rings]
            found.earlier = [where + n for n in sorted(n for n in names if ".ring." in n and EARLIER_RE.match(n))]
        markers = sorted(n for n in names if n.endswith(".init") and MARKER_RE.match(n)) if want_markers else []
        if markers:
            want_markers = False
            found.marker_dir, found.markers = candidate, markers
    return found


def read_header(path: str) -> RingHeader:
    """The header of one ring file (opened as an input: never another user's link)."""
    fd = open_input(path)
    try:
        return parse_header(path, read_header_bytes(fd, fmt.HEADER_SIZE))[0]
    finally:
        os.close(fd)


def foreign_owner(directory: Path, problems: list[LoadProblem]) -> None:
    """Root analysing a directory another user owns: say so (their links are not followed, see docs/security.md)."""
    if os.geteuid() != 0:
        return
    try:
        uid = directory.stat().st_uid
    except OSError:
        return
    if uid != 0:
        problems.append(LoadProblem(
            "info", "foreign-owner",
            f"{directory} belongs to uid {uid} and is analysed as root: links and special files its owner "
            "planted are not followed, and outputs replace what is there (docs/security.md)"))


def select_rings(headers: dict[str, RingHeader], problems: list[LoadProblem]) -> tuple[str, int, dict[int, str]]:
    """Pick the job (majority of files), its world size, and one file per rank; report the rest."""
    jobs = Counter(h.job_id for h in headers.values())
    lowest = {job: min(h.rank for h in headers.values() if h.job_id == job) for job in jobs}
    job = max(jobs, key=lambda j: (jobs[j], -lowest[j]))
    others = sorted(p for p, h in headers.items() if h.job_id != job)
    if others:
        foreign = sorted({h.job_id for h in headers.values() if h.job_id != job})
        problems.append(LoadProblem(
            "error", "mixed-jobs",
            f"ring files from {len(jobs)} different jobs in one directory: analysing job {job!r} "
            f"({jobs[job]} files); ignored {len(others)} files of job(s) {', '.join(map(repr, foreign))}: "
            f"{name_list([os.path.basename(p) for p in others])}", paths=tuple(others)))
    mine = {p: h for p, h in headers.items() if h.job_id == job}
    worlds = Counter(h.world_size for h in mine.values())
    world = worlds.most_common(1)[0][0]
    odd = sorted(p for p, h in mine.items() if h.world_size != world or not 0 <= h.rank < world)
    if odd:
        problems.append(LoadProblem(
            "error", "world-size",
            f"{len(odd)} ring files disagree with the world size {world} of the others or name a rank "
            f"outside it; ignored: {name_list([os.path.basename(p) for p in odd])}", paths=tuple(odd)))
    by_rank: dict[int, list[tuple[str, RingHeader]]] = {}
    odd_set = set(odd)
    for p, h in mine.items():
        if p not in odd_set:
            by_rank.setdefault(h.rank, []).append((p, h))
    chosen: dict[int, str] = {}
    for rank, items in sorted(by_rank.items()):
        if len(items) > 1:  # (the most recent first)
            items.sort(key=lambda ph: (ph[1].anchor_wall_ns, ph[1].write_counter), reverse=True)
            dropped = [p for p, _ in items[1:]]
            problems.append(LoadProblem(
                "error", "duplicate-rank",
                f"rank {rank} appears in {len(items)} ring files; kept the most recent "
                f"({os.path.basename(items[0][0])}), ignored {name_list([os.path.basename(p) for p in dropped])}",
                ranks=(rank,), paths=tuple(dropped)))
        chosen[rank] = items[0][0]
        name = os.path.basename(chosen[rank])
        named = RING_RE.match(name)
        if named and int(named.group(1)) != rank:
            problems.append(LoadProblem(
                "warning", "renamed-ring",
                f"{name} holds rank {rank} (from its header); the file name says otherwise",
                ranks=(rank,), paths=(chosen[rank],)))
    return job, world, chosen
