"""PyTorch profiler (Kineto) chrome traces, one per rank (``*.json`` or ``*.json.gz``) -> :class:`TraceSet`.

What ``prof.export_chrome_trace`` / ``tensorboard_trace_handler`` write: one JSON object with
``distributedInfo`` (``rank``, ``world_size``, ``backend``, ``pg_config``: each group's name, description and
ranks), ``baseTimeNanoseconds`` and ``traceEvents``. Three event forms carry communication:

* GPU (NCCL): ``ncclDevKernel_*``/``ncclKernel_*`` kernels (cat ``kernel``) with the ``record_param_comms``
  arguments (``Collective name``, ``In msg nelems``, ``dtype``, ``Process Group Name``/``Ranks``, ``Seq``,
  ``Src Rank``/``Dst Rank``): a record per kernel, completed at the kernel's end, called at the start of the
  ``record_param_comms`` cpu_op of the same group and Seq (else at the kernel's start);
* ``record_param_comms`` cpu_ops without kernels: a record per op, called at its start; the op only
  launches the work, so its completion time is not in the trace (inferred: the instance's last arrival);
* CPU (gloo, observed on torch 2.13 CPU builds, which write no ``record_param_comms``): ``c10d::allreduce_``,
  ``c10d::send``, ... cpu_ops on the calling thread (the call; its ``Input Dims`` give the element count) and
  ``gloo:all_reduce``, ``gloo:send``, ... user annotations on gloo's worker threads (the execution, with the
  element type): the k-th call of an op is paired with the k-th execution of it; the record is called at the
  cpu_op's start and completed at the execution's end. The group is not named: it is the rank's only group
  (the default one when ``pg_config`` lists no other); on a rank in several groups the calls cannot be
  attributed and are imported in a group of their own (a warning says so).

Times: Kineto's ``ts`` (µs, float) counts from ``baseTimeNanoseconds`` (wall clock, ns): a time is
``baseTimeNanoseconds + ts * 1000`` ns, the host's system clock, so ranks of one host share a clock and ranks of
several hosts are as aligned as their clocks (the clock analysis estimates the offsets). A trace exists only
once the profiler stopped: every call in it is taken as completed (none can show a hang).
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatrace.config import Layout
from megatrace.files import open_input_file, read_input
from megatrace.load.importers.common import (INT64_MAX, MAX_RANKS, Fields, ImportedRank, ImportFormatError,
                                                build_traceset, group_id, infer_completions, new_columns)
from megatrace.load.importers.sniff import files_in, places
from megatrace.load.traceset import LoadProblem, TraceSet, plural
from megatrace.trace.ring_format import Dtype, Op, State

NAME = "kineto"
MAX_BYTES = 1 << 30  # a trace file (decompressed) larger than 1 GiB is refused: json would need ~10x in memory
SNIFF_BYTES = 4096
FILE_RANK = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
KERNEL_PREFIXES = ("ncclDevKernel", "ncclKernel")
# collective names, as record_param_comms, c10d:: ops and gloo: annotations write them, without "_" or "c10d::"
OPS: dict[str, Op] = {
    "allreduce": Op.ALL_REDUCE, "allreducecoalesced": Op.ALL_REDUCE, "broadcast": Op.BROADCAST,
    "broadcastoop": Op.BROADCAST, "reduce": Op.REDUCE, "reduceoop": Op.REDUCE, "allgather": Op.ALL_GATHER,
    "allgatherbase": Op.ALL_GATHER, "allgatherintotensorcoalesced": Op.ALL_GATHER,
    "allgatherintotensor": Op.ALL_GATHER, "allgathercoalesced": Op.ALL_GATHER, "reducescatter": Op.REDUCE_SCATTER,
    "reducescatterbase": Op.REDUCE_SCATTER, "reducescattertensorcoalesced": Op.REDUCE_SCATTER,
    "reducescattertensor": Op.REDUCE_SCATTER, "alltoall": Op.ALL_TO_ALL, "alltoallbase": Op.ALL_TO_ALL,
    "alltoallv": Op.ALL_TO_ALL, "barrier": Op.BARRIER, "send": Op.SEND, "recv": Op.RECV,
    "recvanysource": Op.RECV, "gather": Op.GATHER, "scatter": Op.SCATTER}
# element types: record_param_comms writes c10 ScalarType names, record_shapes C++ type names
DTYPES: dict[str, tuple[int, Dtype]] = {
    "float": (4, Dtype.FLOAT32), "double": (8, Dtype.FLOAT64), "half": (2, Dtype.FLOAT16),
    "c10::half": (2, Dtype.FLOAT16), "bfloat16": (2, Dtype.BFLOAT16), "c10::bfloat16": (2, Dtype.BFLOAT16),
    "long": (8, Dtype.INT64), "long int": (8, Dtype.INT64), "int64_t": (8, Dtype.INT64), "int": (4, Dtype.INT32),
    "short": (2, Dtype.INT16), "short int": (2, Dtype.INT16), "char": (1, Dtype.INT8),
    "signed char": (1, Dtype.INT8), "byte": (1, Dtype.UINT8), "unsigned char": (1, Dtype.UINT8),
    "bool": (1, Dtype.BOOL), "float8_e4m3fn": (1, Dtype.FLOAT8_E4M3), "c10::float8_e4m3fn": (1, Dtype.FLOAT8_E4M3),
    "float8_e5m2": (1, Dtype.FLOAT8_E5M2), "c10::float8_e5m2": (1, Dtype.FLOAT8_E5M2),
    "complexfloat": (8, Dtype.COMPLEX64), "c10::complex<float>": (8, Dtype.COMPLEX64),
    "complexdouble": (16, Dtype.COMPLEX128), "c10::complex<double>": (16, Dtype.COMPLEX128)}
US_MAX = 1e15  # ts and dur in µs: 31 years; beyond it a time is damage
_TIME = "a time in µs (a finite number from 0 to 1e15)"


def _key(name: str) -> str:
    return name.split("::")[-1].split(":")[-1].replace("_", "").lower()


@dataclass
class Call:
    """One communication call of a rank, as read (times in ns; ``t_complete`` -1: not in the trace)."""

    op: Op
    group: str  # process group name ("" on the CPU form: the rank's only group)
    seq: int | None  # the event's Seq (same on every member), None: absent
    nbytes: int
    dtype: int
    t_enqueue: int
    t_complete: int
    peer: int = -1  # send/recv: the other side's rank in the group (-1 unknown)


@dataclass
class RankTrace:
    """A rank's file, read: its calls, groups (name -> (desc, ranks)) and facts."""

    path: Path
    rank: int
    world: int
    backend: str
    host: str
    pid: int
    form: str  # "kernel", "record_param_comms", "c10d"
    calls: list[Call]
    groups: dict[str, tuple[str, tuple[int, ...]]]
    unpaired: int = 0  # c10d calls without their gloo execution


