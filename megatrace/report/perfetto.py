"""Chrome / Perfetto traces (JSON trace-event format), loadable in ui.perfetto.dev and chrome://tracing.

Two exports:

* :func:`write_trace_file` (``megatrace export DIR --perfetto -o trace.json``, through
  :func:`megatrace.pipeline.export_trace`, which loads the trace and aligns its clocks): **every record** of a
  trace of any format (rings or an imported one), streamed to the file as it is formatted. One process per rank
  (pid = rank + 1: Perfetto reserves pid 0 and tid 0; the process is named ``rank R (host, GPU g)``), its
  threads are lanes: one per group and kind (collectives, send/recv) and, where calls of one lane overlap,
  more lanes, so that within one thread no two slices overlap (Perfetto needs slices on a thread to nest).
  Each operation is a complete event ("X"), times in µs (sub-µs as decimals) from ``otherData.t0_ns``
  (aligned wall clock, ns since the epoch); a call that never completed lasts until the end of the trace,
  is named ``... (never completed)`` and has ``args.state`` saying so; a call whose completion time is
  unknown is a zero-length slice. Step and phase markers are instant events ("i") on a lane of their own.
  Flows (v1 "s"/"t"/"f" events, ``bp: "e"``) join the members of each collective instance in the order
  they arrived (one flow id per instance), and each send to its matching recv.
* :func:`trace_events` (the report's ``trace.json``): the incident window of ``findings.json`` only
  (each rank's last operations, as the HTML report draws them): one process per host, a thread per rank
  (and more for a rank's overlapping calls), no flows.
"""

from __future__ import annotations

import gzip
import heapq
import io
import json
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np

from megatrace.errors import MegatraceError
from megatrace.files import atomic_output
from megatrace.names import unknown_op_name
from megatrace.trace.ring_format import Dtype, Flag, Op, Phase, State


