"""NCCL Inspector output (NCCL's profiler-plugin example, ``ext-profiler/inspector``) -> :class:`TraceSet`.

One file per process (``NCCL_INSPECTOR_DUMP_DIR``), holding JSON objects one after the other (one per
line, or pretty-printed), one per completed collective per communicator::

    {"header": {"id": "0x7f8c496ae9f661", "rank": 2, "n_ranks": 8, "nnodes": 1},
     "metadata": {"inspector_output_format_version": "v4.0", "dump_timestamp_us": 1748030377748202,
                  "hostname": "node-1", "pid": 1639453, ...},
     "coll_perf": {"coll": "AllReduce", "coll_sn": 1407, "coll_msg_size_bytes": 17179869184,
                   "coll_exec_time_us": 61974, "coll_timing_source": "kernel_gpu",
                   "coll_algobw_gbs": 277.2, "coll_busbw_gbs": 485.1,
                   "coll_algo": "RING", "coll_proto": "LL",              (v4.2)
                   "event_trace_ts": {"coll_start_ts": ..., "coll_stop_ts": ...,
                                      "kernel_events": [{"kernel_start_ts": ..., "kernel_stop_ts": ...}]}}}

``event_trace_ts`` (µs) only with ``NCCL_INSPECTOR_DUMP_VERBOSE=1``. Records without ``coll_perf``
(v4.1 ``dump_stats``) are skipped. Mapping:

* ``header.id`` is the communicator; ``header.rank`` the rank *within* it. A process's global rank is
  the number its file name ends with (``...rank3.log``), else its rank in a communicator of the whole
  world (at least as many ranks as files, and the layout's world size); else the import fails and
  says so;
* ``group_seq`` = ``coll_sn`` (the same on every member), ``nbytes`` = ``coll_msg_size_bytes``;
* times: the call at ``coll_start_ts``, completion at the last ``kernel_stop_ts`` (else start plus
  ``coll_exec_time_us``); without the verbose trace, completion at ``dump_timestamp_us`` and the call
  ``coll_exec_time_us`` before it (coarse: the dump thread's interval);
* every record is COMPLETED: the Inspector writes a collective when it finished. It therefore cannot
  show what a hung rank waits in (a collective nobody completed leaves no line); it shows timing: who
  arrived last (verbose), how long each collective ran, the bus bandwidth.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from megatrace.config import Layout
from megatrace.files import read_input
from megatrace.load.importers.common import (INT64_MAX, MAX_RANKS, Fields, ImportedRank, ImportFormatError,
                                                build_traceset, group_id, new_columns)
from megatrace.load.importers.sniff import files_in, head, looks_like_inspector, places
from megatrace.load.traceset import LoadProblem, TraceSet, plural
from megatrace.trace.ring_format import Op, State

NAME = "inspector"
COLLS: dict[str, Op] = {"AllReduce": Op.ALL_REDUCE, "AllGather": Op.ALL_GATHER, "ReduceScatter": Op.REDUCE_SCATTER,
                        "Broadcast": Op.BROADCAST, "Reduce": Op.REDUCE, "AllToAll": Op.ALL_TO_ALL,
                        "Gather": Op.GATHER, "Scatter": Op.SCATTER}
TRAILING_RANK = re.compile(r"rank[_-]?(\d+)(?:\.[a-z]+)*$", re.IGNORECASE)
_WS = re.compile(r"\s*")


def iter_objects(path: Path):
    """(line number, object) for each JSON object in the file; errors name the file and line."""
    try:
        data = read_input(path)
    except OSError as exc:
        raise ImportFormatError(f"{path}: unreadable: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ImportFormatError(f"{path}, line {line}: not UTF-8 text (byte {data[exc.start]:#04x} at column "
                                f"{column}; damaged NCCL Inspector output?)") from None
    decoder = json.JSONDecoder()
    at = _WS.match(text, 0).end()
    line, counted = 1, 0  # the line of ``at``, newlines counted up to ``counted`` (each byte once: linear)
    while at < len(text):
        line += text.count("\n", counted, at)
        counted = at
        try:
            obj, end = decoder.raw_decode(text, at)
        except ValueError as exc:
            msg = getattr(exc, "msg", str(exc))
            raise ImportFormatError(f"{path}, line {line}: not a JSON object ({msg}; truncated or damaged "
                                    f"NCCL Inspector output?)") from None
        except RecursionError:
            raise ImportFormatError(f"{path}, line {line}: not an NCCL Inspector record (JSON nested too deeply "
                                    f"to read)") from None
        if not isinstance(obj, dict):
            raise ImportFormatError(f"{path}, line {line}: expected a JSON object, got {type(obj).__name__}")
        yield line, obj
        at = _WS.match(text, end).end()


US_MAX = INT64_MAX // 1000  # times in µs become ns in int64 columns
_TIME = "a time in µs (a finite number from 0 to 2**63/1000)"


def _ns(us: float) -> int:
    return min(int(us * 1000), INT64_MAX)  # (a float near the bound may round above it)


def _record(path: Path, line: int, obj: dict) -> tuple | None:
    """(comm id, comm rank, n_ranks, op, sn, bytes, t_start_ns, t_stop_ns, host, pid, algo, verbose) or None
    (a record without coll_perf). Every field read is checked here, in one place (type, range for its column):
    ``FILE, line N: field X: expected ..., got ...``."""
    perf = obj.get("coll_perf")
    if perf is None:
        return None
    at = Fields(f"{path}, line {line}")
    need = ("not an NCCL Inspector record (header.id/rank/n_ranks, coll_perf.coll/coll_sn/coll_msg_size_bytes/"
            "coll_exec_time_us needed")
    if not isinstance(perf, dict) or not isinstance(obj.get("header"), dict):
        why = "missing header" if "header" not in obj else "header and coll_perf must be objects"
        raise ImportFormatError(f"{at.where}: {need}; {why})")
    head = obj["header"]
    missing = [f"header.{k}" for k in ("id", "rank", "n_ranks") if k not in head]
    missing += [f"coll_perf.{k}" for k in ("coll", "coll_sn", "coll_msg_size_bytes", "coll_exec_time_us")
                if k not in perf]
    if missing:
        raise ImportFormatError(f"{at.where}: {need}; missing {', '.join(missing)})")
    meta = at.mapping("metadata", obj.get("metadata"), optional=True)
    if type(head["id"]) not in (str, int):
        at.fail("header.id", "a communicator id (a string)", head["id"])
    comm = str(head["id"])
    n = at.integer("header.n_ranks", head["n_ranks"], 1, MAX_RANKS, what=f"a communicator size (1 to {MAX_RANKS})")
    rank = at.integer("header.rank", head["rank"], 0, n - 1, what=f"a rank in the communicator of {n} (0 to {n - 1})")
    coll = at.text("coll_perf.coll", perf["coll"])
    if coll not in COLLS:
        raise ImportFormatError(f"{path}, line {line}: unknown collective {coll!r} (known: {', '.join(COLLS)})")
    sn = at.integer("coll_perf.coll_sn", perf["coll_sn"], what="a sequence number (an integer from 0 to 2**63-1)")
    size = at.integer("coll_perf.coll_msg_size_bytes", perf["coll_msg_size_bytes"],
                      what="a byte count (an integer from 0 to 2**63-1)")
    exec_us = at.number("coll_perf.coll_exec_time_us", perf["coll_exec_time_us"], hi=US_MAX,
                        what="a duration in µs (a finite number from 0 to 2**63/1000)")
    trace = at.mapping("coll_perf.event_trace_ts", perf.get("event_trace_ts"), optional=True)
    start = trace.get("coll_start_ts")
    if start is not None:
        at.number("coll_perf.event_trace_ts.coll_start_ts", start, hi=US_MAX, what=_TIME)
    stops = []
    events = "coll_perf.event_trace_ts.kernel_events"
    for k, ev in enumerate(at.sequence(events, trace.get("kernel_events"), optional=True)):
        ev = at.mapping(f"{events}[{k}]", ev)
        if ev.get("kernel_stop_ts") is not None:
            stops.append(at.number(f"{events}[{k}].kernel_stop_ts", ev["kernel_stop_ts"], hi=US_MAX, what=_TIME))
    stops = [s for s in stops if s > 0]
    host = at.text("metadata.hostname", meta.get("hostname", ""), optional=True) or ""
    pid = at.integer("metadata.pid", meta.get("pid", 0) or 0, 0, (1 << 31) - 1, what="a process id")
    algo = at.text("coll_perf.coll_algo", perf.get("coll_algo", ""), optional=True) or ""
    if start is not None and start > 0:
        t0 = _ns(start)
        t1 = _ns(max(stops)) if stops else min(t0 + _ns(exec_us), INT64_MAX)
    else:
        dumped = meta.get("dump_timestamp_us")
        if dumped is None:
            raise ImportFormatError(f"{path}, line {line}: no time (neither event_trace_ts.coll_start_ts nor "
                                    f"metadata.dump_timestamp_us)")
        t1 = _ns(at.number("metadata.dump_timestamp_us", dumped, hi=US_MAX, what=_TIME))
        t0 = max(t1 - _ns(exec_us), 0)
    return (comm, rank, n, COLLS[coll], sn, size, t0, max(t1, t0), host, pid, algo, bool(trace))


def find_files(directory: Path) -> list[Path]:
    for where in places(directory):
        found = sorted(p for p in files_in(where) if looks_like_inspector(p))
        if found:
            return found
    return []


def _global_ranks(per_file: dict[Path, list[tuple]], world: int) -> dict[Path, int]:
    """Each file's global rank: from its name, else from its one communicator of all ``world`` ranks."""
    global_rank: dict[Path, int] = {}
    for path, recs in per_file.items():
        in_world = {r[1] for r in recs if r[2] == world}
        named = TRAILING_RANK.search(path.name)
        if named and int(named.group(1)) >= MAX_RANKS:
            raise ImportFormatError(f"{path}: rank {named.group(1)} (from the file name): expected a rank below "
                                    f"{MAX_RANKS}")
        if named:
            global_rank[path] = int(named.group(1))
        elif len(in_world) == 1:
            global_rank[path] = in_world.pop()
        else:
            raise ImportFormatError(f"{path}: cannot tell this process's global rank (no communicator of all "
                                    f"{world} ranks in it, and no rank at the end of the file name): rename the "
                                    f"files <name>-rank<R>.log")
    seen: dict[int, Path] = {}
    for path, rank in global_rank.items():
        if rank in seen:
            raise ImportFormatError(f"{path}: global rank {rank} also comes from {seen[rank]}")
        seen[rank] = path
    return global_rank