def _open_head(path: Path) -> bytes:
    try:
        with open_input_file(path) as raw, (gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw) as fh:
            return fh.read(SNIFF_BYTES)
    except (OSError, EOFError, zlib.error):
        return b""


def looks_like_kineto(path: Path) -> bool:
    """A ``*.json``/``*.json.gz`` whose first bytes open an object with Kineto's ``distributedInfo`` or
    ``schemaVersion`` (``traceEvents`` alone is any Chrome trace, e.g. MegaTrace's own Perfetto export)."""
    if not (path.name.endswith(".json") or path.name.endswith(".json.gz")):
        return False
    head = _open_head(path).lstrip()
    return head.startswith(b"{") and any(k in head for k in (b'"distributedInfo"', b'"schemaVersion"'))


def read_document(path: Path, limit: int = MAX_BYTES) -> dict:
    """The file's JSON object (gunzipped), at most ``limit`` bytes; errors name the file."""
    try:
        if path.stat().st_size > limit:
            raise ImportFormatError(f"{path}: {path.stat().st_size} bytes, over the {limit}-byte limit for a "
                                    f"Kineto trace (profile fewer steps, or split the trace)")
        if path.name.endswith(".gz"):
            with open_input_file(path) as raw, gzip.GzipFile(fileobj=raw) as fh:
                data = fh.read(limit + 1)
        else:
            data = read_input(path, limit)
    except ImportFormatError:
        raise
    except (OSError, EOFError, zlib.error) as exc:
        raise ImportFormatError(f"{path}: unreadable ({getattr(exc, 'strerror', None) or exc}; a damaged "
                                f"or truncated gzip file?)") from None
    if len(data) > limit:
        raise ImportFormatError(f"{path}: over {limit} bytes once decompressed, the limit for a Kineto trace "
                                f"(profile fewer steps, or split the trace)")
    try:
        doc = json.loads(data)
    except UnicodeDecodeError as exc:
        raise ImportFormatError(f"{path}: not UTF-8 text (byte {exc.start}); not a Kineto trace") from None
    except ValueError as exc:
        where = f"line {exc.lineno}, column {exc.colno}: " if isinstance(exc, json.JSONDecodeError) else ""
        raise ImportFormatError(f"{path}: {where}not JSON ({getattr(exc, 'msg', exc)}; a truncated or damaged "
                                f"Kineto trace?)") from None
    except RecursionError:
        raise ImportFormatError(f"{path}: not a Kineto trace (JSON nested too deeply to read)") from None
    if not isinstance(doc, dict):
        raise ImportFormatError(f"{path}: expected a JSON object (a Kineto trace), got {type(doc).__name__}")
    return doc


