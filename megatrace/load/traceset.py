"""The loaded trace as data: per-record columns, per-rank facts, groups, node facts and input problems.

:mod:`megatrace.load` builds a :class:`TraceSet`; analyzers read it and never open files.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from megatrace.config import Layout
from megatrace.errors import MegatraceError

if TYPE_CHECKING:
    from megatrace.trace.init_marker import InitMarker

MAX_LISTED = 12  # ranks or files named in one problem message before "and N more"
HOST_BACKENDS = {"gloo", "mpi"}  # process-group backends that move host memory: no GPU is involved
DEVICE_FLAG = 4  # ring_format.Flag.DEVICE: the call's tensor lived on an accelerator
UNNAMED_DESCS = ("", "undefined")  # torch's description of a group created without one


class TraceLoadError(MegatraceError):
    """The directory is not a trace (or nothing in it is readable); the message names the directory."""


@dataclass(frozen=True)
class LoadProblem:
    """Something wrong with the input; analysis went on with what was usable."""

    severity: str  # "error" (data excluded or contradictory), "warning" (incomplete), "info"
    code: str  # missing-ranks, mixed-jobs, duplicate-rank, empty-ring, unreadable-ring, ring-damage, ...
    message: str
    ranks: tuple[int, ...] = ()
    paths: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"[{self.severity}] {self.message}"


@dataclass(frozen=True)
class RankInfo:
    """One rank's ring header facts."""

    rank: int
    host: str
    local_rank: int  # the GPU index on GPU nodes; -1 if unknown
    pid: int
    path: str
    job_id: str
    step_id: str
    closed_cleanly: bool  # the tracer shut down (process exited normally)
    n_records: int
    dropped: int  # oldest records overwritten because the ring wrapped
    lost: int  # records in the window that could not be read
    anchor_wall_ns: int
    anchor_mono_ns: int
    unread: int = 0  # older records left in the ring, not loaded (a tail-only load: ``TraceSet.tail``)
    ended_early: bool = False  # its records stop before its part of the job did (an imported log that lost its
    #                            later dumps): calls of others after its last record are unobserved on it, and its
    #                            silence after it is no stop
    heartbeat_ns: int = 0  # the tracer's last heartbeat (CLOCK_MONOTONIC of its host); 0: none (liveness.py)
    pulse_ns: int = 0  # the C writer's last native pulse (same clock); 0: none
    signal_ns: int = 0  # when a SIGTERM reached its process (same clock): ended from outside; 0: none did


@dataclass(frozen=True)
class GroupInfo:
    """A process group: id, names and global member ranks."""

    gid: int
    name: str
    desc: str  # "tp", "pp", "dp", "default_pg", ... ("" if unknown)
    ranks: tuple[int, ...]
    backend: str = ""
    inferred: bool = False  # members guessed from who used the group (no meta line seen)
    assigned: bool = False  # its calls were assigned to it by inference (no communicator id in the input): calls
    #                         of other communicators may be among them, so a disagreement is no proven mismatch

    @property
    def named(self) -> bool:
        """The group has a description of its own (torch calls an undescribed one "undefined")."""
        return self.desc not in UNNAMED_DESCS

    @property
    def dim(self) -> str:
        """The parallel dimension the description names: ``tp`` for "tp" and for a DeviceMesh's "mesh_tp"."""
        return self.desc.removeprefix("mesh_")

    @property
    def kind(self) -> str:
        """A short name: the description (tp, pp, dp, world), else the group's members."""
        if self.desc == "default_pg":
            return "world"
        return self.desc if self.named else f"group {rank_list(self.ranks)}"

    @property
    def label(self) -> str:
        """E.g. ``tp group [2, 3]``, or ``group [0, 1]`` for a group without a description."""
        return f"{self.kind} group {rank_list(self.ranks)}" if self.named else self.kind

    def to_dict(self) -> dict:
        return {"gid": self.gid, "name": self.name, "desc": self.desc, "ranks": list(self.ranks),
                "inferred": self.inferred, "assigned": self.assigned}


