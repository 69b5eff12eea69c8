"""Training iterations (steps) inferred from the records alone, without markers.

Every rank ends a step with the data-parallel gradient sync, so the DP group's
collectives repeat with a fixed pattern (one ``all_reduce``, or
``reduce_scatter`` + ``all_gather``): the ``k``-th repetition ends step ``k``
(``method="dp-sync"``). Without a DP sync (dp == 1) the pipeline numbers the
steps: each point-to-point channel between adjacent stages carries one message
per microbatch per step (``method="pipeline"``), and the schedule match
(:mod:`megatrace.analyze.segments`) places the records in between. Markers
(``MARK_STEP``) are never used; tests compare against them.

Per rank and step this module also measures the compute: the time outside any
communication call (from the end of one call to the enqueue of the next), the
quantity that ranks doing the same work should share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from megatrace.analyze.context import AnalysisContext
from megatrace.analyze.findings import Kind
from megatrace.analyze.index import CHUNK, RecordIndex, chunks
from megatrace.analyze.segments import (ACT_IN, ACT_OUT, DP, GRAD_IN, GRAD_OUT, MARKER, OTHER, P2P_ROLES, PP_OTHER,
                                        TP, RankSegments, Segmenter)
from megatrace.config import Layout
from megatrace.load.traceset import TraceSet, per_row, rank_spans
from megatrace.schedule import SCHEDULES
from megatrace.trace.ring_format import Op

try:
    from megatrace.analyze._kernels import fill_runs, step_cells  # type: ignore[import-not-found]
    from megatrace.analyze._kernels import record_roles as role_kernel  # type: ignore[import-not-found]
except ImportError:  # not built (no C compiler at install): numpy makes the same passes
    fill_runs = role_kernel = step_cells = None

DP_PATTERN_MAX = 256  # longest DP pattern per step looked for (a flat buffer: 1 all_reduce, or reduce_scatter +
#                      all_gather; DDP: one all_reduce per gradient bucket and backward; FSDP: two per layer)
MIN_REPEATS = 3  # a pattern must repeat this many times in the records looked at to be a step
PERIOD_MISMATCH = 0.05  # share of a rank's records that may break its repeating pattern (setup, a final barrier)
MAX_PERIOD_RECORDS = 4000  # records of one rank used to find its period (the pattern repeats every step)
STEP_NARROW_MAX = (1 << 15) - 2  # steps below this: record_step kept in int16 (a step + 1 still fits)
CHECK_STEPS = 4  # steps of one rank per stage matched against the schedule up front (dp-sync mode)


@dataclass
class Iterations:
    """Step boundaries and per-rank step facts (times in aligned ns; rank axis in ``TraceSet.ranks`` order)."""

    method: str  # "dp-sync", "pipeline" or "none"
    steps: np.ndarray  # step numbers complete on every rank, ascending
    rank_start: np.ndarray  # [n_ranks, n_steps] end of the rank's previous step (or its first enqueue)
    rank_end: np.ndarray  # [n_ranks, n_steps] completion of the rank's last record of the step
    compute: np.ndarray  # [n_ranks, n_steps] time outside communication calls during the step
    record_step: np.ndarray  # per record: its step, -1 when unknown (markers, setup, an unfinished step); int16
    #                          once the steps are known to fit (below STEP_NARROW_MAX), else int32
    roles: np.ndarray  # per record role (megatrace.analyze.segments role codes)
    microbatches: int | None = None
    dp_per_step: int | None = None
    segments: dict[int, RankSegments] = field(default_factory=dict)  # pipeline mode: every rank's match
    schedule_problem: str | None = None  # why the schedule cannot be matched (then no dependency graph)
    notes: list[str] = field(default_factory=list)
    dp_arrival: np.ndarray | None = None  # [n_ranks, n_steps] first DP enqueue of the step (0: none)
    segmenter: Segmenter | None = None  # matches ranks on demand (dp-sync mode)
    gap: np.ndarray | None = None  # per record, float32: the compute before it (see compute_gaps)

    def segments_for(self, ranks: list[int], steps: np.ndarray) -> dict[int, RankSegments]:
        """Schedule matches of ``ranks`` covering ``steps`` (sorted); raises SegmentError."""
        if self.segments:
            return {r: self.segments[r] for r in ranks if r in self.segments}
        if self.segmenter is None:
            return {}
        return {r: self.segmenter.rank(r, np.asarray(steps)) for r in ranks}

    def step_index(self, steps: list[int]) -> Callable[[np.ndarray], np.ndarray]:
        """A function of records' steps (values of ``record_step``): each one's index in ``steps`` (sorted), -1
        when it is not among them (int32), by a table lookup (``np.isin`` searches per call)."""
        top = max(int(self.record_step.max(initial=-1)), max(steps, default=-1)) + 3
        table = np.full(top, -1, np.int32)  # step + 1 -> index; the first and last entries are no step's
        table[np.asarray(steps, np.int64) + 1] = np.arange(len(steps), dtype=np.int32)
        return lambda step: np.take(table, step + 1, mode="clip")  # (out of range: the first or the last entry)

    def in_steps(self, steps: list[int]) -> Callable[[np.ndarray], np.ndarray]:
        """A function of records' steps: which are among ``steps`` (see :meth:`step_index`)."""
        index = self.step_index(steps)
        return lambda step: index(step) >= 0

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def end_ns(self) -> np.ndarray:
        """Per step, when the last rank finished it."""
        return self.rank_end.max(axis=0) if self.n_steps else np.zeros(0, np.int64)

    @property
    def start_ns(self) -> np.ndarray:
        """Per step, the end of the previous step (for the first one, the earliest start of any rank)."""
        if not self.n_steps:
            return np.zeros(0, np.int64)
        end = self.end_ns
        start = np.empty_like(end)
        start[0] = self.rank_start[:, 0].min()
        start[1:] = np.where(np.diff(self.steps) == 1, end[:-1], self.rank_start[:, 1:].min(axis=0))
        return start

    @property
    def step_ns(self) -> np.ndarray:
        return self.end_ns - self.start_ns

    def summary(self) -> dict:
        return {"method": self.method, "steps": [int(s) for s in self.steps[:1]] + [int(s) for s in self.steps[-1:]],
                "n_steps": self.n_steps, "microbatches": self.microbatches, "dp_per_step": self.dp_per_step,
                "schedule_matched": self.segmenter is not None and self.schedule_problem is None}