def _ranks_text(at: Fields, name: str, value: object) -> tuple[int, ...] | None:
    """``Process Group Ranks``: "[0, 1]" (a string) or a list of ranks."""
    if value is None:
        return None
    if isinstance(value, str):
        if not re.fullmatch(r"\s*\[[\d,\s]*\]\s*", value) or len(value) > 10 * MAX_RANKS:
            at.fail(name, "a list of ranks such as '[0, 1]'", value)
        value = [int(x) for x in re.findall(r"\d+", value) if len(x) <= 8]
    items = at.sequence(name, value)
    return tuple(at.integer(f"{name}[{k}]", r, 0, MAX_RANKS - 1, what=f"a rank (0 to {MAX_RANKS - 1})")
                 for k, r in enumerate(items))


def _nelems(at: Fields, dims: object) -> int:
    """Elements of the first input (a tensor's dims, or a TensorList's list of dims) from ``Input Dims``."""
    first = at.sequence("args.Input Dims", dims)
    if not first:
        return 0
    shapes = at.sequence("args.Input Dims[0]", first[0])
    if shapes and isinstance(shapes[0], (list, tuple)):
        lists = shapes
    else:
        lists = [shapes]
    total = 0
    for k, shape in enumerate(lists):
        n = 1
        for j, d in enumerate(at.sequence(f"args.Input Dims[0][{k}]", shape)):
            n *= at.integer(f"args.Input Dims[0][{k}][{j}]", d, 0, 1 << 48, what="a dimension (0 to 2**48)")
        total = min(total + n, INT64_MAX)
    return total


def _dtype(name: str) -> tuple[int, int]:
    size, code = DTYPES.get(name.strip().lower(), (0, Dtype.UNKNOWN))
    return size, int(code)


