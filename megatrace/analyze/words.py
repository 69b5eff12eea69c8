"""Shared wording for findings: durations, ranks with their place, and operations as people name them."""

from __future__ import annotations

from megatrace.analyze.findings import Subject
from megatrace.analyze.index import op_name
from megatrace.load.traceset import GroupInfo, TraceSet, rank_list
from megatrace.trace.ring_format import Op


def duration(ns: float | int) -> str:
    """A human duration: ``47.0 s``, ``115.9 ms``, ``830 µs``."""
    s = abs(float(ns)) / 1e9
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    if s >= 1:
        return f"{s:.1f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} µs"


def coords(trace: TraceSet, rank: int) -> dict[str, int] | None:
    if trace.layout is None or not 0 <= rank < trace.layout.world_size:
        return None
    c = trace.layout.coords(rank)
    return {"pp": c.pp, "dp": c.dp, "tp": c.tp}


def where(trace: TraceSet, rank: int) -> str:
    """``host vm, GPU 5, pp=1 dp=0 tp=1`` (what is known)."""
    parts = []
    host = trace.host_of(rank)
    if host:
        parts.append(f"host {host}")
    gpu = trace.gpu_of(rank)
    if gpu is not None:
        parts.append(f"GPU {gpu}")
    c = coords(trace, rank)
    if c is not None:
        parts.append(f"pp={c['pp']} dp={c['dp']} tp={c['tp']}")
    return ", ".join(parts)


def rank_label(trace: TraceSet, rank: int) -> str:
    """``rank 5 (host vm, GPU 5, pp=1 dp=0 tp=1)``."""
    place = where(trace, rank)
    return f"rank {rank} ({place})" if place else f"rank {rank}"


def rank_subject(trace: TraceSet, rank: int, group: GroupInfo | None = None) -> Subject:
    return Subject(rank=rank, host=trace.host_of(rank), local_rank=trace.gpu_of(rank),
                   coords=coords(trace, rank), group=group.to_dict() if group else None)


def group_prefix(group: GroupInfo | None) -> str:
    """``TP`` for a tp group, ``world`` for the default group, ``''`` when unknown."""
    if group is None or not group.named:
        return ""
    kind = group.kind
    return kind.upper() if kind in ("tp", "pp", "dp", "cp", "ep") else kind


def collective_label(trace: TraceSet, gid: int, op: int, seq: int) -> str:
    """``TP all_reduce #49 (group [4, 5])``."""
    group = trace.groups.get(gid)
    if group is None:
        return f"{op_name(op)} #{seq} (group {gid})"
    if not group.named:
        return f"group {rank_list(group.ranks)} {op_name(op)} #{seq}"
    return f"{group_prefix(group)} {op_name(op)} #{seq} (group {rank_list(group.ranks)})"


def record_label(trace: TraceSet, row: int) -> str:
    """A record as a person names it: ``PP recv #13 from rank 4`` or ``TP all_reduce #49 (group [4, 5])``."""
    rec = trace.records
    op, gid, seq, peer = int(rec.op[row]), int(rec.group_id[row]), int(rec.group_seq[row]), int(rec.peer[row])
    if op in (Op.SEND, Op.RECV):
        prefix = group_prefix(trace.groups.get(gid))
        direction = "to" if op == Op.SEND else "from"
        return f"{prefix + ' ' if prefix else ''}{op_name(op)} #{seq} {direction} rank {peer}"
    if op >= Op.MARK_STEP:
        return f"{op_name(op)} (step {seq})"
    return collective_label(trace, gid, op, seq)
