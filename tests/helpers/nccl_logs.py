"""Megatrace NCCL-patch logs written from a trace: :func:`write_nccl_logs`, a small writer of the patch's exact line
format (element counts, process-local stream pointers, per-communicator opCounts, a one-rank communicator that
logs opCount 0, overlapping dumps of a ring of lines, with or without ``groupHash``).

Used by tests/test_import_nccl_log.py, tests/test_import_bad_input.py, tests/test_import_flight_recorder.py,
tests/test_import_semantics.py and tests/test_export_perfetto.py.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from megatrace.load.traceset import TraceSet
from megatrace.trace.ring_format import Flag, Op

FUNCS = {Op.ALL_REDUCE: "AllReduce", Op.ALL_GATHER: "AllGather", Op.REDUCE_SCATTER: "ReduceScatter",
         Op.BROADCAST: "Broadcast", Op.REDUCE: "Reduce", Op.SEND: "Send", Op.RECV: "Recv"}


def _calls(trace: TraceSet, rank: int, split: bool = False) -> list[tuple[int, str, int, str, int, int]]:
    """One rank's calls as the patch would log them: (wall ns, Fun, Data, stream, opCount, groupHash). ``split``:
    each group's collectives go to two communicators by turns (two streams, their own opCounts and groupHash), as
    Megatron's groups of the same members made twice (data parallel with and without context parallelism)."""
    rec, info = trace.records, trace.info(rank)
    rows = trace.rows(rank)
    op_count: dict[int, int] = {}
    batch_end: dict[int, int] = {}
    out = []
    for i in range(rows.start, rows.stop):
        op = int(rec.op[i])
        if op not in FUNCS:
            continue
        gid = int(rec.group_id[i])
        members = trace.groups[gid].ranks
        # a batch of send/recv is one NCCL group: one kernel launch, one opCount
        batched = bool(rec.flags[i] & Flag.BATCHED) and rec.t_enqueue[i] <= batch_end.get(gid, -1)
        if not batched:
            op_count[gid] = op_count.get(gid, -1) + 1
        batch_end[gid] = max(batch_end.get(gid, -1), int(rec.t_complete[i])) if rec.flags[i] & Flag.BATCHED else -1
        wall = info.anchor_wall_ns + int(rec.t_enqueue[i]) - info.anchor_mono_ns
        twin = int(split and op not in (Op.SEND, Op.RECV) and int(rec.group_seq[i]) % 2)  # the second communicator
        stream = f"0x{0x55919d000000 + 0x10000 * rank + 0x100 * sorted(trace.groups).index(gid) + 0x10 * twin:x}"
        ghash = zlib.crc32(",".join(map(str, members)).encode()) + twin
        count = int(rec.group_seq[i]) // 2 if split and op not in (Op.SEND, Op.RECV) else op_count[gid]
        out.append((wall, FUNCS[op], int(rec.nbytes[i]) // 4, stream, count, ghash))
        if len(out) % 7 == 0:  # a one-rank communicator: its opCount stays 0
            out.append((wall + 1000, "Broadcast", 1, f"0x{0x77000000 + rank:x}", 0, 1_000_000 + rank))
    return out


def write_nccl_logs(trace: TraceSet, out: Path, *, group_hash: bool, ring: int = 9999, dump_every: int = 40,
                    old_format: bool = False, split: bool = False) -> dict:
    """The demo's calls as ``rank_<R>.log`` files of the NCCL patch; returns rank -> calls written.

    Every ``dump_every`` calls (the patch dumps when the rank goes idle) and at the end, the rank's ring
    of the last ``ring`` lines is appended as one dump (``save_count`` 1, 2, ...): dumps overlap.
    ``old_format``: the older line format instead (no save_count, opCount or groupHash; every call once).
    ``split``: each collective group on two streams (see :func:`_calls`).
    """
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for rank in trace.ranks.tolist():
        calls = _calls(trace, rank, split)
        written[rank] = calls
        if old_format:
            (out / f"rank_{rank}.log").write_text("".join(
                f"[{wall // 10**9}.{wall % 10**9:09d}] [Rank {rank}] Fun {fun} Data {data} stream {stream}\n"
                for wall, fun, data, stream, _, _ in calls))
            continue
        lines = []
        ends = list(range(dump_every, len(calls), dump_every)) + [len(calls)]
        for save, end in enumerate(ends, start=1):
            for wall, fun, data, stream, count, ghash in calls[max(0, end - ring):end]:
                lines.append(f"[save_count {save}] [{wall // 10**9}.{wall % 10**9:09d}] [Rank {rank}] Fun {fun} "
                             f"Data {data} stream {stream} opCount {count}" + (f" groupHash {ghash}" if group_hash
                                                                               else ""))
        (out / f"rank_{rank}.log").write_text("\n".join(lines) + "\n")
    layout = trace.layout
    (out / "config.yaml").write_text(f"TP: {layout.tp}\nPP: {layout.pp}\nworld_size: {layout.world_size}\n")
    return written