def read_rank(path: Path, doc: dict) -> RankTrace:
    """Every communication call of one file; each field read is checked (``FILE, traceEvents[i]: field X``)."""
    top = Fields(str(path))
    events = top.sequence("traceEvents", doc.get("traceEvents"))
    info = top.mapping("distributedInfo", doc.get("distributedInfo"), optional=True)
    base = doc.get("baseTimeNanoseconds")
    base = 0 if base is None else top.integer("baseTimeNanoseconds", base, 0, INT64_MAX // 2,
                                              what="wall-clock ns (an integer from 0 to 2**62)")
    rank = info.get("rank")
    if rank is not None:
        rank = top.integer("distributedInfo.rank", rank, 0, MAX_RANKS - 1, what=f"a rank (0 to {MAX_RANKS - 1})")
    else:
        named = FILE_RANK.search(path.name)
        if not named or len(named.group(1)) > 7 or int(named.group(1)) >= MAX_RANKS:
            raise ImportFormatError(f"{path}: no distributedInfo.rank and no rank in the file name (name the files "
                                    f"<name>-rank<R>.json): the rank of its calls is unknown")
        rank = int(named.group(1))
    world = top.integer("distributedInfo.world_size", info.get("world_size", rank + 1), 1, MAX_RANKS,
                        what=f"a world size (1 to {MAX_RANKS})")
    if rank >= world:
        top.fail("distributedInfo.rank", f"a rank below the world size {world}", rank)
    backend = top.text("distributedInfo.backend", info.get("backend", ""), optional=True) or ""
    host = top.text("host_name", doc.get("host_name", ""), optional=True) or ""
    groups: dict[str, tuple[str, tuple[int, ...]]] = {}
    for k, pg in enumerate(top.sequence("distributedInfo.pg_config", info.get("pg_config"), optional=True)):
        pg = top.mapping(f"distributedInfo.pg_config[{k}]", pg)
        name = str(top.text(f"distributedInfo.pg_config[{k}].pg_name", pg.get("pg_name")))
        desc = top.text(f"distributedInfo.pg_config[{k}].pg_desc", pg.get("pg_desc", ""), optional=True) or ""
        members = _ranks_text(top, f"distributedInfo.pg_config[{k}].ranks", pg.get("ranks"))
        groups[name] = (desc, members or ())
    kernels, params, c10d, gloo = [], [], [], []
    pid = 0
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            Fields(f"{path}, traceEvents[{i}]").fail("event", "an object (a dict)", ev)
        name, cat = ev.get("name"), ev.get("cat")
        if not isinstance(name, str) or ev.get("ph") != "X" or cat not in ("kernel", "cpu_op", "user_annotation"):
            continue
        if cat == "kernel" and name.startswith(KERNEL_PREFIXES):
            kind = kernels
        elif cat == "cpu_op" and name == "record_param_comms":
            kind = params
        elif cat == "cpu_op" and name.startswith("c10d::") and _key(name) in OPS:
            kind = c10d
        elif cat == "user_annotation" and name.startswith("gloo:") and _key(name) in OPS:
            kind = gloo
        else:
            continue
        at = Fields(f"{path}, traceEvents[{i}]")
        ts = at.number("ts", ev.get("ts"), hi=US_MAX, what=_TIME)
        dur = at.number("dur", ev.get("dur"), hi=US_MAX, what="a duration in µs (a finite number from 0 to 1e15)")
        args = at.mapping("args", ev.get("args"), optional=True)
        if not pid and type(ev.get("pid")) is int and 0 < ev["pid"] < 1 << 31:
            pid = ev["pid"]
        t0 = min(base + round(ts * 1000), INT64_MAX)
        kind.append((at, name, t0, min(t0 + round(dur * 1000), INT64_MAX), args))
    if kernels and any("Collective name" in e[4] for e in kernels):
        form = "kernel"
        calls = [c for e in kernels if "Collective name" in e[4] and (c := _param_call(e, groups)) is not None]
        launch = {(c.group, c.seq): c.t_enqueue for e in params if (c := _param_call(e, groups)) is not None}
        for c in calls:
            c.t_enqueue = min(launch.get((c.group, c.seq), c.t_enqueue), c.t_enqueue) if c.seq is not None \
                else c.t_enqueue
    elif params:
        form = "record_param_comms"
        calls = [c for e in params if (c := _param_call(e, groups)) is not None]
        for c in calls:
            c.t_complete = -1  # the op launched the work: its completion is not in the trace
    else:
        form = "c10d"
        calls, unpaired = _c10d_calls(c10d, gloo)
        return RankTrace(path, rank, world, backend, host, pid, form, calls, groups, unpaired)
    return RankTrace(path, rank, world, backend, host, pid, form, calls, groups)