def group_roles(trace: TraceSet, ix: RecordIndex, layout: Layout | None) -> np.ndarray:
    """Role (TP, DP, PP_OTHER for the pipeline group, OTHER) of each group index, by description or membership."""
    by_desc = {"tp": TP, "dp": DP, "pp": PP_OTHER}
    out = np.full(len(ix.group_ids), OTHER, np.int8)
    for k, gid in enumerate(ix.group_ids.tolist()):
        g = trace.groups[int(gid)]
        if len(g.ranks) < 2:
            continue
        if g.dim in by_desc:
            out[k] = by_desc[g.dim]
        elif (not g.named or g.desc == "default_pg") and layout is not None and max(g.ranks) < layout.world_size:
            for kind in ("tp", "pp", "dp"):
                if list(g.ranks) == layout.group_of(kind, g.ranks[0]):
                    out[k] = by_desc[kind]
                    break
    return out


def record_roles(trace: TraceSet, ix: RecordIndex, layout: Layout | None) -> np.ndarray:
    """Per record: TP / DP collective, pipeline p2p direction (activation or gradient, in or out), marker, other."""
    rec = trace.records
    groles = group_roles(trace, ix, layout)
    role = np.empty(len(rec), np.int8)
    world = layout.world_size if layout is not None else 0
    stage = np.array([layout.coords(r).pp for r in range(world)], np.int64) if layout is not None else None
    codes = (int(Op.MARK_STEP), int(Op.SEND), int(Op.RECV)), (OTHER, MARKER, TP, DP, PP_OTHER, ACT_IN, ACT_OUT,
                                                               GRAD_IN, GRAD_OUT)
    for sl in chunks(len(rec)):  # (chunk by chunk: no temporary as long as the records)
        gidx, op = ix.gidx_of(rec, sl), rec.op[sl]
        if role_kernel is not None and role_kernel(gidx, op, rec.peer[sl], rec.rank[sl], groles, stage, *codes,
                                                   role[sl]) == 0:
            continue
        part = np.where(gidx >= 0, groles[np.maximum(gidx, 0)], OTHER).astype(np.int8)
        part[op >= Op.MARK_STEP] = MARKER
        p2p = (op == Op.SEND) | (op == Op.RECV)
        part[((part == TP) | (part == DP)) & p2p] = OTHER
        pp = part == PP_OTHER
        part[pp & ~p2p] = OTHER
        if stage is not None:
            peer, me_rank = rec.peer[sl], rec.rank[sl]
            rows = np.flatnonzero(pp & p2p & (peer >= 0) & (peer < world) & (me_rank < world))
            me, other = stage[me_rank[rows]], stage[peer[rows]]
            send = op[rows] == Op.SEND
            new = np.full(len(rows), PP_OTHER, np.int8)
            new[~send & (other == me - 1)] = ACT_IN
            new[send & (other == me + 1)] = ACT_OUT
            new[~send & (other == me + 1)] = GRAD_IN
            new[send & (other == me - 1)] = GRAD_OUT
            part[rows] = new
        role[sl] = part
    return role


