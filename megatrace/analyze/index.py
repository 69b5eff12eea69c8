"""Matching keys for every record, without timing: group index, collective instance id, p2p pair id.

A collective record's instance is (group, group_seq); group_seq is dense per
group and identical on all members, so the id is
``base[group] + group_seq - min_seq[group]`` (then compacted): no sort. A
point-to-point record's channel is (group, src, dst) — for a send src is the
rank and dst its peer, for a recv the other way round — and its pair id is
(channel, seq) made dense the same way: send #k from A to B pairs with recv #k
on B from A. Both kinds of id share one column (a record is one or the other): what is kept per record is
4 bytes, and the group index every key derives from is recomputed where it is needed, not kept.

The passes over every record run in C where the extension is built (``analyze/native/_kernels.c``: the
group lookup, the p2p channels, the dense ids, the counting sort's placing), else with numpy, whose every pass
runs over at most :data:`CHUNK` rows at a time, so temporaries stay bounded at 16,384 ranks; both give the same
arrays (``tests/test_analyze_kernels.py``). The ids are int32 (int64 beyond 2**31 records).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from megatrace.load.traceset import Records, TraceSet
from megatrace.names import unknown_op_name
from megatrace.trace.ring_format import Op

try:
    from megatrace.analyze._kernels import (group_index, key_ranges, p2p_channels,  # type: ignore[import-not-found]
                                            place, place_by_key)
except ImportError:  # not built (no C compiler at install): numpy makes the same passes
    group_index = key_ranges = p2p_channels = place = place_by_key = None
MAX_KERNEL_WORLD = 1 << 21  # the C channel keys take worlds up to this size (MAX_WORLD_SIZE is below it)

SEND, RECV = int(Op.SEND), int(Op.RECV)
MARKER_MIN = int(Op.MARK_STEP)
CHUNK = 1 << 20  # rows per vectorised pass: ~25 MB of temporaries each (larger measured slower: fresh memory)
DENSE_SLACK = 4  # dense ids while the id space is at most this many times the keyed rows (else sort)
I64_MAX = np.iinfo(np.int64).max


def op_name(op: int) -> str:
    if op == Op.UNKNOWN:
        return "collective"  # (an imported call whose op its input does not say)
    try:
        return Op(op).label
    except ValueError:
        return unknown_op_name(op)


def chunks(n: int, size: int = CHUNK) -> Iterator[slice]:
    for lo in range(0, n, size):
        yield slice(lo, min(n, lo + size))


def select_rows(n: int, mask_of: Callable[[slice], np.ndarray]) -> np.ndarray:
    """The rows below ``n`` where ``mask_of(sl)``, the mask of the rows ``sl``, holds: chunk by chunk, so no mask
    as long as the records is made; ascending, int32 (int64 beyond 2**31 records)."""
    parts = [(sl.start + np.flatnonzero(mask_of(sl))).astype(_id_dtype(n)) for sl in chunks(n)]
    return np.concatenate(parts) if parts else np.empty(0, _id_dtype(n))


def rows_by_key(n: int, mask_of: Callable[[slice], np.ndarray], key_of: Callable[[np.ndarray], np.ndarray],
                n_keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows below ``n`` where ``mask_of(sl)`` holds, grouped by ``key_of(rows)`` (ints below ``n_keys``): keys
    ascending, rows ascending within a key, as a stable sort would order them; and for each key present, where
    its rows start and how many there are (in the rows' dtype).

    A counting sort of the rows selected chunk by chunk (one pass counts, one places): no temporary as long as
    the records, and no sort of every selected row at once. Between the passes only each chunk's mask is kept,
    packed (a bit a row): the selected rows themselves, 4 bytes each, would be held twice at the second pass's
    start (as chunks and in the result), the full analysis's peak at 16,384 ranks.
    """
    masks = []
    counts = np.zeros(n_keys, np.int64)
    for sl in chunks(n):
        mask = np.asarray(mask_of(sl), bool)
        counts += np.bincount(key_of(sl.start + np.flatnonzero(mask)), minlength=n_keys)
        masks.append((sl, np.packbits(mask)))
    offsets = np.cumsum(counts) - counts
    out = np.empty(int(counts.sum()), _id_dtype(n))
    cursor = offsets.copy()
    for sl, packed in masks:
        rows = (sl.start + np.flatnonzero(np.unpackbits(packed, count=sl.stop - sl.start))).astype(_id_dtype(n))
        keys = key_of(rows)
        if place_by_key is not None and place_by_key(keys, rows, cursor, out) == 0:  # (in C: no sort)
            continue
        order = np.argsort(keys, kind="stable")
        keys, rows = keys[order], rows[order]
        heads = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, np.int64)
        run = np.diff(np.r_[heads, len(keys)])
        out[cursor[keys] + np.arange(len(keys)) - np.repeat(heads, run)] = rows
        cursor[keys[heads]] += run
    present = counts > 0
    return out, offsets[present].astype(out.dtype), counts[present].astype(out.dtype)