def _param_call(event: tuple, groups: dict) -> Call | None:
    """A record_param_comms op or NCCL kernel as a call (None: not a communication, e.g. ``wait``)."""
    at, _, t0, t1, args = event
    coll = at.text("args.Collective name", args.get("Collective name"))
    op = OPS.get(_key(coll))
    if op is None:
        return None
    nelems = at.integer("args.In msg nelems", args.get("In msg nelems", 0), what="an element count (0 to 2**63-1)")
    size, code = _dtype(at.text("args.dtype", args.get("dtype", ""), optional=True) or "")
    pg = args.get("Process Group Name")
    pg = "" if pg is None else str(at.text("args.Process Group Name", pg))
    ranks = _ranks_text(at, "args.Process Group Ranks", args.get("Process Group Ranks"))
    if pg and ranks and pg not in groups:
        groups[pg] = (at.text("args.Process Group Description", args.get("Process Group Description", ""),
                              optional=True) or "", ranks)
    seq = args.get("Seq")
    if seq is not None:
        seq = at.integer("args.Seq", seq, what="a sequence number (0 to 2**63-1)")
    peer = -1
    if op in (Op.SEND, Op.RECV):
        field = "Dst Rank" if op == Op.SEND else "Src Rank"
        if args.get(field) is not None:
            peer = at.integer(f"args.{field}", args[field], 0, MAX_RANKS - 1, what=f"a rank (0 to {MAX_RANKS - 1})")
    return Call(op, pg, seq, min(nelems * size, INT64_MAX), code, t0, t1, peer)


def _c10d_calls(c10d: list[tuple], gloo: list[tuple]) -> tuple[list[Call], int]:
    """c10d:: calls paired, op by op and in order, with the gloo: executions; returns (calls, unpaired)."""
    runs: dict[str, list[tuple]] = {}
    for e in sorted(gloo, key=lambda e: e[2]):
        runs.setdefault(_key(e[1]), []).append(e)
    taken: dict[str, int] = {}
    calls, unpaired = [], 0
    for at, name, t0, _, args in sorted(c10d, key=lambda e: e[2]):
        key = _key(name)
        op = OPS[key]
        k = taken.get(key, 0)
        taken[key] = k + 1
        run = runs.get(key, [])[k] if k < len(runs.get(key, ())) else None
        unpaired += run is None
        nelems = 0 if op == Op.BARRIER else _nelems(at, args.get("Input Dims", []))
        size, code = 0, int(Dtype.UNKNOWN)
        if run is not None and op != Op.BARRIER:
            types = run[0].sequence("args.Input type", run[4].get("Input type", []))
            size, code = _dtype(run[0].text("args.Input type[0]", types[0])) if types else (0, code)
        peer = -1
        if op in (Op.SEND, Op.RECV):
            inputs = at.sequence("args.Concrete Inputs", args.get("Concrete Inputs", []))
            if len(inputs) > 2 and inputs[2] != "":
                text = at.text("args.Concrete Inputs[2]", inputs[2])
                peer = at.decimal("args.Concrete Inputs[2]", text, 0, MAX_RANKS - 1, what="a peer rank") \
                    if text.isdigit() else at.fail("args.Concrete Inputs[2]", "a peer rank (digits)", text)
        calls.append(Call(op, "", None, min(nelems * size, INT64_MAX), code, t0,
                          max(run[3], t0) if run is not None else -1, peer))
    return calls, unpaired


def find_files(directory: Path) -> list[Path]:
    for where in places(directory):
        found = sorted(p for p in files_in(where) if looks_like_kineto(p))
        if found:
            return found
    return []


