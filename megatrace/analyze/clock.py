"""Clock alignment: put every rank's monotonic timestamps on one wall-clock timeline.

Step 1, anchors: each ring header holds a (wall, monotonic) pair read together
at creation, so ``wall = mono + (anchor_wall - anchor_mono)``. All ranks of one
host share the monotonic clock, so the host's offset is the median of its
ranks' (absorbing the jitter of reading two clocks).

Step 2, refinement from collectives: a collective completes at nearly the same
moment on all members. For every instance that spans two or more hosts, each
member's deviation from the instance's mean completion time is an
observation of its host's clock error. First the host's correction is the mean
of its deviations, iterated until it settles: that spreads the information
along chains of hosts linked by small groups (pairs, whose median would be one
member and would never move). Then a few passes take the median instead, so
stragglers and outliers cannot drag a host. Corrections are pinned so the host
of the lowest rank keeps its anchor clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatrace.analyze.index import RecordIndex, chunks, select_rows
from megatrace.load.traceset import TraceSet, per_row
from megatrace.trace.ring_format import Flag, State

MAX_SAMPLES = 400_000  # completion records used for refinement; instances are sampled whole beyond this
MEAN_ITERATIONS = 200  # at most this many mean passes (each re-centres the instances on the corrected clocks) ...
SETTLED_NS = 1_000  # ... stopping once no host moves more than this
MEDIAN_ITERATIONS = 3  # then robust passes
MIN_OBSERVATIONS = 3  # a host needs this many cross-host observations to get a correction
SAMPLE_HASH = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads instance ids uniformly


@dataclass
class ClockAlignment:
    """Per-host offsets and the aligned time columns (ns since the Unix epoch)."""

    method: str  # "anchors" or "anchors+collectives"
    host_offset_ns: dict[str, int]  # wall = mono + offset (anchor part + refinement)
    correction_ns: dict[str, int]  # the refinement part alone (0 for the reference host)
    rank_offset_ns: np.ndarray  # per present rank (TraceSet.ranks order)
    t_enqueue: np.ndarray  # int64 aligned
    t_complete: np.ndarray  # int64 aligned; 0 where no completion was recorded
    observations: int = 0  # cross-host completion observations used
    residual_ns: int = 0  # median |deviation| after alignment (how well hosts agree)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"method": self.method, "hosts": len(self.host_offset_ns),
                "corrections_ns": dict(sorted(self.correction_ns.items())),
                "observations": self.observations, "residual_ns": self.residual_ns}


def _anchor_offsets(trace: TraceSet) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(hosts, host index per present rank, anchor offset per host)."""
    hosts = sorted({i.host for i in trace.rank_info})
    hidx = {h: k for k, h in enumerate(hosts)}
    rank_host = np.array([hidx[i.host] for i in trace.rank_info], dtype=np.int64)
    per_rank = np.array([i.anchor_wall_ns - i.anchor_mono_ns for i in trace.rank_info], dtype=np.int64)
    offsets = np.zeros(len(hosts), np.int64)
    for k in range(len(hosts)):
        offsets[k] = int(np.median(per_rank[rank_host == k]))
    return hosts, rank_host, offsets


def _sample_rows(trace: TraceSet, ix: RecordIndex, rank_host: np.ndarray) -> np.ndarray:
    """Rows of completed, timed collective records, whole instances, at most about MAX_SAMPLES."""
    rec = trace.records

    def usable(sl: slice) -> np.ndarray:
        return (ix.inst[sl] >= 0) & (rec.state[sl] == State.COMPLETED) & (rec.t_complete[sl] > 0) \
            & ((rec.flags[sl] & Flag.NO_COMPLETION) == 0)

    total = sum(int(np.count_nonzero(usable(sl))) for sl in chunks(len(rec)))
    if total <= MAX_SAMPLES:
        return select_rows(len(rec), usable)
    keep = MAX_SAMPLES / total

    def sampled(sl: slice) -> np.ndarray:  # (the hash of the instance: a sampled instance keeps all its members)
        h = (ix.inst[sl].astype(np.uint64) * SAMPLE_HASH) >> np.uint64(11)
        return usable(sl) & (h.astype(np.float64) < keep * float(1 << 53))

    return select_rows(len(rec), sampled)


