"""The analysis's C kernels (megatrace/analyze/native/_kernels.c) give what their numpy twins give.

Each case runs the function once as built (its passes in C) and once with the kernels taken away, as on an
install without a C compiler; the arrays must be equal, dtypes included.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatrace.analyze import index, iterations, match
from megatrace.analyze.jobconfig import build
from megatrace.trace.ring_format import Op

kernels = pytest.importorskip("megatrace.analyze._kernels", reason="C kernels not built (no compiler at install)")


def both(fn, *args, **kwargs):
    """``fn(*args)`` with the C kernels, then with numpy only."""
    with_c = fn(*args, **kwargs)
    with pytest.MonkeyPatch.context() as m:
        for name in ("key_ranges", "place", "group_index", "p2p_channels", "place_by_key"):
            m.setattr(index, name, None)
        m.setattr(iterations, "step_cells", None)
        m.setattr(iterations, "fill_runs", None)
        m.setattr(iterations, "role_kernel", None)
        m.setattr(match, "instance_facts", None)
        m.setattr(build, "group_counts", None)
        without = fn(*args, **kwargs)
    return with_c, without


def assert_same(a: tuple, b: tuple) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 400), n_keys=st.integers(1, 9),
       spread=st.sampled_from([1, 3, 50, 10**6]), seq_dtype=st.sampled_from([np.int32, np.int64]),
       with_op=st.booleans(), negative=st.booleans())
def test_dense_ids_in_c_are_numpys(seed: int, n: int, n_keys: int, spread: int,
                                   seq_dtype: type, with_op: bool, negative: bool) -> None:
    """Dense and sparse sequence numbers (the sort path), gaps (ids renumbered), rows without a key, sends and
    receives left out of the collectives, and a negative sequence number (C refuses it: numpy's answer)."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(-1, n_keys, n).astype(np.int32)
    seqs = (rng.integers(0, spread, n) + 1).astype(seq_dtype)
    if negative and n:
        seqs[rng.integers(0, n)] = -5
    op = rng.choice(np.array([1, 2, int(Op.SEND), int(Op.RECV)], np.uint16), n) if with_op else None
    a, b = both(index._dense_ids, keys, seqs, n_keys, op=op)
    assert_same(a, b)
    if with_op and n:
        assert (a[0][(op == Op.SEND) | (op == Op.RECV)] == -1).all()


def test_dense_ids_of_a_real_trace_index_are_the_same(tmp_path) -> None:
    """The whole index of a simulated pipeline job (collectives and p2p pairs), with and without the kernels."""
    from megatrace.load import load_trace
    from megatrace.simulate import SimOptions, simulate_job

    simulate_job(SimOptions(tp=2, pp=4, dp=4, out=tmp_path / "t", steps=4))
    trace = load_trace(tmp_path / "t")
    a, b = both(index.index_records, trace)
    for name in ("inst", "inst_gidx", "inst_seq", "pair_chan", "pair_seq", "send_row", "recv_row",
                 "chan_gidx", "chan_src", "chan_dst"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert a.n_instances > 0 and a.n_pairs > 0
    pairs = a.pair_of(slice(None))  # (one column: pair p as -2 - p beside the instances)
    assert np.array_equal(np.flatnonzero(pairs >= 0), np.sort(np.r_[a.send_row[a.send_row >= 0],
                                                                     a.recv_row[a.recv_row >= 0]]))
    assert not ((a.inst >= 0) & (pairs >= 0)).any()


def _records(rng: np.random.Generator, n: int, world: int, n_groups: int):
    from megatrace.load.traceset import COLUMNS, Records

    cols = {name: np.zeros(n, dt) for name, dt in COLUMNS.items()}
    cols["rank"] = np.sort(rng.integers(0, world, n)).astype(np.int32)
    cols["peer"] = rng.integers(-2, world + 2, n).astype(np.int32)  # some outside the world
    cols["op"] = rng.choice(np.array([1, 3, int(Op.SEND), int(Op.RECV), int(Op.MARK_STEP)], np.uint16), n)
    cols["group_id"] = rng.choice(np.array([7, 9, 1000, 2**32 - 1, 5], np.uint32)[:n_groups + 1], n)
    return Records(**cols)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 3000), world=st.integers(1, 70), n_groups=st.integers(0, 4))
