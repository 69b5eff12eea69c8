"""Logs of the Megatrace NCCL patch (``rank_<R>.log``) -> :class:`TraceSet`.

One file per rank; each line is one NCCL call as the host enqueued it::

    [save_count 3] [1755590104.253968145] [Rank 0] Fun AllReduce Data 25165824 stream 0x55919d27b4b0 opCount 12

with an optional trailing `` groupHash <int>`` in newer builds. Facts that shape the import:

* the time is CLOCK_REALTIME at enqueue; there is **no completion time**;
* ``Data`` is an element count (kept as is in ``nbytes``: only comparisons across ranks use it);
* ``opCount`` counts the communicator's kernel launches: calls inside one NCCL group share it and a
  one-rank communicator logs 0 forever, so a call's place in its communicator is (opCount, its index
  among the calls of that opCount), renumbered densely across ranks;
* the stream is a process-local pointer; each ``save_count`` is a full dump of a ring of up to 9,999
  lines, written whenever the rank was idle, so dumps overlap: the lines of all dumps are merged and
  duplicates dropped;
* without ``groupHash`` the communicators are inferred: a rank's calls on one stream are one
  communicator; streams with send/recv are the pipeline's, collective streams are matched to the layout's
  groups (``config.yaml``: ``TP``, ``PP``, ``world_size``; Megatron order) by call volume (TP calls
  more often than DP: Megatron's pattern) when both have more than one rank;
* a send/recv on a communicator of more than two ranks (a Megatron pipeline group) names no peer: the
  peer and the pairing are inferred from the call sequences of adjacent stages
  (:func:`megatrace.load.importers.nccl_log_peers.p2p_partners`);
* completion is inferred: a collective is complete when every member enqueued it (at its last arrival)
  and no member had an earlier call that could not complete (a GPU stream runs its work in order); a
  send/recv when both sides posted it. What a member never enqueued is what the others wait for: the
  first call of a rank that cannot complete is the one it waits in.
* each rank's log is a window of its calls, and windows differ. A member is not counted as missing from
  a call its window does not cover: a call of a channel (a communicator, or one direction of a send/recv
  pair) before a later call of that channel in its log (its ring wrapped, or a dump in between is lost:
  calls of a channel are made in order, so it made this one too); a call whose last arrival precedes its
  log; a call after the end of a log that ended early (its later dumps are missing), told apart from a
  rank that stopped by what the others did after it (:func:`_ended_early`; a warning names such ranks and
  the analysis does not take the end of their log for a stop).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from pathlib import Path

import numpy as np

from megatrace.config import GROUP_KINDS, Layout, LayoutError
from megatrace.load.importers.common import (ImportedRank, ImportFormatError,
                                                build_traceset, dense_group_seq, group_id, new_columns)
from megatrace.load.importers.nccl_log_lines import FUNCS, OP_SLOTS, parse_log
from megatrace.load.importers.nccl_log_peers import layout_kind, p2p_partners
from megatrace.load.importers.nccl_log_streams import assign_streams, read_layout
from megatrace.load.importers.sniff import looks_like_nccl_log, places
from megatrace.load.traceset import LoadProblem, TraceSet, plural, rank_list
from megatrace.trace.ring_format import Flag, Op, State

NAME = "nccl-log"


def load_nccl_logs(directory: Path, layout: Layout | None = None) -> TraceSet:
    """Every ``rank_<R>.log`` in ``directory`` (or one level below) as a :class:`TraceSet`."""
    files: list[Path] = []
    for where in places(directory):
        files = sorted(p for p in where.iterdir() if p.is_file() and looks_like_nccl_log(p))
        if files:
            break
    if not files:
        raise ImportFormatError(f"{directory}: no Megatrace NCCL logs (rank_<R>.log) in it or its subdirectories")
    problems: list[LoadProblem] = []
    rank_calls: dict[int, list[tuple]] = {}
    paths: dict[int, str] = {}
    dumps: dict[int, dict[int, list[int]]] = {}  # rank -> save_count -> [first, last] line time
    for path in files:
        spans: dict[int, list[int]] = {}
        rank, calls = parse_log(path, problems, spans)
        dumps[rank] = spans
        if rank in rank_calls:
            raise ImportFormatError(f"{path}: rank {rank} also in {paths[rank]}")
        rank_calls[rank], paths[rank] = calls, str(path)
    _note_dump_gaps(dumps, problems)
    world = max(rank_calls) + 1
    config = layout or read_layout(files[0].parent, world, problems)
    if config is None and (directory / "layout.yaml").exists():
        from megatrace.config import load_layout
        try:
            config = load_layout(directory / "layout.yaml")
        except LayoutError:
            config = None
    if config is not None:
        world = max(world, config.world_size)
    hashed = {rank: any(c[5] is not None for c in calls) for rank, calls in rank_calls.items() if calls}
    with_hash = any(hashed.values())
    if with_hash and not all(hashed.values()):
        plain = min(r for r, h in hashed.items() if not h)
        raise ImportFormatError(f"{paths[plain]}: no groupHash, while {paths[min(r for r, h in hashed.items() if h)]} "
                                f"has them (logs of two NCCL builds mixed)")

    comm_of = _communicators(rank_calls, config, with_hash, problems)

    # send/recv of communicators of 3+ ranks name no peer: inferred, knowing which logs ended early (from the
    # collectives alone, whose places do not depend on the peers)
    ranks, lines, _ = _columns(rank_calls, comm_of, {}, config, paths)
    early = _ended_early(ranks, *_instances(ranks), dumps, None)
    partners = p2p_partners(rank_calls, comm_of, config, early)
    ranks, lines, names = _columns(rank_calls, comm_of, partners, config, paths)
    ended = _infer_states(ranks, {gid: tuple(e["ranks"]) for gid, e in lines.items()}, dumps, problems)
    n = sum(len(r) for r in ranks)
    problems.append(LoadProblem("info", "imported", f"imported {plural(n, 'call')} of {plural(len(ranks), 'rank')} "
                                f"from Megatrace NCCL logs (enqueue times only: completions inferred)"))
    trace = build_traceset(directory, NAME, ranks, world, problems, config, names=names,
                           inferred="the logs hold enqueue times only: completions were inferred from arrivals",
                           completions="arrivals")
    trace.rank_info = [dataclasses.replace(i, ended_early=True) if i.rank in ended else i for i in trace.rank_info]
    if not with_hash:  # communicators inferred from streams: calls of different ones may have been joined
        trace.groups = {gid: dataclasses.replace(g, assigned=len(g.ranks) > 1) for gid, g in trace.groups.items()}
    return trace


def _communicators(rank_calls: dict[int, list[tuple]], config: Layout | None, with_hash: bool,
                   problems: list[LoadProblem]) -> dict[tuple[int, int], tuple[str, tuple[int, ...]]]:
    """The communicator of every call: (rank, row) -> (key, members); from the groupHash where the logs carry
    it, else inferred from each rank's streams."""
    comm_of: dict[tuple[int, int], tuple[str, tuple[int, ...]]] = {}  # (rank, row) -> ...
    if with_hash:
        users: dict[int, set[int]] = {}
        for rank, calls in rank_calls.items():
            for c in calls:
                users.setdefault(c[5], set()).add(rank)
        members_of = {}
        for h, us in users.items():
            members = tuple(sorted(us))
            kind = layout_kind(members, config)
            if config is not None and not kind and len(members) >= 2:
                for k in GROUP_KINDS:  # a member that never logged on it (its ring wrapped, or it hung first)
                    full = tuple(config.group_of(k, members[0]))
                    if set(members) < set(full) and getattr(config, k) > 1:
                        members = full
                        break
            members_of[h] = members
        for rank, calls in rank_calls.items():
            for i, c in enumerate(calls):
                comm_of[(rank, i)] = (f"hash:{c[5]}", members_of[c[5]])
    else:
        chans = assign_streams(rank_calls, config, problems)
        for rank, calls in rank_calls.items():
            for i, c in enumerate(calls):
                comm_of[(rank, i)] = chans[(rank, c[3])]
        problems.append(LoadProblem(
            "info", "nccl-log-inferred", "the logs carry no groupHash: communicators were inferred from each rank's "
            "streams, the calls on them and the layout" + ("" if config is not None else " (no layout: only streams "
                                                           "every rank has are taken as world-wide)")))
    return comm_of


