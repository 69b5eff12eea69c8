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

from megatrace.analyze.importers.common import (INT64_MAX, MAX_RANKS, Fields, ImportedRank, ImportFormatError,
                                                build_traceset, group_id, infer_completions, new_columns, shown)
from megatrace.analyze.importers.safe_pickle import MAX_BYTES, UnsafePickleError, safe_loads
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
    from megatrace.analyze.importers.detect import _files, _places

    for where in _places(directory):
        found = sorted(p for p in _files(where) if not p.name.endswith(".tmp")
                       and dump_rank(p) is not None and looks_like_dump(p))
        if found:
            return found
    return []


def _siblings(dumps: list[Path]) -> list[Path]:
    """Files beside ``dumps`` named like them (the same text before the rank, the same suffix) that do not look
    like dumps (empty, cut short before the sniffed keys, another format): a rank's dump that would be missed."""
    from megatrace.analyze.importers.detect import _files

    names = {(m.group(1), m.group(3)) for p in dumps if (m := RANK_RE.match(p.name))}
    return sorted(p for p in _files(dumps[0].parent) if p not in dumps and not p.name.endswith(".tmp")
                  and (m := RANK_RE.match(p.name)) and (m.group(1), m.group(3)) in names)


def read_dump(path: Path) -> dict:
    """One dump, parsed safely and checked for the fields the importer needs (:func:`check_dump`)."""
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ImportFormatError(f"{path}: {size} bytes: too large for a Flight Recorder dump (at most "
                                    f"{MAX_BYTES >> 20} MiB)")
        data = path.read_bytes()
    except OSError as exc:
        raise ImportFormatError(f"{path}: unreadable: {exc.strerror}") from None
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
            if isinstance(exc, UnicodeDecodeError):
                line = data[:exc.start].count(b"\n") + 1
            raise ImportFormatError(f"{path}{f', line {line}' if line else ''}: not a Flight Recorder dump "
                                    f"(neither a pickle nor valid JSON: {exc})") from None
        except RecursionError:
            raise ImportFormatError(f"{path}: not a Flight Recorder dump (JSON nested too deeply to read)") from None
    check_dump(path, dump)
    return dump


def check_dump(path: Path, dump: object) -> None:
    """Check every field the importer reads, in one place: its type, and its range for the column it goes into.

    Raises :class:`ImportFormatError` naming the file, the entry (and its record id) and the field:
    ``FILE: entry N (record R): field X: expected ..., got ...``.
    """
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        keys = ", ".join(sorted(map(shown, dump))[:12]) if isinstance(dump, dict) else type(dump).__name__
        raise ImportFormatError(f"{path}: not a Flight Recorder dump (no 'entries' list; keys: {keys})")
    top = Fields(str(path))
    if type(dump.get("version", "")) not in (str, int, float):
        top.fail("version", "a version string", dump["version"])
    config = top.mapping("pg_config", dump.get("pg_config"), optional=True)
    for name, c in config.items():
        if type(name) not in (str, int) or not isinstance(c, dict):
            raise ImportFormatError(f"{path}: pg_config: expected group name -> {{name, desc, ranks}}, got "
                                    f"{shown(name)} -> {shown(c)}")
        if "ranks" in c and _members(c["ranks"]) is None:
            Fields(f"{path}: pg_config[{shown(name)}]").fail(
                "ranks", f"a list of ranks from 0 to {MAX_RANKS - 1} (or its text, e.g. '[0, 1]')", c["ranks"])
    records: dict[int, int] = {}
    for i, e in enumerate(dump["entries"]):
        if not isinstance(e, dict):
            raise ImportFormatError(f"{path}: entry {i}: expected an entry (a dict), got {shown(e)}")
        missing = [k for k in REQUIRED if k not in e]
        if missing:
            raise ImportFormatError(f"{path}: entry {i}: missing {', '.join(missing)} (a Flight Recorder dump of "
                                    f"another version, or a damaged one)")
        rid = Fields(f"{path}: entry {i}").integer("record_id", e["record_id"], what="a record id (an integer "
                                                                                     "from 0 to 2**63-1)")
        if rid in records:
            raise ImportFormatError(f"{path}: entry {i}: field record_id: expected a record id of its own, got {rid} "
                                    f"(entry {records[rid]}'s too: a damaged dump)")
        records[rid] = i
        at = Fields(f"{path}: entry {i} (record {rid})")
        pg = e["process_group"]
        if not (isinstance(pg, (list, tuple)) and len(pg) == 2 and all(type(x) in (str, int) for x in pg)):
            at.fail("process_group", "(name, description), two strings", pg)
        at.text("profiling_name", e["profiling_name"])
        at.integer("time_created_ns", e["time_created_ns"], what="a wall-clock time in ns (an integer from 0 to "
                                                                 "2**63-1)")
        at.integer("collective_seq_id", e["collective_seq_id"], what="a sequence number (an integer from 0 to "
                                                                     "2**63-1)")
        if e.get("time_discovered_completed_ns") is not None:
            at.integer("time_discovered_completed_ns", e["time_discovered_completed_ns"],
                       what="a wall-clock time in ns (an integer from 0 to 2**63-1) or null")
        at.text("state", e.get("state"), optional=True)
        if e.get("retired") not in (None, True, False):
            at.fail("retired", "true, false or null", e["retired"])
        dtypes = at.sequence("input_dtypes", e.get("input_dtypes"), optional=True)
        for k, name in enumerate(dtypes):
            at.text(f"input_dtypes[{k}]", name)
        total = 0
        for k, shape in enumerate(at.sequence("input_sizes", e.get("input_sizes"), optional=True)):
            dims = at.sequence(f"input_sizes[{k}]", shape)
            for d in dims:
                at.integer(f"input_sizes[{k}]", d, what="a tensor shape (integers from 0 to 2**63-1)")
            total += math.prod(dims) * DTYPES.get(dtypes[k] if k < len(dtypes) else "", (Dtype.UNKNOWN, 1))[1]
            if total > INT64_MAX:
                at.fail("input_sizes", "tensors of fewer than 2**63 bytes in all", e["input_sizes"])


