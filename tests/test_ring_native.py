"""The C hot path and the pure-Python writer produce the same records, both valid for the reader."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatrace.trace.ring_reader import read_ring
from megatrace.trace.ring_records import SlotSummary
from megatrace.trace.ring_writer import RingIdentity, RingWriter

pytest.importorskip("megatrace.trace._ringfast", reason="C hot path not built (no compiler at install)")

calls = st.lists(st.tuples(
    st.integers(1, 9), st.integers(0, 2**32 - 1), st.integers(0, 2**40), st.integers(0, 2**50),
    st.integers(-1, 2**31 - 1), st.integers(0, 14), st.integers(0, 31), st.sampled_from([None, 2, 3, "now"])),
    min_size=1, max_size=60)


def _write(directory: Path, native: bool, stream: list[tuple]) -> list[dict]:
    writer = RingWriter(directory, RingIdentity(rank=0, world_size=1), capacity=32, use_native=native)
    assert writer.native is native
    for op, gid, gseq, nbytes, peer, dtype, flags, end in stream:
        handle = writer.begin(op, gid, gseq, nbytes, peer, dtype, flags)
        if end == "now":
            writer.complete_now(handle)
        elif end is not None:
            writer.complete(handle, end)
    writer.close()
    snap = read_ring(writer.path)
    assert snap.problems == [] and snap.dropped == max(0, len(stream) - 32)
    return [{k: v for k, v in r.items() if not k.startswith("t_")} | {"timed": r["t_complete"] > 0}
            for r in snap.to_dicts()]


@settings(max_examples=40, deadline=None)
@given(stream=calls)
def test_c_and_python_writers_agree_field_by_field(tmp_path_factory: pytest.TempPathFactory,
                                                   stream: list[tuple]) -> None:
    base = tmp_path_factory.mktemp("agree")
    assert _write(base / "c", True, stream) == _write(base / "py", False, stream)


def test_c_writer_refuses_a_buffer_smaller_than_its_capacity() -> None:
    from megatrace.trace._ringfast import FastRing

    with pytest.raises(ValueError, match="smaller than header"):
        FastRing(bytearray(4096 + 64 * 3), 4)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("args", [(70000, 1, 1, 1), (1, 2**32, 1, 1), (1, 1, -1, 1), (1, 1, 1, 1, 2**31),
                                  (1, 1, 1, 1, -1, 256), (1, 1, 1, 1, -1, 0, -1)])
def test_both_writers_reject_out_of_range_fields(tmp_path: Path, native: bool, args: tuple) -> None:
    import struct

    writer = RingWriter(tmp_path, RingIdentity(rank=0, world_size=1), capacity=16, use_native=native)
    with pytest.raises((OverflowError, struct.error)):
        writer.begin(*args)


def test_c_slot_checks_give_the_numpy_masks_on_damaged_slots(tmp_path: Path) -> None:
    """A full read checks every slot in C (``validate_ring``): on a ring whose slots are torn, zeroed, moved,
    of bad state or with padding set, its masks are exactly numpy's (``validate``, the fallback without C)."""
    import numpy as np

    from megatrace.trace import ring_format as fmt
    from megatrace.trace.ring_records import validate, validate_ring

    capacity = 256
    writer = RingWriter(tmp_path, RingIdentity(rank=0, world_size=1), capacity=capacity, use_native=True)
    for k in range(capacity + 100):  # lapped: slots hold records of two laps
        handle = writer.begin(1 + k % 9, 7, k, 1 << (k % 40), -1, 0, 0)
        if k % 3:
            writer.complete(handle, 2 + k % 2)
    writer.close()
    body = np.fromfile(writer.path, np.uint8)[fmt.HEADER_SIZE:].reshape(capacity, fmt.RECORD_SIZE).copy()
    rng = np.random.default_rng(7)
    rows = rng.permutation(capacity)
    body[rows[:40], rng.integers(0, 64, 40)] ^= rng.integers(1, 256, 40).astype(np.uint8)  # a flipped byte
    body[rows[40:50]] = 0  # never written
    body[rows[50:55]] = body[rows[55:60]]  # a record in another record's slot
    body[rows[60:65], 56] = 7  # a state out of range (checksum fixed below for some)
    body[rows[65:70], 57] = 1  # padding that the tail check covers
    body[rows[70:72], 44:48] = 0  # head check zeroed
    *c_masks, summary = validate_ring(body, capacity)
    py_masks = validate(body, np.arange(capacity, dtype=np.uint64), capacity)
    for name, c, py in zip(("empty", "head_ok", "tail_ok"), c_masks, py_masks, strict=True):
        assert np.array_equal(c, py), name
    assert c_masks[1].sum() < capacity - 40 and c_masks[0].sum() >= 10  # the damage was seen
    assert summary == _summary_of(body, *py_masks) and not summary.clean and not summary.ascending
    assert validate_ring(body[:0], capacity)[0].shape == (0,)
    assert validate_ring(body[:0], capacity)[3] == SlotSummary(0, 0, -1, -1, True, True)