def _columns(rank_calls: dict[int, list[tuple]], comm_of: dict[tuple[int, int], tuple[str, tuple[int, ...]]],
             partners: dict[tuple[int, int], tuple[int, int]], config: Layout | None, paths: dict[int, str]
             ) -> tuple[list[ImportedRank], dict[int, dict], dict[int, tuple[str, str]]]:
    """Every rank's calls as columns, places numbered densely per communicator (and send/recv channel); the
    group lines and names of the communicators. ``partners``: the inferred peer and place of send/recv on
    communicators of 3+ ranks (:func:`p2p_partners`; without them those calls name no peer)."""
    ranks: list[ImportedRank] = []
    keys: dict[int, np.ndarray] = {}
    chan_keys: dict[int, np.ndarray] = {}
    lines: dict[int, dict] = {}
    names: dict[int, tuple[str, str]] = {}
    gid_of: dict[str, int] = {}
    sole: dict[tuple[str, int], int] = {}  # (communicator, rank) -> the one other member of a pair (-1: not a pair)
    code = {name: int(op) for name, op in FUNCS.items()}
    send, recv = int(Op.SEND), int(Op.RECV)
    for rank in sorted(rank_calls):
        calls = rank_calls[rank]
        n_calls = len(calls)
        gids, ops, peers, key, chan = [0] * n_calls, [0] * n_calls, [-1] * n_calls, [-1] * n_calls, [0] * n_calls
        slot: Counter = Counter()
        for i, c in enumerate(calls):
            ckey, members = comm_of[(rank, i)]
            gid = gid_of.get(ckey)
            if gid is None:
                gid = gid_of[ckey] = group_id("nccl", ckey)
                desc = layout_kind(members, config)
                lines[gid] = {"kind": "group", "gid": gid, "name": ckey, "desc": desc, "ranks": list(members),
                              "backend": "nccl"}
                names[gid] = (ckey, desc)
            op = code[c[1]]
            gids[i], ops[i] = gid, op
            if op == send or op == recv:
                other = sole.get((ckey, rank))
                if other is None:
                    other = sole[(ckey, rank)] = (members[1] if members[0] == rank else members[0]) \
                        if len(members) == 2 and rank in members else -1
                peer = other if other >= 0 else partners.get((rank, i), (-1, 0))[0]
                peers[i] = peer
                src, dst = (rank, peer) if op == send else (peer, rank)
                chan[i] = (src + 1) << 21 | (dst + 1)
                place = (gid, c[4], op, peer)
            else:
                place = (gid, c[4], 0, -1)
            n = slot[place]
            slot[place] = n + 1
            key[i] = partners[(rank, i)][1] if (rank, i) in partners else c[4] * OP_SLOTS + n
        cols = new_columns(n_calls)
        cols["group_id"][:], cols["op"][:], cols["peer"][:] = gids, ops, peers
        cols["t_enqueue"][:] = [c[0] for c in calls]
        cols["nbytes"][:] = [c[2] for c in calls]
        ranks.append(ImportedRank(rank, paths[rank], cols, groups=[]))
        keys[rank], chan_keys[rank] = np.array(key, np.int64), np.array(chan, np.int64)
    dense_group_seq(ranks, keys, chan_keys)
    for r in ranks:
        r.groups = [lines[g] for g in np.unique(r.columns["group_id"]).tolist()]
    return ranks, lines, names


