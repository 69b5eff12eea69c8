"""Tails that turn out too short: which ranks a quick (tail) load must read further back, and the re-read.

A quick load (``load_trace(DIR, tail=K)``) reads each rank's newest records. When a partner's record
of an op someone waits in may lie before its tail, :func:`tail_gaps` names it and :func:`widen_tails`
re-reads it deeper (:func:`megatrace.load.rings.extend_tails`), re-indexing.
"""

from __future__ import annotations

import numpy as np

from megatrace.analyze.index import RecordIndex, index_records
from megatrace.load.rings import extend_tails
from megatrace.load.traceset import TraceSet
from megatrace.trace import ring_format as fmt

WIDEN_DEPTHS = (4096, None)  # records per rank re-read for ranks whose tail was too short (None: all of it)


def tail_gaps(trace: TraceSet, ix: RecordIndex, recent: int) -> list[int]:
    """Ranks whose loaded tail may be too short to say what the others wait for.

    Each rank's newest ``recent`` records show what it waits in. A collective instance there that a
    member never entered, or a send or recv whose counterpart is not there, means something only if
    that member or peer really never posted it. When the partner's loaded tail starts after that op
    (its oldest loaded record of the group, or of the channel, is a later one) and its ring holds
    older records that were not loaded, the partner may have posted it earlier: it is a gap.
    """
    if trace.tail is None or not len(trace.records):
        return []
    unread = np.array([i.unread > 0 for i in trace.rank_info], dtype=bool)
    if not unread.any():
        return []
    rec = trace.records
    idx = trace.starts[1:, None] - recent + np.arange(recent)[None, :]  # each rank's newest rows
    recent_rows = idx[idx >= trace.starts[:-1, None]]
    recent_rows = recent_rows[rec.op[recent_rows] < fmt.Op.MARK_STEP]
    gaps: set[int] = set()

    # Point to point: no counterpart loaded, and the partner's oldest loaded op of the other side on the
    # channel is a later one (or it has none).
    pair = ix.pair_of(recent_rows)
    p_rows, pair = recent_rows[pair >= 0], pair[pair >= 0]
    is_send = rec.op[p_rows] == fmt.Op.SEND
    lone = np.where(is_send, ix.recv_row[pair], ix.send_row[pair]) < 0
    p_rows, pair, is_send = p_rows[lone], pair[lone], is_send[lone]
    if len(pair):
        chan, seq = ix.pair_chan[pair], ix.pair_seq[pair]
        want = np.zeros(len(ix.chan_gidx), bool)
        want[chan] = True
        oldest = {}
        for side, table in (("send", ix.send_row), ("recv", ix.recv_row)):
            first = np.full(len(want), np.iinfo(np.int64).max, np.int64)
            has = np.flatnonzero((table >= 0) & want[ix.pair_chan])
            np.minimum.at(first, ix.pair_chan[has], ix.pair_seq[has].astype(np.int64))  # (one dtype: the fast path)
            oldest[side] = first
        partner_first = np.where(is_send, oldest["recv"][chan], oldest["send"][chan])
        peer = np.where(is_send, ix.chan_dst[chan], ix.chan_src[chan])
        for r in np.unique(peer[partner_first > seq]).tolist():
            if trace.has(r) and unread[trace.pos(r)]:
                gaps.add(int(r))

    # Collectives: a member that never entered an instance someone is in, and whose oldest loaded
    # record of that group is a later instance (or who has none loaded).
    inst = ix.inst[recent_rows]
    insts = np.unique(inst[inst >= 0])
    if len(insts):
        entered = np.bincount(ix.inst[ix.inst >= 0], minlength=ix.n_instances)
        short = insts[entered[insts] < ix.group_size[ix.inst_gidx[insts]]]
        if len(short):
            rows, bounds = ix.instance_rows(short)
            who, groups, seqs = [], [], []
            for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
                i = int(ix.inst[rows[a]])
                group = trace.groups.get(ix.gid_of_instance(i))
                if group is None:
                    continue
                missing = np.setdiff1d(np.array(group.ranks, dtype=np.int64), rec.rank[rows[a:b]])
                missing = [trace.pos(int(r)) for r in missing.tolist() if trace.has(int(r))]
                missing = [m for m in missing if unread[m]]
                who += missing
                groups += [int(ix.inst_gidx[i])] * len(missing)
                seqs += [int(ix.inst_seq[i])] * len(missing)
            if who:
                pos_of_row = np.repeat(np.arange(len(trace.ranks)), np.diff(trace.starts))
                gaps.update(_uncovered(trace, ix, pos_of_row, np.array(who), np.array(groups), np.array(seqs)))
    return sorted(gaps)


def _uncovered(trace: TraceSet, ix: RecordIndex, pos_of_row: np.ndarray, who: np.ndarray, groups: np.ndarray,
               seqs: np.ndarray) -> set[int]:
    """Ranks (by position ``who``) whose oldest loaded record of group ``groups`` is after ``seqs`` (or absent)."""
    n_groups = len(ix.group_ids)
    need_rank = np.zeros(len(trace.ranks), bool)
    need_rank[who] = True
    need_group = np.zeros(n_groups + 1, bool)
    need_group[groups + 1] = True
    gidx = ix.gidx_of(trace.records)
    rows = np.flatnonzero(need_rank[pos_of_row] & (ix.inst >= 0) & need_group[gidx + 1])
    keys = pos_of_row[rows].astype(np.int64) * n_groups + gidx[rows]
    del gidx
    order = np.lexsort((trace.records.group_seq[rows], keys))
    uniq, first = np.unique(keys[order], return_index=True)
    oldest = trace.records.group_seq[rows][order][first]
    want = who.astype(np.int64) * n_groups + groups
    at = np.minimum(np.searchsorted(uniq, want), max(len(uniq) - 1, 0))
    covered = (uniq[at] == want) & (oldest[at] <= seqs) if len(uniq) else np.zeros(len(want), bool)
    return {int(trace.ranks[p]) for p in who[~covered].tolist()}


def widen_tails(trace: TraceSet, ix: RecordIndex, recent: int) -> tuple[TraceSet, RecordIndex]:
    """Re-read the ranks :func:`tail_gaps` names, deeper each round (:data:`WIDEN_DEPTHS`), re-indexing."""
    for depth in WIDEN_DEPTHS:
        gaps = tail_gaps(trace, ix, recent)
        if not gaps:
            break
        wider = extend_tails(trace, gaps, depth)
        if wider is trace:
            break
        trace, ix = wider, index_records(wider)
    return trace, ix
