"""Match one rank's records against its pipeline stage's schedule: which forward/backward each span of compute is.

The pipeline's point-to-point records are the anchors. On stage ``s`` the
schedule (:mod:`megatrace.schedule`) fixes, for every step, the order of the
actions (``F``/``B`` of each microbatch) and the *exchange blocks* between
them: before action ``j`` the receives it needs, after it the sends of what it
produced (Megatron-LM pairs them in one batch, and so does the demo). Each
point-to-point channel carries one message per microbatch per step, so the
``n``-th message of a channel is microbatch ``(n - 1) % mb`` of step
``(n - 1) // mb``, which names its block. The DP gradient sync closes each step
(block ``D``).

Between two consecutive anchors lie the actions of the schedule between them
(one, or a run of several when no communication separates them, e.g. ``F0``
and ``B0`` on the last stage) and the records issued inside them (TP
collectives). A run is split into its actions when its inner records divide
evenly among them (the same number of TP collectives per action); otherwise it
stays one node of the dependency graph. An action's time runs from the
completion of the anchor before it to the enqueue of the anchor after it: the
compute between its boundary communication calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatrace.analyze.index import pair_ids
from megatrace.config import Layout
from megatrace.errors import MegatraceError
from megatrace.load.traceset import TraceSet
from megatrace.schedule import ACT_IN, ACT_OUT, GRAD_IN, GRAD_OUT, SCHEDULES, Action, exchange_blocks
from megatrace.trace.ring_format import Op

# Per-record roles (see megatrace.analyze.iterations.record_roles).
OTHER, MARKER, TP, DP, PP_OTHER = 0, 1, 2, 3, 8  # and the p2p roles ACT_IN..GRAD_OUT (4-7) of megatrace.schedule
P2P_ROLES = (ACT_IN, ACT_OUT, GRAD_IN, GRAD_OUT)
ROLE_NAMES = ("other", "marker", "tp", "dp", "act-in", "act-out", "grad-in", "grad-out", "pp-other")
P2P = np.isin(np.arange(len(ROLE_NAMES)), P2P_ROLES)  # role -> is a pipeline p2p anchor
ANCHOR = P2P | (np.arange(len(ROLE_NAMES)) == DP)  # role -> is an anchor (p2p or the DP sync)


class Local:
    """A rank's stretch of a per-record column, indexed by absolute row (ints or arrays)."""

    def __init__(self, values: np.ndarray, lo: int) -> None:
        self.values, self.lo = values, lo

    def __getitem__(self, idx: Any) -> Any:
        return self.values[idx - self.lo]


def done_local(te: np.ndarray, tc: np.ndarray, rows: np.ndarray) -> Local:
    """Completion times (the enqueue where none was recorded) over the row range of ``rows``."""
    lo, hi = (int(rows.min()), int(rows.max()) + 1) if len(rows) else (0, 0)
    return Local(np.where(tc[lo:hi] > 0, tc[lo:hi], te[lo:hi]), lo)


class SegmentError(MegatraceError, ValueError):
    """The records do not follow the expected schedule; the message says where."""


@dataclass
class RankSegments:
    """One rank's steps cut into schedule actions and exchange blocks (times in aligned ns, rows absolute).

    Arrays are indexed by the position of a step in ``steps`` and by action ``j`` (``[n, A]``) or block ``j``
    (``[n, A + 1]``). A step missing on this rank has ``ok[i] == False``.
    """

    rank: int
    stage: int
    actions: list[Action]
    steps: np.ndarray  # step numbers
    ok: np.ndarray  # [n] bool: the step was fully matched on this rank
    act_start: np.ndarray  # [n, A] int64
    act_end: np.ndarray  # [n, A]
    act_lo: np.ndarray  # [n, A] first row of the inner records (TP collectives) of the action's run slice
    act_hi: np.ndarray  # [n, A] one past the last
    act_run: np.ndarray  # [n, A] run id: actions of one step with the same id form one graph node
    blk_present: np.ndarray  # [n, A+1] bool: an exchange block is expected there
    blk_first: np.ndarray  # [n, A+1] first enqueue of the block
    blk_ready: np.ndarray  # [n, A+1] when both sides of every op had arrived
    blk_done: np.ndarray  # [n, A+1] last completion
    blk_peer: np.ndarray  # [n, A+1] partner of the op that finished last after being ready (-1 none)
    prev_end: np.ndarray  # [n] end of the rank's previous step (last anchor completion), -1 unknown
    dp_first: np.ndarray  # [n] first enqueue of the DP sync block (0 when no DP)
    dp_done: np.ndarray  # [n] its last completion
    dag_problem: str | None = None  # set when a run of actions cannot be split across a step boundary
    head_unknown: set[int] = field(default_factory=set)  # step indexes whose first action's start is a lower bound


