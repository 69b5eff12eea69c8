"""PyTorch Flight Recorder dumps -> :class:`TraceSet`.

A dump (``torch._C._distributed_c10d._dump_fr_trace()``, or the file the watchdog writes to
``$TORCH_FR_DUMP_TEMP_FILE<rank>``) is a pickled dict; ``_dump_fr_trace_json()`` gives the same as
JSON. What torch 2.13 writes (checked on real gloo dumps, version "2.10"):

* ``version``, ``comm_lib_version``, ``pg_status`` (per *local* pg id: last enqueued / started /
  completed collective), ``pg_config`` (group name -> ``{name, desc, ranks}``, ``ranks`` a string
  such as ``"[0, 1]"``; **empty on gloo**: ``{"": {"ranks": "[]"}}``), ``entries``;
* per entry: ``record_id``, ``pg_id`` (a local index), ``process_group`` = (name, desc), the name
  being global (the same on every member), ``collective_seq_id`` (per group, the same on every
  member), ``p2p_seq_id``, ``op_id``, ``profiling_name`` (``gloo:all_reduce``, ``nccl:send 0->1``
  with group-local ranks), ``time_created_ns`` (wall clock), ``input_sizes``/``input_dtypes``,
  ``output_sizes``/``output_dtypes``, ``state`` (``scheduled``/``started``/``completed``),
  ``time_discovered_started_ns``/``time_discovered_completed_ns`` (None on gloo), ``retired``
  (the work finished and left the watchdog), ``timeout_ms``, ``is_p2p``, ``frames``.
* The dump holds no rank: it comes from the file name's trailing digits, as for ``torchfrtrace``
  (``nccl_trace_rank_3``, ``fr_rank_3.pkl``).
* On gloo only collectives are recorded (point-to-point calls leave no entry) and every entry
  stays ``scheduled``: ``retired`` is the only sign of completion.

Mapping: group id ``crc32("torch:" + name)`` (the ring tracer's), ``group_seq`` =
``collective_seq_id``; send/recv are numbered per (group, source, destination). An entry is
completed when ``state == "completed"`` or it is retired; its completion time is
``time_discovered_completed_ns`` or, when unknown, its instance's last arrival
(:func:`common.infer_completions`). Members come from ``pg_config``, else from who used the group.
Dumps are unpickled by :mod:`safe_pickle` only.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from megatrace.analyze.importers.common import (ImportedRank, ImportFormatError, build_traceset, group_id,
                                                infer_completions, new_columns)
from megatrace.analyze.importers.safe_pickle import UnsafePickleError, safe_loads
from megatrace.analyze.traceset import LoadProblem, TraceSet, plural
from megatrace.config import Layout
from megatrace.trace.ring_format import Dtype, Flag, Op, State

NAME = "flight-recorder"
RANK_RE = re.compile(r"^(.*?)(\d+)(\.pkl|\.pickle|\.json)?$")
PICKLE_MAGIC = b"\x80"
REQUIRED = ("record_id", "process_group", "collective_seq_id", "profiling_name", "time_created_ns")

OPS: dict[str, Op] = {
    "all_reduce": Op.ALL_REDUCE, "allreduce": Op.ALL_REDUCE, "allreduce_coalesced": Op.ALL_REDUCE,
    "all_reduce_coalesced": Op.ALL_REDUCE, "all_reduce_barrier": Op.BARRIER,
    "all_gather": Op.ALL_GATHER, "allgather": Op.ALL_GATHER, "all_gather_single": Op.ALL_GATHER,
    "_all_gather_base": Op.ALL_GATHER, "all_gather_into_tensor_coalesced": Op.ALL_GATHER,
    "all_gather_v": Op.ALL_GATHER, "allgather_coalesced": Op.ALL_GATHER,
    "reduce_scatter": Op.REDUCE_SCATTER, "reduce_scatter_single": Op.REDUCE_SCATTER,
    "_reduce_scatter_base": Op.REDUCE_SCATTER, "reduce_scatter_tensor_coalesced": Op.REDUCE_SCATTER,
    "reduce_scatter_v": Op.REDUCE_SCATTER, "reduce_scatter_coalesced": Op.REDUCE_SCATTER,
    "broadcast": Op.BROADCAST, "_broadcast_oop": Op.BROADCAST, "reduce": Op.REDUCE, "_reduce_oop": Op.REDUCE,
    "all_to_all": Op.ALL_TO_ALL, "alltoall": Op.ALL_TO_ALL, "all_to_all_single": Op.ALL_TO_ALL,
    "alltoall_base": Op.ALL_TO_ALL, "all_to_all_v_single": Op.ALL_TO_ALL, "barrier": Op.BARRIER,
    "gather": Op.GATHER, "scatter": Op.SCATTER, "send": Op.SEND, "recv": Op.RECV,
}
DTYPES: dict[str, tuple[Dtype, int]] = {
    "Float": (Dtype.FLOAT32, 4), "Half": (Dtype.FLOAT16, 2), "BFloat16": (Dtype.BFLOAT16, 2),
    "Double": (Dtype.FLOAT64, 8), "Char": (Dtype.INT8, 1), "Byte": (Dtype.UINT8, 1), "Short": (Dtype.INT16, 2),
    "Int": (Dtype.INT32, 4), "Long": (Dtype.INT64, 8), "Bool": (Dtype.BOOL, 1),
    "Float8_e4m3fn": (Dtype.FLOAT8_E4M3, 1), "Float8_e5m2": (Dtype.FLOAT8_E5M2, 1),
    "ComplexFloat": (Dtype.COMPLEX64, 8), "ComplexDouble": (Dtype.COMPLEX128, 16),
}


def dump_rank(path: Path) -> int | None:
    """The rank a dump file's name ends with (``nccl_trace_rank_3``, ``fr_rank_3.pkl``), or None."""
    m = RANK_RE.match(path.name)
    return int(m.group(2)) if m else None