def _members(raw: object) -> tuple[int, ...] | None:
    """The ranks of a ``pg_config`` entry (a list, or its text as torch writes it: ``"[0, 1]"``; ``()`` when empty,
    as on gloo), or None when they are not a list of ranks."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):
            return None
    if not isinstance(raw, (list, tuple)) or not all(type(r) is int and 0 <= r < MAX_RANKS for r in raw):
        return None
    return tuple(raw)


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
    """(bytes, dtype code) of a list of shapes and their dtype names (checked by :func:`check_dump`)."""
    total, code = 0, Dtype.UNKNOWN
    names = dtypes or []
    for k, shape in enumerate(sizes or []):
        dt = DTYPES.get(names[k] if k < len(names) else "", (Dtype.UNKNOWN, 1))
        if k == 0:
            code = dt[0]
        total += math.prod(shape) * dt[1]
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
    members = {str(name): _members(c.get("ranks")) or None for name, c in config.items()}
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
    for path in _siblings(files):  # named like a rank's dump, not sniffed as one: empty, or read to say why not
        if path.stat().st_size == 0:
            problems.append(LoadProblem("warning", "fr-empty-dump", f"{path}: empty file (rank {dump_rank(path)}'s "
                                        f"dump was not written, or cut off at once); analysed without it",
                                        paths=(str(path),)))
        else:
            files.append(path)  # read_dump says what is wrong with it (or reads it: a dump after all)
    ranks: list[ImportedRank] = []
    versions: dict[str, list[int]] = {}
    names: dict[int, tuple[str, str]] = {}
    skipped: dict[str, int] = {}
    gloo = False
    for path in files:
        rank = dump_rank(path)
        if rank >= MAX_RANKS:
            raise ImportFormatError(f"{path}: rank {rank} (from the file name): expected a rank below {MAX_RANKS}")
        dump = read_dump(path)
        versions.setdefault(str(dump.get("version", "?")), []).append(rank)
        ranks.append(import_dump(path, rank, dump, skipped))
        ranks[-1].dropped = min((e["record_id"] for e in dump["entries"]), default=0)  # older ones left the ring
        for e in dump["entries"]:
            name = str(e["process_group"][0])
            names.setdefault(group_id("torch", name), (name, str(e["process_group"][1])))
            gloo = gloo or e["profiling_name"].startswith("gloo:")
    if len(versions) > 1:
        problems.append(LoadProblem("warning", "fr-versions", "Flight Recorder dumps of different versions: " +
                                    "; ".join(f"{v}: ranks {r}" for v, r in sorted(versions.items()))))
    if skipped:
        problems.append(LoadProblem("info", "fr-skipped", "Flight Recorder entries of operations not analysed: " +
                                    ", ".join(f"{n} × {name}" for name, n in sorted(skipped.items()))))
    if not any(r.groups for r in ranks):
        problems.append(LoadProblem(
            "info", "fr-no-members", "the dumps carry no group members (pg_config is empty): members come from the "
            "layout or the ranks that used each group" + ("; gloo records no point-to-point calls" if gloo else "")))
    _outside_windows(ranks, problems)
    guessed = sum(int(r.done.sum()) for r in ranks if r.done is not None)
    infer_completions(ranks)
    world = max((len(g["ranks"]) for r in ranks for g in r.groups), default=0) or None  # the default group's size
    n = sum(len(r) for r in ranks)
    problems.append(LoadProblem("info", "imported", f"imported {plural(n, 'record')} of {plural(len(ranks), 'rank')} "
                                f"from Flight Recorder dumps ({', '.join(sorted(versions))})"))
    return build_traceset(directory, NAME, ranks, world, problems, layout, names=names,
                          inferred=f"{guessed} of the entries finished without a completion time (their "
                                   f"instance's last arrival stands in)" if guessed else "", completions="arrivals")


def _outside_windows(ranks: list[ImportedRank], problems: list[LoadProblem]) -> None:
    """Leave out, on every rank, the collective instances that lie before some rank's window.

    Each dump is a ring: a rank whose first entry has a record id above 0 lost its older entries, so its
    window starts at its first entry, and each rank's starts elsewhere. Collectives of a group are called in
    one order by all its members, so a member that recorded instance ``k`` of a group also made every earlier
    one: an instance before a member's first recorded one is unobserved on it, not missing, and cannot be
    judged (its completion, the last arrival, is unknown, and the members' calls no longer pair up one by
    one). Ranks are also compared across groups (a slow rank's pipeline neighbours wait for it in receives a
    gloo dump does not record, which only its own slowness explains), so the common window is kept: every
    collective instance with an entry created before the latest window start (the first entry of a rank that
    lost older ones), or before a member's first recorded instance of its group, is left out on every rank,
    and a note says how many. Point-to-point entries are kept (their order is per peer, not per group).
    """
    late = sorted(r.rank for r in ranks if r.dropped > 0 and len(r))
    if not late:
        return
    start = max(int(r.columns["t_enqueue"].min()) for r in ranks if r.rank in late)
    first: dict[int, int] = {}  # group -> the latest first recorded instance over its members
    early: set[tuple[int, int]] = set()  # (group, instance) with an entry before the common window
    for r in ranks:
        c = r.columns
        coll = (c["op"] != Op.SEND) & (c["op"] != Op.RECV)
        for g in np.unique(c["group_id"][coll]).tolist():
            lo = int(c["group_seq"][coll & (c["group_id"] == g)].min())
            first[g] = max(first.get(g, lo), lo)
        before = coll & (c["t_enqueue"] < start)
        early.update(zip(c["group_id"][before].tolist(), c["group_seq"][before].tolist()))
    left_out = 0
    for r in ranks:
        c = r.columns
        coll = (c["op"] != Op.SEND) & (c["op"] != Op.RECV)
        lo = np.array([first.get(g, 0) for g in c["group_id"].tolist()], np.int64)
        drop = coll & ((c["group_seq"] < lo) | np.array([(g, q) in early for g, q in
                                                          zip(c["group_id"].tolist(), c["group_seq"].tolist())], bool))
        if not drop.any():
            continue
        left_out += int(drop.sum())
        for name in c:
            c[name] = c[name][~drop]
        c["seq"] = np.arange(1, int((~drop).sum()) + 1, dtype=c["seq"].dtype)
        if r.done is not None:
            r.done = r.done[~drop]
    if left_out:
        problems.append(LoadProblem(
            "info", "fr-windows", f"the dumps cover different windows (the rings of ranks {late[:12]}"
            f"{' …' if len(late) > 12 else ''} had dropped older entries): {plural(left_out, 'entry')} of "
            f"collectives before the common window were left out, so that every instance judged was seen by all "
            f"its members and all ranks are compared over the same time", ranks=tuple(late)))
