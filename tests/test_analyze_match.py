"""Matching: collective instances by (group, seq), p2p pairs by (src, dst, group, seq), and mismatches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from helpers.analysis_factory import MS, TraceBuilder
from hypothesis import given, settings
from hypothesis import strategies as st

from megatrace.analyze.clock import align_clocks
from megatrace.analyze.match import MatchResult, index_records, instance_details, match
from megatrace.load import load_trace
from megatrace.trace.ring_format import Dtype, Op


def run(tmp_path: Path, b: TraceBuilder) -> tuple:
    b.write(tmp_path)
    trace = load_trace(tmp_path)
    ix = index_records(trace)
    clock = align_clocks(trace, ix)
    return trace, match(trace, ix, clock.t_enqueue, clock.t_complete)


def find(m: MatchResult, gid: int, seq: int) -> int:
    ix = m.index
    hits = np.flatnonzero((ix.group_ids[ix.inst_gidx] == gid) & (ix.inst_seq == seq))
    assert len(hits) == 1
    return int(hits[0])


def test_instances_count_entries_completions_and_arrivals(tmp_path: Path) -> None:
    b = TraceBuilder(world=4)
    g = b.group("dp", [0, 1, 2, 3])
    b.collective(g, at=1.0)
    b.collective(g, at=10.0, enter={3: 14.0})  # rank 3 arrives 4 ms late
    b.collective(g, at=20.0, skip=(2,), stuck=(0, 1, 3))  # rank 2 never enters
    b.collective(b.world_group, at=30.0, failed=(1,))
    trace, m = run(tmp_path, b)
    c = m.collectives
    assert len(c) == 4
    i = find(m, g.gid, 2)
    assert c.n_entered[i] == 4 and c.n_completed[i] == 4 and c.complete[i]
    assert c.arrival_lag[i] == 4 * MS and c.last_enter_rank[i] == 3
    i = find(m, g.gid, 3)
    assert c.n_entered[i] == 3 and c.n_completed[i] == 0 and c.n_members[i] == 4 and not c.complete[i]
    d = instance_details(trace, m.index, [i])[i]
    assert d.never_entered == (2,) and d.entered == (0, 1, 3) and d.stuck == (0, 1, 3)
    i = find(m, b.world_group.gid, 1)
    assert c.n_failed[i] == 1 and not c.complete[i]
    assert m.summary()["incomplete_instances"] == 2 and not m.mismatches


def test_different_op_size_or_dtype_in_one_instance_are_mismatches(tmp_path: Path) -> None:
    b = TraceBuilder(world=3)
    g = b.group("tp", [0, 1, 2])
    b.collective(g, at=1.0)
    b.collective(g, at=5.0, override={2: {"op": int(Op.ALL_GATHER)}})
    b.collective(g, at=9.0, override={1: {"nbytes": 8192}})
    b.collective(g, at=13.0, override={0: {"dtype": int(Dtype.BFLOAT16)}})
    _, m = run(tmp_path, b)
    assert m.n_mismatched == 3 and m.collectives.mismatch.sum() == 3
    got = {(mm.seq, mm.field): mm.values for mm in m.mismatches}
    assert got[(2, "op")] == {"all_reduce": (0, 1), "all_gather": (2,)}
    assert got[(3, "nbytes")] == {"4096 bytes": (0, 2), "8192 bytes": (1,)}
    assert got[(4, "dtype")] == {"bfloat16": (0,), "float32": (1, 2)}
    assert "tp group [0, 1, 2]" in m.mismatches[0].describe()
    c = m.collectives  # per instance: the lowest op and the largest size seen, whoever wrote them
    ops = sorted([int(Op.ALL_REDUCE), int(Op.ALL_GATHER)])
    assert c.op[find(m, g.gid, 2)] == ops[0] and c.op[find(m, g.gid, 1)] == int(Op.ALL_REDUCE)
    assert c.nbytes[find(m, g.gid, 3)] == 8192 and c.nbytes[find(m, g.gid, 4)] == 4096
    assert not c.mismatch[find(m, g.gid, 1)] and c.mismatch[find(m, g.gid, 2)]


def test_sends_pair_with_receives_by_direction_and_sequence(tmp_path: Path) -> None:
    b = TraceBuilder(world=4)
    pp = b.group("pp", [0, 1, 2, 3])
    for k in range(3):
        b.p2p(0, 1, pp, at=1.0 + 5 * k)  # sends #1..#3 from 0 to 1
        b.p2p(1, 0, pp, at=2.0 + 5 * k)  # and the other direction, its own sequence
    b.p2p(2, 3, pp, at=20.0, send_only=True)  # rank 3 never posts its recv
    b.p2p(3, 2, pp, at=21.0, nbytes=100, recv_nbytes=200)  # sizes differ
    trace, m = run(tmp_path, b)
    ix, rec = m.index, trace.records
    assert ix.n_pairs == 8
    both = (ix.send_row >= 0) & (ix.recv_row >= 0)
    assert both.sum() == 7
    assert np.all(rec.rank[ix.send_row[both]] == rec.peer[ix.recv_row[both]])
    assert np.all(rec.group_seq[ix.send_row[both]] == rec.group_seq[ix.recv_row[both]])
    order = np.lexsort((ix.pair_seq, ix.pair_chan))  # pair ids ascend by (channel, seq)
    assert order.tolist() == list(range(ix.n_pairs)) and len(np.unique(ix.pair_chan)) == 4
    lone = np.flatnonzero(~both)[0]
    assert rec.rank[ix.send_row[lone]] == 2 and ix.recv_row[lone] == -1
    (mm,) = m.mismatches
    assert mm.p2p and mm.field == "nbytes" and mm.values == {"100 bytes": (3,), "200 bytes": (2,)}


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), min_size=1, max_size=30))
def test_every_collective_instance_is_matched_once(tmp_path_factory, plan: list[tuple[int, int]]) -> None:
    """Random sequences of collectives over overlapping groups: one instance per (group, seq)."""
    b = TraceBuilder(world=4)
    groups = [b.group("a", [0, 1]), b.group("b", [1, 2, 3]), b.group("c", [0, 1, 2, 3])]
    expected: dict[int, int] = {}
    for k, (gi, late) in enumerate(plan):
        g = groups[gi]
        b.collective(g, at=1.0 + 10 * k, enter={g.ranks[-1]: 1.0 + 10 * k + late})
        expected[g.gid] = expected.get(g.gid, 0) + 1
    _, m = run(tmp_path_factory.mktemp("t"), b)
    c = m.collectives
    assert len(c) == len(plan) and np.all(c.complete)
    per_group = np.bincount(m.index.inst_gidx, minlength=len(m.index.group_ids))
    assert {int(g): int(n) for g, n in zip(m.index.group_ids, per_group) if n} == expected
    assert np.all(c.n_entered == c.n_members)
    ix = m.index  # instance ids ascend by (group, seq)
    assert np.lexsort((ix.inst_seq, ix.inst_gidx)).tolist() == list(range(ix.n_instances))


def test_sparse_sequence_numbers_keep_ids_ordered_by_key_and_seq() -> None:
    """Sequence numbers too far apart for dense slots take the sorting path: the same ids, the same order."""
    from megatrace.analyze.index import _dense_ids

    keys = np.array([1, 0, -1, 1, 0, 1], np.int32)
    for seqs in (np.array([3, 7, 0, 4, 8, 5], np.int64), np.array([3, 7, 0, 4, 10**9, 10**12], np.int64)):
        ids, key_of, seq_of = _dense_ids(keys, seqs, 2)
        assert ids[2] == -1
        assert list(zip(key_of.tolist(), seq_of.tolist())) == sorted(zip(key_of.tolist(), seq_of.tolist()))
        assert all((key_of[i], seq_of[i]) == (keys[r], seqs[r]) for r, i in enumerate(ids.tolist()) if i >= 0)