def looks_like_dump(path: Path) -> bool:
    """A pickle, or a JSON object mentioning ``entries`` and ``pg_config`` (a cheap sniff, nothing parsed)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return False
    if head.startswith(PICKLE_MAGIC):
        return True
    return head.lstrip().startswith(b"{") and any(k in head for k in (b'"entries"', b'"pg_config"'))


def find_dumps(directory: Path) -> list[Path]:
    """Dump files in ``directory`` (or, when it has none, its subdirectories one level down)."""
    for where in [directory] + sorted(p for p in directory.iterdir() if p.is_dir()):
        found = sorted(p for p in where.iterdir() if p.is_file() and not p.name.endswith(".tmp")
                       and dump_rank(p) is not None and looks_like_dump(p))
        if found:
            return found
    return []


def read_dump(path: Path) -> dict:
    """One dump, parsed safely and checked for the fields the importer needs."""
    data = path.read_bytes()
    if not data:
        raise ImportFormatError(f"{path}: empty file (not a Flight Recorder dump)")
    if data.startswith(PICKLE_MAGIC):
        try:
            dump = safe_loads(data, str(path))
        except UnsafePickleError as exc:
            raise ImportFormatError(str(exc)) from None
    else:
        try:
            dump = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            line = getattr(exc, "lineno", None)
            raise ImportFormatError(f"{path}{f', line {line}' if line else ''}: not a Flight Recorder dump "
                                    f"(neither a pickle nor valid JSON: {exc})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise ImportFormatError(f"{path}: not a Flight Recorder dump (no 'entries' list; keys: "
                                f"{sorted(map(str, dump)) if isinstance(dump, dict) else type(dump).__name__})")
    for i, e in enumerate(dump["entries"]):
        missing = [k for k in REQUIRED if not isinstance(e, dict) or k not in e]
        if missing:
            raise ImportFormatError(f"{path}: entry {i}: missing {', '.join(missing)} (a Flight Recorder dump of "
                                    f"another version, or a damaged one)")
        pg = e["process_group"]
        if not (isinstance(pg, (list, tuple)) and len(pg) == 2):
            raise ImportFormatError(f"{path}: entry {i} (record {e['record_id']}): process_group should be "
                                    f"(name, description), got {pg!r}")
        if not isinstance(e["time_created_ns"], int) or not isinstance(e["collective_seq_id"], int):
            raise ImportFormatError(f"{path}: entry {i} (record {e['record_id']}): time_created_ns and "
                                    f"collective_seq_id must be integers")
    return dump


def _members(raw: object) -> tuple[int, ...] | None:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    if not isinstance(raw, (list, tuple)) or not raw:
        return None
    try:
        return tuple(int(r) for r in raw)
    except (TypeError, ValueError):
        return None


def _op(name: str) -> tuple[Op, int | None, int | None, str]:
    """(op, source, destination (group-local, p2p only), backend) of a ``profiling_name``."""
    backend, _, rest = str(name).partition(":")
    if not rest:
        backend, rest = "", backend
    kind, _, meta = rest.partition(" ")
    op = OPS.get(kind.strip(), Op.UNKNOWN)
    src = dst = None
    try:
        if op == Op.SEND and "->" in meta:
            s, d = meta.split("->")
            src, dst = int(s), int(d)
        elif op == Op.RECV and "<-" in meta:
            d, s = meta.split("<-")
            src, dst = int(s), int(d)
    except ValueError:
        pass
    return op, src, dst, backend


def _nbytes(sizes: object, dtypes: object) -> tuple[int, int]:
    """(bytes, dtype code) of a list of shapes and their dtype names."""
    total, code = 0, Dtype.UNKNOWN
    if not isinstance(sizes, list):
        return 0, code
    names = dtypes if isinstance(dtypes, list) else []
    for k, shape in enumerate(sizes):
        dt = DTYPES.get(names[k] if k < len(names) else "", (Dtype.UNKNOWN, 1))
        if k == 0:
            code = dt[0]
        try:
            total += math.prod(int(x) for x in shape) * dt[1]
        except (TypeError, ValueError):
            pass
    return total, int(code)


def _rank_of(members: tuple[int, ...] | None, local: int | None) -> int:
    if local is None:
        return -1
    if members is not None:
        ordered = sorted(members)
        return ordered[local] if 0 <= local < len(ordered) else -1
    return local


def import_dump(path: Path, rank: int, dump: dict, skipped: dict[str, int] | None = None) -> ImportedRank:
    """One rank's dump as columns plus the group lines its ``pg_config`` gives. Entries of operations
    MegaTrace does not know (e.g. the ``coalesced`` entry that wraps a batch of NCCL calls, whose calls
    have entries of their own) are left out and counted by name in ``skipped``."""
    entries = []
    for e in sorted(dump["entries"], key=lambda e: e["record_id"]):
        if _op(e["profiling_name"])[0] == Op.UNKNOWN:
            if skipped is not None:
                skipped[str(e["profiling_name"])] = skipped.get(str(e["profiling_name"]), 0) + 1
        else:
            entries.append(e)
    config = dump.get("pg_config") if isinstance(dump.get("pg_config"), dict) else {}
    members = {str(name): _members(c.get("ranks")) for name, c in config.items() if isinstance(c, dict)}
    cols = new_columns(len(entries))
    done = np.zeros(len(entries), bool)
    channel: dict[tuple[int, int, int], int] = {}
    lines: dict[int, dict] = {}
    for i, e in enumerate(entries):
        name, desc = str(e["process_group"][0]), str(e["process_group"][1])
        gid = group_id("torch", name)
        op, src, dst, backend = _op(e["profiling_name"])
        mem = members.get(name)
        if mem is not None and gid not in lines:
            lines[gid] = {"kind": "group", "gid": gid, "name": name, "desc": desc, "ranks": list(mem),
                          "backend": backend}
        cols["group_id"][i] = gid
        cols["op"][i] = op
        cols["t_enqueue"][i] = e["time_created_ns"]
        nbytes, dtype = _nbytes(e.get("input_sizes"), e.get("input_dtypes"))
        cols["nbytes"][i], cols["dtype"][i] = nbytes, dtype
        if op in (Op.SEND, Op.RECV):
            peer = _rank_of(mem, dst if op == Op.SEND else src)
            cols["peer"][i] = peer
            key = (gid, int(op), peer)
            channel[key] = channel.get(key, 0) + 1
            cols["group_seq"][i] = channel[key]
            cols["flags"][i] = Flag.ASYNC
        else:
            cols["group_seq"][i] = e["collective_seq_id"]
        completed_at = e.get("time_discovered_completed_ns")
        if isinstance(completed_at, int) and completed_at > 0:
            cols["state"][i], cols["t_complete"][i] = State.COMPLETED, completed_at
        elif e.get("state") == "completed" or e.get("retired") is True:
            done[i] = True
    return ImportedRank(rank, str(path), cols, groups=list(lines.values()), done=done)


def load_flight_recorder(directory: Path, layout: Layout | None = None) -> TraceSet:
    """Every Flight Recorder dump in ``directory`` (or one level below) as a :class:`TraceSet`."""
    files = find_dumps(directory)
    if not files:
        raise ImportFormatError(f"{directory}: no Flight Recorder dumps (pickle or JSON files whose names end "
                                f"with the rank, e.g. nccl_trace_rank_0) in it or its subdirectories")
    problems: list[LoadProblem] = []
    ranks: list[ImportedRank] = []
    versions: dict[str, list[int]] = {}
    names: dict[int, tuple[str, str]] = {}
    skipped: dict[str, int] = {}
    for path in files:
        rank = dump_rank(path)
        dump = read_dump(path)
        versions.setdefault(str(dump.get("version", "?")), []).append(rank)
        ranks.append(import_dump(path, rank, dump, skipped))
        for e in dump["entries"]:
            name = str(e["process_group"][0])
            names.setdefault(group_id("torch", name), (name, str(e["process_group"][1])))
    if len(versions) > 1:
        problems.append(LoadProblem("warning", "fr-versions", "Flight Recorder dumps of different versions: " +
                                    "; ".join(f"{v}: ranks {r}" for v, r in sorted(versions.items()))))
    if skipped:
        problems.append(LoadProblem("info", "fr-skipped", "Flight Recorder entries of operations not analysed: " +
                                    ", ".join(f"{n} × {name}" for name, n in sorted(skipped.items()))))
    if not any(r.groups for r in ranks):
        gloo = any(e["profiling_name"].startswith("gloo:") for e in dump["entries"])
        problems.append(LoadProblem(
            "info", "fr-no-members", "the dumps carry no group members (pg_config is empty): members come from the "
            "layout or the ranks that used each group" + ("; gloo records no point-to-point calls" if gloo else "")))
    guessed = sum(int(r.done.sum()) for r in ranks if r.done is not None)
    infer_completions(ranks)
    world = max((len(g["ranks"]) for r in ranks for g in r.groups), default=0) or None  # the default group's size
    n = sum(len(r) for r in ranks)
    problems.append(LoadProblem("info", "imported", f"imported {plural(n, 'record')} of {plural(len(ranks), 'rank')} "
                                f"from Flight Recorder dumps ({', '.join(sorted(versions))})"))
    return build_traceset(directory, NAME, ranks, world, problems, layout, names=names,
                          inferred=f"{guessed} of the entries finished without a completion time (their "
                                   f"instance's last arrival stands in)" if guessed else "", completions="arrivals")
