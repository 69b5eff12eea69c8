"""Ring files into record columns: every record of each chosen ring, or each ring's newest records (tails).

Records of all ranks are concatenated column by column (numpy), rank after rank, each rank's rows in
``seq`` order: no Python object per record. Tails are read with one vectorised validation pass
(:func:`ring_reader.read_tails`), batch by batch, meta files read ahead beside them;
:func:`extend_tails` reads further back for the few ranks whose tail turns out too short.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from megatrace.files import read_input
from megatrace.load.discovery import RING_RE
from megatrace.load.prefault import populate_in_background
from megatrace.load.traceset import (COLUMNS, CountedSeq, LoadProblem, RankInfo, Records, TraceSet, name_list, plural,
                                     rank_list, rank_spans)
from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_reader import (META_LIMIT, RECORD_DTYPE, ReadProblem, RingFormatError, RingHeader,
                                         RingSnapshot, read_meta, read_ring, read_tails)
from megatrace.trace.ring_io import read_files
from megatrace.trace.ring_records import NARROWED, native_split, split_records
from megatrace.trace.tail_pack import PackedFile

@dataclass
class RankRead:
    """What was read for one rank, as the :class:`Tally` counts it."""

    info: RankInfo
    meta_found: bool
    meta_problems: list[str]
    damage: str


def known_gids(entries: list[dict]) -> list[int]:
    """Group ids a rank's meta file declares."""
    return [e["gid"] for e in entries if e.get("kind") == "group" and isinstance(e.get("gid"), int)
            and 0 <= e["gid"] < 1 << 32]


def _meta_path_str(path: str, rank: int | None) -> str:
    """The meta file beside ring file ``path``: of ``rank`` (its header's; None: the rank its name gives), or of the
    same name for a ring not named rank-N.ring (built as strings: thousands of ranks)."""
    where, name = os.path.split(path)
    named = RING_RE.match(name)
    if named is None:
        return os.path.splitext(path)[0] + ".meta.jsonl"
    return os.path.join(where, fmt.meta_name(int(named.group(1)) if rank is None else rank))


def damage(snap: RingSnapshot) -> str:
    if any(p.severity == "error" for p in snap.problems) or snap.lost:
        return str(snap.problems[0]) if snap.problems else f"{snap.lost} records lost"
    return ""


def _rank_info(rank: int, path: str, snap: RingSnapshot, n_records: int) -> RankInfo:
    """What the loaded trace keeps of one rank's ring (``n_records`` of its records loaded)."""
    h = snap.header
    return RankInfo(rank, h.host, h.local_rank, h.pid, path, h.job_id, h.step_id, h.closed_cleanly, n_records,
                    snap.overwritten, snap.lost, h.anchor_wall_ns, h.anchor_mono_ns, snap.dropped - snap.overwritten,
                    heartbeat_ns=h.heartbeat_ns, pulse_ns=h.pulse_ns, signal_ns=h.signal_ns)


@dataclass
class Tally:
    """Per-rank reading problems, reported as one problem per kind."""

    unreadable: list[str] = field(default_factory=list)
    empty: list[int] = field(default_factory=list)
    no_meta: list[int] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    bad_meta: list[str] = field(default_factory=list)
    wrapped: list[int] = field(default_factory=list)

    def add(self, got: RankRead) -> None:
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


_I16 = 1 << 15