def test_group_index_and_p2p_channels_in_c_are_numpys(seed: int, n: int, world: int, n_groups: int) -> None:
    """Each record's group position (markers and unknown groups left at -1) and the p2p rows with their channels
    (peers outside the world and rows without a group left out); thousands of channels grow the C hash table."""
    rng = np.random.default_rng(seed)
    rec = _records(rng, n, world, n_groups)
    gids = np.array(sorted({7, 9, 1000, 2**32 - 1})[:n_groups], np.uint32)
    gidx_c, gidx_np = both(index._group_index, rec.group_id, rec.op, gids)
    assert gidx_c.dtype == gidx_np.dtype and np.array_equal(gidx_c, gidx_np)
    assert_same(*both(index._p2p_channels, rec, gidx_c, world))


def test_thousands_of_channels_grow_the_c_table() -> None:
    rng = np.random.default_rng(3)
    world = 300
    rec = _records(rng, 200_000, world, 4)
    gidx = rng.integers(-1, 40, len(rec)).astype(np.int32)
    a, b = both(index._p2p_channels, rec, gidx, world)
    assert_same(a, b)
    assert len(a[1]) > 10_000  # distinct channels: the table grew several times


def test_kernels_refuse_what_they_cannot_take() -> None:
    keys = np.array([0, 1, 0], np.int32)
    seqs = np.array([1, 2, 3], np.int64)
    smin, smax = np.full(2, 2**62, np.int64), np.full(2, -1, np.int64)
    assert kernels.key_ranges(keys, seqs, None, 8, 9, smin, smax) == 3
    assert smin.tolist() == [1, 2] and smax.tolist() == [3, 2]
    assert kernels.key_ranges(np.array([5], np.int32), seqs[:1], None, 8, 9, smin, smax) == -1  # key out of range
    with pytest.raises(ValueError, match="one length"):
        kernels.key_ranges(keys, seqs[:2], None, 8, 9, smin, smax)
    with pytest.raises(ValueError, match="integers"):
        kernels.key_ranges(keys.astype(np.float32), seqs, None, 8, 9, smin, smax)
    with pytest.raises(TypeError):
        kernels.key_ranges(keys, seqs, None, smin, smax)
    ids, used = np.empty(3, np.int32), np.zeros(2, np.uint8)
    assert kernels.place(keys, seqs, None, 8, 9, np.array([0, 0], np.int64), ids, used) == -1  # slot 3 outside
    used = np.zeros(4, np.uint8)
    assert kernels.place(keys, seqs, None, 8, 9, np.array([0, 0], np.int64), ids, used) == 0  # slot 0 unused
    assert ids.tolist() == [1, 2, 3] and used.tolist() == [0, 1, 1, 1]


def _rank_trace(rng: np.random.Generator, counts: list[int]):
    """A trace-like object for the per-step sums: ranks' row bounds and their records' group_seq."""
    from types import SimpleNamespace

    n = sum(counts)
    starts = np.r_[0, np.cumsum(counts)].astype(np.int64)
    records = SimpleNamespace(group_seq=rng.integers(0, 40, n).astype(np.int32))
    return SimpleNamespace(ranks=np.arange(len(counts)), starts=starts, records=records)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), counts=st.lists(st.integers(0, 60), min_size=1, max_size=12),
       n_steps=st.integers(1, 6), dp_per_step=st.sampled_from([None, 1, 3]), wide=st.booleans())