@dataclass(frozen=True)
class ProcFact:
    """What the launcher or collector saw of one rank's process."""

    rank: int
    pid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    killed_by_launcher: bool = False
    alive: bool | None = None  # what the collector saw of the process (None: not looked at)
    state: str | None = None  # e.g. "sleeping"
    wchan: str | None = None  # the kernel function it waits in
    node: str | None = None  # where the collector saw it
    stack: tuple[str, ...] = ()  # innermost frames of its main thread (py-spy, when the collector had it)

    @property
    def crashed(self) -> bool:
        """Exited non-zero or by a signal that the launcher did not send."""
        if self.killed_by_launcher:
            return False
        return (self.exit_code is not None and self.exit_code != 0) or self.signal is not None

    def describe(self) -> str:
        if self.signal is not None:
            how = f"was killed by {self.signal}"
        elif self.exit_code is not None:
            how = f"exited with status {self.exit_code}"
        else:
            how = "was still running"
        return how + (" (sent by the launcher)" if self.killed_by_launcher else "")


@dataclass(frozen=True)
class ProcessProbe:
    """What this host's process table said of the open rings' writers, and when (this host's monotonic clock)."""

    host: str
    mono_ns: int
    states: dict[int, str] = field(default_factory=dict)  # rank -> RUNNING / STOPPED / ENDING / GONE



@dataclass
class NodeFacts:
    """Facts from outside the rings (``procs.json``, this host's process table, the nodes' rendezvous lookups)."""

    procs: dict[int, ProcFact] = field(default_factory=dict)
    outcome: str | None = None  # the launcher's own summary, e.g. "stalled"
    message: str | None = None
    probe: ProcessProbe | None = None  # this host's process table, for rings still open (load/probe.py)
    notes: dict[int, str] = field(default_factory=dict)  # rank -> what an importer's input says of its stop
    # endpoint -> node -> its collector's lookup of the rendezvous address (load/markers.py; start markers only)
    rendezvous: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)


class CountedSeq:
    """A ``seq`` column in which every run of rows (a rank's, as loaded) counts up by one from its first row: a
    ring that lost no record in between, the usual case. Held as each run's first number (4 bytes a record less,
    0.1 GiB at 16,384 ranks); reading rows gives an array, as the column would."""

    def __init__(self, run_starts: np.ndarray, first: np.ndarray, dtype: np.dtype) -> None:
        self._starts = run_starts  # int64, the runs' first rows and the end
        self._base = first.astype(np.int64) - run_starts[:-1]  # seq = base[run] + row
        self.dtype = np.dtype(dtype)

    @classmethod
    def of(cls, seq: np.ndarray, run_starts: np.ndarray, chunk: int = 1 << 20) -> CountedSeq | None:
        """``seq`` kept this way when every run (rows ``run_starts[i]:run_starts[i + 1]``) counts up by one, else
        None (a lost record, a reordered ring): one pass of chunks."""
        n = len(seq)
        starts = np.asarray(run_starts, np.int64)
        if not n or int(starts[-1]) != n:
            return None
        inner = np.zeros(n + 1, bool)  # rows whose step from the row before must be one
        inner[1:n] = True
        inner[starts] = False
        for lo in range(0, n - 1, chunk):
            hi = min(n - 1, lo + chunk)
            if ((seq[lo + 1:hi + 1] - seq[lo:hi] != 1) & inner[lo + 1:hi + 1]).any():
                return None
        first = np.zeros(len(starts) - 1, np.int64)
        present = starts[:-1] < starts[1:]
        first[present] = seq[starts[:-1][present]]
        return cls(starts, first, seq.dtype)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, rows: Any) -> Any:
        n = len(self)
        if isinstance(rows, slice) and rows.indices(n)[2] == 1:  # (a range of rows: one run after another)
            lo, hi, _ = rows.indices(n)
            sl = slice(lo, max(lo, hi))
            return (per_row(self._base, self._starts, sl) + np.arange(sl.start, sl.stop)).astype(self.dtype)
        idx = np.arange(n)[rows] if isinstance(rows, slice) else np.asarray(rows)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        idx = np.where(idx < 0, idx + n, idx)
        if ((idx < 0) | (idx >= n)).any():
            raise IndexError(f"row out of range for {n} records")
        run = np.searchsorted(self._starts, idx, side="right") - 1
        return (self._base[run] + idx).astype(self.dtype)[()]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def tolist(self) -> list[int]:
        return self[:].tolist()