class RecordColumns:
    """Preallocated record columns, appended to rank by rank (grown if a live ring outgrew its header).

    The columns of :data:`~megatrace.trace.ring_records.NARROWED` have its narrower dtypes while every value
    appended fits (the usual case: sequence numbers and message sizes below 2**31, in int32; peers below 2**15,
    in int16; op codes below 256, in uint8), each widened to its field's dtype by the first block of records that
    does not: 15 bytes less a record, at 16,384 ranks 0.43 GiB. So is ``rank`` int16 while every rank is below
    2**15 (widened to int32 by the first that is not): 2 bytes more.
    """

    def __init__(self, capacity: int) -> None:
        self.data = {name: np.empty(max(capacity, 0), np.int16 if name == "rank" else NARROWED.get(name, dt))
                     for name, dt in COLUMNS.items()}
        self.n = 0
        self.runs = [0]  # where each appended rank's rows start (then the end)

    def append(self, rank: int, recs: np.ndarray) -> None:
        self.extend([rank], [recs])

    def extend(self, ranks: list[int], parts: list[np.ndarray]) -> None:
        """Append the rows ``parts[k]`` (records with every column but ``rank``, one dtype) of ``ranks[k]``: one pass of
        C per part, or without the extension one copy per column of the whole batch (thousands of small copies
        cost more than the bytes)."""
        counts = [len(p) for p in parts]
        end = self.n + sum(counts)
        if end > len(self.data["rank"]):
            self.data = {name: _grown(col, self.n, max(end, 2 * len(col))) for name, col in self.data.items()}
        if end > self.n and native_split() and parts[0].dtype == RECORD_DTYPE and end - self.n >= 1024 * len(parts):
            at = self.n  # (whole rings: one pass of C per part; tails are joined first, one call per batch)
            for part in parts:
                self._copy(part, at)
                at += len(part)
        elif end > self.n:
            # (joined as plain bytes: numpy's concatenate of records compares their fields' dtypes, one by one)
            joined = np.concatenate([np.ascontiguousarray(p).view(np.uint8) for p in parts]).view(parts[0].dtype) \
                if len(parts) > 1 else parts[0]
            self._copy(joined, self.n)
        if end > self.n:
            column = self.data["rank"]
            if column.dtype == np.int16 and not all(-_I16 <= r < _I16 for r in ranks):
                column = self.data["rank"] = column.astype(np.int32)
            column[self.n:end] = np.repeat(np.array(ranks, column.dtype), counts)
        self.runs += np.cumsum([self.n, *counts])[1:].tolist()
        self.n = end

    def _copy(self, recs: np.ndarray, at: int) -> None:
        """Copy the fields of ``recs`` into the columns from row ``at`` (all but ``rank``), widening a narrow column
        that a value does not fit first.

        Block by block: each block of records stays in cache while its fields are checked and picked out (in one
        pass of C when the extension is built, else field by field).
        """
        for lo in range(0, len(recs), _COPY_BLOCK):
            part = recs[lo:lo + _COPY_BLOCK]
            wide = split_records(part, self.data, at + lo)
            while wide:  # (a value that a narrowed column does not fit: widen it, copy the block again)
                for name in wide:
                    self.data[name] = self.data[name].astype(COLUMNS[name])
                wide = split_records(part, self.data, at + lo)
            if wide is not None:
                continue
            for name in NARROWED:
                col, v = self.data[name], part[name]
                fits = np.iinfo(col.dtype)
                if col.dtype != COLUMNS[name] and len(v) and (v.max() > fits.max or v.min() < fits.min):
                    self.data[name] = col.astype(COLUMNS[name])
            for name, col in self.data.items():
                if name != "rank":
                    col[at + lo:at + lo + len(part)] = part[name]

    def filled(self) -> dict[str, np.ndarray]:
        """The columns' rows appended so far (views)."""
        return {name: col[:self.n] for name, col in self.data.items()}

    def finish(self) -> Records:
        """The columns as records; ``seq`` as a :class:`CountedSeq` where every rank's count up by one (its column,
        4 or 8 bytes a record, freed)."""
        size = len(self.data["rank"])
        counted = CountedSeq.of(self.data["seq"][:self.n], np.array(self.runs, np.int64))
        cols = {name: counted if name == "seq" and counted is not None else
                col[:self.n] if self.n >= 0.9 * size else col[:self.n].copy()
                for name, col in self.data.items()}
        self.data = {}
        return Records(**cols)




Loaded = tuple[Records, list[RankInfo], dict[int, list[dict]], dict[int, set[int]]]


FULL_BATCH = 32  # rings whose records are copied into the columns together (about 4 MiB of records at 2,048 each)


def load_all(chosen: dict[int, str], headers: dict[str, RingHeader], tally: Tally) -> Loaded:
    """Every record of the chosen rings, rank by rank, and their meta files."""
    # Columns are filled in place, sized from the headers (at most capacity, at most write_counter + 1
    # records per ring): many small per-rank arrays would fragment the heap and double the peak memory.
    columns = RecordColumns(sum(min(headers[p].write_counter + 1, headers[p].capacity) for p in chosen.values()))
    populate_in_background(columns.data.values())  # (their pages faulted in on another core while rings are read)
    read: list[tuple[RankInfo, str]] = []
    meta_paths: list[str] = []
    meta_data: list[bytes | None] = []
    ranks: list[int] = []
    parts: list[np.ndarray] = []
    # Sequential on purpose: read_ring is bound by the interpreter, threads measured no faster.
    for rank, path in sorted(chosen.items()):
        try:
            snap = read_ring(path)
        except (RingFormatError, OSError) as exc:
            tally.unreadable.append(str(exc))
            continue
        read.append((_rank_info(rank, path, snap, len(snap.records)), damage(snap)))
        ranks.append(rank)
        parts.append(snap.records)
        if len(parts) == FULL_BATCH:
            columns.extend(ranks, parts)
            ranks, parts = [], []
        meta_paths.append(_meta_path_str(path, rank))
        try:
            meta_data.append(_read_file(meta_paths[-1]))
        except OSError:
            meta_data.append(None)  # read_meta says why, later
    columns.extend(ranks, parts)
    return _with_metas(columns.finish(), read, meta_paths, meta_data, tally)