@dataclass
class RecordIndex:
    """Per-record matching keys and the tables they point into.

    Instance ids ascend by (group index, seq) and pair ids by (channel, seq): a group's instances, and a channel's
    pairs, are one run of ids.
    """

    group_ids: np.ndarray  # uint32, gidx -> gid (sorted)
    group_size: np.ndarray  # int64 per gidx (members in the group table)
    inst: np.ndarray  # int32/int64 per record: its collective instance id (>= 0); a send or recv's p2p pair id
    #                   p as -2 - p (:meth:`pair_of`); -1 for other records. A collective is ``inst >= 0``.
    inst_gidx: np.ndarray  # per instance (int32)
    inst_seq: np.ndarray  # per instance (the dtype of Records.group_seq)
    chan_gidx: np.ndarray  # per channel
    chan_src: np.ndarray
    chan_dst: np.ndarray
    pair_chan: np.ndarray  # per pair (int32)
    pair_seq: np.ndarray  # per pair (as inst_seq)
    send_row: np.ndarray  # per pair: row of the send record, -1 if none (int32, int64 beyond 2**31 records)
    recv_row: np.ndarray  # per pair: row of the recv record, -1 if none

    @property
    def n_instances(self) -> int:
        return len(self.inst_gidx)

    @property
    def n_pairs(self) -> int:
        return len(self.pair_chan)

    def gid_of_instance(self, i: int) -> int:
        return int(self.group_ids[self.inst_gidx[i]])

    def pair_of(self, rows: np.ndarray | slice) -> np.ndarray:
        """The p2p pair id of each of ``rows`` (row numbers or a slice), -1 for a row that is not a send or recv."""
        return pair_ids(self.inst[rows])

    def instance_rows(self, insts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of the instances ``insts``, grouped by instance (ascending; rows ascending within one), and
        where each instance's rows start (with the end appended)."""
        want = np.zeros(self.n_instances + 1, bool)
        want[np.asarray(insts, np.int64) + 1] = True
        # (chunk by chunk; pair codes clip to the -1 slot, which is False)
        rows = select_rows(len(self.inst), lambda sl: np.take(want, self.inst[sl] + 1, mode="clip"))
        rows = rows[np.argsort(self.inst[rows], kind="stable")]
        return rows, np.r_[0, np.flatnonzero(np.diff(self.inst[rows])) + 1, len(rows)]

    def gidx_of(self, rec: Records, rows: slice = slice(None)) -> np.ndarray:
        """The group index of each of ``rows`` (int32; -1 for a marker or a group not in :attr:`group_ids`),
        recomputed from the group ids (a pass of C, or a binary search): kept for no record."""
        return _group_index(rec.group_id[rows], rec.op[rows], self.group_ids)


def pair_ids(codes: np.ndarray) -> np.ndarray:
    """Pair ids from :attr:`RecordIndex.inst` values: -2 - p is pair p; every other value gives -1."""
    return np.where(codes <= -2, -2 - codes, -1)


def _id_dtype(n: int) -> type:
    return np.int32 if n < np.iinfo(np.int32).max else np.int64


def _dense_ids(keys: np.ndarray, seqs: np.ndarray, n_keys: int,
               op: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ids of (key, seq) for rows with ``keys >= 0`` (with ``op``, the records' ops: not a send or a recv either):
    (id per row or -1, key per id, seq per id). Its passes over the rows run in C when the extension is built."""
    n = len(keys)
    ids = np.full(n, -1, _id_dtype(n))
    smin = np.full(n_keys, I64_MAX, np.int64)
    smax = np.full(n_keys, -1, np.int64)
    rows = key_ranges(keys, seqs, op, SEND, RECV, smin, smax) if key_ranges is not None else -1
    if rows < 0:  # (numpy; also where C refused: a negative sequence number)
        smin[:], smax[:], rows = I64_MAX, -1, 0
        for sl in chunks(n):
            k = _keys_of(keys, op, sl)
            sel = k >= 0
            v = seqs[sl][sel].astype(np.int64, copy=False)  # (as the tables: ufunc.at is slow across dtypes)
            np.minimum.at(smin, k[sel], v)
            np.maximum.at(smax, k[sel], v)
            rows += int(sel.sum())
    if not rows:
        return ids, np.empty(0, _id_dtype(n_keys)), np.empty(0, seqs.dtype)
    span = np.where(smax >= 0, smax - np.minimum(smin, smax) + 1, 0)
    total = int(span.sum())
    key_dtype = _id_dtype(n_keys)  # (the tables per id as narrow as their values: seqs keep their dtype)
    if total > DENSE_SLACK * rows + 1024 or smin.min() < 0:  # sparse or negative sequence numbers (corrupt or
        #                                                       huge, beyond 2**63 in the ring): sort instead
        sel = np.concatenate([sl.start + np.flatnonzero(_keys_of(keys, op, sl) >= 0) for sl in chunks(n)])
        uniq, inv = np.unique(np.stack([keys[sel].astype(np.int64), seqs[sel]]), axis=1, return_inverse=True)
        ids[sel] = inv.reshape(-1)
        return ids, uniq[0].astype(key_dtype), uniq[1].astype(seqs.dtype)
    base = np.concatenate([[0], np.cumsum(span)[:-1]])
    offset = base - smin  # slot = offset[key] + seq
    used = np.zeros(total, bool)
    every = place(keys, seqs, op, SEND, RECV, offset, ids, used.view(np.uint8)) if place is not None else -1
    if every < 0:
        ids[:] = -1
        used[:] = False
        for sl in chunks(n):
            k = _keys_of(keys, op, sl)
            sel = np.flatnonzero(k >= 0)
            slot = offset[k[sel]] + seqs[sl][sel]
            used[slot] = True
            ids[sl][sel] = slot
    if not (every == 1 or used.all()):  # (every slot used, the usual case: the slots are the ids already)
        remap = (np.cumsum(used, dtype=np.int64) - 1).astype(ids.dtype)
        for sl in chunks(n):
            part = ids[sl]
            sel = part >= 0
            part[sel] = remap[part[sel]]
    slot_key = np.repeat(np.arange(n_keys, dtype=key_dtype), span)
    slot_seq = np.arange(total) - base[slot_key] + smin[slot_key]
    return ids, slot_key[used], slot_seq[used].astype(seqs.dtype)


def _keys_of(keys: np.ndarray, op: np.ndarray | None, sl: slice) -> np.ndarray:
    """The keys of rows ``sl``, -1 for a send or a recv when ``op`` is given."""
    if op is None:
        return keys[sl]
    o = op[sl]
    return np.where((o != SEND) & (o != RECV), keys[sl], -1)


def _group_index(group_id: np.ndarray, op: np.ndarray, gids: np.ndarray) -> np.ndarray:
    """Each record's position in the sorted ``gids`` (int32), -1 for markers and groups not among them."""
    gidx = np.full(len(group_id), -1, np.int32)
    if not len(gids):
        return gidx
    if group_index is not None:
        group_index(group_id, op, gids, MARKER_MIN, gidx)
        return gidx
    for sl in chunks(len(group_id)):
        g = group_id[sl]
        pos = np.minimum(np.searchsorted(gids, g), len(gids) - 1)
        known = (gids[pos] == g) & (op[sl] < MARKER_MIN)
        gidx[sl][known] = pos[known]
    return gidx


def _p2p_channels(rec: Records, gidx: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The point-to-point rows (a send or recv in a known group, to a peer in the world), the sorted distinct
    channel keys ``(gidx * world + src) * world + dst``, and each row's channel (its key's position, int32)."""
    n = len(rec)
    if p2p_channels is not None and world <= MAX_KERNEL_WORLD:  # one C pass: a hash table of the few channels
        rows, chan = np.empty(n, _id_dtype(n)), np.empty(n, np.int32)
        count, seen = p2p_channels(rec.op, gidx, rec.rank, rec.peer, world, SEND, RECV, rows, chan)
        first_seen = np.frombuffer(seen, np.int64)
        order = np.argsort(first_seen, kind="stable")
        position = np.empty(len(order), np.int32)
        position[order] = np.arange(len(order), dtype=np.int32)
        return rows[:count], first_seen[order], position[chan[:count]]
    p_rows = np.flatnonzero(((rec.op == SEND) | (rec.op == RECV)) & (gidx >= 0) & (rec.peer >= 0)
                            & (rec.peer < world)).astype(_id_dtype(n))
    sends = rec.op[p_rows] == SEND
    me, peer = rec.rank[p_rows].astype(np.int64), rec.peer[p_rows].astype(np.int64)
    chan_key = (gidx[p_rows].astype(np.int64) * world + np.where(sends, me, peer)) * world + np.where(sends, peer, me)
    del me, peer
    # The distinct channels are few (a handful per rank): sort-unique them, then find each row's by binary
    # search, instead of unique(return_inverse=True), whose argsort of every row is the slow part.
    chans = np.unique(chan_key)
    return p_rows, chans, np.searchsorted(chans, chan_key).astype(np.int32)


def index_records(trace: TraceSet) -> RecordIndex:
    """Assign collective instance ids and p2p pair ids to every record."""
    rec = trace.records
    gids = np.array(sorted(trace.groups), dtype=np.uint32)
    sizes = np.array([len(trace.groups[int(g)].ranks) for g in gids], dtype=np.int64)
    gidx = _group_index(rec.group_id, rec.op, gids)

    inst, inst_gidx, inst_seq = _dense_ids(gidx, rec.group_seq, len(gids), op=rec.op)  # (collectives: no p2p)

    world = max(trace.world_size, 1)
    p_rows, chans, chan_of = _p2p_channels(rec, gidx, world)
    del gidx
    sends = rec.op[p_rows] == SEND
    p_ids, pair_chan, pair_seq = _dense_ids(chan_of, rec.group_seq[p_rows], len(chans))
    del chan_of
    inst[p_rows] = -2 - p_ids  # (the p2p rows are no collective's: their slots are free)
    send_row = np.full(len(pair_chan), -1, inst.dtype)
    recv_row = np.full(len(pair_chan), -1, inst.dtype)
    send_row[p_ids[sends]] = p_rows[sends]
    recv_row[p_ids[~sends]] = p_rows[~sends]
    return RecordIndex(
        group_ids=gids, group_size=sizes, inst=inst, inst_gidx=inst_gidx, inst_seq=inst_seq,
        chan_gidx=chans // (world * world), chan_src=(chans // world) % world, chan_dst=chans % world,
        pair_chan=pair_chan, pair_seq=pair_seq, send_row=send_row, recv_row=recv_row)