def test_step_cells_in_c_are_numpys(seed: int, counts: list[int], n_steps: int, dp_per_step: int | None,
                                    wide: bool) -> None:
    """Compute gaps and per-step sums: markers, calls without completion, steps out of row order (numpy's unsorted
    path), and (``wide``) a rank whose times span more than 2**63 ns, which C refuses and numpy answers."""
    from megatrace.analyze.segments import DP, MARKER

    rng = np.random.default_rng(seed)
    trace = _rank_trace(rng, counts)
    n = int(trace.starts[-1])
    role = rng.choice(np.array([0, MARKER, 2, DP], np.int8), n)
    te = np.cumsum(rng.integers(0, 5_000, n)).astype(np.int64) + 10**12
    tc = np.where(rng.random(n) < 0.2, 0, te + rng.integers(0, 20_000, n))
    if wide and n:
        te[rng.integers(0, n)] = -2**62
        tc[rng.integers(0, n)] = 2**62
    k0 = 3
    step = rng.integers(k0 - 1, k0 + n_steps, n).astype(np.int32)
    step[step < k0] = -1
    a, b = both(iterations._step_cells, trace, role, te, tc, step, k0, n_steps, dp_per_step)
    assert_same(a, b)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 5000), n_keys=st.integers(1, 300))
def test_rows_by_key_in_c_is_numpys(seed: int, n: int, n_keys: int) -> None:
    """The counting sort of selected rows by key (several chunks of rows: ``CHUNK`` made small)."""
    rng = np.random.default_rng(seed)
    keep = rng.random(n) < 0.7
    key = rng.integers(0, n_keys, n)
    chunks = index.chunks
    with pytest.MonkeyPatch.context() as m:
        m.setattr(index, "chunks", lambda n, size=0: chunks(n, 700))
        a, b = both(index.rows_by_key, n, lambda sl: keep[sl], lambda rows: key[rows], n_keys)
    assert_same(a, b)
    rows, starts, sizes = a
    assert np.array_equal(np.sort(rows), np.flatnonzero(keep)) and sizes.sum() == keep.sum()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 3000), n_inst=st.integers(1, 200))
def test_instance_facts_in_c_are_numpys(seed: int, n: int, n_inst: int) -> None:
    """Per-instance counts, times and the values members must agree on (all_to_all sizes and roots of rooted ops
    read as numpy's checks read them), ties for the last enqueue (the last row's rank)."""
    from types import SimpleNamespace

    from megatrace.trace.ring_format import State

    rng = np.random.default_rng(seed)
    rec = _records(rng, n, 64, 4)
    rec.op[:] = rng.choice(np.array([int(Op.ALL_REDUCE), int(Op.ALL_TO_ALL), int(Op.BROADCAST), int(Op.REDUCE)],
                                    np.uint16), n)
    rec.state[:] = rng.choice(np.array([int(s) for s in State], np.uint8), n)
    rec.nbytes[:] = rng.integers(0, 3, n) * 1024
    rec.dtype[:] = rng.integers(0, 2, n)
    ix = SimpleNamespace(inst=rng.integers(-1, n_inst, n).astype(np.int32), n_instances=n_inst)
    te = rng.integers(0, 50, n).astype(np.int64)  # (ties)
    tc = te + rng.integers(0, 9, n)
    a, b = both(match._instance_facts, rec, ix, te, tc)
    assert a.keys() == b.keys()
    assert_same(tuple(a.values()), tuple(b.values()))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), counts=st.lists(st.integers(0, 80), min_size=1, max_size=10),
       wrapped=st.booleans())