def _summary_of(body, empty, head_ok, tail_ok):
    """The SlotSummary of a ring's copy, worked out with numpy from its masks."""
    import numpy as np

    from megatrace.trace.ring_records import RECORD_DTYPE

    rows = np.flatnonzero(head_ok)
    seqs = body.view(RECORD_DTYPE).reshape(-1)["seq"][rows]
    return SlotSummary(len(rows), int(seqs.max(initial=0)), int(rows[0]) if len(rows) else -1,
                       int(rows[-1]) if len(rows) else -1, bool((seqs[1:] > seqs[:-1]).all()),
                       bool((empty | head_ok & tail_ok).all()))


@pytest.mark.parametrize("written", [0, 1, 50, 64, 100, 130])
def test_c_slot_summary_of_finished_rings(tmp_path: Path, written: int) -> None:
    """The summary the reader trusts to skip its mask passes: of a clean ring, empty, partly filled, full or lapped
    (its rows then ascend in two runs)."""
    import numpy as np

    from megatrace.trace import ring_format as fmt
    from megatrace.trace.ring_records import validate, validate_ring

    writer = RingWriter(tmp_path, RingIdentity(rank=0, world_size=1), capacity=64, use_native=True)
    for k in range(written):
        writer.complete(writer.begin(1, 7, k, 8, -1, 0, 0), 2)
    writer.close()
    body = np.fromfile(writer.path, np.uint8)[fmt.HEADER_SIZE:].reshape(64, fmt.RECORD_SIZE).copy()
    *_, summary = validate_ring(body, 64)
    assert summary == _summary_of(body, *validate(body, np.arange(64, dtype=np.uint64), 64))
    assert summary.clean and summary.whole == min(written, 64) and summary.newest == written
    assert summary.ascending == (written <= 64)
    snap = read_ring(writer.path)
    assert snap.records["seq"].tolist() == list(range(max(1, written - 63), written + 1)) and not snap.problems


def test_c_slot_checks_refuse_bad_buffers() -> None:
    import numpy as np

    from megatrace.trace._ringfast import scan_slots

    raw = np.zeros((4, 64), np.uint8)
    masks = [np.empty(4, bool) for _ in range(3)]
    with pytest.raises(ValueError, match="capacity"):
        scan_slots(raw, 0, *masks)
    with pytest.raises(ValueError, match="whole 64-byte rows"):
        scan_slots(raw.reshape(-1)[:100], 4, *masks)
    with pytest.raises(ValueError, match="one byte per row"):
        scan_slots(raw, 4, np.empty(3, bool), *masks[1:])
    with pytest.raises(TypeError):
        scan_slots(raw, 4, *masks[:2])
    scan_slots(raw, 4, *masks)
    assert masks[0].all() and not masks[1].any() and not masks[2].any()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 300),
       big=st.sets(st.sampled_from(["seq", "group_seq", "nbytes", "peer", "op"])))
def test_c_record_split_gives_numpys_columns(seed: int, n: int, big: set[str]) -> None:
    """``split_records`` (records into columns in one pass of C) writes every field as numpy's field copy would,
    in columns of the field's size and in the narrower ones of ``NARROWED``, and names the narrowed columns that a
    value does not fit (a size above 2**31 - 1, a peer outside int16, an op code above 255)."""
    import numpy as np

    from megatrace.trace.ring_records import NARROWED, RECORD_DTYPE, SPLIT_COLUMNS, split_records

    rng = np.random.default_rng(seed)
    recs = np.frombuffer(rng.integers(0, 256, n * 64, dtype=np.uint8).tobytes(), RECORD_DTYPE)
    recs = recs.copy()
    for name in ("seq", "group_seq", "nbytes"):
        recs[name] &= np.uint64((1 << 31) - 1)  # fits int32 ...
        if name in big and n:
            recs[name][rng.integers(0, n)] = rng.integers(1 << 31, 1 << 63, dtype=np.uint64)  # ... but for one row
    recs["peer"] = rng.integers(-(1 << 15), 1 << 15, n)
    recs["op"] = rng.integers(0, 256, n)
    if "peer" in big and n:
        recs["peer"][rng.integers(0, n)] = rng.choice([-(1 << 15) - 1, 1 << 15, -(1 << 31), (1 << 31) - 1])
    if "op" in big and n:
        recs["op"][rng.integers(0, n)] = rng.integers(256, 1 << 16)
    for narrow in (False, True):
        dtypes = {name: NARROWED[name] if narrow and name in NARROWED else RECORD_DTYPE[name] for name in SPLIT_COLUMNS}
        cols = {name: np.zeros(n + 3, dt) for name, dt in dtypes.items()}
        over = split_records(recs, cols, 3)
        assert over == (tuple(c for c in NARROWED if c in big) if narrow and n else ())
        for name, col in cols.items():
            if name not in over:
                assert np.array_equal(col[3:], recs[name].astype(dt := dtypes[name])), name
                assert not col[:3].any() and col.dtype == dt  # rows before `at` untouched