def _split(run: list[tuple[int, int]], inner: np.ndarray, start: int, end: int, tc: np.ndarray,
           ) -> list[tuple[int, int, int, int]] | None:
    """(start, end, lo, hi) per action of a run, or None if the inner records do not divide evenly."""
    m, n = len(run), len(inner)
    if m == 1:
        return [(start, end, 0, n)]
    if n == 0 or n % m:
        return None
    q = n // m
    out = []
    for i in range(m):
        s = start if i == 0 else int(tc[inner[i * q - 1]])
        e = end if i == m - 1 else int(tc[inner[(i + 1) * q - 1]])
        out.append((s, e, i * q, (i + 1) * q))
    return out


def segment_rank(rank: int, stage: int, num_stages: int, actions: list[Action], rows: np.ndarray,
                 role: np.ndarray, group_seq: np.ndarray, te: np.ndarray, tc: np.ndarray, peer: np.ndarray,
                 partner_te: np.ndarray | Local, microbatches: int, dp_per_step: int,
                 steps: np.ndarray) -> RankSegments:
    """Cut one rank's records into the schedule's actions for each step in ``steps`` (sorted, gaps allowed).

    ``rows``: the rank's non-marker rows in order (all of them, or only those of ``steps`` when the steps have
    gaps); ``role``/``group_seq``/``te``/``tc``/``peer`` are per-record columns and ``partner_te`` the enqueue
    time of each p2p record's match (0 if none), indexable by row. ``dp_per_step``: DP collectives per step
    (0 when there is no DP sync). A step right after a gap
    has no known start (``prev_end`` -1). Raises :class:`SegmentError` when the records contradict the schedule.
    """
    blocks = exchange_blocks(actions, stage, num_stages)
    n_act = len(actions)
    nst = len(steps)
    tc = done_local(te, tc, rows)  # completion, or the enqueue where none was recorded
    anchor_of, earlier = _anchors(rank, stage, blocks, n_act, rows, role, group_seq, microbatches, dp_per_step,
                                  steps)
    seg = _empty_segments(rank, stage, actions, steps)

    # Which steps have every expected anchor, with the expected number of records.
    complete = np.zeros(nst, bool)
    for i in range(nst):
        good = all(len(anchor_of.get((i, j), ())) == len(blk) for j, blk in enumerate(blocks) if blk)
        if dp_per_step > 0:
            good = good and len(anchor_of.get((i, n_act + 1), ())) == dp_per_step
        complete[i] = good

    slots = _slots(steps, blocks, n_act, dp_per_step)

    walk = _Walk(seg, rows, role, te, tc, actions, steps)
    if earlier >= 0:  # records of steps before the analysed ones: start after them
        walk.broken([earlier])
    for kind, i, j in slots:
        if kind == "A":
            if complete[i]:
                walk.run.append((i, j))
            continue
        if kind == "GAP":
            walk.close_trailing()
            walk.broken(())
            continue
        if not complete[i]:
            walk.close_trailing()
            walk.broken(anchor_of.get((i, j), ()))
            continue
        mine = anchor_of[(i, j)]
        lo_pos, hi_pos = min(mine), max(mine)
        if lo_pos <= walk.prev_pos:
            raise SegmentError(f"rank {rank}: step {int(steps[i])}: the p2p/DP records are not in schedule order "
                               f"(stage {stage})")
        walk.close(lo_pos, i)
        prow = rows[mine]
        done = int(tc[prow].max())
        if kind == "X":
            first = int(te[prow].min())
            arrive = np.maximum(first, partner_te[prow])
            seg.blk_present[i, j] = True
            seg.blk_first[i, j], seg.blk_done[i, j] = first, done
            seg.blk_ready[i, j] = min(int(arrive.max()), done)
            seg.blk_peer[i, j] = int(peer[prow[int(np.argmax(tc[prow] - arrive))]])
        else:
            seg.dp_first[i], seg.dp_done[i] = int(te[prow].min()), done
        walk.anchored(hi_pos, done)
    walk.close_trailing()

    # A step is fully matched when it was complete and every one of its actions got times.
    seg.ok = complete & (seg.act_run >= 0).all(axis=1) & (seg.act_end >= seg.act_start).all(axis=1)
    _prev_end(seg, blocks, dp_per_step)
    if seg.dag_problem is None:
        seg.dag_problem = walk.problem
    return seg