def test_steps_from_ends_in_c_are_numpys(seed: int, counts: list[int], wrapped: bool) -> None:
    """Each record's step from the next step-ending record of its rank (ranks without one, rows after the last end,
    and a wrapped ring whose first step is partial)."""
    from types import SimpleNamespace

    rng = np.random.default_rng(seed)
    trace = _rank_trace(rng, counts)
    n = int(trace.starts[-1])
    trace.rank_info = [SimpleNamespace(dropped=int(wrapped and k % 2)) for k in range(len(counts))]
    trace.tail = None
    ends = np.flatnonzero(rng.random(n) < 0.1)
    end_step = np.zeros(len(ends), np.int32)
    for i in range(len(counts)):  # each rank's ends numbered from a step of its own
        mine = (ends >= trace.starts[i]) & (ends < trace.starts[i + 1])
        end_step[mine] = rng.integers(0, 3) + np.arange(mine.sum())

    def run(_):
        out = np.full(n, -1, np.int32)
        iterations._steps_from_ends(trace, ends, end_step, out)
        return (out,)

    assert_same(*both(run, None))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 2000), pp=st.sampled_from([None, 1, 2, 4]))
def test_record_roles_in_c_are_numpys(seed: int, n: int, pp: int | None) -> None:
    """Roles from groups described as TP, DP or PP or not at all, markers, p2p calls in collective groups and
    collectives in pipeline groups, and p2p directions by stage (peers outside the world left PP_OTHER)."""
    from types import SimpleNamespace

    from megatrace.config import Layout
    from megatrace.load.traceset import GroupInfo

    rng = np.random.default_rng(seed)
    world = 8
    rec = _records(rng, n, world, 4)
    rec.op[:] = rng.choice(np.array([1, 3, int(Op.SEND), int(Op.RECV), int(Op.MARK_STEP), int(Op.MARK_STEP) + 1],
                                    np.uint16), n)
    dims = ["tp", "dp", "pp", ""]
    groups = {gid: GroupInfo(gid=gid, name=str(gid), desc=dims[k] or "default_pg", ranks=tuple(range(world)))
              for k, gid in enumerate((5, 7, 9, 1000))}
    layout = None if pp is None else Layout(world_size=world, tp=1, pp=pp, dp=world // pp)
    trace = SimpleNamespace(records=rec, groups=groups)
    gidx = rng.integers(-1, len(groups), n).astype(np.int32)  # (each record's group index, as RecordIndex.gidx_of)
    ix = SimpleNamespace(group_ids=np.array(sorted(groups), np.uint32), gidx_of=lambda _rec, sl=slice(None): gidx[sl])
    a, b = both(lambda: (iterations.record_roles(trace, ix, layout),))
    assert_same(a, b)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 2000), n_groups=st.integers(0, 4))
def test_group_uses_in_c_are_numpys(seed: int, n: int, n_groups: int) -> None:
    """Records per known group, collectives and p2p apart (markers and groups nobody declared left out)."""
    from types import SimpleNamespace

    from megatrace.load.traceset import GroupInfo

    rng = np.random.default_rng(seed)
    rec = _records(rng, n, 8, 4)
    groups = {gid: GroupInfo(gid=gid, name=str(gid), desc="tp", ranks=(0, 1))
              for gid in sorted({7, 9, 1000, 2**32 - 1})[:n_groups]}
    a, b = both(build.group_uses, SimpleNamespace(records=rec, groups=groups))
    assert a == b and len(a) == n_groups


@pytest.mark.parametrize("n_groups", [5000, 40_000])
def test_group_lookup_of_thousands_of_groups(n_groups: int) -> None:
    """The C group table (open addressing) against numpy's binary search: thousands of groups, or more than 2**15,
    a third of the records in groups nobody declared."""
    rng = np.random.default_rng(11)
    gids = np.unique(rng.integers(0, 2**32, n_groups, dtype=np.uint64)).astype(np.uint32)
    rec = _records(rng, 300_000, 64, 4)
    rec.group_id[:] = np.where(rng.random(len(rec)) < 0.33, rng.integers(0, 2**32, len(rec), dtype=np.uint64),
                               gids[rng.integers(0, len(gids), len(rec))]).astype(np.uint32)
    a, b = both(index._group_index, rec.group_id, rec.op, gids)
    assert a.dtype == b.dtype == np.int32
    assert np.array_equal(a, b) and (a >= 0).mean() > 0.5 and int(a.max()) > n_groups // 2
