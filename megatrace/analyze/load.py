"""Load a trace directory into one columnar :class:`TraceSet`: every rank's records, groups, layout, node facts.

A trace directory holds ``rings/rank-NNNNN.ring`` (or the rings directly),
their ``rank-NNNNN.meta.jsonl`` files, and optionally ``layout.yaml`` and
``procs.json``. Records of all ranks are concatenated column by column
(numpy), rank after rank, each rank's rows in ``seq`` order: no Python object
per record, so 16,384 ranks × 2,000 records fit in memory and in seconds.

Bad input never raises a traceback: missing, duplicated, empty or foreign
(other job) ring files and a layout that does not fit become
:class:`LoadProblem` entries; only a directory that holds no readable ring at
all raises :class:`TraceLoadError`. ``fault.json`` (demo ground truth) is
never read here.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatrace.analyze.traceset import (COLUMNS, GroupInfo, LoadProblem, NodeFacts, ProcFact, RankInfo, Records,
                                        TraceLoadError, TraceSet, name_list, plural, rank_list)

__all__ = ["GroupInfo", "LoadProblem", "NodeFacts", "ProcFact", "RankInfo", "Records", "TraceLoadError", "TraceSet",
           "fit_layout", "load_trace"]
from megatrace.config import Layout, LayoutError, load_layout
from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_reader import RingFormatError, RingHeader, parse_header, read_meta, read_ring

RING_RE = re.compile(r"^rank-(\d+)\.ring$")
EARLIER_RE = re.compile(r"^rank-(\d+)\.ring\.\d+$")


def _ring_files(directory: Path) -> tuple[list[Path], list[Path]]:
    """(ring files, earlier-attempt files), looking in DIR/rings, then DIR."""
    for candidate in (directory / "rings", directory):
        if candidate.is_dir():
            rings = sorted(p for p in candidate.iterdir() if RING_RE.match(p.name) and p.is_file())
            if rings:
                return rings, sorted(p for p in candidate.iterdir() if EARLIER_RE.match(p.name))
    return [], []


def _read_header(path: Path) -> RingHeader:
    with open(path, "rb") as fh:
        blob = fh.read(fmt.HEADER_SIZE)
    return parse_header(str(path), blob)[0]


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


def _groups(metas: dict[int, list[dict]], used: dict[int, set[int]],
            problems: list[LoadProblem]) -> dict[int, GroupInfo]:
    """Merge group lines of all ranks; check that members agree; infer groups seen only in records."""
    versions: dict[int, dict[tuple[int, ...], list[int]]] = {}
    first: dict[int, dict] = {}
    for rank, entries in metas.items():
        for e in entries:
            if e.get("kind") != "group" or not isinstance(e.get("gid"), int):
                continue
            try:
                members = tuple(int(r) for r in e.get("ranks") or ())
            except (TypeError, ValueError):
                continue
            versions.setdefault(e["gid"], {}).setdefault(members, []).append(rank)
            first.setdefault(e["gid"], e)
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
    if not path.exists():
        return NodeFacts()
    try:
        data = json.loads(path.read_text())
        procs = {}
        for key, p in (data.get("ranks") or {}).items():
            procs[int(key)] = ProcFact(int(key), p.get("pid"), p.get("exit_code"), p.get("signal"),
                                       bool(p.get("killed_by_launcher", False)))
        return NodeFacts(procs, data.get("outcome"), data.get("message"))
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        problems.append(LoadProblem("warning", "procs", f"{path}: unreadable process facts ({exc}); ignored",
                                    paths=(str(path),)))
        return NodeFacts()


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
    if not path.exists():
        return None
    try:
        return fit_layout(load_layout(path), world, str(path), problems)
    except LayoutError as exc:
        problems.append(LoadProblem("error", "layout", f"{exc}; analysing without a layout", paths=(str(path),)))
        return None


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


def _read_rank(rank: int, path: Path) -> _RankRead | str:
    """Read one ring and its meta file; a string is the reason it is unreadable."""
    try:
        snap = read_ring(path)
    except (RingFormatError, OSError) as exc:
        return str(exc)
    h, recs = snap.header, snap.records
    n = len(recs)
    meta_path = path.with_name(fmt.meta_name(rank)) if RING_RE.match(path.name) else path.with_suffix(".meta.jsonl")
    entries, meta_problems = read_meta(meta_path)
    known = np.array([e["gid"] for e in entries if e.get("kind") == "group" and isinstance(e.get("gid"), int)
                      and 0 <= e["gid"] < 1 << 32], dtype=np.uint32)
    gids = recs["group_id"][recs["op"] < fmt.Op.MARK_STEP]
    unknown = gids[~np.isin(gids, known)] if len(known) else gids
    damage = ""
    if any(p.severity == "error" for p in snap.problems) or snap.lost:
        damage = str(snap.problems[0]) if snap.problems else f"{snap.lost} records lost"
    info = RankInfo(rank, h.host, h.local_rank, h.pid, str(path), h.job_id, h.step_id, h.closed_cleanly, n,
                    snap.dropped, snap.lost, h.anchor_wall_ns, h.anchor_mono_ns)
    return _RankRead(info, recs, entries, meta_path.exists(),
                     [str(p) for p in meta_problems if p.severity == "error"],
                     np.unique(unknown).tolist() if len(unknown) else [], damage)


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


def load_trace(directory: str | Path, layout: Layout | None = None) -> TraceSet:
    """Load a trace directory; see the module docstring. ``layout`` overrides ``layout.yaml``."""
    directory = Path(directory)
    if not directory.exists():
        raise TraceLoadError(f"{directory}: no such directory")
    if not directory.is_dir():
        raise TraceLoadError(f"{directory}: not a directory (expected a MegaTrace trace directory)")
    files, earlier = _ring_files(directory)
    if not files:
        raise TraceLoadError(f"{directory}: not a MegaTrace trace directory: no ring files "
                             f"(rank-NNNNN.ring) in it or in its rings/ subdirectory")
    problems: list[LoadProblem] = []
    if earlier:
        problems.append(LoadProblem(
            "info", "earlier-attempts",
            f"{len(earlier)} ring files of earlier attempts of restarted ranks ignored: "
            f"{name_list([p.name for p in earlier])}", paths=tuple(map(str, earlier))))
    headers: dict[Path, RingHeader] = {}
    unreadable: list[str] = []
    for path in files:
        try:
            headers[path] = _read_header(path)
        except (RingFormatError, OSError) as exc:
            unreadable.append(str(exc))
    if not headers:
        raise TraceLoadError(f"{directory}: none of the {len(files)} ring files is readable: "
                             f"{name_list(unreadable, 3)}")
    job, world, chosen = _select(headers, problems)

    # Columns are filled in place, sized from the headers (at most capacity, at most write_counter + 1
    # records per ring): many small per-rank arrays would fragment the heap and double the peak memory.
    columns = _Columns(sum(min(headers[p].write_counter + 1, headers[p].capacity) for p in chosen.values()))
    infos: list[RankInfo] = []
    counts: list[int] = []
    metas: dict[int, list[dict]] = {}
    used: dict[int, set[int]] = {}
    tally = _Tally(unreadable=unreadable)
    # Sequential on purpose: read_ring is bound by the interpreter, threads measured no faster.
    for rank, path in sorted(chosen.items()):
        got = _read_rank(rank, path)
        if isinstance(got, str):
            tally.unreadable.append(got)
            continue
        columns.append(rank, got.records)
        counts.append(got.info.n_records)
        infos.append(got.info)
        metas[rank] = got.meta
        for gid in got.unknown_gids:
            used.setdefault(gid, set()).add(rank)
        tally.add(got)
    if not infos:
        raise TraceLoadError(f"{directory}: none of the {len(files)} ring files is readable: "
                             f"{name_list(unreadable, 3)}")
    tally.report(problems)
    present = [i.rank for i in infos]
    missing = tuple(sorted(set(range(world)) - set(present)))
    if missing:
        problems.append(LoadProblem(
            "warning", "missing-ranks",
            f"no readable ring for {len(missing)} of {world} ranks: {rank_list(list(missing))}; analysed the "
            f"other {len(present)}, with lower confidence", ranks=missing))

    records = columns.finish()
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    groups = _groups(metas, used, problems)
    return TraceSet(path=directory, job_id=job, world_size=world, ranks=np.array(present, dtype=np.int64),
                    rank_info=infos, starts=starts, records=records, groups=groups,
                    layout=_layout(directory, layout, world, problems), facts=_node_facts(directory, problems),
                    problems=problems, missing_ranks=missing)