def _with_metas(records: Records, read: list[tuple[RankInfo, str]], meta_paths: list[str],
                meta_data: list[bytes | None], tally: Tally) -> Loaded:
    """The loaded ranks (``read``: each one's info and damage, in the order of its rows) with their meta files
    (their paths and bytes) parsed together, counted in ``tally``, and the groups used in records undeclared."""
    metas: dict[int, list[dict]] = {}
    for (info, harm), (entries, problems, found) in zip(read, _read_metas(meta_paths, meta_data), strict=True):
        metas[info.rank] = entries
        tally.add(RankRead(info, found, [str(p) for p in problems if p.severity == "error"], harm))
    infos = [info for info, _ in read]
    return records, infos, metas, _unknown_groups(records, np.array([i.n_records for i in infos]), metas)


_COPY_BLOCK = 1 << 15  # records (2 MB) per block when picking fields out of records
TAIL_BATCH = 128  # rings per read_tails call: ~2 MB of buffers at K=128, bounded whatever the trace's size
_NO_RECORDS = np.empty(0, RECORD_DTYPE)


@dataclass
class TailColumns:
    """The tails of every readable ring file, as columns, file after file."""

    columns: dict[str, np.ndarray]
    rows: dict[str, tuple[int, int]]  # file -> (first row, count)
    snaps: dict[str, RingSnapshot]  # what was read, without the records (they are in ``columns``)
    metas: dict[str, bytes | None]  # the meta file's bytes (None: unreadable, read_meta will say why)
    meta_paths: dict[str, str]  # which meta file that is (by the rank in the ring's header)


def _packed_meta(pack: Mapping[str, PackedFile] | None, meta: str) -> bytes | None:
    entry = pack.get(os.path.basename(meta)) if pack else None
    return bytes(entry.body) if entry is not None and not entry.first else None


def _read_batch(batch: list[str], tail: int,
                pack: Mapping[str, PackedFile] | None = None) -> tuple[list, list[bytes | None], list[str]]:
    """The tails of ``batch`` (``read_tails``), the bytes of their meta files and those files' paths.

    The rank in the ring header decides which meta file is read (the one named by the ring's rank, usually); the
    meta files are read together in one pass of C (``ring_io.read_files``), a file that pass leaves through
    ``files.open_input``. What the tails ``pack`` holds is taken from it, not read.
    """
    snaps = read_tails(batch, tail, pack=pack)
    meta_paths = [_meta_path_str(path, got.header.rank if isinstance(got, RingSnapshot) else None)
                  for path, got in zip(batch, snaps, strict=True)]
    metas: list[bytes | None] = [_packed_meta(pack, meta) if isinstance(got, RingSnapshot) else None
                                 for got, meta in zip(snaps, meta_paths, strict=True)]
    wanted = [k for k, got in enumerate(snaps) if isinstance(got, RingSnapshot) and metas[k] is None]
    for k, data in zip(wanted, read_files([meta_paths[k] for k in wanted], META_LIMIT), strict=True):
        if data is None:
            try:
                data = _read_file(meta_paths[k])
            except OSError:
                pass  # read_meta says why, later
        metas[k] = data
    return snaps, metas, meta_paths


def read_tail_columns(files: list[str], tail: int, unreadable: list[str],
                      pack: Mapping[str, PackedFile] | None = None) -> TailColumns:
    """Every ring's tail and meta file, batch by batch (from the tails ``pack`` where it holds them), copied into
    the columns."""
    # Sized for every file's whole tail (pages never written cost nothing); grown if a huge ``tail`` was asked.
    columns = RecordColumns(len(files) * min(tail, 4096))
    rows: dict[str, tuple[int, int]] = {}
    snaps: dict[str, RingSnapshot] = {}
    metas: dict[str, bytes | None] = {}
    meta_paths: dict[str, str] = {}
    for lo in range(0, len(files), TAIL_BATCH):
        batch = files[lo:lo + TAIL_BATCH]
        got_snaps, got_metas, got_paths = _read_batch(batch, tail, pack)
        parts: list[np.ndarray] = []
        ranks: list[int] = []
        at = columns.n
        for path, got, meta, meta_path in zip(batch, got_snaps, got_metas, got_paths, strict=True):
            if not isinstance(got, RingSnapshot):
                unreadable.append(str(got))
                continue
            parts.append(got.records)
            rows[path] = (at, len(got.records))
            at += len(got.records)
            ranks.append(got.header.rank)
            got.records = _NO_RECORDS  # (no reference to read_tails' buffer once copied)
            snaps[path] = got
            metas[path] = meta
            meta_paths[path] = meta_path
        columns.extend(ranks, parts)
    return TailColumns(columns.filled(), rows, snaps, metas, meta_paths)