def _instances(ranks: list[ImportedRank]) -> tuple[dict[int, np.ndarray], dict, dict]:
    """(rank -> instance / pair key per row, instance -> (group, channel, place), rank -> channel -> last place)."""
    inst: dict[int, np.ndarray] = {}
    for r in ranks:
        c = r.columns
        p2p = (c["op"] == Op.SEND) | (c["op"] == Op.RECV)
        src = np.where(c["op"] == Op.SEND, r.rank, c["peer"])
        dst = np.where(c["op"] == Op.SEND, c["peer"], r.rank)
        inst[r.rank] = np.array([hash((int(g), int(s), int(d), int(q)) if p else (int(g), int(q)))
                                 for g, q, p, s, d in zip(c["group_id"], c["group_seq"], p2p, src, dst)],
                                dtype=np.int64) if len(r) else np.empty(0, np.int64)
    return (inst, *_channel_seqs(ranks, inst))


def _infer_states(ranks: list[ImportedRank], members: dict[int, tuple[int, ...]],
                  dumps: dict[int, dict[int, list[int]]] | None = None,
                  problems: list[LoadProblem] | None = None) -> dict[int, int]:
    """Completed (at the last arrival) or not, per call; see the module docstring. Sets state, t_complete, flags.
    ``dumps``: rank -> save_count -> [first, last] line time. Returns the ranks whose log ended early -> their
    last call (:func:`_ended_early`)."""
    start = {r.rank: int(r.columns["t_enqueue"].min()) if len(r) else 0 for r in ranks}
    inst, where, last_seq = _instances(ranks)
    arrivals: dict[int, list[tuple[int, int, int]]] = {}  # instance -> (rank, row, t)
    for r in ranks:
        for row, (k, t) in enumerate(zip(inst[r.rank].tolist(), r.columns["t_enqueue"].tolist())):
            arrivals.setdefault(k, []).append((r.rank, row, t))
    expected: dict[int, set[int]] = {}
    for r in ranks:
        c = r.columns
        for row, k in enumerate(inst[r.rank].tolist()):
            if k in expected:
                continue
            op = c["op"][row]
            if op in (Op.SEND, Op.RECV):
                peer = int(c["peer"][row])
                expected[k] = {r.rank, peer} if peer >= 0 else {r.rank}
            else:
                expected[k] = set(members.get(int(c["group_id"][row]), (r.rank,)))
    last = {k: max(t for _, _, t in a) for k, a in arrivals.items()}
    ended = _ended_early(ranks, inst, where, last_seq, dumps or {}, problems)
    ok = {}
    for k, a in arrivals.items():
        present = {rk for rk, _, _ in a}
        g, chan, seq = where[k]
        missing = set()
        for m in expected[k] - present:
            logged_to = last_seq.get(m, {}).get((g, chan))
            if logged_to is not None and seq <= logged_to:
                continue  # m logged a later call of this channel, so it made this one: its log lost it
            if m in start and start[m] > last[k]:
                continue  # m's log starts after this call's last arrival (its ring wrapped)
            if m in ended and (logged_to is not None or min(t for _, _, t in a) > ended[m]):
                continue  # m's log ended early (its later dumps are missing): the call is after its window
            missing.add(m)
        ok[k] = not missing
    # a GPU stream runs in order: after a call that cannot complete, nothing of that rank completes
    changed = True
    while changed:
        changed = False
        for r in ranks:
            ks = inst[r.rank].tolist()
            stuck = next((i for i, k in enumerate(ks) if not ok[k]), None)
            if stuck is None:
                continue
            for k in ks[stuck + 1:]:
                if ok[k]:
                    ok[k] = False
                    changed = True
    for r in ranks:
        c = r.columns
        ks = inst[r.rank].tolist()
        done = np.array([ok[k] for k in ks], bool)
        c["state"][:] = np.where(done, State.COMPLETED, State.ENQUEUED)
        c["t_complete"][:] = np.where(done, np.array([last[k] for k in ks], np.int64) if ks else 0, 0)
        c["flags"][:] = np.where(done, 0, Flag.ASYNC)  # queued behind the first stuck call ...
        first = np.flatnonzero(~done)
        if len(first):
            c["flags"][first[0]] = 0  # ... which is the call the rank waits in
    return ended