def test_c_record_split_refuses_bad_columns() -> None:
    import numpy as np

    from megatrace.trace.ring_records import RECORD_DTYPE, SPLIT_COLUMNS, split_records

    recs = np.zeros(4, RECORD_DTYPE)
    cols = {name: np.zeros(4, RECORD_DTYPE[name]) for name in SPLIT_COLUMNS}
    assert split_records(recs, cols, 0) == ()
    with pytest.raises(ValueError, match="fewer than 5 rows"):
        split_records(recs, cols, 1)
    with pytest.raises(ValueError, match="column 2: 4-byte items"):  # t_enqueue is never narrowed
        split_records(recs, cols | {"t_enqueue": np.zeros(4, np.int32)}, 0)
    with pytest.raises(ValueError, match="column 5: 2-byte items"):  # nor group_id
        split_records(recs, cols | {"group_id": np.zeros(4, np.uint16)}, 0)
    assert split_records(recs.view(np.uint8)[:100], cols, 0) is None  # not ring records: copied field by field
    from megatrace.trace._ringfast import split_records as c_split

    with pytest.raises(ValueError, match="whole 64-byte records"):
        c_split(recs.view(np.uint8)[:100], 0, *(cols[name] for name in SPLIT_COLUMNS))
    with pytest.raises(ValueError):
        split_records(recs, cols | {"op": np.zeros(4, np.uint16)[::-1]}, 0)  # not contiguous


def test_c_whole_rows_give_numpys_mask(tmp_path: Path) -> None:
    """The tail reader's check of rows of several rings against the records they should hold (``whole_records``):
    in C, exactly numpy's mask on torn, zeroed, moved and out-of-state rows, and rows checked against the wrong
    sequence number."""
    import numpy as np

    from megatrace.trace import ring_format as fmt
    from megatrace.trace._ringfast import whole_rows
    from megatrace.trace.ring_records import RECORD_DTYPE, whole_records, whole_records_numpy

    capacity = 128
    bodies = []
    for r in range(3):
        writer = RingWriter(tmp_path / str(r), RingIdentity(rank=r, world_size=3), capacity=capacity, use_native=True)
        for k in range(capacity + 40 * r):
            handle = writer.begin(1 + k % 9, 7, k, 1 << (k % 40), -1, 0, 0)
            if k % 3:
                writer.complete(handle, 2 + k % 2)
        writer.close()
        bodies.append(np.fromfile(writer.path, np.uint8)[fmt.HEADER_SIZE:].reshape(capacity, fmt.RECORD_SIZE))
    raw = np.concatenate(bodies)
    rng = np.random.default_rng(3)
    rows = rng.permutation(len(raw))
    raw[rows[:30], rng.integers(0, 64, 30)] ^= rng.integers(1, 256, 30).astype(np.uint8)
    raw[rows[30:40]] = 0
    raw[rows[40:45]] = raw[rows[45:50]]
    raw[rows[50:55], 56] = 0  # state "none"
    seqs = raw.view(RECORD_DTYPE).reshape(-1)["seq"].copy()
    seqs[rows[60:80]] += np.uint64(1)  # checked against a record the row does not hold
    c, py = whole_records(raw, seqs), whole_records_numpy(raw, seqs)
    assert np.array_equal(c, py)
    assert 0 < c.sum() < len(raw) - 60 and not c[rows[60:80]].any()
    assert whole_records(raw[:0], seqs[:0]).shape == (0,)
    with pytest.raises(ValueError):
        whole_rows(raw, seqs[:-1], np.empty(len(raw), np.uint8))
    with pytest.raises(ValueError):
        whole_rows(raw, seqs.astype(np.int32), np.empty(len(raw), np.uint8))
    with pytest.raises(ValueError):
        whole_rows(raw.reshape(-1)[:100], seqs, np.empty(len(raw), np.uint8))