def trace_events(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The trace-event document of the exported timeline, or None when the analysis exported none."""
    report = (doc.get("analysis") or {}).get("report") or {}
    tl = report.get("timeline")
    if not tl or not tl.get("rank"):
        return None
    ranks = report.get("ranks") or {}
    hosts, host_col = ranks.get("hosts") or [], ranks.get("host") or []
    end_us = int(tl.get("end_us") or 0)
    events: list[dict[str, Any]] = []
    pids: dict[int, int] = {}

    def pid_of(rank: int) -> int:
        return (host_col[rank] + 1) if 0 <= rank < len(host_col) and host_col[rank] >= 0 else 0

    # a rank's overlapping calls (e.g. batched send and recv) go to more threads of it: slices must nest
    start = np.asarray(tl["start_us"], np.int64)
    dur_col = np.asarray(tl["dur_us"], np.int64)
    stop = np.where(dur_col >= 0, start + dur_col, np.maximum(end_us, start))
    rank_col = np.asarray(tl["rank"], np.int64)
    lane = assign_lanes(rank_col, np.zeros(len(rank_col), np.int64), start, stop).tolist()
    extra: dict[tuple[int, int], int] = {}  # (rank, lane > 0) -> tid, after every rank's own tid
    for rank, ln in sorted({(r, ln) for r, ln in zip(tl["rank"], lane, strict=True) if ln}):
        extra[(rank, ln)] = int(rank_col.max()) + 1 + len(extra)

    for i, rank in enumerate(tl["rank"]):
        g = tl["groups"][tl["group"][i]]
        name = tl["ops"][tl["op"][i]]
        kind = g["kind"].upper() if g["kind"] in ("tp", "pp", "dp") else g["kind"]
        dur = tl["dur_us"][i]
        pid = pid_of(rank)
        pids.setdefault(pid, rank)
        args = {"group": g["label"], "seq": tl["seq"][i], "bytes": tl["bytes"][i],
                "state": tl.get("states", {}).get(str(tl["state"][i]), tl["state"][i])}
        if tl["peer"][i] >= 0:
            args["peer"] = tl["peer"][i]
        events.append({"name": f"{kind} {name} #{tl['seq'][i]}" + (" (never completed)" if dur < 0 else ""),
                       "cat": g["kind"], "ph": "X", "ts": tl["start_us"][i], "pid": pid,
                       "tid": extra[(rank, lane[i])] if lane[i] else rank,
                       "dur": dur if dur >= 0 else max(0, end_us - tl["start_us"][i]), "args": args})
    meta: list[dict[str, Any]] = []
    for pid in sorted(pids):
        meta.append({"name": "process_name", "ph": "M", "pid": pid,
                     "args": {"name": hosts[pid - 1] if 0 < pid <= len(hosts) else "unknown host"}})
    for rank in sorted(set(tl["rank"])):
        meta.append({"name": "thread_name", "ph": "M", "pid": pid_of(rank), "tid": rank,
                     "args": {"name": f"rank {rank}"}})
    for (rank, ln), tid in extra.items():
        meta.append({"name": "thread_name", "ph": "M", "pid": pid_of(rank), "tid": tid,
                     "args": {"name": f"rank {rank} ({ln + 1})"}})
    if tl.get("incident_us") is not None:
        meta.append({"name": "incident", "ph": "i", "s": "g", "ts": tl["incident_us"], "pid": 0, "tid": 0})
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "metadata": {"t0_ns": tl.get("t0_ns"), "job_id": (doc.get("trace") or {}).get("job_id"),
                         "generator": doc.get("generator")}}


def dumps(trace: dict[str, Any]) -> str:
    return json.dumps(trace, separators=(",", ":"), ensure_ascii=False)


# --------------------------------------------------------------------------------------------------------------
# The full export: every record of the trace, streamed.
# --------------------------------------------------------------------------------------------------------------

PID_BASE = 1  # pid = rank + PID_BASE (Perfetto reserves pid 0 and tid 0 for the idle "swapper")
GZIP_LEVEL = 3  # ``-o trace.json.gz``: a tenth of the size or less, and no slower (less to write)
CHUNK_ROWS = 1 << 15  # records formatted per write: memory stays bounded by the record columns
MARKER_KEY = -1  # lane key of step / phase markers; an operation's key is 2 * (group index + 1) + is_p2p
COLLECTIVE, P2P, MARKER = "collective", "p2p", "marker"
SEND, RECV = int(Op.SEND), int(Op.RECV)
FLOW_START, FLOW_STEP, FLOW_END = 1, 2, 3
_FLOW_PH = {FLOW_START: "s", FLOW_STEP: "t", FLOW_END: "f"}
# Record shapes in the export
DONE = 0  # completed: a slice from the call to its completion
OPEN = 1  # entered, never completed: a slice to the end of the trace, named "(never completed)"
POINT = 2  # no completion time (unknown or not observable): a zero-length slice
FAILED = 3  # the call raised: a slice to its failure (or to the end of the trace when that is unknown)
MARK = 4  # a step / phase marker: an instant event
_NAMED_FLAGS = ((Flag.ASYNC, "async"), (Flag.BATCHED, "batched"), (Flag.DEVICE, "device"),
                (Flag.TENSOR_API, "tensor_api"), (Flag.NO_COMPLETION, "no_completion"))


class _OpText(NamedTuple):
    name: str  # e.g. TP all_reduce (escaped, no quotes)
    cat: str  # collective or p2p
    args: str  # "op":..,"group":..
    dtype_arg: str  # ,"dtype":".." or nothing
    peer_role: int  # 0: none, 1: peer (send/recv), 2: root (broadcast, reduce, gather, scatter)
    flow: str  # the group's label (escaped, no quotes): flows are named "<label> #<seq>"


class ExportError(MegatraceError):
    """The output cannot be written (the message names the path and why)."""


@dataclass
class ExportStats:
    """What one export wrote."""

    path: str = ""
    records: int = 0  # records of the trace (= slices + instants)
    slices: int = 0  # complete events ("X"): one per operation
    instants: int = 0  # instant events ("i"): one per step / phase marker
    incomplete: int = 0  # operations that never completed (slices up to the end of the trace)
    flows: int = 0  # one per collective instance with two or more members, one per matched send/recv
    flow_events: int = 0  # their "s" / "t" / "f" events
    ranks: int = 0  # ranks with records (processes with lanes)
    lanes: int = 0  # threads over all ranks
    events: int = 0  # every event written, metadata included
    bytes: int = 0  # size of the file
    seconds: float = 0.0  # load, match and write


def record_shapes(rec: Any, te: np.ndarray, tc: np.ndarray, end_ns: int) -> tuple[np.ndarray, np.ndarray]:
    """(shape, end of its slice in ns) of every record (shapes: :data:`DONE`, :data:`OPEN`, ...)."""
    timed = (tc > 0) & (tc >= te)
    unobservable = (rec.flags & Flag.NO_COMPLETION) != 0
    state = rec.state
    shape = np.full(len(te), POINT, np.uint8)
    shape[(state == State.COMPLETED) & timed] = DONE
    shape[(state == State.ENQUEUED) & ~unobservable] = OPEN
    shape[state == State.FAILED] = FAILED
    shape[rec.op >= Op.MARK_STEP] = MARK
    end = te.copy()
    closed = (shape == DONE) | ((shape == FAILED) & timed)
    end[closed] = tc[closed]
    hung = (shape == OPEN) | ((shape == FAILED) & ~timed)
    end[hung] = np.maximum(end_ns, te[hung])
    return shape, end


def lane_keys(rec: Any, gidx: np.ndarray) -> np.ndarray:
    """Each record's base lane: its group and kind (collective or send/recv); markers have their own."""
    p2p = ((rec.op == Op.SEND) | (rec.op == Op.RECV)).astype(np.int64)
    key = 2 * (gidx.astype(np.int64) + 1) + p2p
    key[rec.op >= Op.MARK_STEP] = MARKER_KEY
    return key


def assign_lanes(rank: np.ndarray, key: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """A lane per record such that within one (rank, key, lane) no two slices overlap.

    Two slices may touch (one ends where the next starts), unless one of them has no length (or 1 ns): a
    zero-length slice shares no point with another slice of its lane, so that a flow event at its time
    binds to it alone. Sorted by start, a track none of whose slices clashes with the next clashes
    nowhere (each ends before the next starts, hence before all later ones): those tracks, nearly all,
    stay in lane 0 after one vectorised pass. Only tracks with a clash go through interval partitioning
    (each slice to the lowest lane free at its start: the fewest lanes possible), in Python.
    """
    n = len(rank)
    lane = np.zeros(n, np.int32)
    if n < 2:
        return lane
    order = np.lexsort((end, start, key, rank))
    r, k, s, e = rank[order], key[order], start[order], end[order]
    point = e - s <= 1  # (a flow binds at mid-slice: to a 1 ns slice at its start, a point too)
    same = (r[1:] == r[:-1]) & (k[1:] == k[:-1])
    clash = np.flatnonzero(same & ((s[1:] < e[:-1]) | ((s[1:] == e[:-1]) & (point[1:] | point[:-1]))))
    if not len(clash):
        return lane
    track_start = np.concatenate([[0], np.flatnonzero(~same) + 1])
    track_stop = np.concatenate([track_start[1:], [n]])
    for t in np.unique(np.searchsorted(track_start, clash, side="right") - 1).tolist():
        a, b = int(track_start[t]), int(track_stop[t])
        free: list[int] = []
        busy: list[tuple[int, bool, int]] = []  # (end, zero length, lane) of each lane's last slice
        used = 0
        out = np.empty(b - a, np.int32)
        for i, (si, ei) in enumerate(zip(s[a:b].tolist(), e[a:b].tolist(), strict=True)):
            zero = ei - si <= 1
            while busy and (busy[0][0] < si or (busy[0][0] == si and not busy[0][1] and not zero)):
                heapq.heappush(free, heapq.heappop(busy)[2])
            if free:
                got = heapq.heappop(free)
            else:
                got, used = used, used + 1
            heapq.heappush(busy, (ei, zero, got))
            out[i] = got
        lane[order[a:b]] = out
    return lane


def flow_links(ix: Any, rank: np.ndarray, te: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(flow id, flow phase, flows) per record: each collective instance with two or more entered members is
    one flow through its members in arrival order (id = instance id; "s" at the first arrival, "t" at the
    middle ones, "f" at the last); each send with its matching recv is one flow (id = instances + pair id)."""
    n = len(rank)
    fid = np.full(n, -1, np.int64)
    fph = np.zeros(n, np.uint8)
    rows = np.flatnonzero(ix.inst >= 0)
    flows = 0
    if len(rows):
        inst = ix.inst[rows].astype(np.int64)
        order = np.lexsort((rank[rows], te[rows], inst))
        rows, inst = rows[order], inst[order]
        first = np.r_[True, inst[1:] != inst[:-1]]
        starts = np.flatnonzero(first)
        size = np.diff(np.r_[starts, len(rows)])
        pos = np.arange(len(rows)) - np.repeat(starts, size)
        size = np.repeat(size, size)
        multi = size >= 2
        fid[rows[multi]] = inst[multi]
        fph[rows[multi]] = np.where(pos == 0, FLOW_START, np.where(pos == size - 1, FLOW_END, FLOW_STEP))[multi]
        flows += int((first & multi).sum())
    both = np.flatnonzero((ix.send_row >= 0) & (ix.recv_row >= 0))
    if len(both):
        base = int(ix.n_instances)
        fid[ix.send_row[both]] = base + both
        fph[ix.send_row[both]] = FLOW_START
        fid[ix.recv_row[both]] = base + both
        fph[ix.recv_row[both]] = FLOW_END
        flows += len(both)
    return fid, fph, flows


def _js(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _kind_label(kind: str) -> str:
    return kind.upper() if kind in ("tp", "pp", "dp") else kind


def _flag_text(flags: int) -> str:
    return ",".join(name for bit, name in _NAMED_FLAGS if flags & bit)


def _dtype_text(code: int) -> str | None:
    try:
        d = Dtype(code)
    except ValueError:
        return f"dtype{code}"
    return None if d == Dtype.UNKNOWN else d.name.lower()


def _phase_text(code: int) -> str:
    try:
        return Phase(code).name.lower()
    except ValueError:
        return f"phase {code}"


def _op_text(code: int) -> str:
    try:
        return Op(code).label
    except ValueError:
        return unknown_op_name(code)


class _Writer:
    """Counts what it writes; wraps output errors into :class:`ExportError`."""

    def __init__(self, fh: IO[str], path: str) -> None:
        self.fh, self.path, self.events = fh, path, 0

    def events_out(self, events: list[str]) -> None:
        if not events:
            return
        text = ("" if self.events == 0 else ",\n") + ",\n".join(events)
        self.events += len(events)
        self.raw(text)

    def raw(self, text: str) -> None:
        try:
            self.fh.write(text)
        except OSError as exc:
            raise ExportError(f"cannot write {self.path}: {exc.strerror or exc}") from None


@dataclass
class _Layout:
    """Where every record goes: its shape, slice end, lane (a thread) and flow."""

    shape: np.ndarray  # DONE, OPEN, ... per record
    end: np.ndarray  # end of its slice (ns)
    closed: np.ndarray  # it has a completion (or failure) time
    lanes: np.ndarray  # the lanes' codes ((rank * key_span + key) * lane_span + lane), sorted
    tid_ix: np.ndarray  # per record: its lane's index in ``lanes``
    key_span: int
    lane_span: int
    tid_base: int  # a lane's tid is tid_base + its index
    fid: np.ndarray  # flow id per record (-1: none)
    fph: np.ndarray  # flow phase per record (0: none)


def _layout(trace: Any, ix: Any, te: np.ndarray, tc: np.ndarray, end_ns: int, stats: ExportStats) -> _Layout:
    rec = trace.records
    n = len(rec)
    shape, end = record_shapes(rec, te, tc, end_ns)
    closed = ((shape == DONE) | (shape == FAILED)) & (tc > 0) & (tc >= te)  # a completion (or failure) time
    key = lane_keys(rec, ix.gidx_of(rec))
    lane = np.zeros(n, np.int32)
    ops = np.flatnonzero(shape != MARK)  # (markers are instants: any number may share a lane and a time)
    lane[ops] = assign_lanes(rec.rank[ops], key[ops], te[ops], end[ops])
    key_span = int(key.max()) + 2 if n else 1
    lane_span = int(lane.max()) + 1 if n else 1
    code = (rec.rank.astype(np.int64) * key_span + (key - MARKER_KEY)) * lane_span + lane
    lanes, tid_ix = np.unique(code, return_inverse=True)
    del code
    tid_base = trace.world_size + PID_BASE + 1  # tids never equal a pid (Perfetto names threads by tid)
    fid, fph, stats.flows = flow_links(ix, rec.rank, te)
    return _Layout(shape, end, closed, lanes, tid_ix, key_span, lane_span, tid_base, fid, fph)


def _lane_name(groups: list[Any], k: int, ln: int) -> str:
    if k == MARKER_KEY:
        base = "steps and phases"
    else:
        gi = k // 2 - 1
        g = groups[gi] if 0 <= gi < len(groups) else None
        base = (g.label if g is not None else "unknown groups") + (" send/recv" if k % 2 else "")
    return base + (f" ({ln + 1})" if ln else "")


def _metadata_events(trace: Any, groups: list[Any], lay: _Layout) -> list[str]:
    """Every rank of the world as a named process, every lane as a named thread."""
    meta: list[str] = []
    present = {int(r) for r in trace.ranks.tolist()}
    for r in range(trace.world_size):
        host, gpu = trace.host_of(r), trace.local_rank_of(r)
        where = ", ".join(x for x in (host or "", f"GPU {gpu}" if gpu is not None else "") if x)
        name = f"rank {r}" + (f" ({where})" if where else "") + ("" if r in present else " (no trace)")
        pid = r + PID_BASE
        meta.append(f'{{"ph":"M","name":"process_name","pid":{pid},"tid":{pid},"args":{{"name":{_js(name)}}}}}')
        meta.append(f'{{"ph":"M","name":"process_sort_index","pid":{pid},"tid":{pid},'
                    f'"args":{{"sort_index":{r}}}}}')
    for j, c in enumerate(lay.lanes.tolist()):
        ln = c % lay.lane_span
        k = (c // lay.lane_span) % lay.key_span + MARKER_KEY
        pid = c // lay.lane_span // lay.key_span + PID_BASE
        tid = lay.tid_base + j
        meta.append(f'{{"ph":"M","name":"thread_name","pid":{pid},"tid":{tid},'
                    f'"args":{{"name":{_js(_lane_name(groups, k, ln))}}}}}')
        meta.append(f'{{"ph":"M","name":"thread_sort_index","pid":{pid},"tid":{tid},"args":{{"sort_index":{j}}}}}')
    return meta


_ROOTED = {int(Op.BROADCAST), int(Op.REDUCE), int(Op.GATHER), int(Op.SCATTER)}
_STATES = {int(State.COMPLETED): "completed", int(State.ENQUEUED): "enqueued", int(State.FAILED): "failed",
           int(State.EMPTY): "empty"}
_POINT_STATE = {int(State.COMPLETED): "completed, completion time unknown",
                int(State.ENQUEUED): "enqueued, completion not observable"}
_SHAPE_STATE = {DONE: ("completed", "", ""),  # (state, name suffix, category suffix)
                OPEN: ("enqueued, never completed", " (never completed)", ",incomplete"),
                FAILED: ("failed", " (failed)", ",failed")}
_DIGITS = [f"{i:03d}" for i in range(1000)]
_FLAG_TEXT = {f: _flag_text(f) for f in range(256)}


def _op_parts(groups: list[Any], gi: int, op: int, dt: int) -> _OpText:
    """The parts of an operation's event that do not vary per (group index, op, dtype), JSON-escaped."""
    g = groups[gi] if gi >= 0 else None
    label = g.label if g is not None else "unknown group"
    dname = _dtype_text(dt)
    return _OpText(name=_js(f"{_kind_label(g.kind) if g is not None else '?'} {_op_text(op)}")[1:-1],
                   cat=P2P if op in (SEND, RECV) else COLLECTIVE,
                   args=f'"op":{_js(_op_text(op))},"group":{_js(label)}',
                   dtype_arg="" if dname is None else f',"dtype":"{dname}"',
                   peer_role=1 if op in (SEND, RECV) else 2 if op in _ROOTED else 0, flow=_js(label)[1:-1])


def _us(ns: np.ndarray) -> list[str]:
    """Times in ns as µs with three decimals."""
    return [f"{q}.{_DIGITS[r]}" for q, r in zip((ns // 1000).tolist(), (ns % 1000).tolist(), strict=True)]


def _chunk_columns(trace: Any, ix: Any, te: np.ndarray, t0: int, lay: _Layout, sl: slice) -> tuple[Any, ...]:
    """(event times, durations, ends, flow times by row, per-record columns) of the records ``sl``."""
    rec = trace.records
    gi_col = ix.gidx_of(rec, sl)
    off = te[sl] - t0
    dur = lay.end[sl] - te[sl]
    mid = off + dur // 2
    flow_rows = lay.fph[sl] > 0
    mid_s = dict(zip(np.flatnonzero(flow_rows).tolist(), _us(mid[flow_rows]), strict=True))
    gids = ix.group_ids
    cols = zip(rec.rank[sl].tolist(), (lay.tid_ix[sl] + lay.tid_base).tolist(), lay.shape[sl].tolist(),
               rec.op[sl].tolist(), gi_col.tolist(),
               np.where(gi_col >= 0, gids[np.maximum(gi_col, 0)] if len(gids) else 0, rec.group_id[sl]).tolist(),
               rec.group_seq[sl].tolist(), rec.nbytes[sl].tolist(), rec.dtype[sl].tolist(),
               rec.peer[sl].tolist(), rec.flags[sl].tolist(), rec.state[sl].tolist(), rec.seq[sl].tolist(),
               lay.fid[sl].tolist(), lay.fph[sl].tolist(), lay.closed[sl].tolist(), strict=True)
    return _us(off), _us(dur), _us(off + dur), mid_s, cols


def _chunk_events(chunk: tuple[Any, ...], parts_of: Any, size_key: str, stats: ExportStats) -> list[str]:
    """The events of one chunk of records (``chunk``: what :func:`_chunk_columns` returned)."""
    ts_s, dur_s, end_s, mid_s, cols = chunk
    step_op = int(Op.MARK_STEP)
    events: list[str] = []
    add = events.append
    for i, (r, tid, shp, op, gi, gid, gseq, size, dt, peer, flags, st, rseq, f_id, f_ph, ended) in enumerate(cols):
        pid = r + PID_BASE
        ts = ts_s[i]
        if shp == MARK:
            if op == step_op:
                name = f"step {gseq}"
            else:
                name = _phase_text(dt) + (f" mb {peer}" if peer >= 0 else "") + f" (step {gseq})"
            add(f'{{"ph":"i","s":"t","pid":{pid},"tid":{tid},"ts":{ts},"name":"{name}","cat":"{MARKER}",'
                f'"args":{{"rank":{r},"record":{rseq},"step":{gseq}}}}}')
            stats.instants += 1
            continue
        pname, cat, fixed, dtype_arg, peer_role, flow_label = parts_of(gi, op, dt)
        if peer_role == 1:
            pname = f"{pname} {'→' if op == SEND else '←'} {peer}"
            peer_arg = f',"peer":{peer}'
        else:
            peer_arg = f',"root":{peer}' if peer_role == 2 and peer >= 0 else ""
        if shp == POINT:
            state, suffix, more = _POINT_STATE.get(st, _STATES.get(st, f"state {st}")), "", ""
        else:
            state, suffix, more = _SHAPE_STATE[shp]
            if shp == OPEN:
                stats.incomplete += 1
        add(f'{{"ph":"X","pid":{pid},"tid":{tid},"ts":{ts},"dur":{dur_s[i]},"name":"{pname} #{gseq}{suffix}",'
            f'"cat":"{cat}{more}","args":{{{fixed},"gid":{gid},"seq":{gseq},{size_key}:{size}{dtype_arg}'
            f'{peer_arg},"state":"{state}","enqueue_us":{ts},"complete_us":{end_s[i] if ended else "null"}'
            + (f',"flags":"{_FLAG_TEXT[flags]}"' if flags else "") + f',"rank":{r},"record":{rseq}}}}}')
        stats.slices += 1
        if f_ph:
            add(f'{{"ph":"{_FLOW_PH[f_ph]}","id":{f_id},"cat":"{cat}","name":"{flow_label} #{gseq}",'
                f'"pid":{pid},"tid":{tid},"ts":{mid_s[i]},"bp":"e"}}')
            stats.flow_events += 1
    return events


def _other_data(trace: Any, t0: int, end_ns: int, clock_method: str, counts: int) -> dict[str, Any]:
    from megatrace import __version__

    return {"generator": f"megatrace {__version__}", "source": str(trace.path), "format": _format_name(trace),
            "job_id": trace.job_id, "world_size": trace.world_size, "t0_ns": t0,
            "end_us": (end_ns - t0) / 1000, "records": len(trace.records), "clock": clock_method,
            "completion_times": trace.completion_times,
            "size_unit": "elements (the NCCL patch logs counts)" if counts else "bytes",
            "pid": "rank + 1", "missing_ranks": list(trace.missing_ranks)}


def write_trace(trace: Any, ix: Any, te: np.ndarray, tc: np.ndarray, fh: IO[str], path: str = "",
                clock_method: str = "") -> ExportStats:
    """Write the whole trace as one JSON trace-event document to ``fh`` (see the module docstring).

    ``te`` / ``tc``: the aligned enqueue and completion times (ns) of every record; ``ix`` its
    :class:`~megatrace.analyze.index.RecordIndex`.
    """
    rec = trace.records
    n = len(rec)
    stats = ExportStats(path=path, records=n)
    out = _Writer(fh, path)
    t0 = int(te.min()) if n else 0
    end_ns = int(max(te.max(), tc.max())) if n else 0
    lay = _layout(trace, ix, te, tc, end_ns, stats)
    counts = int(trace.source_format == "nccl-log")  # the NCCL patch logs element counts, not bytes
    size_key = '"count"' if counts else '"bytes"'

    out.raw('{"traceEvents":[\n')
    groups = [trace.groups.get(int(g)) for g in ix.group_ids.tolist()]
    out.events_out(_metadata_events(trace, groups, lay))
    stats.lanes = len(lay.lanes)
    stats.ranks = len(np.unique(rec.rank))

    cache: dict[tuple[int, int, int], _OpText] = {}

    def parts_of(gi: int, op: int, dt: int) -> _OpText:
        parts = cache.get((gi, op, dt))
        if parts is None:
            parts = cache[(gi, op, dt)] = _op_parts(groups, gi, op, dt)
        return parts

    for lo in range(0, n, CHUNK_ROWS):
        chunk = _chunk_columns(trace, ix, te, t0, lay, slice(lo, min(n, lo + CHUNK_ROWS)))
        out.events_out(_chunk_events(chunk, parts_of, size_key, stats))
    other = _other_data(trace, t0, end_ns, clock_method, counts)
    out.raw('\n],"displayTimeUnit":"ms","otherData":' + json.dumps(other, ensure_ascii=False) + "}\n")
    stats.events = out.events
    return stats


def _format_name(trace: Any) -> str:
    return trace.source_format


def write_trace_file(out: str | os.PathLike[str], load: Callable[[], tuple[Any, Any, Any]]) -> ExportStats:
    """Write a trace to ``out`` (see the module docstring): ``load()`` gives (trace, its record index, its clock
    alignment), called once the output is open (so that an unwritable ``out`` fails before the trace is read).

    A name ending in ``.gz`` is written gzipped. The file appears whole or not at all
    (:func:`megatrace.files.atomic_output`: written beside ``out`` and renamed over it; a FIFO or device
    of root or this user, e.g. ``/dev/stdout``, is written in place; another user's link or FIFO never).
    Raises :class:`ExportError` when ``out`` cannot be written, and what ``load`` raises.
    """
    t_start = time.perf_counter()
    path = Path(out)
    stage = "open"  # an OSError before the trace is read, or once it is written, is about the output file
    try:
        with atomic_output(path) as raw:
            stage = "work"
            if path.name.endswith(".gz"):  # Perfetto and chrome://tracing open gzipped traces as they are
                fh: IO[str] = gzip.open(raw, "wt", encoding="utf-8", compresslevel=GZIP_LEVEL)  # noqa: SIM115
            else:
                fh = io.TextIOWrapper(raw, encoding="utf-8")
            trace, ix, clock = load()
            stats = write_trace(trace, ix, clock.t_enqueue, clock.t_complete, fh, str(path), clock.method)
            stage = "close"
            if isinstance(fh, io.TextIOWrapper):
                fh.detach()  # flushes; atomic_output closes the file and renames it
            else:
                fh.close()
    except OSError as exc:
        if stage == "work":
            raise
        raise ExportError(f"cannot write {path}: {exc.strerror or exc}") from None
    stats.seconds = time.perf_counter() - t_start
    try:
        stats.bytes = os.stat(path).st_size if stat.S_ISREG(os.stat(path).st_mode) else 0
    except OSError:
        pass
    return stats