def _grown(col: np.ndarray, used: int, size: int) -> np.ndarray:
    out = np.empty(size, col.dtype)
    out[:used] = col[:used]
    return out


def _read_metas(paths: list[str], data: list[bytes | None]) -> list[tuple[list[dict], list[ReadProblem], bool]]:
    """``read_meta`` of many meta files, given their bytes: (entries, problems, file exists) each.

    Well-formed files (complete lines, each a JSON object with a "kind") are parsed together, each
    distinct line once (the members of a group all write the same group line) with one
    ``json.loads``; ranks that wrote the same line share its entry (read-only, as every meta entry is: 16,384
    ranks' copies cost 0.08 s of a quick analysis). Any other file is read
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
            out.append(([parsed[i] for i in ids], [], True))
        else:
            entries, problems = read_meta(path)
            out.append((entries, problems, os.path.exists(path)))
    return out


def _read_file(path: str) -> bytes:
    """A meta file's bytes (``os.read`` on a descriptor: half the cost of ``open().read()``)."""
    return read_input(path, META_LIMIT)


def _json_or_none(line: bytes) -> object:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # read_meta reports the line
        return None


def load_tails(chosen: dict[int, str], tails: TailColumns, tally: Tally) -> Loaded:
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
    read = [(_rank_info(rank, path, tails.snaps[path], tails.rows[path][1]), damage(tails.snaps[path]))
            for rank, path in order]
    return _with_metas(records, read, [tails.meta_paths[path] for _, path in order],
                       [tails.metas[path] for _, path in order], tally)


_UNKNOWN_ROWS = 1 << 20  # rows per pass when looking for undeclared groups


def _unknown_groups(records: Records, counts: np.ndarray, metas: dict[int, list[dict]]) -> dict[int, set[int]]:
    """Group id -> ranks that used it in records without declaring it in their own meta (all ranks at once).

    ``counts``: rows per rank, ranks in the order of ``metas``. A rank declares a handful of groups:
    they are compared column by column (the j-th declared group of every rank at once), no sort.
    """
    known = [known_gids(entries) for entries in metas.values()]
    width = max((len(k) for k in known), default=0)
    if width <= 32:
        columns = [np.array([k[j] if j < len(k) else -1 for k in known], dtype=np.int64) for j in range(width)]
        bounds = np.r_[0, np.cumsum(counts)]
        parts = []
        for i0, i1 in rank_spans(bounds, _UNKNOWN_ROWS):
            lo, hi = int(bounds[i0]), int(bounds[i1])
            gid = records.group_id[lo:hi]
            declared = np.zeros(hi - lo, bool)
            for column in columns:
                declared |= gid == np.repeat(column[i0:i1], counts[i0:i1])
            left = lo + np.flatnonzero((records.op[lo:hi] < fmt.Op.MARK_STEP) & ~declared)
            parts.append((records.rank[left].astype(np.int64) << 32) | records.group_id[left].astype(np.int64))
        keys = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    else:  # some rank declares many groups: a sorted membership test
        keyed = records.op < fmt.Op.MARK_STEP
        keys = (records.rank[keyed].astype(np.int64) << 32) | records.group_id[keyed].astype(np.int64)
        flat = np.array([(rank << 32) | gid for rank, k in zip(metas, known) for gid in k], dtype=np.int64)
        keys = keys[~np.isin(keys, flat)]
    used: dict[int, set[int]] = {}
    left = np.unique(keys)
    for rank, gid in zip((left >> 32).tolist(), (left & 0xFFFFFFFF).tolist(), strict=True):
        used.setdefault(gid, set()).add(rank)
    return used



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
        harm = damage(snap)
        if harm and not info.lost:
            problems.append(LoadProblem("warning", "ring-damage", f"rank {r}: {harm} (read further back for the "
                                        "hang analysis; kept the rest)", ranks=(r,), paths=(info.path,)))
    for name in COLUMNS:
        cols[name].append(getattr(rec, name)[prev:])
    records = Records(**{name: np.concatenate(parts) for name, parts in cols.items()})
    starts = np.concatenate([[0], np.cumsum([i.n_records for i in infos])]).astype(np.int64)
    return dataclasses.replace(trace, records=records, rank_info=infos, starts=starts, problems=problems)