def _anchors(rank: int, stage: int, blocks: list[list[tuple[int, int]]], n_act: int, rows: np.ndarray,
             role: np.ndarray, group_seq: np.ndarray, microbatches: int, dp_per_step: int,
             steps: np.ndarray) -> tuple[dict[tuple[int, int], list[int]], int]:
    """The anchors of one rank: per (step index in ``steps``, block), their positions in ``rows``; and the last
    position of an anchor of a step before ``steps`` (-1 when none). p2p records name their block through (role,
    microbatch); DP records close their step (block ``n_act + 1``)."""
    nst = len(steps)
    index = {int(k): i for i, k in enumerate(steps)}
    r_role = role[rows]
    pos = np.flatnonzero(ANCHOR[r_role] if dp_per_step > 0 else P2P[r_role])
    seq = group_seq[rows[pos]] - 1
    is_dp = r_role[pos] == DP
    block_of = np.full((len(ROLE_NAMES), microbatches), -1, np.int64)
    for j, blk in enumerate(blocks):
        for rl, mb in blk:
            block_of[rl, mb] = j
    j = np.where(is_dp, n_act + 1, block_of[r_role[pos], seq % microbatches])
    if (j < 0).any():
        bad = int(np.flatnonzero(j < 0)[0])
        raise SegmentError(f"rank {rank}: {ROLE_NAMES[r_role[pos[bad]]]} record #{seq[bad] + 1} does not fit the "
                           f"schedule of stage {stage}")
    step = np.where(is_dp, seq // max(dp_per_step, 1), seq // microbatches)
    anchor_of: dict[tuple[int, int], list[int]] = {}
    earlier = -1
    first_step = int(steps[0]) if nst else 0
    for p, k, jj in zip(pos.tolist(), step.tolist(), j.tolist()):
        i = index.get(k)
        if i is not None:
            anchor_of.setdefault((i, jj), []).append(p)
        elif k < first_step:
            earlier = max(earlier, p)
    return anchor_of, earlier


def _empty_segments(rank: int, stage: int, actions: list[Action], steps: np.ndarray) -> RankSegments:
    """A rank's segments with every step unmatched and no times yet."""
    nst, n_act = len(steps), len(actions)
    shape, shape_b = (nst, n_act), (nst, n_act + 1)
    seg = RankSegments(
        rank=rank, stage=stage, actions=actions, steps=np.asarray(steps), ok=np.zeros(nst, bool),
        act_start=np.zeros(shape, np.int64), act_end=np.zeros(shape, np.int64),
        act_lo=np.zeros(shape, np.int64), act_hi=np.zeros(shape, np.int64), act_run=np.full(shape, -1, np.int64),
        blk_present=np.zeros(shape_b, bool), blk_first=np.zeros(shape_b, np.int64),
        blk_ready=np.zeros(shape_b, np.int64), blk_done=np.zeros(shape_b, np.int64),
        blk_peer=np.full(shape_b, -1, np.int64), prev_end=np.full(nst, -1, np.int64),
        dp_first=np.zeros(nst, np.int64), dp_done=np.zeros(nst, np.int64))
    return seg


def _slots(steps: np.ndarray, blocks: list[list[tuple[int, int]]], n_act: int,
           dp_per_step: int) -> list[tuple[str, int, int]]:
    """The slots in order: ("X", i, j) anchors, ("A", i, j) actions, ("D", i) the DP sync; ("GAP",) between
    steps that do not follow each other."""
    nst = len(steps)
    slots: list[tuple[str, int, int]] = []
    for i in range(nst):
        if i and steps[i] != steps[i - 1] + 1:
            slots.append(("GAP", i, 0))
        for j in range(n_act + 1):
            if blocks[j]:
                slots.append(("X", i, j))
            if j < n_act:
                slots.append(("A", i, j))
        if dp_per_step > 0:
            slots.append(("D", i, n_act + 1))
    return slots


class _Walk:
    """State of the walk over one rank's anchors: the pending run of actions and the last anchor."""

    def __init__(self, seg: RankSegments, rows: np.ndarray, role: np.ndarray, te: np.ndarray, tc: np.ndarray,
                 actions: list[Action], steps: np.ndarray) -> None:
        self.seg, self.rows, self.role, self.te, self.tc, self.actions = seg, rows, role, te, tc, actions
        self.steps = steps
        self.run: list[tuple[int, int]] = []
        self.prev_pos = -1  # last position (in rows) of the previous anchor
        self.last_done: int | None = None  # its completion; None: no anchor before (start unknown)
        self.per_action: list[int] = []  # inner records of single-action runs (to close a trailing run)
        self.problem: str | None = None

    def broken(self, positions: list[int] | tuple[int, ...]) -> None:
        """An incomplete step: what follows has no usable anchor before it."""
        self.run, self.last_done = [], None
        if positions:
            self.prev_pos = max(self.prev_pos, max(positions))

    def anchored(self, hi_pos: int, done: int) -> None:
        self.prev_pos, self.last_done = hi_pos, done

    def close(self, lo_pos: int, step_i: int) -> None:
        """The pending run ends at the anchor starting at position ``lo_pos``."""
        inner = self.rows[self.prev_pos + 1:lo_pos]
        if len(inner) and ANCHOR[self.role[inner]].any():
            raise SegmentError(f"rank {self.seg.rank}: step {int(self.steps[step_i])}: an unexpected p2p or DP record "
                               f"between exchange blocks (stage {self.seg.stage})")
        if self.run:
            self._assign(inner, int(self.te[self.rows[lo_pos]]))
        self.run = []

    def close_trailing(self) -> None:
        """Close a run that no anchor of a complete step ends: at the next record after its inner records."""
        if not self.run:
            return
        rest = self.rows[self.prev_pos + 1:]
        n_inner = 0
        while n_inner < len(rest) and self.role[rest[n_inner]] == TP:
            n_inner += 1
        if self.per_action:
            n_inner = min(n_inner, int(np.median(self.per_action)) * len(self.run))
        if n_inner < len(rest):
            self._assign(rest[:n_inner], int(self.te[rest[n_inner]]))
        self.run = []

    def _assign(self, inner: np.ndarray, end: int) -> None:
        seg, run = self.seg, self.run
        if self.last_done is None:  # no anchor before: the first action's start is only known from its records
            start = int(self.te[inner[0]]) if len(inner) else end
        else:
            start = self.last_done
        parts = _split(run, inner, start, end, self.tc)
        if parts is None:
            if len({i for i, _ in run}) > 1:
                self.problem = (f"on stage {seg.stage}, {_names(self.actions, run)} have no communication between "
                                "them across the step boundary, so the boundary is not observable there")
            parts = [(start, end, 0, len(inner))] * len(run)
            ids = [slot_id(run[0])] * len(run)
        else:
            ids = [slot_id(a) for a in run]
            if len(run) == 1:
                self.per_action.append(len(inner))
        for (ri, rj), (s, e, lo, hi), rid in zip(run, parts, ids):
            seg.act_start[ri, rj], seg.act_end[ri, rj], seg.act_run[ri, rj] = s, e, rid
            if len(inner):
                seg.act_lo[ri, rj], seg.act_hi[ri, rj] = int(inner[0]) + lo, int(inner[0]) + hi
        if self.last_done is None:  # the start is a lower bound: the step's head is not known
            seg.head_unknown.add(run[0][0])


def slot_id(action_slot: tuple[int, int]) -> int:
    i, j = action_slot
    return i * 100_000 + j


def _names(actions: list[Action], run: list[tuple[int, int]]) -> str:
    return "+".join(f"{actions[j][0]}{actions[j][1]}" for _, j in run)


def _prev_end(seg: RankSegments, blocks: list[list[tuple[int, int]]], dp_per_step: int) -> None:
    """``prev_end`` of step i: the completion of the last anchor of step i - 1 (DP sync or last block)."""
    last_blk = max((j for j, b in enumerate(blocks) if b), default=None)
    for i in range(1, len(seg.steps)):
        if seg.steps[i] != seg.steps[i - 1] + 1:
            continue
        if dp_per_step > 0 and seg.dp_done[i - 1]:
            seg.prev_end[i] = seg.dp_done[i - 1]
        elif last_blk is not None and seg.blk_present[i - 1, last_blk]:
            seg.prev_end[i] = seg.blk_done[i - 1, last_blk]


@dataclass
class Segmenter:
    """Matches ranks against their stage's schedule (:func:`segment_rank`) on demand."""

    trace: TraceSet
    role: np.ndarray
    te: np.ndarray
    tc: np.ndarray
    inst: np.ndarray  # RecordIndex.inst (its pair codes), send_row, recv_row: to find each p2p record's match
    send_row: np.ndarray
    recv_row: np.ndarray
    layout: Layout
    microbatches: int
    dp_per_step: int
    record_step: np.ndarray  # dp-sync mode: every record's step (filled in place in pipeline mode)

    def _partner_te(self, rows: np.ndarray) -> Local:
        """Enqueue time of the matching record of each p2p row (0 if none), over the row range of ``rows``."""
        lo, hi = (int(rows.min()), int(rows.max()) + 1) if len(rows) else (0, 0)
        pair = pair_ids(self.inst[lo:hi])
        out = np.zeros(hi - lo, np.int64)
        p2p = np.flatnonzero(pair >= 0)
        sends = self.trace.records.op[lo:hi][p2p] == Op.SEND
        other = np.where(sends, self.recv_row[pair[p2p]], self.send_row[pair[p2p]])
        out[p2p] = np.where(other >= 0, self.te[np.maximum(other, 0)], 0)
        return Local(out, lo)

    def _rows(self, rank: int) -> np.ndarray:
        sl = self.trace.rows(rank)
        return sl.start + np.flatnonzero(self.role[sl] != MARKER)

    def rank(self, rank: int, steps: np.ndarray, rows: np.ndarray | None = None) -> RankSegments:
        """One rank's match for ``steps``; raises :class:`SegmentError`."""
        stage = self.layout.coords(rank).pp
        actions = SCHEDULES[self.layout.schedule](stage, self.layout.pp, self.microbatches)
        if rows is None:
            rows = self._rows(rank)
            if len(steps) and self.dp_per_step:  # only the wanted steps' records (gaps between them allowed)
                rows = rows[np.isin(self.record_step[rows], steps)]
        rec = self.trace.records
        return segment_rank(rank, stage, self.layout.pp, actions, rows, self.role, rec.group_seq, self.te,
                            self.tc, rec.peer, self._partner_te(rows), self.microbatches, self.dp_per_step, steps)

    def check(self, steps: np.ndarray) -> str | None:
        """Match one rank per stage on a few steps: why the schedule does not fit, or None."""
        seen: set[int] = set()
        for rank in self.trace.ranks.tolist():
            if rank >= self.layout.world_size or self.layout.coords(rank).pp in seen:
                continue
            seen.add(self.layout.coords(rank).pp)
            try:
                seg = self.rank(rank, steps)
            except SegmentError as exc:
                return str(exc)
            if seg.dag_problem:
                return seg.dag_problem
            if not seg.ok[1:].all():
                return f"rank {rank}'s records do not follow the {self.layout.schedule} schedule of its stage"
        return None

    def all_ranks(self) -> tuple[dict[int, RankSegments], str | None]:
        """Pipeline mode: match every rank on every step and place each record in its step."""
        rec = self.trace.records
        p2p = np.isin(self.role, P2P_ROLES)
        seqs = (rec.group_seq[p2p] - 1) // self.microbatches
        if not len(seqs):
            return {}, "no pipeline records to anchor the schedule"
        steps = np.arange(int(seqs.min()), int(seqs.max()) + 1)
        out: dict[int, RankSegments] = {}
        problem = None
        for rank in self.trace.ranks.tolist():
            if rank >= self.layout.world_size:
                continue
            rows = self._rows(rank)
            try:
                seg = self.rank(rank, steps, rows)
            except SegmentError as exc:
                return {}, str(exc)
            out[rank] = seg
            problem = problem or seg.dag_problem
            sel = rows[p2p[rows]]
            self.record_step[sel] = (rec.group_seq[sel] - 1) // self.microbatches
            for si in np.flatnonzero(seg.ok):
                for a_lo, a_hi in zip(seg.act_lo[si].tolist(), seg.act_hi[si].tolist()):
                    self.record_step[a_lo:a_hi] = steps[si]
            bad = steps[~seg.ok]
            self.record_step[rows[np.isin(self.record_step[rows], bad)]] = -1
        return out, problem