def load_inspector(directory: Path, layout: Layout | None = None) -> TraceSet:
    """Every NCCL Inspector file in ``directory`` (or one level below) as a :class:`TraceSet`."""
    files = find_files(directory)
    if not files:
        raise ImportFormatError(f"{directory}: no NCCL Inspector output (JSON objects with header and coll_perf) "
                                f"in it or its subdirectories")
    problems: list[LoadProblem] = []
    suffixes = {p.suffix for p in files}
    for path in sorted(p for p in files_in(files[0].parent) if p.suffix in suffixes and p not in files):
        first = head(path).lstrip()
        if not first:  # beside the Inspector files, with their suffix: a process's file, empty
            problems.append(LoadProblem("warning", "inspector-empty", f"{path}: empty (no collective of this "
                                        f"process was written); analysed without it", paths=(str(path),)))
        elif first.startswith(b"{"):  # a JSON object not recognised from its first bytes: read, to say what is wrong
            files.append(path)
    per_file: dict[Path, list[tuple]] = {}
    for path in files:
        recs = [r for line, obj in iter_objects(path) if (r := _record(path, line, obj)) is not None]
        if recs:
            per_file[path] = recs
    if not per_file:
        raise ImportFormatError(f"{directory}: NCCL Inspector files without any coll_perf record")
    widest = max(r[2] for recs in per_file.values() for r in recs)
    world = max(widest, layout.world_size if layout is not None else 0, len(per_file))
    global_rank = _global_ranks(per_file, world)
    # communicator members: global rank at each comm rank
    members: dict[str, dict[int, int]] = {}
    sizes: dict[str, int] = {}
    for path, recs in per_file.items():
        for r in recs:
            members.setdefault(r[0], {})[r[1]] = global_rank[path]
            sizes[r[0]] = r[2]
    partial = sorted(c for c in members if len(members[c]) < sizes[c])
    if partial:
        problems.append(LoadProblem("warning", "inspector-partial-comms",
                                    f"{plural(len(partial), 'communicator')} with members whose files are missing: "
                                    f"their members are the ranks seen ({', '.join(partial[:4])})"))
    ranks: list[ImportedRank] = []
    for path, recs in per_file.items():
        recs.sort(key=lambda r: (r[6], r[7]))
        cols = new_columns(len(recs))
        gids = {r[0]: group_id("nccl", r[0]) for r in recs}
        for i, r in enumerate(recs):
            cols["group_id"][i], cols["op"][i], cols["group_seq"][i] = gids[r[0]], r[3], r[4]
            cols["nbytes"][i], cols["t_enqueue"][i], cols["t_complete"][i] = r[5], r[6], r[7]
        cols["state"][:] = State.COMPLETED
        lines = [{"kind": "group", "gid": gid, "name": comm, "desc": "default_pg" if sizes[comm] == world else "",
                  "ranks": [members[comm][k] for k in sorted(members[comm])], "backend": "nccl"}
                 for comm, gid in gids.items()]
        host, pid = recs[0][8], recs[0][9]
        ranks.append(ImportedRank(global_rank[path], str(path), cols, host=host, pid=pid, groups=lines))
    n = sum(len(r) for r in ranks)
    problems.append(LoadProblem("info", "imported", f"imported {plural(n, 'collective')} of "
                                f"{plural(len(ranks), 'rank')} from NCCL Inspector output (completed collectives "
                                f"only: a hang leaves no line)"))
    coarse = sum(1 for recs in per_file.values() for r in recs if not r[11])
    trace = build_traceset(directory, NAME, ranks, world, problems, layout,
                           inferred=f"{plural(coarse, 'record')} without the verbose event trace (times from the "
                                    f"dump time and the execution time)" if coarse else "")
    for gid, g in trace.groups.items():  # name the groups by the layout where they match one of its kinds
        if trace.layout is not None and not g.desc and len(g.ranks) > 1:
            for kind in ("tp", "pp", "dp"):
                if tuple(trace.layout.group_of(kind, g.ranks[0])) == tuple(sorted(g.ranks)):
                    trace.groups[gid] = dataclasses.replace(g, desc=kind)
                    break
    return trace