LEAD_MIN = 2  # collectives another member logged past a rank's last one, at the least, for its log to have ended early


def _channel_seqs(ranks: list[ImportedRank], inst: dict[int, np.ndarray]
                  ) -> tuple[dict[int, tuple[int, object, int]], dict[int, dict[tuple[int, object], int]]]:
    """(instance -> (group, channel, place), rank -> (group, channel) -> the last place it logged). The channel
    is 0 for a collective, (source, destination) for a send/recv."""
    where: dict[int, tuple[int, object, int]] = {}
    last_seq: dict[int, dict[tuple[int, object], int]] = {}
    for r in ranks:
        c = r.columns
        mine = last_seq.setdefault(r.rank, {})
        for k, g, q, op, peer in zip(inst[r.rank].tolist(), c["group_id"].tolist(), c["group_seq"].tolist(),
                                     c["op"].tolist(), c["peer"].tolist()):
            chan: object = 0 if op not in (Op.SEND, Op.RECV) else (r.rank, peer) if op == Op.SEND else (peer, r.rank)
            where.setdefault(k, (g, chan, q))
            if q > mine.get((g, chan), -1):
                mine[(g, chan)] = q
    return where, last_seq


def _note_dump_gaps(dumps: dict[int, dict[int, list[int]]], problems: list[LoadProblem]) -> None:
    """An info note for logs whose save_counts skip numbers: dumps lost in between. Their calls are judged by the
    in-order rule (a member that logged a later call of a channel made the earlier ones), not taken as missing."""
    gaps = {rank: _missing_runs(sorted(d)) for rank, d in dumps.items() if d}  # from the numbers seen: never
    gaps = {rank: g for rank, g in gaps.items() if g}                            # a range as wide as a bad one
    if gaps:
        worst = max(gaps, key=lambda r: sum(b - a + 1 for a, b in gaps[r]))
        shown = [n for a, b in gaps[worst][:12] for n in range(a, min(b, a + 11) + 1)][:12]
        total = sum(b - a + 1 for a, b in gaps[worst])
        runs = rank_list(shown) if total == len(shown) else \
            f"[{', '.join(map(str, shown))}, … {total - len(shown)} more]"
        problems.append(LoadProblem(
            "info", "nccl-log-gaps", f"the logs of {plural(len(gaps), 'rank')} lack dumps between their first and last "
            f"(save_count gaps; rank {worst}: {runs}): their calls in between are unobserved, "
            f"and a rank that logged a later call of a communicator is taken to have made the earlier ones: ranks "
            f"{rank_list(sorted(gaps))}", ranks=tuple(sorted(gaps))))


