"""Cross-rank matching: collective instances by (group, group_seq), point-to-point pairs by (src, dst, group, seq).

Everything is vectorised over the record columns. Each collective record gets
a dense instance id: ``base[group] + group_seq - min_seq[group]`` (group_seq is
dense per group and identical on all members), so per-instance facts (who
entered, completed, failed, first and last arrival, op/size/dtype agreement)
are ``bincount`` / ``ufunc.at`` reductions, without a sort. Point-to-point
records get a channel id ``(group, src, dst)`` and a pair id within it: send
#k from A to B pairs with recv #k on B from A.

:func:`index_records` needs no clock (the clock module uses it to align
hosts); :func:`match` adds the timings on aligned clocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from megatrace.analyze.index import RecordIndex, chunks, index_records, op_name
from megatrace.load.traceset import GroupInfo, Records, TraceSet
from megatrace.trace.ring_format import Dtype, Op, State

try:
    from megatrace.analyze._kernels import instance_facts  # type: ignore[import-not-found]
except ImportError:  # not built (no C compiler at install): numpy makes the same passes
    instance_facts = None

__all__ = ["Collectives", "InstanceDetail", "MatchResult", "Mismatch", "RecordIndex", "index_records",
           "instance_details", "match", "op_name"]

MAX_MISMATCHES = 200  # mismatched instances described one by one; the rest are counted
ROOTED = (int(Op.BROADCAST), int(Op.REDUCE))  # collectives whose root (peer) must agree


def dtype_name(code: int) -> str:
    try:
        return Dtype(code).name.lower()
    except ValueError:
        return f"dtype{code}"


@dataclass
class Collectives:
    """Per-instance facts (arrays indexed by instance id)."""

    n_members: np.ndarray  # from the group table
    n_entered: np.ndarray
    n_completed: np.ndarray
    n_failed: np.ndarray
    first_enter: np.ndarray  # aligned ns
    last_enter: np.ndarray
    last_enter_rank: np.ndarray
    last_complete: np.ndarray  # aligned ns; 0 if none completed
    op: np.ndarray  # the lowest op code seen (== the op unless mismatched)
    nbytes: np.ndarray  # the largest size seen
    mismatch: np.ndarray  # bool: op, size, dtype or root differ between members

    def __len__(self) -> int:
        return len(self.n_members)

    @property
    def complete(self) -> np.ndarray:
        """Every member entered and completed."""
        return (self.n_completed >= self.n_members) & (self.n_entered >= self.n_members)

    @property
    def arrival_lag(self) -> np.ndarray:
        """How long the last arrival kept the first one waiting (ns)."""
        return self.last_enter - self.first_enter


@dataclass(frozen=True)
class Mismatch:
    """Members of one collective instance (or one p2p pair) disagree on op, size, dtype or root."""

    gid: int
    seq: int
    group: str  # label
    field: str  # "op", "nbytes", "dtype", "root"
    values: dict[str, tuple[int, ...]]  # value (as text) -> ranks
    p2p: bool = False

    def describe(self) -> str:
        parts = "; ".join(f"{v} on ranks {list(r)}" for v, r in self.values.items())
        what = "send/recv pair" if self.p2p else "collective"
        return f"{what} #{self.seq} of {self.group}: {self.field} differs ({parts})"


@dataclass
class MatchResult:
    index: RecordIndex
    collectives: Collectives
    mismatches: list[Mismatch] = field(default_factory=list)
    n_mismatched: int = 0  # instances and pairs with a mismatch (may exceed len(mismatches))

    def summary(self) -> dict:
        c, ix = self.collectives, self.index
        pairs_done = int(((ix.send_row >= 0) & (ix.recv_row >= 0)).sum())
        return {"collective_instances": len(c), "incomplete_instances": int((~c.complete).sum()),
                "p2p_pairs": ix.n_pairs, "p2p_matched": pairs_done, "mismatches": self.n_mismatched}


def _value_text(field_name: str, value: int) -> str:
    if field_name == "op":
        return op_name(value)
    if field_name == "dtype":
        return dtype_name(value)
    if field_name == "nbytes":
        return f"{value} bytes"
    return f"root {value}"


def _describe_mismatches(trace: TraceSet, ix: RecordIndex, bad: np.ndarray,
                         checks: dict[str, Callable[[np.ndarray], np.ndarray]], p2p: bool) -> list[Mismatch]:
    """One Mismatch per (instance, field) for the instance ids in ``bad`` (limited)."""
    out: list[Mismatch] = []
    rec = trace.records
    if p2p:  # (a pair's rows: its send and its recv)
        ids = bad[:MAX_MISMATCHES]
        ends = np.sort(np.stack([ix.send_row[ids], ix.recv_row[ids]], axis=1), axis=1)
        by_key = [(int(i), r[r >= 0]) for i, r in zip(ids.tolist(), ends)]
    else:
        rows, bounds = ix.instance_rows(bad[:MAX_MISMATCHES])
        by_key = [(int(ix.inst[rows[a]]), rows[a:b]) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())
                  if b > a]
    for i, chunk in by_key:
        if p2p:
            gidx, seq = int(ix.chan_gidx[ix.pair_chan[i]]), int(ix.pair_seq[i])
        else:
            gidx, seq = int(ix.inst_gidx[i]), int(ix.inst_seq[i])
        gid = int(ix.group_ids[gidx])
        for name, column in checks.items():
            vals = column(chunk)
            if vals.min() != vals.max():
                by: dict[str, list[int]] = {}
                for v, r in zip(vals.tolist(), rec.rank[chunk].tolist()):
                    by.setdefault(_value_text(name, int(v)), []).append(int(r))
                out.append(Mismatch(gid, seq, trace.group_label(gid), name,
                                    {k: tuple(sorted(v)) for k, v in by.items()}, p2p))
    return out


_CHECKS: dict[str, Callable] = {  # per-record value that all members of an instance must agree on
    "op": lambda rec, r: rec.op[r].astype(np.int64),
    "dtype": lambda rec, r: rec.dtype[r].astype(np.int64),
    "nbytes": lambda rec, r: np.where(rec.op[r] == Op.ALL_TO_ALL, 0, rec.nbytes[r]).astype(np.int64),  # (uneven
    #                                                                         splits of an all_to_all are legal)
    "root": lambda rec, r: np.where(np.isin(rec.op[r], ROOTED), rec.peer[r], -1).astype(np.int64),
}
I64_MIN, I64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max


# Per-instance facts (match's first passes) and the starting value of each, in the order of the C kernel's tables:
# the facts match keeps first, then those that only tell whether the members agree (dropped after the check).
KEPT_FACTS: dict[str, int] = {"entered": 0, "completed": 0, "failed": 0, "first": I64_MAX, "last": I64_MIN,
                              "last_complete": 0, "last_rank": -1, "op_lo": I64_MAX, "nbytes_hi": I64_MIN}
CHECK_FACTS: dict[str, int] = {"op_hi": I64_MIN, "dtype_lo": I64_MAX, "dtype_hi": I64_MIN, "nbytes_lo": I64_MAX,
                               "root_lo": I64_MAX, "root_hi": I64_MIN}
FACTS = KEPT_FACTS | CHECK_FACTS


def _instance_facts(rec: Records, ix: RecordIndex, t_enqueue: np.ndarray,
                    t_complete: np.ndarray) -> dict[str, np.ndarray]:
    """Per collective instance: members entered, completed and failed; first and last enqueue, last completion;
    the min and max of each of :data:`_CHECKS`' values; the rank of the last row whose enqueue was the last. In two
    passes of C when the extension is built, else chunk by chunk with numpy."""
    n = ix.n_instances
    kept, checks = (np.empty((len(names), n), np.int64) for names in (KEPT_FACTS, CHECK_FACTS))
    for table, names in ((kept, KEPT_FACTS), (checks, CHECK_FACTS)):
        for k, start in enumerate(names.values()):
            table[k] = start
    codes = (int(State.COMPLETED), int(State.FAILED), int(Op.ALL_TO_ALL), *ROOTED)
    if instance_facts is not None and instance_facts(ix.inst, rec.state, t_enqueue, t_complete, rec.op, rec.dtype,
                                                     rec.nbytes, rec.peer, rec.rank, codes, kept.reshape(-1),
                                                     checks.reshape(-1)) == 0:
        return dict(zip(FACTS, [*kept, *checks], strict=True))
    del kept, checks
    facts = {name: np.full(n, start, np.int64) for name, start in FACTS.items()}
    n_entered, n_completed, n_failed = facts["entered"], facts["completed"], facts["failed"]
    first, last, last_complete, last_rank = facts["first"], facts["last"], facts["last_complete"], facts["last_rank"]
    lo = {name: facts[f"{name}_lo"] for name in _CHECKS}
    hi = {name: facts[f"{name}_hi"] for name in _CHECKS}
    for sl in chunks(len(rec)):
        rows = sl.start + np.flatnonzero(ix.inst[sl] >= 0)
        inst, state, te = ix.inst[rows], rec.state[rows], t_enqueue[rows]
        n_entered += np.bincount(inst, minlength=n)
        done = state == State.COMPLETED
        n_completed += np.bincount(inst[done], minlength=n)
        n_failed += np.bincount(inst[state == State.FAILED], minlength=n)
        np.minimum.at(first, inst, te)
        np.maximum.at(last, inst, te)
        np.maximum.at(last_complete, inst[done], t_complete[rows][done])
        for name, value in _CHECKS.items():
            col = value(rec, rows)
            np.minimum.at(lo[name], inst, col)
            np.maximum.at(hi[name], inst, col)
    for sl in chunks(len(rec)):
        rows = sl.start + np.flatnonzero(ix.inst[sl] >= 0)
        at_last = t_enqueue[rows] == last[ix.inst[rows]]
        last_rank[ix.inst[rows][at_last]] = rec.rank[rows][at_last]
    return facts


def match(trace: TraceSet, ix: RecordIndex, t_enqueue: np.ndarray, t_complete: np.ndarray) -> MatchResult:
    """Per-instance facts on aligned times, and mismatches of collectives and p2p pairs (chunked passes)."""
    rec = trace.records
    n = ix.n_instances
    facts = _instance_facts(rec, ix, t_enqueue, t_complete)
    n_entered, n_completed, n_failed, first, last, last_complete, last_rank = (
        facts[k] for k in ("entered", "completed", "failed", "first", "last", "last_complete", "last_rank"))
    lo = {name: facts[f"{name}_lo"] for name in _CHECKS}
    hi = {name: facts[f"{name}_hi"] for name in _CHECKS}
    mismatch = np.zeros(n, bool)
    for name in _CHECKS:
        mismatch |= (lo[name] != hi[name]) & (n_entered > 0)
    # Arrays of their own, so that the facts' table (every fact in int64) is freed: counts, ranks and op codes in
    # int32, times and sizes in int64.
    i32 = np.int32
    colls = Collectives(
        n_members=np.maximum(ix.group_size[ix.inst_gidx], n_entered).astype(i32), n_entered=n_entered.astype(i32),
        n_completed=n_completed.astype(i32), n_failed=n_failed.astype(i32), first_enter=first.copy(),
        last_enter=last.copy(), last_enter_rank=last_rank.astype(i32), last_complete=last_complete.copy(),
        op=lo["op"].astype(i32), nbytes=hi["nbytes"].copy(), mismatch=mismatch)

    bad = np.flatnonzero(mismatch)
    checks = {name: (lambda r, v=value: v(rec, r)) for name, value in _CHECKS.items()}
    mismatches = _describe_mismatches(trace, ix, bad, checks, p2p=False) if len(bad) else []
    both = np.flatnonzero((ix.send_row >= 0) & (ix.recv_row >= 0))
    size_bad = both[rec.nbytes[ix.send_row[both]] != rec.nbytes[ix.recv_row[both]]]
    if len(size_bad):
        mismatches += _describe_mismatches(trace, ix, size_bad,
                                           {"nbytes": lambda r: rec.nbytes[r]}, p2p=True)
    return MatchResult(ix, colls, mismatches, len(bad) + len(size_bad))


@dataclass
class InstanceDetail:
    """Who did what in one collective instance."""

    inst: int
    gid: int
    seq: int
    group: GroupInfo | None
    members: tuple[int, ...]
    rows: dict[int, int]  # rank -> record row (entered)
    completed: tuple[int, ...]
    failed: tuple[int, ...]
    never_entered: tuple[int, ...]

    @property
    def entered(self) -> tuple[int, ...]:
        return tuple(sorted(self.rows))

    @property
    def stuck(self) -> tuple[int, ...]:
        """Entered and neither completed nor failed."""
        done = set(self.completed) | set(self.failed)
        return tuple(r for r in self.entered if r not in done)


def instance_details(trace: TraceSet, ix: RecordIndex, insts: np.ndarray | list[int]) -> dict[int, InstanceDetail]:
    """Members, entries and completions of a few instances (one vectorised pass over the records)."""
    insts = np.unique(np.asarray(insts, dtype=np.int64))
    if not len(insts):
        return {}
    rows, bounds = ix.instance_rows(insts)
    by_inst = {int(ix.inst[rows[a]]): rows[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())
               if b > a}
    rec = trace.records
    out: dict[int, InstanceDetail] = {}
    for i in insts.tolist():
        gid = ix.gid_of_instance(i)
        group = trace.groups.get(gid)
        chunk = by_inst.get(i, np.empty(0, np.int64))
        ranks = rec.rank[chunk].tolist()
        states = rec.state[chunk].tolist()
        entered = {int(r): int(row) for r, row in zip(ranks, chunk.tolist())}
        members = group.ranks if group is not None else tuple(sorted(entered))
        out[i] = InstanceDetail(
            inst=i, gid=gid, seq=int(ix.inst_seq[i]), group=group, members=members, rows=entered,
            completed=tuple(sorted(r for r, s in zip(ranks, states) if s == State.COMPLETED)),
            failed=tuple(sorted(r for r, s in zip(ranks, states) if s == State.FAILED)),
            never_entered=tuple(r for r in members if r not in entered))
    return out