def load_kineto(directory: Path, layout: Layout | None = None) -> TraceSet:
    """Every Kineto trace in ``directory`` (or one level below) as a :class:`TraceSet`."""
    files = find_files(directory)
    if not files:
        raise ImportFormatError(f"{directory}: no PyTorch profiler (Kineto) traces (*.json or *.json.gz objects "
                                f"with distributedInfo or schemaVersion) in it or its subdirectories")
    problems: list[LoadProblem] = []
    traces = [read_rank(p, read_document(p)) for p in files]
    seen: dict[int, Path] = {}
    for t in traces:
        if t.rank in seen:
            raise ImportFormatError(f"{t.path}: rank {t.rank} also comes from {seen[t.rank]}; one trace per rank")
        seen[t.rank] = t.path
    world = max(t.world for t in traces)
    world_name = next((n for t in traces for n, (d, r) in t.groups.items() if d == "default_pg" or len(r) == world),
                      "0")
    ranks, unknown_groups, unpaired = [], [], 0
    for t in traces:
        lines: dict[int, dict] = {}
        mine = [n for n, (_, r) in t.groups.items() if t.rank in r] or [world_name]
        cols = new_columns(len(t.calls))
        done = np.zeros(len(t.calls), bool)
        order: dict[tuple, int] = {}
        seq_ok: dict[str, bool] = {}
        for c in t.calls:
            if not c.group:
                c.group = mine[0] if len(mine) == 1 else f"unattributed:{t.rank}"
            if c.op not in (Op.SEND, Op.RECV):
                seq_ok[c.group] = seq_ok.get(c.group, True) and c.seq is not None
        if any(c.group.startswith("unattributed:") for c in t.calls):
            unknown_groups.append(t.rank)
        t.calls.sort(key=lambda c: c.t_enqueue)
        for i, c in enumerate(t.calls):
            desc, members = t.groups.get(c.group, ("default_pg" if c.group == world_name else "", ()))
            if c.group == world_name and not members:
                members = tuple(range(world))
            gid = group_id("kineto", c.group)
            if gid not in lines and members:
                lines[gid] = {"kind": "group", "gid": gid, "name": c.group, "desc": desc, "ranks": list(members),
                              "backend": t.backend}
            peer = members[c.peer] if 0 <= c.peer < len(members) else c.peer
            if c.op in (Op.SEND, Op.RECV):
                ch = (c.group, t.rank, peer) if c.op == Op.SEND else (c.group, peer, t.rank)
            else:
                ch = (c.group,)
            order[ch] = order.get(ch, 0) + 1
            seq = c.seq if len(ch) == 1 and seq_ok.get(c.group) else order[ch]
            cols["group_id"][i], cols["op"][i], cols["group_seq"][i] = gid, c.op, seq
            cols["nbytes"][i], cols["dtype"][i], cols["peer"][i] = c.nbytes, c.dtype, peer
            cols["t_enqueue"][i] = c.t_enqueue
            if c.t_complete >= 0:
                cols["t_complete"][i], cols["state"][i] = c.t_complete, State.COMPLETED
            else:
                done[i] = True
        unpaired += t.unpaired
        ranks.append(ImportedRank(t.rank, str(t.path), cols, host=t.host, pid=t.pid, closed_cleanly=True,
                                  groups=list(lines.values()), done=done))
    infer_completions(ranks)
    if unknown_groups:
        problems.append(LoadProblem("warning", "kineto-unattributed", f"{plural(len(unknown_groups), 'rank')} in "
                                    f"several process groups whose trace does not name the group of a call (gloo "
                                    f"c10d ops): their calls are imported unmatched", ranks=tuple(unknown_groups)))
    if unpaired:
        problems.append(LoadProblem("info", "kineto-unpaired", f"{plural(unpaired, 'call')} without its gloo "
                                    f"execution in the trace: completion inferred from the last arrival"))
    forms = sorted({t.form for t in traces})
    n = sum(len(r) for r in ranks)
    problems.append(LoadProblem("info", "imported", f"imported {plural(n, 'communication call')} of "
                                f"{plural(len(ranks), 'rank')} from PyTorch profiler traces ({', '.join(forms)}; "
                                f"a trace is written when the profiler stops: no hang can be seen in it)"))
    inferred = ("record_param_comms ops only launch the work: completion inferred from the last arrival"
                if "record_param_comms" in forms else "")
    return build_traceset(directory, NAME, ranks, world, problems, layout, inferred=inferred,
                          completions="arrivals")

