"""What each Flight Recorder dump covers, and what its rank did outside that: positions, pairing, windows.

A dump holds a window of its rank's calls: the newest ``TORCH_FR_BUFFER_SIZE`` entries of a ring, or,
in the watchdog's dumps of NCCL jobs, only the calls still in flight (every completed one is left out;
the dumps of NVIDIA's resiliency tests are of that kind). Windows differ from rank to rank, so a call
another member has no entry for is either one it never made (what a hang leaves) or one outside its
window. Three facts tell them apart, all in sequence numbers (the hosts' clocks are not comparable:
dumps of one job measured 330 ms apart):

* ``pg_status`` (per *local* pg id: last enqueued, last completed): how far the rank got in each group,
  whatever its window holds (:func:`pg_positions` maps the local ids to group names);
* a member that has an entry of a channel (a group's collectives, or one direction of a send/recv pair)
  made every earlier call of that channel (calls of a channel are made in order);
* ``p2p_seq_id`` numbers a rank's send/recv per group; where those numbers agree across ranks (checked on
  the dumps: :func:`aligned_p2p_groups`) they place a send and its receive on one scale, as
  ``collective_seq_id`` does for collectives.

:func:`judge_windows` then leaves out, on every rank, each call some participant made outside its window
(it cannot be judged: who completed it is unknown), marks the calls a rank's ``pg_status`` shows completed,
and keeps the calls a participant never made: those are the facts of a hang. :func:`common_window` keeps
the completed calls of all ranks to one stretch of time, for the timing analyses (on one host's clock).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from megatrace.load.importers.common import ImportedRank, shown
from megatrace.load.traceset import LoadProblem, plural, rank_list
from megatrace.trace.ring_format import Op

P2P = (Op.SEND, Op.RECV)
NO_POSITION = -(1 << 62)  # below every sequence number


@dataclass(frozen=True)
class Position:
    """How far one rank got in one group (``pg_status``): the last call enqueued and the last completed."""

    enqueued: int
    completed: int


@dataclass
class Calls:
    """Per rank, per row of its :class:`ImportedRank`: the channel and the sequence key of each call.

    ``chan`` is (gid, -1, -1) for a collective and (gid, src, dst) for a send/recv; ``key`` the
    ``collective_seq_id`` of a collective, and of a send/recv its ``p2p_seq_id`` (on groups where those agree
    across ranks) or its place in its channel from the start of the window."""

    chan: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    key: dict[int, np.ndarray] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # gid -> group name
    labels: dict[int, str] = field(default_factory=dict)  # gid -> its description (what the user calls it)


def pg_positions(dumps: dict[int, tuple[str, dict]], problems: list[LoadProblem]) -> dict[tuple[int, str], Position]:
    """(rank, group name) -> :class:`Position`, from each dump's ``pg_status``.

    ``pg_status`` is keyed by the rank's local pg id, which its entries pair with a group name. A rank
    without an entry of some group (one whose calls had all completed) is paired by creation order: both
    the local ids and torch's default group names (decimal counters) grow as groups are created, so the k-th
    id goes with the k-th name of the rank's ``pg_config``. That pairing is used only when every pair the
    entries show, on every rank, agrees with it. A ``pg_status`` that is not the expected shape is a
    warning naming the file and field, and is not used.
    """
    direct: dict[int, dict[str, str]] = {}
    statuses: dict[int, dict[str, Position]] = {}
    ordered: dict[int, dict[str, str]] = {}
    for rank, (path, dump) in dumps.items():
        status = _status(path, dump.get("pg_status"), problems)
        if status is None:
            continue
        statuses[rank] = status
        direct[rank] = {str(e["pg_id"]): str(e["process_group"][0]) for e in dump["entries"]
                        if type(e.get("pg_id")) in (int, str)}
        names = list(dump.get("pg_config") or {})
        if all(isinstance(n, str) and n.isdecimal() for n in names) and all(k.isdecimal() for k in status) \
                and len(names) == len(status):
            ordered[rank] = dict(zip(sorted(status, key=int), sorted(names, key=int), strict=True))
    evidence = [r for r in direct if direct[r]]
    by_order = bool(evidence) and all(r in ordered and all(ordered[r].get(k) == v for k, v in direct[r].items())
                                      for r in evidence)
    out: dict[tuple[int, str], Position] = {}
    unmapped = []
    for rank, status in statuses.items():
        names = {**(ordered.get(rank, {}) if by_order else {}), **direct[rank]}
        for pg, pos in status.items():
            if pg in names:
                out[(rank, names[pg])] = pos
            elif pos.enqueued > pos.completed:
                unmapped.append(rank)
    if unmapped:
        problems.append(LoadProblem("info", "fr-pg-status", f"pg_status of {plural(len(set(unmapped)), 'rank')} "
                                    f"names groups by local id only, with calls in flight: those positions were "
                                    f"not used: ranks {rank_list(sorted(set(unmapped)))}",
                                    ranks=tuple(sorted(set(unmapped)))))
    return out


def _status(path: str, raw: object, problems: list[LoadProblem]) -> dict[str, Position] | None:
    if raw is None:
        return None
    bad = None
    out: dict[str, Position] = {}
    if not isinstance(raw, dict):
        bad = f"field pg_status: expected local pg id -> {{last_enqueued_collective, last_completed_collective}}, " \
              f"got {shown(raw)}"
    else:
        for pg, s in raw.items():
            enq = s.get("last_enqueued_collective") if isinstance(s, dict) else None
            done = s.get("last_completed_collective") if isinstance(s, dict) else None
            if type(pg) not in (str, int) or type(enq) is not int or type(done) is not int:
                bad = f"field pg_status[{shown(pg)}]: expected last_enqueued_collective and " \
                      f"last_completed_collective (integers), got {shown(s)}"
                break
            out[str(pg)] = Position(enq, done)
    if bad is not None:
        problems.append(LoadProblem("warning", "fr-pg-status", f"{path}: {bad}; not used", paths=(path,)))
        return None
    return out


def aligned_p2p_groups(ranks: list[ImportedRank], p2p_key: dict[int, np.ndarray],
                       chans: dict[int, list[tuple[int, int, int]]], kinds: dict[int, str]) -> set[int]:
    """Groups whose send/recv ``p2p_seq_id`` agree across ranks, judged per kind of group (``kinds``: gid -> its
    description, e.g. every pipeline group of a job): every channel of the kind whose two sides both have
    entries shows the same numbers on both sides where their ranges overlap, at least one channel overlaps,
    and no rank repeats a number in a channel. (Each rank counts its own send/recv per group, so the numbers
    agree when the two sides of a channel issue the same sequence, as pipeline stages do; where they do not,
    places in the channel are counted from the start of each window instead.)"""
    sends: dict[tuple[int, int, int], list[int]] = {}
    recvs: dict[tuple[int, int, int], list[int]] = {}
    for r in ranks:
        op = r.columns["op"]
        for i, ch in enumerate(chans[r.rank]):
            if ch[1] < 0:
                continue
            (sends if op[i] == Op.SEND else recvs).setdefault(ch, []).append(int(p2p_key[r.rank][i]))
    seen: set[str] = set()
    bad: set[str] = set()
    for ch in set(sends) | set(recvs):
        gid = kinds.get(ch[0], str(ch[0]))
        s, v = sorted(sends.get(ch, [])), sorted(recvs.get(ch, []))
        if len(set(s)) < len(s) or len(set(v)) < len(v) or min(s + v, default=0) < 0:
            bad.add(gid)
            continue
        if not s or not v:
            continue
        lo, hi = max(s[0], v[0]), min(s[-1], v[-1])
        if lo > hi:
            continue
        if [k for k in s if lo <= k <= hi] != [k for k in v if lo <= k <= hi]:
            bad.add(gid)
        seen.add(gid)
    return {g for r in ranks for g in set(r.columns["group_id"].tolist()) if kinds.get(g, str(g)) in seen - bad}


def judge_windows(ranks: list[ImportedRank], calls: Calls, members: dict[int, tuple[int, ...]],
                  positions: dict[tuple[int, str], Position], p2p_space: set[int],
                  problems: list[LoadProblem]) -> dict[int, str]:
    """Leave out the calls some participant made outside its window; mark those ``pg_status`` shows completed.

    A participant without an entry of a call made it when it got further in the channel: it has an entry
    with a later key there, or its ``pg_status`` position in the group (on the scale of the group's calls:
    collective numbers for a group of collectives only, ``p2p_seq_id`` for one of aligned send/recv only) is
    at or past the key. Such a call is left out on every rank. A call no participant got past stays: a
    participant that never made it is what the others wait for. ``members``: gid -> ranks (a collective's
    participants). Returns notes per rank on what its position shows (for the hang's evidence)."""
    through: dict[tuple[int, int, int], dict[int, int]] = {}  # channel -> rank -> how far it got
    space = _key_space(ranks, calls, p2p_space)
    for r in ranks:
        for ch, k in zip(calls.chan[r.rank], calls.key[r.rank].tolist()):
            mine = through.setdefault(ch, {})
            mine[r.rank] = max(mine.get(r.rank, NO_POSITION), k)
    for ch, mine in through.items():
        if space.get(ch[0]) is None:
            continue
        for rank in _participants(ch, members, mine):
            pos = positions.get((rank, calls.names.get(ch[0], "")))
            if pos is not None:
                mine[rank] = max(mine.get(rank, NO_POSITION), pos.enqueued)
    have: dict[tuple[tuple[int, int, int], int], int] = {}  # (channel, key) -> ranks with an entry
    for r in ranks:
        for ch, k in zip(calls.chan[r.rank], calls.key[r.rank].tolist()):
            have[(ch, k)] = have.get((ch, k), 0) + 1
    reach = {ch: sorted(mine.values()) for ch, mine in through.items()}
    unjudged = {ck for ck, n in have.items() if len(reach[ck[0]]) - bisect.bisect_left(reach[ck[0]], ck[1]) > n}
    notes = _position_notes(ranks, calls, positions, space)
    left_out, emptied = 0, []
    for r in ranks:
        keep = np.array([(ch, k) not in unjudged for ch, k in zip(calls.chan[r.rank], calls.key[r.rank].tolist())],
                        bool)
        done = np.array([space.get(ch[0]) is not None and k <= positions.get(
            (r.rank, calls.names.get(ch[0], "")), Position(NO_POSITION, NO_POSITION)).completed
            for ch, k in zip(calls.chan[r.rank], calls.key[r.rank].tolist())], bool)
        if r.done is not None:
            r.done |= done
        left_out += int((~keep).sum())
        if len(keep) and not keep.any():
            emptied.append(r.rank)
        _keep_rows(r, calls, keep)
    if left_out:
        problems.append(LoadProblem(
            "info", "fr-windows", f"{left_out} {'entry' if left_out == 1 else 'entries'} of calls another "
            f"participant made outside its dump's window (its ring dropped them, or they had completed and the dump "
            f"kept only calls in flight) were left out: only calls every participant's dump covers are judged"
            + (f"; none is left of ranks {rank_list(emptied)}: every call in their dumps is one the others "
               f"had gone past" if emptied else ""), ranks=tuple(emptied)))
    return notes


def _key_space(ranks: list[ImportedRank], calls: Calls, p2p_space: set[int]) -> dict[int, str | None]:
    """gid -> "collective", "p2p" or None: which numbers a group's ``pg_status`` positions count (the group's
    calls are all collectives, or all send/recv whose ``p2p_seq_id`` agree; else its positions are not used)."""
    kinds: dict[int, set[str]] = {}
    for r in ranks:
        for ch in calls.chan[r.rank]:
            kinds.setdefault(ch[0], set()).add("p2p" if ch[1] >= 0 else "collective")
    return {gid: (k.pop() if len(k) == 1 and (k != {"p2p"} or gid in p2p_space) else None)
            for gid, k in kinds.items()}


def _participants(ch: tuple[int, int, int], members: dict[int, tuple[int, ...]], mine: dict[int, int]) -> list[int]:
    return [ch[1], ch[2]] if ch[1] >= 0 else list(members.get(ch[0]) or mine)


def _position_notes(ranks: list[ImportedRank], calls: Calls, positions: dict[tuple[int, str], Position],
                    space: dict[int, str | None]) -> dict[int, str]:
    """Per rank, what its ``pg_status`` says about its stop: calls it enqueued that every other member completed
    but it did not (its device work stopped), or every call it enqueued completed and none is in its dump
    (its host stopped issuing calls)."""
    gid_of = {name: gid for gid, name in calls.names.items()}
    lowest: dict[int, list[tuple[int, int]]] = {}  # gid -> the two lowest (completed, rank) of its members
    by_rank: dict[int, list[Position]] = {}
    for (rank, name), pos in positions.items():
        by_rank.setdefault(rank, []).append(pos)
        gid = gid_of.get(name)
        if gid is not None and space.get(gid) == "collective":
            lowest[gid] = sorted(lowest.get(gid, []) + [(pos.completed, rank)])[:2]
    notes: dict[int, str] = {}
    for r in ranks:
        behind: list[tuple[int, int]] = []
        for ch, k in zip(calls.chan[r.rank], calls.key[r.rank].tolist()):
            gid = ch[0]
            own = positions.get((r.rank, calls.names.get(gid, "")))
            if ch[1] >= 0 or space.get(gid) != "collective" or own is None or k <= own.completed:
                continue
            others = [c for c, rank in lowest.get(gid, []) if rank != r.rank]
            if others and others[0] >= k:  # (the lowest of the others: every other member completed it)
                behind.append((k, gid))
        if behind:
            k, gid = behind[0]  # (rows are in the order the rank made them)
            notes[r.rank] = (f"its pg_status shows {plural(len(behind), 'collective')} it enqueued that every other "
                             f"member completed and it never did (its device work stopped), the first "
                             f"{calls.labels.get(gid, calls.names[gid])} #{k}")
    present = {r.rank for r in ranks if len(r)}
    for rank, mine in by_rank.items():
        if rank not in notes and rank not in present and all(p.enqueued == p.completed for p in mine):
            notes[rank] = ("its pg_status shows every call it enqueued completed and none in flight: it stopped "
                           "issuing calls (its host thread stopped, e.g. held the GIL or waited outside "
                           "communication)")
    return notes


def _keep_rows(r: ImportedRank, calls: Calls, keep: np.ndarray) -> None:
    if keep.all():
        return
    for name in r.columns:
        r.columns[name] = r.columns[name][keep]
    r.columns["seq"] = np.arange(1, int(keep.sum()) + 1, dtype=r.columns["seq"].dtype)
    if r.done is not None:
        r.done = r.done[keep]
    calls.chan[r.rank] = [ch for ch, k in zip(calls.chan[r.rank], keep.tolist()) if k]
    calls.key[r.rank] = calls.key[r.rank][keep]


def common_window(ranks: list[ImportedRank], problems: list[LoadProblem]) -> None:
    """Leave out the completed collective instances that lie before some rank's window in time.

    A slow rank's pipeline neighbours wait for it in receives a gloo dump does not record, which only its own
    slowness explains, so ranks are compared across groups: every completed instance with an entry created
    before the latest window start (the first entry of a rank whose ring dropped older entries) is left out on
    every rank. Calls in flight are never left out this way: they are the hang's facts, and the hosts'
    clocks, which this compares, may disagree."""
    late = sorted(r.rank for r in ranks if r.dropped > 0 and len(r))
    if not late:
        return
    start = max(int(r.columns["t_enqueue"].min()) for r in ranks if r.rank in late)
    early: set[tuple[int, int]] = set()
    pending: set[tuple[int, int]] = set()
    for r in ranks:
        c = r.columns
        coll = ~np.isin(c["op"], P2P)
        done = r.done if r.done is not None else np.zeros(len(r), bool)
        keyed = list(zip(c["group_id"].tolist(), c["group_seq"].tolist()))
        for i in np.flatnonzero(coll).tolist():
            if not done[i] and c["state"][i] != 2:
                pending.add(keyed[i])
            elif c["t_enqueue"][i] < start:
                early.add(keyed[i])
    early -= pending
    left_out = 0
    for r in ranks:
        c = r.columns
        drop = ~np.isin(c["op"], P2P) & np.array([k in early for k in zip(c["group_id"].tolist(),
                                                                          c["group_seq"].tolist())], bool)
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
            "info", "fr-common-window", f"the dumps cover different stretches of time (the rings of ranks "
            f"{rank_list(late)} had dropped older entries): {plural(left_out, 'entry')} of completed collectives "
            f"before the common window were left out, so that all ranks are compared over the same time",
            ranks=tuple(late)))