def _missing_runs(seen: list[int]) -> list[tuple[int, int]]:
    """The runs of numbers missing between consecutive ``seen`` (sorted) ones: [(first, last), ...]."""
    return [(a + 1, b - 1) for a, b in zip(seen, seen[1:]) if b > a + 1]


def _ended_early(ranks: list[ImportedRank], inst: dict[int, np.ndarray], where: dict[int, tuple[int, object, int]],
                 last_seq: dict[int, dict[tuple[int, object], int]], dumps: dict[int, dict[int, list[int]]],
                 problems: list[LoadProblem] | None) -> dict[int, int]:
    """Ranks whose log ends before their part of the job did (their later dumps are missing) -> their last call.

    A log that ends is either a rank that stopped (a hang: it goes idle, the patch dumps what it has, and
    nothing comes after) or a file that lost its later dumps. What the other ranks did after it tells them
    apart. Let ``y`` share a communicator with ``m`` and have logged at least :data:`LEAD_MIN` collectives of
    it after ``m``'s last one. Had ``m`` stopped, ``y`` would wait in the first of them for ever: a blocking
    call never returns, and an NCCL collective queued behind a stuck one never completes, so a host that
    waits for it goes idle and never resumes. So ``m``'s log ended early when, besides, ``y`` went on past
    that first call in a way only progress explains: it went idle and resumed (one of its dumps ends between
    the first and the last of those calls: the patch dumps when a rank was idle for its sensitivity time),
    or its calls there go on longer after ``m``'s last call than the shortest idle that ever preceded a dump
    in these logs (a stand-in for that sensitivity). Such an ``m`` is unobserved after its last call, not
    stopped: the calls of its communicators after its window are not counted as missing on it, and a
    warning says so (no hang is inferred from the end of its log).

    Only collectives count: a send may complete before its receive is posted (eager transports), so sends to a
    stopped rank can run ahead of it. Limits: a rank whose lost dumps held less than :data:`LEAD_MIN`
    collectives more than its partners' logs show still looks stopped (briefly: at most a possible hang); a
    partner that queued many asynchronous collectives and idled between them for reasons of its own, for longer
    than the shortest idle before a dump, would hide a real hang.
    """
    times: dict[tuple[int, object], dict[int, tuple[list[int], list[int]]]] = {}  # channel -> rank -> (places, t)
    for r in ranks:
        for k, t in zip(inst[r.rank].tolist(), r.columns["t_enqueue"].tolist()):
            g, chan, q = where[k]
            if chan == 0:
                qs, ts = times.setdefault((g, chan), {}).setdefault(r.rank, ([], []))
                qs.append(q)
                ts.append(t)
    ends = {rank: np.sort(np.array([span[1] for span in d.values()], np.int64)) for rank, d in dumps.items()}
    idle = math.inf  # the shortest idle before a dump: from a dump's last line to the rank's next call
    for r in ranks:
        t_all = np.sort(r.columns["t_enqueue"])
        for end in ends.get(r.rank, np.empty(0, np.int64))[:-1].tolist():
            k = int(np.searchsorted(t_all, end, "right"))
            if k < len(t_all):
                idle = min(idle, int(t_all[k]) - end)
    top = {ch: max(max(qs) for qs, _ in by.values()) for ch, by in times.items()}
    out: dict[int, int] = {}
    for r in ranks:
        if not len(r):
            continue
        e_m = int(r.columns["t_enqueue"].max())
        for ch, q_m in last_seq.get(r.rank, {}).items():
            if ch not in times or top[ch] - q_m < LEAD_MIN:
                continue
            for y, (qs, ts) in times[ch].items():
                beyond = [t for q, t in zip(qs, ts) if q > q_m]
                if y == r.rank or len(beyond) < LEAD_MIN:
                    continue
                d = ends.get(y, np.empty(0, np.int64))
                k = int(np.searchsorted(d, min(beyond), "left"))
                if (k < len(d) and d[k] < max(beyond)) or max(beyond) - e_m > idle:
                    out[r.rank] = e_m
                    break
            if r.rank in out:
                break
    if out and problems is not None:
        latest = max(int(r.columns["t_enqueue"].max()) for r in ranks if len(r))
        worst = min(out, key=lambda q: out[q])
        problems.append(LoadProblem(
            "warning", "nccl-log-window",
            f"the logs of {plural(len(out), 'rank')} end before the job did (their later dumps are missing: ranks "
            f"sharing a communicator with them went on with collectives they never logged): their calls after "
            f"that are unobserved, not missing, and no hang is inferred from it; rank {worst}'s log ends "
            f"{(latest - out[worst]) / 1e6:.1f} ms before the last call of the trace: ranks {rank_list(sorted(out))}",
            ranks=tuple(sorted(out))))
    return out