def smallest_period(tokens: np.ndarray, max_period: int | None = None,
                    max_mismatch: float = PERIOD_MISMATCH) -> int | None:
    """The smallest ``p`` with ``tokens[i] == tokens[i + p]`` for all but ``max_mismatch`` of the ``i``."""
    n = len(tokens)
    limit = min(n // MIN_REPEATS, max_period or n // MIN_REPEATS)
    for p in range(1, limit + 1):
        if np.count_nonzero(tokens[p:] != tokens[:-p]) <= max_mismatch * (n - p):
            return p
    return None


def _dp_pattern(trace: TraceSet, role: np.ndarray) -> int | None:
    """DP collectives per step: the period of (op, size) over one DP member's DP records."""
    rows = np.flatnonzero(role == DP)
    if not len(rows):
        return None
    rec = trace.records
    mine = rows[rec.rank[rows] == rec.rank[rows[0]]]
    mine = mine[rec.group_id[mine] == rec.group_id[mine[0]]][:MAX_PERIOD_RECORDS]
    tokens = rec.op[mine].astype(np.int64) << 40 | rec.nbytes[mine]
    return smallest_period(tokens, DP_PATTERN_MAX) or (1 if len(mine) == 1 else None)


def _microbatches(trace: TraceSet, role: np.ndarray, layout: Layout, notes: list[str]) -> int:
    """Messages per channel per step: one period of a first-stage rank's record pattern, checked against the layout."""
    rec = trace.records
    for rank in trace.ranks.tolist():
        if layout.coords(rank).pp != 0:
            continue
        rows = np.arange(*trace.rows(rank).indices(len(rec)))
        rows = rows[role[rows] != MARKER][:MAX_PERIOD_RECORDS]
        tokens = (role[rows].astype(np.int64) << 48) | (rec.group_id[rows].astype(np.int64) << 16) \
            | (rec.peer[rows].astype(np.int64) & 0xFFFF)
        period = smallest_period(tokens)
        if period is None:
            continue
        found = int(np.count_nonzero(role[rows[:period]] == ACT_OUT))
        # The smallest period can be a part of a step (tp == dp == 1: the p2p pattern repeats per microbatch
        # pair), so the records only overrule a layout that says fewer microbatches than one period shows.
        if found > layout.microbatches:
            notes.append(f"the records show {found} microbatches per step, the layout says {layout.microbatches}: "
                         f"using {found}")
            return found
        break
    return layout.microbatches


def rank_chunks(trace: TraceSet, max_rows: int = CHUNK) -> Iterator[tuple[int, int]]:
    """Ranges ``[i0, i1)`` of rank positions whose records span at most about ``max_rows`` rows."""
    return rank_spans(trace.starts, max_rows)


def _positions(trace: TraceSet, i0: int, i1: int) -> np.ndarray:
    """For the rows of ranks ``[i0, i1)``, each row's rank position (int64)."""
    return np.repeat(np.arange(i0, i1, dtype=np.int64), np.diff(trace.starts[i0:i1 + 1]))


def compute_gaps(trace: TraceSet, role: np.ndarray, te: np.ndarray, tc: np.ndarray) -> np.ndarray:
    """Per record, the compute before it: its enqueue minus the end of every earlier call of its rank (>= 0).

    A segmented running maximum: each rank's times are shifted into a band of their own (chunks of ranks).
    Returned as float32 ns (a few ns off at most for gaps below a second).
    """
    gap = np.zeros(len(te), np.float32)
    for i0, i1 in rank_chunks(trace):
        lo, hi = int(trace.starts[i0]), int(trace.starts[i1])
        keep = role[lo:hi] != MARKER
        every = bool(keep.all())  # (no marker among these rows, the usual case: slices, no gathers)
        rows = None if every else lo + np.flatnonzero(keep)
        count = hi - lo if every else len(rows)
        if count < 2:
            continue
        pos = _positions(trace, i0, i1) - i0
        t, end = (te[lo:hi], tc[lo:hi]) if every else (te[rows], tc[rows])
        if not every:
            pos = pos[rows - lo]
        new = np.empty(count, bool)
        new[0] = True
        np.not_equal(pos[1:], pos[:-1], out=new[1:])
        heads = np.flatnonzero(new)
        base = np.repeat(np.minimum.reduceat(t, heads), np.diff(np.r_[heads, count]))
        local_te = t - base
        local_end = np.maximum(end, t)  # no completion (0): the enqueue
        local_end -= base
        span = int(local_end.max()) + 1
        if span * (i1 - i0) >= np.iinfo(np.int64).max // 2:  # bands would overflow: one rank at a time
            busy = np.empty_like(local_end)
            for a, b in zip(heads.tolist(), heads[1:].tolist() + [count]):
                busy[a:b] = np.maximum.accumulate(local_end[a:b])
        else:
            band = pos * span
            local_end += band
            busy = np.maximum.accumulate(local_end)
            busy -= band
        after = np.maximum(local_te[1:] - busy[:-1], 0).astype(np.float32)
        after[new[1:]] = 0  # a rank's first row: nothing before it
        if every:
            gap[lo + 1:hi] = after
        else:
            gap[rows[1:]] = after
    return gap


def _steps_from_ends(trace: TraceSet, ends: np.ndarray, end_step: np.ndarray, record_step: np.ndarray) -> None:
    """Each record belongs to the step of the next step-ending record of its rank (none after: -1)."""
    if not len(ends):
        return
    n = len(record_step)
    end_pos = np.searchsorted(trace.starts, ends, side="right") - 1
    # The next step-ending record is the same for every row of a run between two breaks (the row after an
    # end, a rank's first row): one search per run, then the runs' steps repeated over their rows.
    breaks = np.concatenate((ends + 1, trace.starts[:-1]))  # (two sorted runs: the stable sort merges them, where
    breaks.sort(kind="stable")  # np.union1d's hashing took 0.6 s at 16,384 ranks)
    breaks = breaks[np.r_[True, breaks[1:] != breaks[:-1]] & (breaks < n)]
    nxt = np.searchsorted(ends, breaks)
    pos = np.searchsorted(trace.starts, breaks, side="right") - 1
    step = np.full(len(breaks), -1, record_step.dtype)
    inside = np.flatnonzero(nxt < len(ends))
    mine = inside[end_pos[nxt[inside]] == pos[inside]]
    step[mine] = end_step[nxt[mine]]
    runs = np.r_[breaks, n]  # (breaks start at row 0: the first rank's)
    if fill_runs is None or runs[0] != 0 or fill_runs(runs.astype(np.int64), step.astype(np.int32), record_step) < 0:
        for sl in chunks(n):  # each run's step over its rows
            record_step[sl] = per_row(step, runs, sl)
    # A wrapped ring (oldest records overwritten), or one loaded from its tail only, starts inside a step: that
    # first step is partial.
    tail_only = getattr(trace, "tail", None) is not None
    for i in [k for k, info in enumerate(trace.rank_info) if info.dropped > 0 or tail_only]:
        mine = end_step[end_pos == i]
        if len(mine):
            sl = slice(int(trace.starts[i]), int(trace.starts[i + 1]))
            record_step[sl][record_step[sl] == mine[0]] = -1


def infer_iterations(trace: TraceSet, ix: RecordIndex, te: np.ndarray, tc: np.ndarray,
                     layout: Layout | None = None) -> Iterations:
    """Find the steps, match every rank against its stage's schedule, and measure compute per rank and step."""
    layout = layout if layout is not None else trace.layout
    rec = trace.records
    role = record_roles(trace, ix, layout)
    notes: list[str] = []
    record_step = np.full(len(rec), -1, np.int32)
    dp_per_step = _dp_pattern(trace, role)
    method = "none"
    mb: int | None = None
    if dp_per_step:
        method = "dp-sync"
        dp_rows = np.flatnonzero(role == DP)
        ends = dp_rows[rec.group_seq[dp_rows] % dp_per_step == 0]
        _steps_from_ends(trace, ends, (rec.group_seq[ends] - 1) // dp_per_step, record_step)
    elif layout is not None and layout.pp > 1 and np.isin(role, P2P_ROLES).any():
        method = "pipeline"
    elif layout is None and not (role == DP).any():
        notes.append("no layout and no DP group: steps cannot be inferred")
    if layout is not None and layout.pp > 1 or method == "pipeline":
        mb = _microbatches(trace, role, layout, notes) if layout is not None else None

    segmenter = None
    problem = None
    if layout is not None and method != "none":
        if layout.schedule in SCHEDULES:
            segmenter = Segmenter(trace, role, te, tc, ix.inst, ix.send_row, ix.recv_row, layout,
                                  mb or layout.microbatches, dp_per_step or 0, record_step)
        else:
            problem = f"schedule {layout.schedule!r} is not modelled"
    segments: dict[int, RankSegments] = {}
    if segmenter is not None and method == "pipeline":  # the schedule match also places the records in steps
        segments, problem = segmenter.all_ranks()
    record_step[role == MARKER] = -1
    it = _per_step(trace, role, te, tc, record_step, method, mb, dp_per_step, segments, notes)
    if segmenter is not None and method == "dp-sync" and it.n_steps and problem is None:
        problem = segmenter.check(it.steps[:CHECK_STEPS])
    it.segmenter, it.schedule_problem = segmenter, problem
    if len(it.steps) and -1 <= int(it.steps.min()) and int(it.steps.max()) < STEP_NARROW_MAX:
        it.record_step = it.record_step.astype(np.int16)  # (2 bytes a record less: 58 MiB at 16,384 ranks)
        if segmenter is not None:
            segmenter.record_step = it.record_step
    if problem:
        notes.append(f"no dependency graph: {problem}")
    return it


def _per_step(trace: TraceSet, role: np.ndarray, te: np.ndarray, tc: np.ndarray, record_step: np.ndarray,
              method: str, mb: int | None, dp_per_step: int | None, segments: dict[int, RankSegments],
              notes: list[str]) -> Iterations:
    """Per rank and step: start, end, compute and DP arrival; keep the steps complete on every rank."""
    n_ranks = len(trace.ranks)
    empty = Iterations(method, np.zeros(0, np.int64), np.zeros((n_ranks, 0), np.int64),
                       np.zeros((n_ranks, 0), np.int64), np.zeros((n_ranks, 0), np.int64), record_step, role, mb,
                       dp_per_step, segments, notes=notes)
    k1 = int(record_step.max(initial=-1))
    if k1 < 0:
        return empty
    k0 = k1
    for sl in chunks(len(record_step)):
        k0 = min(k0, int(np.min(record_step[sl], initial=k1, where=record_step[sl] >= 0)))
    n = k1 - k0 + 1
    gap, count, end, first, compute, arrival, dp_end = _step_cells(trace, role, te, tc, record_step, k0, n,
                                                                   dp_per_step)
    arrival[arrival == np.iinfo(np.int64).max] = 0
    end, first, compute = end.reshape(n_ranks, n), first.reshape(n_ranks, n), compute.reshape(n_ranks, n)
    arrival, count = arrival.reshape(n_ranks, n), count.reshape(n_ranks, n)
    # A step is complete on a rank when it has records and (being the rank's first) nothing before it is missing.
    complete = count > 0
    if method == "dp-sync":  # the rank's step must end with a completed DP sync
        complete &= dp_end.reshape(n_ranks, n)
    for i, rank in enumerate(trace.ranks.tolist()):  # pipeline mode: the schedule match must hold
        seg = segments.get(rank)
        if seg is not None:
            ok = np.zeros(n, bool)
            sel = (seg.steps >= k0) & (seg.steps <= k1)
            ok[seg.steps[sel] - k0] = seg.ok[sel]
            complete[i] &= ok
    good = complete.all(axis=0)
    if not good.any():
        notes.append("no step is complete on every rank")
        return empty
    idx = np.flatnonzero(good)
    start = np.where(np.arange(n)[None, :] > 0, np.roll(end, 1, axis=1), first)
    start = np.where(start > 0, start, first)
    steps = idx + k0
    for sl in chunks(len(record_step)):  # the records of a step left out lose it
        part = record_step[sl]
        part[(part >= 0) & ~np.isin(part, steps)] = -1
    return Iterations(method, steps, start[:, idx], end[:, idx], compute[:, idx].astype(np.int64), record_step,
                      role, mb, dp_per_step, segments, notes=notes, dp_arrival=arrival[:, idx], gap=gap)


def _step_cells(trace: TraceSet, role: np.ndarray, te: np.ndarray, tc: np.ndarray, record_step: np.ndarray, k0: int,
                n: int, dp_per_step: int | None) -> tuple[np.ndarray, ...]:
    """Each record's compute gap (:func:`compute_gaps`) and, per rank and step (flat cells ``position * n + step -
    k0``): records, the float64 sum of their gaps, the latest end, the first enqueue, the first DP enqueue (int64 max:
    none) and whether a completed DP sync ended it. In C when the extension is built (two passes a rank), else numpy.
    """
    n_cells = len(trace.ranks) * n
    count = np.zeros(n_cells, np.int64)
    end = np.zeros(n_cells, np.int64)
    first = np.full(n_cells, np.iinfo(np.int64).max, np.int64)
    compute = np.zeros(n_cells, np.float64)
    arrival = np.full(n_cells, np.iinfo(np.int64).max, np.int64)
    dp_end = np.zeros(n_cells, bool)
    gseq = trace.records.group_seq
    if step_cells is not None and n_cells:
        gap = np.zeros(len(te), np.float32)
        if step_cells(trace.starts, role, te, tc, record_step, gseq, k0, n, dp_per_step or 0, MARKER, DP, gap, count,
                      end, first, compute, arrival, dp_end.view(np.uint8)) == 0:
            return gap, count, end, first, compute, arrival, dp_end
        # (refused: a rank's times span more than 2**63 ns) numpy from the start
        count[:], end[:], first[:], compute[:], dp_end[:] = 0, 0, np.iinfo(np.int64).max, 0, False
        arrival[:] = np.iinfo(np.int64).max
    gap = compute_gaps(trace, role, te, tc)
    for i0, i1 in rank_chunks(trace):
        lo, hi = int(trace.starts[i0]), int(trace.starts[i1])
        rows = lo + np.flatnonzero(record_step[lo:hi] >= 0)
        cell = _positions(trace, i0, i1)[rows - lo] * n + record_step[rows].astype(np.int64) - k0
        heads = _cell_heads(cell)
        if heads is not None:  # (the gaps are whole ns: their float sums do not depend on the order)
            cells = cell[heads]
            count[cells] += np.diff(np.r_[heads, len(cell)])
            compute[cells] += np.add.reduceat(gap[rows].astype(np.float64), heads)
        else:
            count += np.bincount(cell, minlength=n_cells)
            compute += np.bincount(cell, weights=gap[rows], minlength=n_cells)
        t_enq = te[rows]
        _cell_reduce(np.maximum, end, cell, np.maximum(tc[rows], t_enq), heads)
        _cell_reduce(np.minimum, first, cell, t_enq, heads)
        dp = role[rows] == DP
        _cell_reduce(np.minimum, arrival, cell[dp], t_enq[dp])
        if dp_per_step:
            dp_end[cell[dp & (gseq[rows] % dp_per_step == 0) & (tc[rows] > 0)]] = True  # it completed
    return gap, count, end, first, compute, arrival, dp_end


def _cell_heads(cell: np.ndarray) -> np.ndarray | None:
    """Where each run of equal cells starts, when the cells come sorted (the usual case); None when they do not."""
    if len(cell) and not (cell[1:] >= cell[:-1]).all():
        return None
    return np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]]) if len(cell) else np.zeros(0, np.int64)


def _cell_reduce(ufunc: np.ufunc, out: np.ndarray, cell: np.ndarray, values: np.ndarray,
                 heads: np.ndarray | None = None) -> None:
    """``out[cell] = ufunc(out[cell], values)`` per cell: ``reduceat`` when cells come sorted (the usual case;
    ``heads``: their :func:`_cell_heads`, when known)."""
    if not len(cell):
        return
    heads = heads if heads is not None else _cell_heads(cell)
    if heads is not None:
        cells = cell[heads]
        out[cells] = ufunc(out[cells], ufunc.reduceat(values, heads))
    else:
        ufunc.at(out, cell, values)


def iterations_of(ctx: AnalysisContext) -> Iterations:
    """The context's iterations, inferred once and shared by the critical-path and straggler stages."""
    it = ctx.results.get("iterations")
    if it is None:
        it = infer_iterations(ctx.trace, ctx.match.index, ctx.clock.t_enqueue, ctx.clock.t_complete)
        ctx.results["iterations"] = it
    return it


def perf_kind(name: str) -> Kind:
    """``Kind.<name>`` of a performance finding."""
    return Kind[name]