def _group_median(values: np.ndarray, groups: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(lower median of ``values`` per group, count per group); 0 for empty groups."""
    counts = np.bincount(groups, minlength=n_groups)
    order = np.lexsort((values, groups))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pick = np.minimum(starts + np.maximum(counts - 1, 0) // 2, max(len(values) - 1, 0))
    med = np.where(counts > 0, values[order][pick] if len(values) else 0, 0)
    return med.astype(np.int64), counts


def align_clocks(trace: TraceSet, ix: RecordIndex, refine: bool = True, in_place: bool = False) -> ClockAlignment:
    """Align all ranks' clocks; see the module docstring.

    ``in_place`` overwrites the trace's time columns with the aligned times (saves 16 bytes per record;
    the analysis engine does this) and sets ``trace.time_base`` to ``"aligned"``.
    """
    if trace.time_base != "monotonic":
        raise ValueError("the trace's clocks are already aligned")
    hosts, rank_host, anchor = _anchor_offsets(trace)
    correction = np.zeros(len(hosts), np.int64)
    method, observations, residual, notes = "anchors", 0, 0, []
    if refine and len(hosts) > 1:
        rows = _sample_rows(trace, ix, rank_host)
        rec_host = rank_host[np.searchsorted(trace.starts, rows, side="right") - 1]
        t = trace.records.t_complete[rows] + anchor[rec_host]
        inst = ix.inst[rows]
        # Keep instances whose members sit on two or more hosts: only they carry cross-host information.
        uniq, local = np.unique(inst, return_inverse=True)
        local = local.reshape(-1)
        hmin = np.full(len(uniq), np.iinfo(np.int64).max, np.int64)
        hmax = np.full(len(uniq), -1, np.int64)
        np.minimum.at(hmin, local, rec_host)
        np.maximum.at(hmax, local, rec_host)
        cross = (hmin != hmax)[local]
        local, rec_host, t = local[cross], rec_host[cross], t[cross]
        if len(local):
            order = np.lexsort((t, local))
            local, rec_host, t = local[order], rec_host[order], t[order]
            starts = np.flatnonzero(np.r_[True, np.diff(local) != 0])
            sizes = np.diff(np.r_[starts, len(local)])
            seen = np.bincount(rec_host, minlength=len(hosts))
            ref = rank_host[0]
            base = t - np.repeat(t[starts], sizes)  # relative to the instance's first member: small numbers

            def deviations() -> np.ndarray:
                tc = base + correction[rec_host]
                return tc - np.repeat(np.add.reduceat(tc, starts) / sizes, sizes)

            for _ in range(MEAN_ITERATIONS):
                step = np.bincount(rec_host, weights=deviations(), minlength=len(hosts)) / np.maximum(seen, 1)
                step = np.where(seen >= MIN_OBSERVATIONS, np.rint(step), 0).astype(np.int64)
                correction -= step
                correction -= correction[ref]
                if np.abs(step).max() < SETTLED_NS:
                    break
            for _ in range(MEDIAN_ITERATIONS):
                correction -= np.where(seen >= MIN_OBSERVATIONS, _group_median(deviations(), rec_host, len(hosts))[0], 0)
                correction -= correction[ref]
            observations = len(local)
            residual = int(np.median(np.abs(deviations())))
            method = "anchors+collectives"
            seen = np.bincount(rec_host, minlength=len(hosts))
            few = [hosts[k] for k in np.flatnonzero(seen < MIN_OBSERVATIONS)]
            if few:
                notes.append(f"no collective shared with other hosts to refine the clocks of {', '.join(few)}; "
                             "their header anchors are used as they are")
        else:
            notes.append("no completed collective spans two hosts: clocks aligned from header anchors only")
    host_offset = anchor + correction
    rank_offset = host_offset[rank_host]
    rec = trace.records
    t_enqueue = rec.t_enqueue if in_place else np.empty_like(rec.t_enqueue)
    t_complete = rec.t_complete if in_place else np.empty_like(rec.t_complete)
    for sl in chunks(len(rec)):  # bounded temporaries; in place, the monotonic columns become the aligned ones
        off = per_row(rank_offset, trace.starts, sl)
        np.add(rec.t_enqueue[sl], off, out=t_enqueue[sl])
        np.add(rec.t_complete[sl], np.where(rec.t_complete[sl] > 0, off, 0), out=t_complete[sl])
    if in_place:
        trace.time_base = "aligned"
    return ClockAlignment(method, {h: int(host_offset[k]) for k, h in enumerate(hosts)},
                          {h: int(correction[k]) for k, h in enumerate(hosts)}, rank_offset,
                          t_enqueue, t_complete, observations, residual, notes)