@dataclass
class Records:
    """All ranks' records as columns (one row per record, ranks contiguous, each in seq order)."""

    rank: np.ndarray  # global rank: int32, or int16 when every rank fits (rings.RecordColumns)
    seq: np.ndarray | CountedSeq  # per-rank sequence; int64, or int32 when every value fits (rings.RecordColumns); a
    #                               CountedSeq where every rank's count up by one (a full load: rings.RecordColumns)
    group_seq: np.ndarray  # int64 or int32 (as seq)
    t_enqueue: np.ndarray  # int64, CLOCK_MONOTONIC of the writing host
    t_complete: np.ndarray  # int64, 0 = no completion recorded
    nbytes: np.ndarray  # int64 or int32 (as seq)
    group_id: np.ndarray  # uint32
    peer: np.ndarray  # int32, or int16 when every value fits (rings.RecordColumns)
    op: np.ndarray  # uint16, or uint8 when every value fits
    dtype: np.ndarray  # uint8
    flags: np.ndarray  # uint8
    state: np.ndarray  # uint8 (ring_format.State)

    def __len__(self) -> int:
        return len(self.rank)


# Column name -> dtype (the RECORD_DTYPE field read for it has the same name).
COLUMNS: dict[str, str] = {"rank": "<i4", "seq": "<i8", "group_seq": "<i8", "t_enqueue": "<i8",
                           "t_complete": "<i8", "nbytes": "<i8", "group_id": "<u4", "peer": "<i4",
                           "op": "<u2", "dtype": "u1", "flags": "u1", "state": "u1"}
assert set(COLUMNS) == {f.name for f in fields(Records)}


