"""Find what a trace directory holds: ring files, earlier attempts, start markers; pick one ring per rank.

Looks in ``DIR/rings``, then ``DIR``. Names and file types come from one ``scandir`` pass (no stat per
ring); another user's links are never followed. :func:`select_rings` keeps the majority job and one
file per rank and reports the rest as :class:`LoadProblem` entries.
"""

from __future__ import annotations

import os
import re
from collections import Counter
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


def ring_files(directory: Path) -> tuple[list[Path], list[Path]]:
    """(ring files, earlier-attempt files), looking in DIR/rings, then DIR."""
    for candidate in (directory / "rings", directory):
        if candidate.is_dir() and (not candidate.is_symlink() or trusted_owner(candidate.lstat().st_uid)):
            with os.scandir(candidate) as it:  # names and file types in one pass: no stat per ring
                entries = [(e.name, trusted_file(e)) for e in it]
            rings = sorted(name for name, is_file in entries if is_file and RING_RE.match(name))
            if rings:
                return ([candidate / name for name in rings],
                        [candidate / name for name in sorted(n for n, _ in entries if EARLIER_RE.match(n))])
    return [], []


def read_header(path: Path) -> RingHeader:
    """The header of one ring file (opened as an input: never another user's link)."""
    fd = open_input(path)
    try:
        return parse_header(str(path), read_header_bytes(fd, fmt.HEADER_SIZE))[0]
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


def select_rings(headers: dict[Path, RingHeader], problems: list[LoadProblem]) -> tuple[str, int, dict[int, Path]]:
    """Pick the job (majority of files), its world size, and one file per rank; report the rest."""
    jobs = Counter(h.job_id for h in headers.values())
    lowest = {job: min(h.rank for h in headers.values() if h.job_id == job) for job in jobs}
    job = max(jobs, key=lambda j: (jobs[j], -lowest[j]))
    others = sorted(str(p) for p, h in headers.items() if h.job_id != job)
    if others:
        foreign = sorted({h.job_id for h in headers.values() if h.job_id != job})
        problems.append(LoadProblem(
            "error", "mixed-jobs",
            f"ring files from {len(jobs)} different jobs in one directory: analysing job {job!r} "
            f"({jobs[job]} files); ignored {len(others)} files of job(s) {', '.join(map(repr, foreign))}: "
            f"{name_list([Path(p).name for p in others])}", paths=tuple(others)))
    mine = {p: h for p, h in headers.items() if h.job_id == job}
    worlds = Counter(h.world_size for h in mine.values())
    world = worlds.most_common(1)[0][0]
    odd = sorted(str(p) for p, h in mine.items() if h.world_size != world or not 0 <= h.rank < world)
    if odd:
        problems.append(LoadProblem(
            "error", "world-size",
            f"{len(odd)} ring files disagree with the world size {world} of the others or name a rank "
            f"outside it; ignored: {name_list([Path(p).name for p in odd])}", paths=tuple(odd)))
    by_rank: dict[int, list[tuple[Path, RingHeader]]] = {}
    for p, h in mine.items():
        if str(p) not in odd:
            by_rank.setdefault(h.rank, []).append((p, h))
    chosen: dict[int, Path] = {}
    for rank, items in sorted(by_rank.items()):
        items.sort(key=lambda ph: (ph[1].anchor_wall_ns, ph[1].write_counter), reverse=True)
        chosen[rank] = items[0][0]
        if len(items) > 1:
            dropped = [str(p) for p, _ in items[1:]]
            problems.append(LoadProblem(
                "error", "duplicate-rank",
                f"rank {rank} appears in {len(items)} ring files; kept the most recent ({items[0][0].name}), "
                f"ignored {name_list([Path(p).name for p in dropped])}", ranks=(rank,), paths=tuple(dropped)))
        if RING_RE.match(chosen[rank].name) and int(RING_RE.match(chosen[rank].name).group(1)) != rank:
            problems.append(LoadProblem(
                "warning", "renamed-ring",
                f"{chosen[rank].name} holds rank {rank} (from its header); the file name says otherwise",
                ranks=(rank,), paths=(str(chosen[rank]),)))
    return job, world, chosen



def marker_files(directory: Path) -> tuple[Path, list[str]]:
    """(where, names) of the start markers, in DIR/rings, then DIR."""
    for candidate in (directory / "rings", directory):
        if candidate.is_dir() and (not candidate.is_symlink() or trusted_owner(candidate.lstat().st_uid)):
            with os.scandir(candidate) as it:
                names = sorted(e.name for e in it if MARKER_RE.match(e.name) and trusted_file(e))
            if names:
                return candidate, names
    return directory, []
