"""What every importer shares: per-rank rows of a foreign trace -> one :class:`TraceSet`.

An importer parses its files into :class:`ImportedRank` objects (one per rank: columns named as
:data:`traceset.COLUMNS`, times in wall-clock ns) plus group lines in the meta-file shape
(``{"kind": "group", "gid", "name", "desc", "ranks"}``); :func:`build_traceset` assembles them
with the ring loader's own helpers (group merging and inference, layout, ``procs.json``), so
everything after loading is the same as for ring files.

Foreign formats often lack completion times. :func:`infer_completions` gives such a collective
the time of its last arrival (it cannot have completed earlier; on small messages it completes
right after), which is what the clock, matching and timing analyses then see.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import numpy as np

from megatrace.config import GROUP_KINDS, Layout, LayoutError, load_layout
from megatrace.load.rings import RecordColumns
from megatrace.load.side_files import merge_groups, node_facts, resolve_layout
from megatrace.load.traceset import (COLUMNS, GroupInfo, LoadProblem, RankInfo, TraceLoadError, TraceSet, plural,
                                     rank_list)
from megatrace.trace.ring_format import Op, State


class ImportFormatError(TraceLoadError):
    """A foreign trace file that cannot be read; the message names the file (and line)."""


INT64_MAX = (1 << 63) - 1  # the record columns are int64 (times in ns, byte counts, sequence numbers)
MAX_RANKS = 1 << 20  # a rank or communicator size beyond this is not a real job's (world-sized tables would be huge)

_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong, _SHOW.maxlevel = 60, 60, 40, 3
_SHOW.maxlist = _SHOW.maxtuple = _SHOW.maxset = 6
_SHOW.maxdict = 4


def shown(value: object) -> str:
    """A short repr of an input value for an error message, however large, deep or self-referencing it is."""
    if type(value) is int and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    try:
        return _SHOW.repr(value)
    except (ValueError, RecursionError):  # (an integer too long to print, deep inside a container)
        return f"a {type(value).__name__}"


def _bound(n: int) -> str:
    return {INT64_MAX: "2**63-1", -INT64_MAX - 1: "-2**63", (1 << 64) - 1: "2**64-1"}.get(n, str(n))


class Fields:
    """Checks one input record's fields (a dump entry, a log line, a JSON object) before they go into columns.

    Every check returns the value or raises :class:`ImportFormatError` in one shape:
    ``WHERE: field NAME: expected WHAT, got VALUE`` (``WHERE`` names the file and the entry or line).
    """

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, name: str, expected: str, value: object) -> NoReturn:
        raise ImportFormatError(f"{self.where}: field {name}: expected {expected}, got {shown(value)}")

    def integer(self, name: str, value: object, lo: int = 0, hi: int = INT64_MAX, what: str = "") -> int:
        """An integer (not a bool, not a float) in [lo, hi]."""
        if type(value) is not int or not lo <= value <= hi:
            self.fail(name, what or f"an integer from {_bound(lo)} to {_bound(hi)}", value)
        return value

    def decimal(self, name: str, text: str, lo: int = 0, hi: int = INT64_MAX, what: str = "") -> int:
        """A number written in decimal digits (a text log's field) in [lo, hi]."""
        value = int(text) if len(text) <= 40 else None  # (never convert thousands of digits)
        if value is None or not lo <= value <= hi:
            raise ImportFormatError(f"{self.where}: field {name}: expected "
                                    f"{what or f'a number from {_bound(lo)} to {_bound(hi)}'}, got "
                                    f"{text if len(text) <= 40 else text[:40] + '…'}")
        return value

    def number(self, name: str, value: object, lo: float = 0, hi: float = INT64_MAX, what: str = "") -> float:
        """A finite int or float (not a bool, not NaN or infinite) in [lo, hi]."""
        if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
            self.fail(name, what or f"a finite number from {_bound(int(lo))} to {_bound(int(hi))}", value)
        return value

    def text(self, name: str, value: object, optional: bool = False) -> str | None:
        """A string (or, when ``optional``, None)."""
        if not isinstance(value, str) and not (optional and value is None):
            self.fail(name, "a string" + (" or null" if optional else ""), value)
        return value

    def mapping(self, name: str, value: object, optional: bool = False) -> dict:
        """A dict (JSON object); when ``optional``, None or absent gives an empty dict."""
        if value is None and optional:
            return {}
        if not isinstance(value, dict):
            self.fail(name, "an object (a dict)" + (" or null" if optional else ""), value)
        return value

    def sequence(self, name: str, value: object, optional: bool = False) -> list | tuple:
        """A list or tuple; when ``optional``, None or absent gives an empty list."""
        if value is None and optional:
            return []
        if not isinstance(value, (list, tuple)):
            self.fail(name, "a list" + (" or null" if optional else ""), value)
        return value


def group_id(namespace: str, key: str) -> int:
    """A group id in its own namespace (docs/trace-format.md section 8); never 0 (markers)."""
    return zlib.crc32(f"{namespace}:{key}".encode()) or 1


@dataclass
class ImportedRank:
    """One rank's records, as columns (without ``rank``), oldest first, times in wall-clock ns."""

    rank: int
    path: str
    columns: dict[str, np.ndarray]
    host: str = ""
    pid: int = 0
    closed_cleanly: bool = False
    dropped: int = 0  # older records the source no longer held
    groups: list[dict] = field(default_factory=list)  # group lines known for this rank (meta-file shape)
    done: np.ndarray | None = None  # per row: completed, completion time unknown (see infer_completions)

    def __len__(self) -> int:
        return len(self.columns["seq"])


def new_columns(n: int) -> dict[str, np.ndarray]:
    """Zeroed columns for ``n`` records (peer -1, state ENQUEUED)."""
    cols = {name: np.zeros(n, dt) for name, dt in COLUMNS.items() if name != "rank"}
    cols["peer"][:] = -1
    cols["state"][:] = State.ENQUEUED
    cols["seq"][:] = np.arange(1, n + 1)
    return cols


def dense_group_seq(ranks: list[ImportedRank], keys: dict[int, np.ndarray],
                    channels: dict[int, np.ndarray] | None = None) -> None:
    """Rewrite ``group_seq`` from sortable keys (``keys[rank]``: int64 per row, -1 = leave it) into dense
    numbers shared by all ranks: the k-th distinct key of a group (and channel: ``channels[rank]``, e.g. a
    send/recv direction; 0 for collectives), over all ranks, becomes k + 1. Keys need only be comparable
    across ranks, not contiguous."""
    if not ranks:
        return
    gids = np.concatenate([r.columns["group_id"] for r in ranks]).astype(np.int64)
    key = np.concatenate([keys[r.rank] for r in ranks])
    chan = (np.concatenate([channels[r.rank] for r in ranks]) if channels is not None
            else np.zeros(len(key), np.int64))
    use = key >= 0
    if not use.any():
        return
    table = np.stack([gids[use], chan[use], key[use]], axis=1)
    uniq, inverse = np.unique(table, axis=0, return_inverse=True)
    new_group = np.r_[True, (np.diff(uniq[:, 0]) != 0) | (np.diff(uniq[:, 1]) != 0)]
    first = np.flatnonzero(new_group)
    start = np.repeat(first, np.diff(np.r_[first, len(uniq)]))
    dense = (np.arange(len(uniq)) - start + 1)[inverse.reshape(-1)]
    out = np.zeros(len(key), np.int64)
    out[use] = dense
    at = 0
    for r in ranks:
        n = len(r)
        mine = use[at:at + n]
        r.columns["group_seq"][mine] = out[at:at + n][mine]
        at += n


def infer_completions(ranks: list[ImportedRank]) -> None:
    """Completed collectives without a completion time get the time of their instance's last arrival.

    ``ImportedRank.done``: bool per row, completion known to have happened but its time unknown.
    """
    done = {r.rank: (r.done if r.done is not None else np.zeros(len(r), bool)) for r in ranks}
    rows = [(r, np.flatnonzero(done[r.rank] & (r.columns["op"] < Op.SEND) & (r.columns["op"] != Op.UNKNOWN)))
            for r in ranks]
    keys, times = [], []
    for r, idx in rows:
        keys.append((r.columns["group_id"][idx].astype(np.int64) << 40) | r.columns["group_seq"][idx])
        times.append(r.columns["t_enqueue"][idx])
    # every entry of an instance counts as an arrival, done or not
    all_keys = np.concatenate([(r.columns["group_id"].astype(np.int64) << 40) | r.columns["group_seq"]
                               for r in ranks]) if ranks else np.empty(0, np.int64)
    all_t = np.concatenate([r.columns["t_enqueue"] for r in ranks]) if ranks else np.empty(0, np.int64)
    uniq, inv = np.unique(all_keys, return_inverse=True)
    last = np.full(len(uniq), np.iinfo(np.int64).min, np.int64)
    np.maximum.at(last, inv, all_t)
    for (r, idx), k in zip(rows, keys, strict=True):
        if len(idx):
            r.columns["t_complete"][idx] = last[np.searchsorted(uniq, k)]
            r.columns["state"][idx] = State.COMPLETED
    for r in ranks:  # p2p and unknown ops known done: completed at their own enqueue (no better bound)
        other = done[r.rank] & (r.columns["state"] != State.COMPLETED)
        r.columns["t_complete"][other] = r.columns["t_enqueue"][other]
        r.columns["state"][other] = State.COMPLETED


def build_traceset(directory: Path, source: str, ranks: list[ImportedRank], world_size: int | None,
                   problems: list[LoadProblem], layout: Layout | None = None,
                   extra_groups: list[dict] | None = None,
                   names: dict[int, tuple[str, str]] | None = None, inferred: str = "",
                   completions: str = "inferred") -> TraceSet:
    """Assemble a :class:`TraceSet` from imported ranks, as :func:`load.load_trace` does from rings.

    Groups: the group lines of every rank (merged and checked like meta files), plus ``extra_groups``
    (known for every rank, e.g. from a layout); groups used in records without a line are inferred from
    the ranks that used them (named from ``names``: gid -> (name, desc); members from the layout when the
    description is a layout kind). ``inferred``: why completion times are estimates ("" when they were
    observed); ``completions`` then says how: "arrivals" (each call completes at its instance's last arrival:
    the straggler analysis still runs, call by call, and the critical path does not) or "inferred" (coarser:
    neither runs).
    World size: the largest of the given one, the layout's, and the highest rank a file or a group line names + 1
    (never one group's size: a group may leave out the highest ranks).
    """
    if not ranks:
        raise TraceLoadError(f"{directory}: no {source} records found")
    ranks = sorted(ranks, key=lambda r: r.rank)
    seen: dict[int, ImportedRank] = {}
    for r in ranks:
        if r.rank in seen:
            raise ImportFormatError(f"{r.path}: rank {r.rank} also comes from {seen[r.rank].path}; one file per rank")
        seen[r.rank] = r
    world, world_source = _world_size(directory, source, ranks, world_size, layout)
    columns, infos, metas, used = _rank_columns(source, ranks, extra_groups)
    empty = [i.rank for i in infos if i.n_records == 0]
    if empty:
        problems.append(LoadProblem("warning", "empty-ring", f"{plural(len(empty), 'rank')} without records: ranks "
                                    f"{rank_list(empty)}", ranks=tuple(empty)))
    present = [i.rank for i in infos]
    missing = tuple(sorted(set(range(world)) - set(present)))
    if missing:  # (confidences are scaled by the fraction present, as for rings)
        problems.append(LoadProblem("warning", "missing-ranks", f"{source}: nothing from "
                                    f"{plural(len(missing), 'rank')} of {world} ({rank_list(list(missing))})",
                                    ranks=missing))
    starts = np.concatenate([[0], np.cumsum([i.n_records for i in infos])]).astype(np.int64)
    found: list[LoadProblem] = []
    groups = merge_groups(metas, used, found)
    problems += [p for p in found if p.code != "unknown-groups"]  # (its wording is about meta files)
    fitted = resolve_layout(directory, layout, world, problems)
    guessed = _complete_groups(groups, names or {}, fitted)
    _layout_groups(groups, fitted)
    if guessed:
        problems.append(LoadProblem(
            "info", "inferred-groups",
            f"{source}: the members of {plural(len(guessed), 'group')} are not in the input: taken from the "
            f"layout where it names the group's kind, else from the ranks that used the group (a member that "
            f"never used it is then unknown): {', '.join(guessed[:6])}{' …' if len(guessed) > 6 else ''}"))
    if inferred:
        skipped = ("the critical path needs real completion times and was not run; stragglers are judged from "
                   "arrivals" if completions == "arrivals" else
                   "no timing analysis runs on it (critical path, stragglers, slow links)" if completions == "order"
                   else
                   "the critical path and the straggler analysis need real completion times and were not run")
        problems.append(LoadProblem("info", "inferred-completions", f"{source}: {inferred}; {skipped}"))
    return TraceSet(path=directory, job_id=source, world_size=world, ranks=np.array(present, dtype=np.int64),
                    rank_info=infos, starts=starts, records=columns.finish(), groups=groups, layout=fitted,
                    facts=node_facts(directory, problems), problems=problems, missing_ranks=missing, tail=None,
                    meta=metas, source_format=source, world_source=world_source,
                    completion_times=completions if inferred else "observed")


def _world_size(directory: Path, source: str, ranks: list[ImportedRank], world_size: int | None,
                layout: Layout | None) -> tuple[int, str]:
    """The world size of :func:`build_traceset` (``ranks`` sorted) and where it came from."""
    lines = {g["gid"]: g for r in ranks for g in r.groups}  # (one line per group: members are read once)
    named = max((max(g.get("ranks") or (-1,)) for g in lines.values()), default=-1)
    world = max(world_size or 0, ranks[-1].rank + 1, named + 1)  # every rank a file or a group names
    world_source = (f"{source}: the highest rank its files and groups name" if world > (world_size or 0) else
                    f"{source}: the layout it was read with")
    if world_size is None:
        known = layout
        if known is None and (directory / "layout.yaml").exists():
            try:
                known = load_layout(directory / "layout.yaml")
            except LayoutError:
                known = None  # reported by resolve_layout below
        if known is not None and known.world_size > world:
            world, world_source = known.world_size, f"{source}: the layout's world size"
    return world, world_source


def _rank_columns(source: str, ranks: list[ImportedRank], extra_groups: list[dict] | None
                  ) -> tuple[RecordColumns, list[RankInfo], dict[int, list[dict]], dict[int, set[int]]]:
    """The ranks' rows in columns, their :class:`RankInfo`, meta lines (group lines plus ``extra_groups``) and
    the groups used in records without a line (gid -> ranks that used it)."""
    columns = RecordColumns(sum(len(r) for r in ranks))
    infos: list[RankInfo] = []
    metas: dict[int, list[dict]] = {}
    used: dict[int, set[int]] = {}
    for r in ranks:
        recs = np.zeros(len(r), dtype=[(n, dt) for n, dt in COLUMNS.items() if n != "rank"])
        for name in recs.dtype.names:
            recs[name] = r.columns[name]
        columns.append(r.rank, recs)
        infos.append(RankInfo(r.rank, r.host, -1, r.pid, r.path, source, "", r.closed_cleanly, len(r), r.dropped,
                              0, 0, 0))
        metas[r.rank] = list(r.groups) + list(extra_groups or ())
        declared = {g["gid"] for g in metas[r.rank]}
        keyed = r.columns["op"] < Op.MARK_STEP
        for gid in np.unique(r.columns["group_id"][keyed]).tolist():
            if gid not in declared and gid != 0:
                used.setdefault(int(gid), set()).add(r.rank)
    return columns, infos, metas, used


def _layout_groups(groups: dict[int, GroupInfo], layout: Layout | None) -> None:
    """Add the layout's groups of each kind (tp, pp, dp) that no imported group has: a format that records
    collectives only (Flight Recorder on gloo) must not make the pipeline groups look absent."""
    if layout is None:
        return
    have = {g.desc for g in groups.values()}
    for kind in GROUP_KINDS:
        if kind in have or getattr(layout, kind) <= 1:
            continue
        for members in getattr(layout, f"{kind}_groups")():
            key = f"{kind}:{','.join(map(str, members))}"
            gid = group_id("layout", key)
            groups.setdefault(gid, GroupInfo(gid, key, kind, tuple(members), inferred=True))


def _complete_groups(groups: dict[int, GroupInfo], names: dict[int, tuple[str, str]],
                     layout: Layout | None) -> list[str]:
    """Give inferred groups their name and description, and their layout members when the description is a
    layout kind (tp, pp, dp) whose group holds every rank that used it. Returns the groups' labels."""
    labels = []
    for gid, g in list(groups.items()):
        if not g.inferred:
            continue
        name, desc = names.get(gid, (g.name, g.desc))
        members = g.ranks
        if layout is not None and desc in GROUP_KINDS and members:
            candidate = tuple(layout.group_of(desc, members[0]))
            if set(members) <= set(candidate):
                members = candidate
        groups[gid] = dataclasses.replace(g, name=name, desc=desc, ranks=members)
        labels.append(groups[gid].label)
    return labels