@dataclass
class TraceSet:
    """A loaded trace: columns over all ranks plus per-rank, per-group and node facts."""

    path: Path
    job_id: str
    world_size: int
    ranks: np.ndarray  # present ranks, ascending (int64)
    rank_info: list[RankInfo]  # aligned with ``ranks``
    starts: np.ndarray  # rows of ranks[i] are starts[i]:starts[i+1]
    records: Records
    groups: dict[int, GroupInfo]
    layout: Layout | None
    facts: NodeFacts
    problems: list[LoadProblem]
    missing_ranks: tuple[int, ...]
    time_base: str = "monotonic"  # "aligned" once clock alignment rewrote the time columns in place
    tail: int | None = None  # None: every record; K: only each rank's newest K records were loaded
    #                          (more for ranks whose tail had to be extended); see ``RankInfo.unread``
    # each loaded rank's meta entries, as read (read-only: a line written by many ranks is one dict)
    meta: dict[int, list[dict]] = field(default_factory=dict)
    source_format: str = "rings"  # the format it was read from: "rings" or an importer's ("flight-recorder", ...)
    world_source: str = "ring headers (torch.distributed world size)"  # where world_size came from
    init_markers: dict[int, InitMarker] = field(default_factory=dict)  # rank -> start marker (load/markers.py)
    completion_times: str = "observed"  # "arrivals": an imported format whose calls complete, as far as it
    #   knows, at their instance's last arrival (stragglers are judged call by call, no critical path);
    #   "inferred": coarser estimates, no timing stage runs on it; "order": no times at all, only the order of
    #   calls (a job log): the same, and the findings say nothing of durations (docs/importers.md)

    def __post_init__(self) -> None:
        self._pos = {int(r): i for i, r in enumerate(self.ranks)}

    @property
    def imported(self) -> str:
        """The foreign format it was imported from (:attr:`source_format`); "" for ring files."""
        return "" if self.source_format == "rings" else self.source_format

    @property
    def coverage(self) -> float:
        """Fraction of the world's ranks whose ring was loaded."""
        return len(self.ranks) / self.world_size if self.world_size else 0.0

    @property
    def hosts(self) -> list[str]:
        return sorted({i.host for i in self.rank_info})

    def has(self, rank: int) -> bool:
        return rank in self._pos

    def pos(self, rank: int) -> int:
        """Index of ``rank`` in :attr:`ranks` (KeyError if absent)."""
        return self._pos[rank]

    def info(self, rank: int) -> RankInfo | None:
        i = self._pos.get(rank)
        return None if i is None else self.rank_info[i]

    def rows(self, rank: int) -> slice:
        """Row range of ``rank`` in :attr:`records` (empty if absent)."""
        i = self._pos.get(rank)
        return slice(0, 0) if i is None else slice(int(self.starts[i]), int(self.starts[i + 1]))

    def host_of(self, rank: int) -> str | None:
        info = self.info(rank)
        if info is not None and info.host:
            return info.host
        if self.layout is not None and rank in self.layout.ranks:
            return self.layout.ranks[rank].host or None
        return None

    @property
    def cpu_only(self) -> bool:
        """Every group's backend is known and runs on host memory (gloo, mpi) and no call was on a device."""
        if not hasattr(self, "_cpu_only"):
            backends = {g.backend.split(":")[0] for g in self.groups.values()}
            on_device = bool(len(self.records)) and bool((self.records.flags & DEVICE_FLAG).any())
            self._cpu_only = bool(backends) and backends <= HOST_BACKENDS and not on_device
        return self._cpu_only

    def gpu_of(self, rank: int) -> int | None:
        """The GPU a rank used (its local rank on a GPU node); None for a CPU-only job or when unknown."""
        return None if self.cpu_only else self.local_rank_of(rank)

    def local_rank_of(self, rank: int) -> int | None:
        info = self.info(rank)
        if info is not None and info.local_rank >= 0:
            return info.local_rank
        if self.layout is not None and rank in self.layout.ranks:
            return self.layout.ranks[rank].local_rank
        return None

    def group_label(self, gid: int) -> str:
        g = self.groups.get(gid)
        return g.label if g is not None else f"group {gid}"


def per_row(values: np.ndarray, starts: np.ndarray, sl: slice) -> np.ndarray:
    """For rows ``sl`` (a forward range) of runs ``starts`` (run ``i``: rows ``starts[i]:starts[i + 1]``), each
    row's run's value, ``values[i]``: the runs' values repeated, no index array built."""
    lo, hi = sl.start, max(sl.start, sl.stop)
    r0 = int(np.searchsorted(starts, lo, side="right")) - 1
    r1 = int(np.searchsorted(starts, max(hi - 1, lo), side="right")) - 1
    bounds = np.clip(starts[r0:r1 + 2], lo, hi)
    return np.repeat(values[r0:r1 + 1], np.diff(bounds))


def rank_spans(starts: np.ndarray, max_rows: int) -> Iterator[tuple[int, int]]:
    """Ranges ``[i0, i1)`` of rank positions whose rows (rank ``i``: ``starts[i]:starts[i + 1]``) span at most
    about ``max_rows`` rows (a single larger rank alone): whole ranks at a time, temporaries bounded."""
    n = len(starts) - 1
    i0 = 0
    while i0 < n:
        i1 = int(np.searchsorted(starts, starts[i0] + max_rows, side="right")) - 1
        i1 = min(max(i1, i0 + 1), n)
        yield i0, i1
        i0 = i1


def rank_list(ranks: tuple[int, ...] | list[int], limit: int = MAX_LISTED) -> str:
    ranks = list(ranks)
    if len(ranks) <= limit:
        return "[" + ", ".join(map(str, ranks)) + "]"
    return "[" + ", ".join(map(str, ranks[:limit])) + f", … {len(ranks) - limit} more]"


def plural(n: int, word: str) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def name_list(items: list[str], limit: int = MAX_LISTED) -> str:
    if len(items) <= limit:
        return ", ".join(items)
    return ", ".join(items[:limit]) + f" and {len(items) - limit} more"
