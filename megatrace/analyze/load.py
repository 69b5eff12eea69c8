"""Load a trace directory into one columnar :class:`TraceSet`: every rank's records, groups, layout, node facts.

A trace directory holds ``rings/rank-NNNNN.ring`` (or the rings directly),
their ``rank-NNNNN.meta.jsonl`` files, and optionally ``layout.yaml`` and
``procs.json``. Records of all ranks are concatenated column by column
(numpy), rank after rank, each rank's rows in ``seq`` order: no Python object
per record, so 16,384 ranks × 2,000 records fit in memory and in seconds.

``load_trace(DIR, tail=K)`` loads only each rank's newest ``K`` records (what
hang localisation needs: ``megatrace analyze --quick``), reading all the tails
with one vectorised validation pass (:func:`ring_reader.read_tails`);
:func:`tail_gaps` and :func:`extend_tails` read further back for the few ranks
whose tail turns out too short.

Bad input never raises a traceback: missing, duplicated, empty or foreign
(other job) ring files and a layout that does not fit become
:class:`LoadProblem` entries; only a directory that holds no readable ring at
all raises :class:`TraceLoadError`. ``fault.json`` (demo ground truth) is
never read here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatrace.analyze.traceset import (COLUMNS, GroupInfo, LoadProblem, NodeFacts, ProcFact, RankInfo, Records,
                                        TraceLoadError, TraceSet, name_list, plural, rank_list)

__all__ = ["QUICK_TAIL", "GroupInfo", "LoadProblem", "NodeFacts", "ProcFact", "RankInfo", "Records",
           "TraceLoadError", "TraceSet", "extend_tails", "fit_layout", "load_trace", "tail_gaps", "widen_tails"]
from megatrace.analyze import liveness
from megatrace.analyze.index import RecordIndex, index_records
from megatrace.analyze.startup import read_markers
from megatrace.config import Layout, LayoutError, layout_from_dict
from megatrace.files import open_input, read_fd, read_input, trusted_owner
from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_reader import (META_LIMIT, RECORD_DTYPE, ReadProblem, RingFormatError, RingHeader,
                                         RingSnapshot, open_budget, parse_header, read_meta, read_ring,
                                         read_tails)

# Records per rank that a quick (hang-only) load reads. The hang analysis looks at each rank's newest
# 64 (hang.TAIL); the other 64 are margin: the op a rank waits in may be a little older than the newest
# records of its partners (they may have made a few calls since, in other groups or async ones), and
# the usual gap between calls is measured over what is there. A rank that stopped long before the
# others still gets its own newest records, however old. Where this is not enough (a partner's record
# of an op someone waits in lies before its tail) tail_gaps() finds it and extend_tails() reads further
# back, so the margin buys speed, not correctness: at 4,096 ranks 256 measured 0.2 s slower than 128.
QUICK_TAIL = 128
WIDEN_DEPTHS = (4096, None)  # records per rank re-read for ranks whose tail was too short (None: all of it)

SIDE_FILE_LIMIT = 16 << 20  # layout.yaml and procs.json are a few KiB
RING_RE = re.compile(r"^rank-(\d+)\.ring$")
MARKER_RE = re.compile(r"^rank-(\d+)\.init$")  # start markers (trace/init_marker.py, analyze/startup.py)
EARLIER_RE = re.compile(r"^rank-(\d+)\.ring\.\d+$")


def _is_file(entry: os.DirEntry) -> bool:
    """A regular file, or a link to one that root or this user owns (another user's link is never followed)."""
    if entry.is_symlink():
        try:
            return trusted_owner(entry.stat(follow_symlinks=False).st_uid) and entry.is_file()
        except OSError:
            return False
    return entry.is_file(follow_symlinks=False)


def _ring_files(directory: Path) -> tuple[list[Path], list[Path]]:
    """(ring files, earlier-attempt files), looking in DIR/rings, then DIR."""
    for candidate in (directory / "rings", directory):
        if candidate.is_dir() and (not candidate.is_symlink() or trusted_owner(candidate.lstat().st_uid)):
            with os.scandir(candidate) as it:  # names and file types in one pass: no stat per ring
                entries = [(e.name, _is_file(e)) for e in it]
            rings = sorted(name for name, is_file in entries if is_file and RING_RE.match(name))
            if rings:
                return ([candidate / name for name in rings],
                        [candidate / name for name in sorted(n for n, _ in entries if EARLIER_RE.match(n))])
    return [], []


def _read_header(path: Path) -> RingHeader:
    fd = open_input(path)
    try:
        return parse_header(str(path), os.pread(fd, fmt.HEADER_SIZE, 0))[0]
    finally:
        os.close(fd)


def _foreign_owner(directory: Path, problems: list[LoadProblem]) -> None:
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


def _select(headers: dict[Path, RingHeader], problems: list[LoadProblem]) -> tuple[str, int, dict[int, Path]]:
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


def _members(raw) -> tuple[int, ...] | None:
    try:
        return tuple(int(r) for r in raw)
    except (TypeError, ValueError):
        return None


def _groups(metas: dict[int, list[dict]], used: dict[int, set[int]],
            problems: list[LoadProblem]) -> dict[int, GroupInfo]:
    """Merge group lines of all ranks; check that members agree; infer groups seen only in records."""
    # Every member of a group writes the same member list: each distinct list is converted and hashed
    # once (thousands of ranks, lists of hundreds), then recognised by identity.
    by_members: dict[int, dict[int, tuple[tuple[int, ...], list[int]]]] = {}  # gid -> id(members) -> ...
    first: dict[int, dict] = {}
    seen_lists: dict[tuple, tuple[int, ...] | None] = {}
    canonical: dict[tuple[int, ...], tuple[int, ...]] = {}
    by_id: dict[int, tuple[object, tuple[int, ...] | None]] = {}  # parsed lists shared by several entries
    for rank, entries in metas.items():
        for e in entries:
            if e.get("kind") != "group" or not isinstance(e.get("gid"), int):
                continue
            listed = e.get("ranks") or ()
            known = by_id.get(id(listed))
            if known is not None and known[0] is listed:
                members = known[1]
            else:
                try:
                    raw = tuple(listed)
                    members = seen_lists[raw] if raw in seen_lists else seen_lists.setdefault(raw, _members(raw))
                except TypeError:  # unhashable members: convert (and fail) the slow way
                    members = _members(listed)
                if members is not None:
                    members = canonical.setdefault(members, members)
                by_id[id(listed)] = (listed, members)
            if members is None:
                continue
            slot = by_members.setdefault(e["gid"], {})
            if id(members) in slot:
                slot[id(members)][1].append(rank)
            else:
                slot[id(members)] = (members, [rank])
            first.setdefault(e["gid"], e)
    versions = {gid: dict(slot.values()) for gid, slot in by_members.items()}
    groups: dict[int, GroupInfo] = {}
    disagree: list[str] = []
    disagree_ranks: set[int] = set()
    for gid, seen in versions.items():
        members = max(seen, key=lambda m: len(seen[m]))  # the majority; a tie: the lowest reporting rank
        e = first[gid]
        groups[gid] = GroupInfo(gid, str(e.get("name", "")), str(e.get("desc", "")), members,
                                str(e.get("backend", "")))
        if len(seen) > 1:
            detail = "; ".join(f"ranks {rank_list(sorted(set(r)), 4)} say {rank_list(m, 4)}" for m, r in seen.items())
            disagree.append(f"group {gid} ({e.get('desc') or e.get('name')}): {detail}; using {rank_list(members, 4)}")
            disagree_ranks.update(r for rs in seen.values() for r in rs)
    if disagree:
        problems.append(LoadProblem(
            "error", "group-disagreement",
            f"the members of {plural(len(disagree), 'group')} disagree across ranks (a group id reused for "
            f"different groups, or meta files of different runs): {name_list(disagree, 3)}",
            ranks=tuple(sorted(disagree_ranks))))
    unknown = {gid: users for gid, users in used.items() if gid not in groups and gid != 0}
    for gid, users in sorted(unknown.items()):
        groups[gid] = GroupInfo(gid, "", "", tuple(sorted(users)), inferred=True)
    if unknown:
        problems.append(LoadProblem(
            "warning", "unknown-groups",
            f"{plural(len(unknown), 'group')} used in records without a meta line (meta files missing or torn); their "
            f"members are inferred from the ranks that used them, so ranks that never entered them are not "
            f"known: groups {name_list([str(g) for g in sorted(unknown)])}"))
    return groups


def _node_facts(directory: Path, problems: list[LoadProblem]) -> NodeFacts:
    path = directory / "procs.json"
    if not os.path.lexists(path):
        return NodeFacts()
    try:
        try:
            data = json.loads(read_input(path, SIDE_FILE_LIMIT))
        except RecursionError:
            raise ValueError("nested too deeply") from None
        procs = {}
        for key, p in (data.get("ranks") or {}).items():
            procs[int(key)] = ProcFact(int(key), p.get("pid"), p.get("exit_code"), p.get("signal"),
                                       bool(p.get("killed_by_launcher", False)), _typed(p.get("alive"), bool),
                                       _typed(p.get("state"), str), _typed(p.get("wchan"), str),
                                       _typed(p.get("node"), str), _frames(p.get("stack")))
        return NodeFacts(procs, data.get("outcome"), data.get("message"))
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        problems.append(LoadProblem("warning", "procs", f"{path}: unreadable process facts ({why[:200]}); ignored",
                                    paths=(str(path),)))
        return NodeFacts()


def _frames(value: Any) -> tuple[str, ...]:
    """A process's stack frames from procs.json (a list of strings; anything else is no stack)."""
    if not isinstance(value, list):
        return ()
    return tuple(f[:200] for f in value[:8] if isinstance(f, str))


def _typed(value: Any, kind: type) -> Any:
    """``value`` when it is a ``kind`` (a side file is input: a wrong type is dropped), else None."""
    return value if isinstance(value, kind) and not (kind is not bool and isinstance(value, bool)) else None


def fit_layout(layout: Layout, world: int, source: str, problems: list[LoadProblem]) -> Layout | None:
    """``layout`` if it fits a world of ``world`` ranks; otherwise None and a problem naming ``source``."""
    if layout.world_size != world:
        problems.append(LoadProblem(
            "error", "layout",
            f"{source}: layout world size {layout.world_size} (tp {layout.tp} × pp {layout.pp} × dp {layout.dp}) "
            f"does not fit the trace's {world} ranks; analysing without a layout"))
        return None
    return layout


def _layout(directory: Path, layout: Layout | None, world: int, problems: list[LoadProblem]) -> Layout | None:
    if layout is not None:
        return fit_layout(layout, world, "the given layout", problems)
    path = directory / "layout.yaml"
    if not os.path.lexists(path):
        return None
    try:
        return fit_layout(_read_layout(path), world, str(path), problems)
    except LayoutError as exc:
        problems.append(LoadProblem("error", "layout", f"{exc}; analysing without a layout", paths=(str(path),)))
        return None


def _read_layout(path: Path) -> Layout:
    """``layout.yaml`` as a regular file (never another user's link); errors name the line, never quote it."""
    import yaml

    try:
        text = read_input(path, SIDE_FILE_LIMIT).decode("utf-8")
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except OSError as exc:
        raise LayoutError(f"{path}: cannot read layout: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise LayoutError(f"{path}: cannot read layout: not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise LayoutError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', None) or 'parse error'}") from None
    except RecursionError:
        raise LayoutError(f"{path}: not valid YAML: nested too deeply") from None
    return layout_from_dict(data, str(path))


@dataclass
class _RankRead:
    """What one worker read for one rank."""

    info: RankInfo
    records: np.ndarray  # RECORD_DTYPE, sorted by seq
    meta: list[dict]
    meta_found: bool
    meta_problems: list[str]
    unknown_gids: list[int]  # group ids used in records but absent from the rank's own meta
    damage: str


def _known_gids(entries: list[dict]) -> list[int]:
    """Group ids a rank's meta file declares."""
    return [e["gid"] for e in entries if e.get("kind") == "group" and isinstance(e.get("gid"), int)
            and 0 <= e["gid"] < 1 << 32]


def _meta_path(rank: int, path: Path) -> Path:
    return path.with_name(fmt.meta_name(rank)) if RING_RE.match(path.name) else path.with_suffix(".meta.jsonl")


def _meta_path_str(rank: int, path: Path) -> str:
    """``_meta_path`` without building Path objects (thousands of ranks)."""
    name = path.name
    if RING_RE.match(name):
        return os.path.join(os.path.dirname(str(path)), fmt.meta_name(rank))
    return os.path.splitext(str(path))[0] + ".meta.jsonl"


def _damage(snap: RingSnapshot) -> str:
    if any(p.severity == "error" for p in snap.problems) or snap.lost:
        return str(snap.problems[0]) if snap.problems else f"{snap.lost} records lost"
    return ""


def _rank_read(rank: int, path: Path, snap: RingSnapshot) -> _RankRead:
    """One rank's snapshot plus its meta file."""
    h, recs = snap.header, snap.records
    meta_path = _meta_path(rank, path)
    entries, meta_problems = read_meta(meta_path)
    known = np.array(_known_gids(entries), dtype=np.uint32)
    gids = recs["group_id"][recs["op"] < fmt.Op.MARK_STEP]
    left = gids[~np.isin(gids, known)] if len(known) else gids
    unknown = np.unique(left).tolist() if len(left) else []
    info = RankInfo(rank, h.host, h.local_rank, h.pid, str(path), h.job_id, h.step_id, h.closed_cleanly, len(recs),
                    snap.overwritten, snap.lost, h.anchor_wall_ns, h.anchor_mono_ns, snap.dropped - snap.overwritten,
                    heartbeat_ns=h.heartbeat_ns, pulse_ns=h.pulse_ns, signal_ns=h.signal_ns)
    return _RankRead(info, recs, entries, meta_path.exists(),
                     [str(p) for p in meta_problems if p.severity == "error"], unknown, _damage(snap))


def _read_rank(rank: int, path: Path) -> _RankRead | str:
    """Read one ring and its meta file; a string is the reason it is unreadable."""
    try:
        snap = read_ring(path)
    except (RingFormatError, OSError) as exc:
        return str(exc)
    return _rank_read(rank, path, snap)


@dataclass
class _Tally:
    """Per-rank reading problems, reported as one problem per kind."""

    unreadable: list[str] = field(default_factory=list)
    empty: list[int] = field(default_factory=list)
    no_meta: list[int] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    bad_meta: list[str] = field(default_factory=list)
    wrapped: list[int] = field(default_factory=list)

    def add(self, got: _RankRead) -> None:
        rank = got.info.rank
        if got.info.n_records == 0:
            self.empty.append(rank)
        if got.damage:
            self.damaged.append(f"rank {rank}: {got.damage}")
        if not got.meta_found:
            self.no_meta.append(rank)
        if got.info.dropped:
            self.wrapped.append(rank)
        self.bad_meta += got.meta_problems

    def report(self, problems: list[LoadProblem]) -> None:
        if self.unreadable:
            problems.append(LoadProblem("error", "unreadable-ring", f"{plural(len(self.unreadable), 'ring file')} "
                                        f"unreadable and skipped: {name_list(self.unreadable, 3)}"))
        if self.damaged:
            problems.append(LoadProblem("warning", "ring-damage", f"{plural(len(self.damaged), 'ring')} with "
                                        f"unreadable records (kept the rest): {name_list(self.damaged, 3)}"))
        if self.bad_meta:
            problems.append(LoadProblem("warning", "meta", f"{plural(len(self.bad_meta), 'unreadable line')} in "
                                        f"meta files (skipped): {name_list(self.bad_meta, 3)}"))
        if self.wrapped:
            problems.append(LoadProblem("info", "ring-wrapped", f"the rings of {plural(len(self.wrapped), 'rank')} "
                                        f"wrapped and lost their oldest records: ranks {rank_list(self.wrapped)}",
                                        ranks=tuple(self.wrapped)))
        if self.empty:
            problems.append(LoadProblem(
                "warning", "empty-ring",
                f"{plural(len(self.empty), 'ring')} without records (the process stopped or hung before its first "
                f"traced call): ranks {rank_list(self.empty)}", ranks=tuple(self.empty)))
        if self.no_meta:
            problems.append(LoadProblem("warning", "missing-meta", f"no meta file (group members) for "
                                        f"{plural(len(self.no_meta), 'rank')}: {rank_list(self.no_meta)}",
                                        ranks=tuple(self.no_meta)))


class _Columns:
    """Preallocated record columns, appended to rank by rank (grown if a live ring outgrew its header)."""

    def __init__(self, capacity: int) -> None:
        self.data = {name: np.empty(max(capacity, 0), dt) for name, dt in COLUMNS.items()}
        self.n = 0

    def append(self, rank: int, recs: np.ndarray) -> None:
        end = self.n + len(recs)
        if end > len(self.data["rank"]):
            for name, col in self.data.items():
                grown = np.empty(max(end, 2 * len(col)), col.dtype)
                grown[:self.n] = col[:self.n]
                self.data[name] = grown
        for name, col in self.data.items():
            col[self.n:end] = rank if name == "rank" else recs[name]
        self.n = end

    def finish(self) -> Records:
        size = len(self.data["rank"])
        cols = {name: (col[:self.n] if self.n >= 0.9 * size else col[:self.n].copy())
                for name, col in self.data.items()}
        self.data = {}
        return Records(**cols)


def load_trace(directory: str | Path, layout: Layout | None = None, tail: int | None = None,
               format: str = "auto") -> TraceSet:  # noqa: A002 - the CLI option's name
    """Load a trace directory; see the module docstring. ``layout`` overrides ``layout.yaml``.

    ``format``: ``auto`` (ring files, else a detected foreign format), ``rings``, or an importer's
    format (:data:`megatrace.analyze.importers.FORMATS`; those load every record, whatever ``tail``).

    ``tail=K`` loads only each rank's newest ``K`` records (``TraceSet.tail``; ``RankInfo.unread``
    counts the older ones left in the ring).
    """
    directory = Path(directory)
    if not directory.exists():
        raise TraceLoadError(f"{directory}: no such directory")
    if not directory.is_dir():
        if not directory.is_file():
            raise TraceLoadError(f"{directory}: neither a directory nor a regular file (a FIFO, device or socket is "
                                 f"never read)")
        if format in ("auto", "nccl-ras"):  # one file: an NCCL RAS report, when it starts like one
            from megatrace.analyze.importers.detect import looks_like_nccl_ras

            if format == "nccl-ras" or looks_like_nccl_ras(directory):
                from megatrace.analyze.importers import import_trace

                return import_trace(directory, "nccl-ras", layout)
        if format in ("auto", "job-log"):  # one file: a job's output log (docs/importers.md)
            from megatrace.analyze.importers import import_trace

            return import_trace(directory, "job-log", layout)
        raise TraceLoadError(f"{directory}: not a directory: a trace of format {format} is a directory (one file is "
                             f"read only as a job output log, --format job-log, or an NCCL RAS report, "
                             f"--format nccl-ras)")
    files, earlier = _ring_files(directory) if format in ("auto", "rings") else ([], [])
    where, marker_names = _marker_files(directory) if format in ("auto", "rings") else (directory, [])
    if not files and marker_names:  # ranks in init_process_group and none past it: stuck before communication
        return _startup_trace(directory, where, marker_names, layout)
    if not files and format != "rings":  # foreign formats: Flight Recorder, NCCL logs, Inspector (docs/importers.md)
        from megatrace.analyze.importers import detect_format, import_trace

        found = detect_format(directory) if format == "auto" else format
        if found is not None:
            return import_trace(directory, found, layout)
    if not files and format == "auto":  # nothing recognised: say what was looked for, in every format
        from megatrace.analyze.importers import not_a_trace

        raise TraceLoadError(not_a_trace(directory))
    if not files:
        raise TraceLoadError(f"{directory}: not a MegaTrace trace directory: no ring files "
                             f"(rank-NNNNN.ring) in it or in its rings/ subdirectory")
    problems: list[LoadProblem] = []
    _foreign_owner(directory, problems)
    if earlier:
        problems.append(LoadProblem(
            "info", "earlier-attempts",
            f"{len(earlier)} ring files of earlier attempts of restarted ranks ignored: "
            f"{name_list([p.name for p in earlier])}", paths=tuple(map(str, earlier))))
    headers: dict[Path, RingHeader] = {}
    unreadable: list[str] = []
    if tail is None:
        for path in files:
            try:
                headers[path] = _read_header(path)
            except (RingFormatError, OSError) as exc:
                unreadable.append(str(exc))
    else:  # header and tail of every file at once (a file of another job or a duplicate is read for nothing)
        tails = _read_tails(files, tail, unreadable)
        headers = {path: snap.header for path, snap in tails.snaps.items()}
    if not headers:
        raise TraceLoadError(f"{directory}: none of the {len(files)} ring files is readable: "
                             f"{name_list(unreadable, 3)}")
    job, world, chosen = _select(headers, problems)

    tally = _Tally(unreadable=unreadable)
    if tail is None:
        records, infos, metas, used = _load_all(chosen, headers, tally)
    else:
        records, infos, metas, used = _load_tails(chosen, tails, tally)
    if not infos:
        raise TraceLoadError(f"{directory}: none of the {len(files)} ring files is readable: "
                             f"{name_list(unreadable, 3)}")
    tally.report(problems)
    present = [i.rank for i in infos]
    missing = tuple(np.setdiff1d(np.arange(world, dtype=np.int64), present).tolist())  # world <= MAX_WORLD_SIZE
    if missing:
        problems.append(LoadProblem(
            "warning", "missing-ranks",
            f"no readable ring for {len(missing)} of {world} ranks: {rank_list(list(missing))}; analysed the "
            f"other {len(present)}, with lower confidence", ranks=missing))

    starts = np.concatenate([[0], np.cumsum([i.n_records for i in infos])]).astype(np.int64)
    groups = _groups(metas, used, problems)
    facts = _node_facts(directory, problems)
    facts.probe = liveness.probe(infos)
    markers = read_markers(where, marker_names, problems) if missing else {}
    return TraceSet(path=directory, job_id=job, world_size=world, ranks=np.array(present, dtype=np.int64),
                    rank_info=infos, starts=starts, records=records, groups=groups,
                    layout=_layout(directory, layout, world, problems), facts=facts,
                    problems=problems, missing_ranks=missing, tail=tail, meta=metas,
                    init_markers={r: m for r, m in markers.items() if r in missing})


def _marker_files(directory: Path) -> tuple[Path, list[str]]:
    """(where, names) of the start markers, in DIR/rings, then DIR."""
    for candidate in (directory / "rings", directory):
        if candidate.is_dir() and (not candidate.is_symlink() or trusted_owner(candidate.lstat().st_uid)):
            with os.scandir(candidate) as it:
                names = sorted(e.name for e in it if MARKER_RE.match(e.name) and _is_file(e))
            if names:
                return candidate, names
    return directory, []


def _startup_trace(directory: Path, where: Path, names: list[str], layout: Layout | None) -> TraceSet:
    """A trace of start markers only: every rank stuck in (or before) init_process_group, no record."""
    problems: list[LoadProblem] = []
    _foreign_owner(directory, problems)
    markers = read_markers(where, names, problems)
    if not markers:
        raise TraceLoadError(f"{where}: no ring files, and none of its {len(names)} start markers "
                             f"(rank-NNNNN.init) is readable: {name_list(names, 3)}")
    world = max(max((m.world_size or 0) for m in markers.values()), max(markers) + 1)
    if world > fmt.MAX_WORLD_SIZE:
        raise TraceLoadError(f"{where}: a start marker names a world of {world} ranks (at most {fmt.MAX_WORLD_SIZE})")
    jobs = sorted({m.job_id for m in markers.values()})
    return TraceSet(path=directory, job_id=jobs[0] if len(jobs) == 1 else ",".join(jobs[:4]), world_size=world,
                    ranks=np.zeros(0, np.int64), rank_info=[], starts=np.zeros(1, np.int64),
                    records=_Columns(0).finish(), groups={}, layout=_layout(directory, layout, world, problems),
                    facts=_node_facts(directory, problems), problems=problems,
                    missing_ranks=tuple(range(world)), meta={}, init_markers=markers,
                    world_source="start markers (the world size init_process_group was called with)")


_Loaded = tuple[Records, list[RankInfo], dict[int, list[dict]], dict[int, set[int]]]


def _load_all(chosen: dict[int, Path], headers: dict[Path, RingHeader], tally: _Tally) -> _Loaded:
    """Every record of the chosen rings, rank by rank."""
    # Columns are filled in place, sized from the headers (at most capacity, at most write_counter + 1
    # records per ring): many small per-rank arrays would fragment the heap and double the peak memory.
    columns = _Columns(sum(min(headers[p].write_counter + 1, headers[p].capacity) for p in chosen.values()))
    infos: list[RankInfo] = []
    metas: dict[int, list[dict]] = {}
    used: dict[int, set[int]] = {}
    # Sequential on purpose: read_ring is bound by the interpreter, threads measured no faster.
    for rank, path in sorted(chosen.items()):
        got = _read_rank(rank, path)
        if isinstance(got, str):
            tally.unreadable.append(got)
            continue
        columns.append(rank, got.records)
        infos.append(got.info)
        metas[rank] = got.meta
        for gid in got.unknown_gids:
            used.setdefault(gid, set()).add(rank)
        tally.add(got)
    return columns.finish(), infos, metas, used


def _copy_columns(recs: np.ndarray, columns: dict[str, np.ndarray], at: int) -> None:
    """Copy the fields of ``recs`` (RECORD_DTYPE) into ``columns`` from row ``at`` (all but ``rank``).

    Block by block: each block of records stays in cache while its twelve fields are picked out.
    """
    for lo in range(0, len(recs), _COPY_BLOCK):
        part = recs[lo:lo + _COPY_BLOCK]
        for name, col in columns.items():
            if name != "rank":
                col[at + lo:at + lo + len(part)] = part[name]


_COPY_BLOCK = 1 << 15  # records (2 MB) per block when picking fields out of records
TAIL_BATCH = 128  # rings per read_tails call: ~2 MB of buffers at K=128, bounded whatever the trace's size
_NO_RECORDS = np.empty(0, RECORD_DTYPE)


@dataclass
class _TailColumns:
    """The tails of every readable ring file, as columns, file after file."""

    columns: dict[str, np.ndarray]
    rows: dict[Path, tuple[int, int]]  # file -> (first row, count)
    snaps: dict[Path, RingSnapshot]  # what was read, without the records (they are in ``columns``)
    metas: dict[Path, bytes | None]  # the meta file's bytes (None: unreadable, read_meta will say why)


def _read_batch(batch: list[Path], tail: int) -> tuple[list, list[bytes | None]]:
    """The tails of ``batch`` (``read_tails``) and the bytes of their meta files.

    The meta files are opened first and the kernel told they will be read (files not in the page
    cache are then read ahead together, while the rings are read), by the rank in their name;
    the rank in the ring header decides which file is read.
    """
    early: dict[str, int] = {}
    try:
        for path in batch[:open_budget()]:
            m = RING_RE.match(path.name)
            guess = _meta_path_str(int(m.group(1)) if m else -1, path)
            try:
                early[guess] = open_input(guess)
            except OSError:
                continue
            if _FADVISE:
                os.posix_fadvise(early[guess], 0, 0, os.POSIX_FADV_WILLNEED)
        snaps = read_tails(batch, tail)
        metas: list[bytes | None] = []
        for path, got in zip(batch, snaps, strict=True):
            data = None
            if isinstance(got, RingSnapshot):
                meta = _meta_path_str(got.header.rank, path)
                try:
                    data = _read_fd(early[meta]) if meta in early else _read_file(meta)
                except OSError:
                    pass  # read_meta says why, later
            metas.append(data)
    finally:
        for fd in early.values():
            os.close(fd)
    return snaps, metas


_FADVISE = hasattr(os, "posix_fadvise")


def _read_tails(files: list[Path], tail: int, unreadable: list[str]) -> _TailColumns:
    """Every ring's tail and meta file, batch by batch, copied into the columns."""
    # Sized for every file's whole tail (pages never written cost nothing); grown if a huge ``tail`` was asked.
    columns = {name: np.empty(len(files) * min(tail, 4096), dt) for name, dt in COLUMNS.items()}
    rows: dict[Path, tuple[int, int]] = {}
    snaps: dict[Path, RingSnapshot] = {}
    metas: dict[Path, bytes | None] = {}
    n = 0
    for lo in range(0, len(files), TAIL_BATCH):
        batch = files[lo:lo + TAIL_BATCH]
        got_snaps, got_metas = _read_batch(batch, tail)
        parts: list[np.ndarray] = []
        ranks: list[int] = []
        counts: list[int] = []
        at = n
        for path, got, meta in zip(batch, got_snaps, got_metas, strict=True):
            if not isinstance(got, RingSnapshot):
                unreadable.append(str(got))
                continue
            k = len(got.records)
            parts.append(np.ascontiguousarray(got.records).view(np.uint8))
            rows[path] = (at, k)
            at += k
            ranks.append(got.header.rank)
            counts.append(k)
            got.records = _NO_RECORDS  # (no reference to read_tails' buffer)
            snaps[path] = got
            metas[path] = meta
        if at > len(columns["rank"]):
            columns = {name: _grown(col, n, max(at, 2 * len(col))) for name, col in columns.items()}
        if at > n:
            _copy_columns(np.concatenate(parts).view(RECORD_DTYPE), columns, n)
            columns["rank"][n:at] = np.repeat(np.array(ranks, dtype=np.int32), counts)
            n = at
    return _TailColumns({name: col[:n] for name, col in columns.items()}, rows, snaps, metas)


def _grown(col: np.ndarray, used: int, size: int) -> np.ndarray:
    out = np.empty(size, col.dtype)
    out[:used] = col[:used]
    return out


def _read_metas(paths: list[str], data: list[bytes | None]) -> list[tuple[list[dict], list[ReadProblem], bool]]:
    """``read_meta`` of many meta files, given their bytes: (entries, problems, file exists) each.

    Well-formed files (complete lines, each a JSON object with a "kind") are parsed together, each
    distinct line once (the members of a group all write the same group line) with one
    ``json.loads``; their entries are fresh dicts, sharing the parsed values. Any other file is read
    again by ``read_meta``, which reports what is wrong with it.
    """
    blobs: list[list[bytes] | None] = []
    distinct: dict[bytes, int] = {}
    for blob in data:
        if blob is None or (blob and (not blob.endswith(b"\n") or b"\r" in blob)):
            blobs.append(None)  # unreadable, torn or odd: read_meta below reports it
            continue
        lines = blob.split(b"\n")[:-1]
        for line in lines:
            distinct.setdefault(line, len(distinct))
        blobs.append(lines)
    try:
        parsed = json.loads(b"[" + b",".join(distinct) + b"]") if distinct else []
    except (ValueError, RecursionError):  # some line is not JSON (or nested too deep): line by line, bad ones None
        parsed = [_json_or_none(line) for line in distinct]
    fine = [isinstance(e, dict) and "kind" in e for e in parsed]
    out: list[tuple[list[dict], list[ReadProblem], bool]] = []
    for path, lines in zip(paths, blobs, strict=True):
        ids = None if lines is None else [distinct[line] for line in lines]
        if ids is not None and all(fine[i] for i in ids):
            out.append(([dict(parsed[i]) for i in ids], [], True))
        else:
            entries, problems = read_meta(path)
            out.append((entries, problems, os.path.exists(path)))
    return out


def _read_file(path: str) -> bytes:
    """A meta file's bytes (``os.read`` on a descriptor: half the cost of ``open().read()``)."""
    return read_input(path, META_LIMIT)


def _read_fd(fd: int) -> bytes:
    return read_fd(fd, META_LIMIT)


def _json_or_none(line: bytes) -> object:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # read_meta reports the line
        return None


def _load_tails(chosen: dict[int, Path], tails: _TailColumns, tally: _Tally) -> _Loaded:
    """The chosen rings' tails (already read into columns) and their meta files."""
    order = sorted(chosen.items())
    spans = [tails.rows[path] for _, path in order]
    n = len(tails.columns["rank"])
    contiguous = all(s[0] == (spans[k - 1][0] + spans[k - 1][1] if k else 0) for k, s in enumerate(spans)) \
        and sum(s[1] for s in spans) == n
    if contiguous:  # the usual case: files in rank order, all of them chosen
        records = Records(**tails.columns)
    else:  # files of another job, duplicates, or renamed files: keep the chosen ones, in rank order
        take = np.concatenate([np.arange(a, a + k) for a, k in spans]) if spans else np.empty(0, np.int64)
        records = Records(**{name: col[take] for name, col in tails.columns.items()})
    infos: list[RankInfo] = []
    metas: dict[int, list[dict]] = {}
    read = _read_metas([_meta_path_str(rank, path) for rank, path in order], [tails.metas[path] for _, path in order])
    for (rank, path), (entries, meta_problems, found) in zip(order, read, strict=True):
        snap, h = tails.snaps[path], tails.snaps[path].header
        info = RankInfo(rank, h.host, h.local_rank, h.pid, str(path), h.job_id, h.step_id, h.closed_cleanly,
                        tails.rows[path][1], snap.overwritten, snap.lost, h.anchor_wall_ns, h.anchor_mono_ns,
                        snap.dropped - snap.overwritten, heartbeat_ns=h.heartbeat_ns, pulse_ns=h.pulse_ns,
                        signal_ns=h.signal_ns)
        infos.append(info)
        metas[rank] = entries
        tally.add(_RankRead(info, _NO_RECORDS, entries, found, [str(p) for p in meta_problems if p.severity == "error"],
                            [], _damage(snap)))
    return records, infos, metas, _unknown_groups(records, np.array([i.n_records for i in infos]), metas)


def _unknown_groups(records: Records, counts: np.ndarray, metas: dict[int, list[dict]]) -> dict[int, set[int]]:
    """Group id -> ranks that used it in records without declaring it in their own meta (all ranks at once).

    ``counts``: rows per rank, ranks in the order of ``metas``. A rank declares a handful of groups:
    they are compared column by column (the j-th declared group of every rank at once), no sort.
    """
    known = [_known_gids(entries) for entries in metas.values()]
    width = max((len(k) for k in known), default=0)
    keyed = records.op < fmt.Op.MARK_STEP
    if width <= 32:
        declared = np.zeros(len(records), bool)
        for j in range(width):
            column = np.array([k[j] if j < len(k) else -1 for k in known], dtype=np.int64)
            declared |= records.group_id == np.repeat(column, counts)
        left_rows = np.flatnonzero(keyed & ~declared)
        keys = (records.rank[left_rows].astype(np.int64) << 32) | records.group_id[left_rows].astype(np.int64)
    else:  # some rank declares many groups: a sorted membership test
        keys = (records.rank[keyed].astype(np.int64) << 32) | records.group_id[keyed].astype(np.int64)
        flat = np.array([(rank << 32) | gid for rank, k in zip(metas, known) for gid in k], dtype=np.int64)
        keys = keys[~np.isin(keys, flat)]
    used: dict[int, set[int]] = {}
    left = np.unique(keys)
    for rank, gid in zip((left >> 32).tolist(), (left & 0xFFFFFFFF).tolist(), strict=True):
        used.setdefault(gid, set()).add(rank)
    return used


# ---------------------------------------------------------------------------------------------------
# Tails that turn out too short
# ---------------------------------------------------------------------------------------------------
def tail_gaps(trace: TraceSet, ix: RecordIndex, recent: int) -> list[int]:
    """Ranks whose loaded tail may be too short to say what the others wait for.

    Each rank's newest ``recent`` records show what it waits in. A collective instance there that a
    member never entered, or a send or recv whose counterpart is not there, means something only if
    that member or peer really never posted it. When the partner's loaded tail starts after that op
    (its oldest loaded record of the group, or of the channel, is a later one) and its ring holds
    older records that were not loaded, the partner may have posted it earlier: it is a gap.
    """
    if trace.tail is None or not len(trace.records):
        return []
    unread = np.array([i.unread > 0 for i in trace.rank_info], dtype=bool)
    if not unread.any():
        return []
    rec = trace.records
    idx = trace.starts[1:, None] - recent + np.arange(recent)[None, :]  # each rank's newest rows
    recent_rows = idx[idx >= trace.starts[:-1, None]]
    recent_rows = recent_rows[rec.op[recent_rows] < fmt.Op.MARK_STEP]
    gaps: set[int] = set()

    # Point to point: no counterpart loaded, and the partner's oldest loaded op of the other side on the
    # channel is a later one (or it has none).
    pair = ix.pair[recent_rows]
    p_rows, pair = recent_rows[pair >= 0], pair[pair >= 0]
    is_send = rec.op[p_rows] == fmt.Op.SEND
    lone = np.where(is_send, ix.recv_row[pair], ix.send_row[pair]) < 0
    p_rows, pair, is_send = p_rows[lone], pair[lone], is_send[lone]
    if len(pair):
        chan, seq = ix.pair_chan[pair], ix.pair_seq[pair]
        want = np.zeros(len(ix.chan_gidx), bool)
        want[chan] = True
        oldest = {}
        for side, table in (("send", ix.send_row), ("recv", ix.recv_row)):
            first = np.full(len(want), np.iinfo(np.int64).max, np.int64)
            has = np.flatnonzero((table >= 0) & want[ix.pair_chan])
            np.minimum.at(first, ix.pair_chan[has], ix.pair_seq[has])
            oldest[side] = first
        partner_first = np.where(is_send, oldest["recv"][chan], oldest["send"][chan])
        peer = np.where(is_send, ix.chan_dst[chan], ix.chan_src[chan])
        for r in np.unique(peer[partner_first > seq]).tolist():
            if trace.has(r) and unread[trace.pos(r)]:
                gaps.add(int(r))

    # Collectives: a member that never entered an instance someone is in, and whose oldest loaded
    # record of that group is a later instance (or who has none loaded).
    inst = ix.inst[recent_rows]
    insts = np.unique(inst[inst >= 0])
    if len(insts):
        entered = np.bincount(ix.inst[ix.inst >= 0], minlength=ix.n_instances)
        short = insts[entered[insts] < ix.group_size[ix.inst_gidx[insts]]]
        if len(short):
            want = np.zeros(ix.n_instances + 1, bool)
            want[short + 1] = True
            rows = np.flatnonzero(want[ix.inst + 1])
            rows = rows[np.argsort(ix.inst[rows], kind="stable")]
            bounds = np.r_[0, np.flatnonzero(np.diff(ix.inst[rows])) + 1, len(rows)]
            who, groups, seqs = [], [], []
            for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
                i = int(ix.inst[rows[a]])
                group = trace.groups.get(ix.gid_of_instance(i))
                if group is None:
                    continue
                missing = np.setdiff1d(np.array(group.ranks, dtype=np.int64), rec.rank[rows[a:b]])
                missing = [trace.pos(int(r)) for r in missing.tolist() if trace.has(int(r))]
                missing = [m for m in missing if unread[m]]
                who += missing
                groups += [int(ix.inst_gidx[i])] * len(missing)
                seqs += [int(ix.inst_seq[i])] * len(missing)
            if who:
                pos_of_row = np.repeat(np.arange(len(trace.ranks)), np.diff(trace.starts))
                gaps.update(_uncovered(trace, ix, pos_of_row, np.array(who), np.array(groups), np.array(seqs)))
    return sorted(gaps)


def _uncovered(trace: TraceSet, ix: RecordIndex, pos_of_row: np.ndarray, who: np.ndarray, groups: np.ndarray,
               seqs: np.ndarray) -> set[int]:
    """Ranks (by position ``who``) whose oldest loaded record of group ``groups`` is after ``seqs`` (or absent)."""
    n_groups = len(ix.group_ids)
    need_rank = np.zeros(len(trace.ranks), bool)
    need_rank[who] = True
    need_group = np.zeros(n_groups + 1, bool)
    need_group[groups + 1] = True
    rows = np.flatnonzero(need_rank[pos_of_row] & (ix.inst >= 0) & need_group[ix.gidx + 1])
    keys = pos_of_row[rows].astype(np.int64) * n_groups + ix.gidx[rows]
    order = np.lexsort((trace.records.group_seq[rows], keys))
    uniq, first = np.unique(keys[order], return_index=True)
    oldest = trace.records.group_seq[rows][order][first]
    want = who.astype(np.int64) * n_groups + groups
    at = np.minimum(np.searchsorted(uniq, want), max(len(uniq) - 1, 0))
    covered = (uniq[at] == want) & (oldest[at] <= seqs) if len(uniq) else np.zeros(len(want), bool)
    return {int(trace.ranks[p]) for p in who[~covered].tolist()}


def extend_tails(trace: TraceSet, ranks: Iterable[int], last: int | None) -> TraceSet:
    """``trace`` (loaded with ``tail``, clocks not aligned yet) with ``ranks`` re-read further back:
    their newest ``last`` records, or all of them (None)."""
    if trace.time_base != "monotonic":
        raise ValueError("extend the tails before aligning the clocks")
    fresh: dict[int, RingSnapshot] = {}
    for r in sorted(set(ranks)):
        info = trace.info(r)
        if info is None or not info.unread:
            continue
        try:
            snap = read_ring(info.path, last=last)
        except (RingFormatError, OSError):
            continue  # (it was readable a moment ago: keep the tail already loaded)
        if len(snap.records) > info.n_records:
            fresh[r] = snap
    if not fresh:
        return trace
    rec = trace.records
    cols = {name: [] for name in COLUMNS}
    infos = list(trace.rank_info)
    problems = list(trace.problems)
    prev = 0
    for r, snap in fresh.items():
        p = trace.pos(r)
        a, b = int(trace.starts[p]), int(trace.starts[p + 1])
        for name, dt in COLUMNS.items():
            cols[name].append(getattr(rec, name)[prev:a])
            cols[name].append(np.full(len(snap.records), r, dt) if name == "rank" else snap.records[name].astype(dt))
        prev = b
        info = infos[p]
        infos[p] = dataclasses.replace(info, n_records=len(snap.records), dropped=snap.overwritten, lost=snap.lost,
                                       unread=snap.dropped - snap.overwritten)
        damage = _damage(snap)
        if damage and not info.lost:
            problems.append(LoadProblem("warning", "ring-damage", f"rank {r}: {damage} (read further back for the "
                                        "hang analysis; kept the rest)", ranks=(r,), paths=(info.path,)))
    for name in COLUMNS:
        cols[name].append(getattr(rec, name)[prev:])
    records = Records(**{name: np.concatenate(parts) for name, parts in cols.items()})
    starts = np.concatenate([[0], np.cumsum([i.n_records for i in infos])]).astype(np.int64)
    return dataclasses.replace(trace, records=records, rank_info=infos, starts=starts, problems=problems)


def widen_tails(trace: TraceSet, ix: RecordIndex, recent: int) -> tuple[TraceSet, RecordIndex]:
    """Re-read the ranks :func:`tail_gaps` names, deeper each round (:data:`WIDEN_DEPTHS`), re-indexing."""
    for depth in WIDEN_DEPTHS:
        gaps = tail_gaps(trace, ix, recent)
        if not gaps:
            break
        wider = extend_tails(trace, gaps, depth)
        if wider is trace:
            break
        trace, ix = wider, index_records(wider)
    return trace, ix
