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

* The watchdog's dumps of NCCL jobs (NVIDIA's resiliency tests: version "2.9", NCCL 2.27) hold only the
  calls still in flight, every one ``scheduled`` without start or completion times; ``pg_status`` then
  tells how far each rank got in each group. Such a dump set exists because a call timed out: the job
  hung (``NodeFacts.outcome`` "stalled"), and the question is who every other member waits for.

Mapping: group id ``crc32("torch:" + name)`` (the ring tracer's), ``group_seq`` =
``collective_seq_id``; send/recv are numbered per (group, source, destination), by ``p2p_seq_id`` where
those agree across ranks. An entry is completed when ``state == "completed"``, it is retired, or
``pg_status`` shows it completed; its completion time is ``time_discovered_completed_ns`` or, when
unknown, its instance's last arrival (:func:`common.infer_completions`). Calls a participant made outside
its dump's window are left out (:mod:`fr_windows`). NCCL collectives are asynchronous (``Flag.ASYNC``).
Members come from ``pg_config``, else from who used the group; the world holds every rank named by a file,
a group or the layout. Dumps are unpickled by :mod:`safe_pickle` only; fields are checked by
:mod:`fr_check`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from megatrace.config import Layout
from megatrace.files import open_input_file, read_input
from megatrace.load.importers.common import (MAX_RANKS, ImportedRank, ImportFormatError, build_traceset,
                                                dense_group_seq, group_id, infer_completions, new_columns)
from megatrace.load.importers.fr_check import DTYPES, check_dump
from megatrace.load.importers.fr_check import members as group_members
from megatrace.load.importers.fr_windows import (Calls, aligned_p2p_groups, common_window, judge_windows,
                                                    pg_positions)
from megatrace.load.importers.safe_pickle import MAX_BYTES, UnsafePickleError, safe_loads
from megatrace.load.importers.sniff import files_in, places
from megatrace.load.traceset import LoadProblem, TraceSet, plural
from megatrace.trace.ring_format import Dtype, Flag, Op, State

NAME = "flight-recorder"
RANK_RE = re.compile(r"^(.*?)(\d+)(\.pkl|\.pickle|\.json)?$")
PICKLE_MAGIC = b"\x80"

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


def dump_rank(path: Path) -> int | None:
    """The rank a dump file's name ends with (``nccl_trace_rank_3``, ``fr_rank_3.pkl``), or None."""
    m = RANK_RE.match(path.name)
    return int(m.group(2)) if m else None


def looks_like_dump(path: Path) -> bool:
    """A pickle, or a JSON object mentioning ``entries`` and ``pg_config`` (a cheap sniff, nothing parsed)."""
    try:
        with open_input_file(path) as fh:
            head = fh.read(4096)
    except OSError:
        return False
    if head.startswith(PICKLE_MAGIC):
        return True
    return head.lstrip().startswith(b"{") and any(k in head for k in (b'"entries"', b'"pg_config"'))


def find_dumps(directory: Path) -> list[Path]:
    """Dump files in ``directory`` (or, when it has none, its subdirectories one level down)."""
    for where in places(directory):
        found = sorted(p for p in files_in(where) if not p.name.endswith(".tmp")
                       and dump_rank(p) is not None and looks_like_dump(p))
        if found:
            return found
    return []


def _siblings(dumps: list[Path]) -> list[Path]:
    """Files beside ``dumps`` named like them (the same text before the rank, the same suffix) that do not look
    like dumps (empty, cut short before the sniffed keys, another format): a rank's dump that would be missed."""
    names = {(m.group(1), m.group(3)) for p in dumps if (m := RANK_RE.match(p.name))}
    return sorted(p for p in files_in(dumps[0].parent) if p not in dumps and not p.name.endswith(".tmp")
                  and (m := RANK_RE.match(p.name)) and (m.group(1), m.group(3)) in names)


def read_dump(path: Path) -> dict:
    """One dump, parsed safely and checked for the fields the importer needs (:func:`fr_check.check_dump`)."""
    return _read(path)[0]


def _read(path: Path) -> tuple[dict, dict[int, int]]:
    """(the dump, record id -> bytes of its input tensors)."""
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ImportFormatError(f"{path}: {size} bytes: too large for a Flight Recorder dump (at most "
                                    f"{MAX_BYTES >> 20} MiB)")
        data = read_input(path, MAX_BYTES)
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
    return dump, check_dump(path, dump)


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


def _rank_of(members: tuple[int, ...] | None, local: int | None) -> int:
    if local is None:
        return -1
    if members is not None:
        ordered = sorted(members)
        return ordered[local] if 0 <= local < len(ordered) else -1
    return local


def _dtype(names: object) -> int:
    return int(DTYPES.get(names[0], (Dtype.UNKNOWN, 1))[0]) if isinstance(names, (list, tuple)) and names and \
        isinstance(names[0], str) else int(Dtype.UNKNOWN)


def import_dump(path: Path, rank: int, dump: dict, skipped: dict[str, int] | None = None,
                nbytes: dict[int, int] | None = None, calls: Calls | None = None,
                p2p_keys: dict[int, np.ndarray] | None = None) -> ImportedRank:
    """One rank's dump as columns plus the group lines its ``pg_config`` gives. Entries of operations
    MegaTrace does not know (e.g. the ``coalesced`` entry that wraps a batch of NCCL calls, whose calls
    have entries of their own) are left out and counted by name in ``skipped``. ``calls`` and ``p2p_keys``,
    when given, receive each row's channel, key and ``p2p_seq_id`` (:mod:`fr_windows`).

    Collectives of NCCL (and of any backend but gloo) are asynchronous: the host queues them on a device
    stream and goes on, so a rank waits in every call it queued that has not completed (``Flag.ASYNC``)."""
    nbytes = nbytes if nbytes is not None else check_dump(path, dump)
    entries = []
    for e in sorted(dump["entries"], key=lambda e: e["record_id"]):
        if _op(e["profiling_name"])[0] == Op.UNKNOWN:
            if skipped is not None:
                skipped[str(e["profiling_name"])] = skipped.get(str(e["profiling_name"]), 0) + 1
        else:
            entries.append(e)
    config = dump.get("pg_config") if isinstance(dump.get("pg_config"), dict) else {}
    members = {str(name): group_members(c.get("ranks")) or None for name, c in config.items()}
    cols = new_columns(len(entries))
    done = np.zeros(len(entries), bool)
    channel: dict[tuple[int, int, int], int] = {}
    lines: dict[int, dict] = {}
    chans: list[tuple[int, int, int]] = []
    keys = np.zeros(len(entries), np.int64)
    p2p = np.full(len(entries), -1, np.int64)
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
        cols["nbytes"][i], cols["dtype"][i] = nbytes.get(e["record_id"], 0), _dtype(e.get("input_dtypes"))
        if op in (Op.SEND, Op.RECV):
            peer = _rank_of(mem, dst if op == Op.SEND else src)
            cols["peer"][i] = peer
            ch = (gid, rank, peer) if op == Op.SEND else (gid, peer, rank)
            channel[ch] = channel.get(ch, 0) + 1
            cols["group_seq"][i] = keys[i] = channel[ch]
            p2p[i] = e["p2p_seq_id"] if type(e.get("p2p_seq_id")) is int else -1
            cols["flags"][i] = Flag.ASYNC
        else:
            ch = (gid, -1, -1)
            cols["group_seq"][i] = keys[i] = e["collective_seq_id"]
            if backend != "gloo":
                cols["flags"][i] = Flag.ASYNC
        chans.append(ch)
        completed_at = e.get("time_discovered_completed_ns")
        if isinstance(completed_at, int) and completed_at > 0:
            cols["state"][i], cols["t_complete"][i] = State.COMPLETED, completed_at
        elif e.get("state") == "completed" or e.get("retired") is True:
            done[i] = True
    if calls is not None:
        calls.chan[rank], calls.key[rank] = chans, keys
        for e in entries:
            gid = group_id("torch", str(e["process_group"][0]))
            calls.names[gid], calls.labels[gid] = str(e["process_group"][0]), str(e["process_group"][1])
    if p2p_keys is not None:
        p2p_keys[rank] = p2p
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
            files.append(path)  # _read says what is wrong with it (or reads it: a dump after all)
    ranks: list[ImportedRank] = []
    versions: dict[str, list[int]] = {}
    names: dict[int, tuple[str, str]] = {}
    skipped: dict[str, int] = {}
    dumps: dict[int, tuple[str, dict]] = {}
    calls, p2p_keys = Calls(), {}
    backends: set[str] = set()
    for path in files:
        rank = dump_rank(path)
        if rank >= MAX_RANKS:
            raise ImportFormatError(f"{path}: rank {rank} (from the file name): expected a rank below {MAX_RANKS}")
        dump, nbytes = _read(path)
        dumps[rank] = (str(path), dump)
        versions.setdefault(str(dump.get("version", "?")), []).append(rank)
        ranks.append(import_dump(path, rank, dump, skipped, nbytes, calls, p2p_keys))
        ranks[-1].dropped = min((e["record_id"] for e in dump["entries"]), default=0)  # older ones left the ring
        for e in dump["entries"]:
            name = str(e["process_group"][0])
            names.setdefault(group_id("torch", name), (name, str(e["process_group"][1])))
            backends.add(_op(e["profiling_name"])[3])
    if len(versions) > 1:
        problems.append(LoadProblem("warning", "fr-versions", "Flight Recorder dumps of different versions: " +
                                    "; ".join(f"{v}: ranks {r}" for v, r in sorted(versions.items()))))
    if skipped:
        problems.append(LoadProblem("info", "fr-skipped", "Flight Recorder entries of operations not analysed: " +
                                    ", ".join(f"{n} × {name}" for name, n in sorted(skipped.items()))))
    if not any(r.groups for r in ranks):
        problems.append(LoadProblem(
            "info", "fr-no-members", "the dumps carry no group members (pg_config is empty): members come from the "
            "layout or the ranks that used each group" + ("; gloo records no point-to-point calls"
                                                          if "gloo" in backends else "")))
    members = {g["gid"]: tuple(g["ranks"]) for r in ranks for g in r.groups if g["ranks"]}
    aligned = aligned_p2p_groups(ranks, p2p_keys, calls.chan, calls.labels)
    for r in ranks:  # send/recv keyed by p2p_seq_id where those agree across ranks
        mine = np.array([ch[0] in aligned and ch[1] >= 0 for ch in calls.chan[r.rank]], bool)
        calls.key[r.rank] = np.where(mine, p2p_keys[r.rank], calls.key[r.rank])
    notes = judge_windows(ranks, calls, members, pg_positions(dumps, problems), aligned, problems)
    _number_p2p(ranks, calls, aligned)
    common_window(ranks, problems)
    guessed = sum(int(r.done.sum()) for r in ranks if r.done is not None)
    infer_completions(ranks)
    n = sum(len(r) for r in ranks)
    problems.append(LoadProblem("info", "imported", f"imported {plural(n, 'record')} of {plural(len(ranks), 'rank')} "
                                f"from Flight Recorder dumps ({', '.join(sorted(versions))})"))
    trace = build_traceset(directory, NAME, ranks, None, problems, layout, names=names,
                           inferred=f"{guessed} of the entries finished without a completion time (their "
                                    f"instance's last arrival stands in)" if guessed else "", completions="arrivals")
    trace.facts.notes.update(notes)
    if backends - {"gloo", ""} and (trace.records.state != State.COMPLETED).any() and trace.facts.outcome is None:
        trace.facts.outcome = "stalled"
        trace.facts.message = ("Flight Recorder dumps of an NCCL job with calls in flight: the watchdog writes them when "
                               "a call timed out (TORCH_NCCL_DUMP_ON_TIMEOUT), so the job hung")
    return trace


def _number_p2p(ranks: list[ImportedRank], calls: Calls, aligned: set[int]) -> None:
    """Send/recv of groups whose ``p2p_seq_id`` agree: numbered in each channel by those keys, densely over all
    ranks (a send and its receive share the number); elsewhere they keep their place in their window."""
    keys, chans = {}, {}
    for r in ranks:
        mine = [ch[0] in aligned and ch[1] >= 0 for ch in calls.chan[r.rank]]
        keys[r.rank] = np.where(np.array(mine, bool), calls.key[r.rank], -1).astype(np.int64)
        chans[r.rank] = np.array([((ch[1] + 1) << 21 | (ch[2] + 1)) if ch[1] >= 0 else 0 for ch in calls.chan[r.rank]],
                                 np.int64)
    dense_group_seq(ranks, keys, chans)
