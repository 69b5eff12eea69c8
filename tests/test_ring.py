"""Property-based tests of the ring-file format: writer, reader, crashes and corruption.

Every test keeps its own model of what was written and compares the reader's
answer with it field by field. Both writers are exercised: the pure-Python one
with a fake clock passed through its ``_now`` keyword (timestamps checked
exactly) and the C hot path, when built, on the real clock (timestamps checked
against bounds taken around each call). Cross-process tests fork a writer
child; ``RING_TEST_SCALE=N`` turns the whole file into an N-times longer stress run.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from helpers.planted import planted_step_dir
from helpers.ring_stream import (COMPLETE_LAG, FAST, FIELDS, FORK, IDENT, KIND_PARAMS, KINDS, NATIVE, SCALE, Clock,
                                 being_written, check_against_gen, check_contiguous, errors, gen, gen_np, make_writer,
                                 slot_offset, write_gen, writer_child)

from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_header import HEADER_USED, read_header_bytes
from megatrace.trace.ring_reader import RECORD_DTYPE, RingFormatError, read_meta, read_ring
from megatrace.trace.ring_writer import RingIdentity, RingWriter


def test_generator_twins_agree():
    seqs = np.arange(1, 2000, dtype=np.uint64)
    exp = gen_np(seqs)
    for s in (1, 2, 3, 4, 5, 96, 97, 1000, 1999):
        op, gid, gseq, nbytes, peer, dtype, flags, t_enq, state, t_comp = gen(s)
        row = {name: int(exp[name][s - 1]) for name in exp}
        assert row == {"op": op, "group_id": gid, "group_seq": gseq, "nbytes": nbytes, "peer": peer,
                       "dtype": dtype, "flags": flags, "t_enqueue": t_enq, "state": state, "t_complete": t_comp}


# ---------------------------------------------------------------------------
# 1. Random record streams, in process: the reader returns exactly the last
#    min(n, capacity) records, every field as written.
# ---------------------------------------------------------------------------
record_fields = st.fixed_dictionaries({
    "op": st.one_of(st.sampled_from([int(o) for o in fmt.Op]), st.integers(0, 0xFFFF)),
    "group_id": st.integers(0, 0xFFFFFFFF),
    # u64 in the format; the native writer takes only < 2**63 (see test_full_u64_fields)
    "group_seq": st.integers(0, 2**63 - 1),
    "nbytes": st.integers(0, 2**64 - 1),
    "peer": st.integers(-(2**31), 2**31 - 1),
    "dtype": st.integers(0, 255),
    "flags": st.integers(0, 255),
    "dt": st.integers(0, 10**6),
    "complete_now": st.booleans(),
})
action = st.one_of(
    st.tuples(st.just("begin"), record_fields),
    # complete the k-th handle handed out so far (modulo), as completed or failed
    st.tuples(st.just("complete"), st.integers(0, 10**6), st.sampled_from([2, 3]), st.integers(0, 10**9)),
)


class Driver:
    """Calls a writer and tells the time window of each call: exact for the fake clock, bounds for the real one."""

    def __init__(self, w: RingWriter, kind: str) -> None:
        self.w, self.kind, self.clock = w, kind, Clock()
        self.clock.t = 1

    def _call(self, fn, *args, dt: int = 0):
        if self.kind == "python":
            self.clock.t += dt
            return fn(*args, _now=self.clock), (self.clock.t, self.clock.t)
        lo = time.monotonic_ns()
        out = fn(*args)
        return out, (lo, time.monotonic_ns())

    def begin(self, *args, dt: int = 0):
        return self._call(self.w.begin, *args, dt=dt)

    def complete(self, handle, state, dt: int = 0):
        return self._call(self.w.complete, handle, state, dt=dt)[1]

    def complete_now(self, handle, dt: int = 0):
        return self._call(self.w.complete_now, handle, dt=dt)[1]


def _write_model(directory: str, capacity: int, actions: list, kind: str) -> tuple[RingWriter, dict[int, dict]]:
    """Apply ``actions`` to a new writer; return it and the model {seq: record} of what it wrote.

    Times in the model are (low, high) bounds; equal for the Python writer's fake clock.
    """
    w = make_writer(directory, capacity, kind)
    drv = Driver(w, kind)
    model: dict[int, dict] = {}
    handles: list[tuple[int, int]] = []
    for act in actions:
        if act[0] == "begin":
            f = act[1]
            h, t_enq = drv.begin(f["op"], f["group_id"], f["group_seq"], f["nbytes"], f["peer"], f["dtype"],
                                 f["flags"], dt=f["dt"])
            seq = len(handles) + 1
            assert h[1] == seq
            handles.append(h)
            model[seq] = {"seq": seq, "group_seq": f["group_seq"], "t_enqueue": t_enq, "nbytes": f["nbytes"],
                          "group_id": f["group_id"], "peer": f["peer"], "op": f["op"], "dtype": f["dtype"],
                          "flags": f["flags"], "t_complete": (0, 0), "state": 1}
            if f["complete_now"]:
                model[seq].update(t_complete=drv.complete_now(h, dt=1), state=2)
        elif handles:
            _, k, state, dt = act
            h = handles[k % len(handles)]
            t = drv.complete(h, state, dt=dt)
            if h[1] > len(handles) - capacity:  # still in the ring; otherwise complete() must do nothing
                model[h[1]].update(t_complete=t, state=state)
    return w, model


def _assert_matches_model(snap, model: dict[int, dict], capacity: int) -> None:
    n = len(model)
    expect = [model[s] for s in range(max(1, n - capacity + 1), n + 1)]
    got = snap.to_dicts()
    assert [r["seq"] for r in got] == [m["seq"] for m in expect]
    for r, m in zip(got, expect):
        for name in FIELDS:
            if name.startswith("t_"):
                lo, hi = m[name]
                assert lo <= r[name] <= hi, (name, r, m)
            else:
                assert r[name] == m[name], (name, r, m)
    assert snap.dropped == max(0, n - capacity)
    assert snap.lost == 0
    assert snap.problems == []
    assert snap.header.write_counter == n


@FAST
@given(kind=st.sampled_from(KINDS), capacity=st.sampled_from([16, 17, 20, 32]),
       actions=st.lists(action, max_size=90))
def test_random_streams_round_trip(kind, capacity, actions):
    with tempfile.TemporaryDirectory() as d:
        w, model = _write_model(d, capacity, actions, kind)
        live = read_ring(w.path)  # writer still open
        _assert_matches_model(live, model, capacity)
        assert live.header.writer_state == fmt.WriterState.OPEN and not live.header.closed_cleanly
        w.close()
        snap = read_ring(w.path)
        _assert_matches_model(snap, model, capacity)
        h = snap.header
        assert h.closed_cleanly and h.capacity == capacity and h.version == fmt.VERSION
        assert (h.rank, h.world_size, h.local_rank, h.pid) == (3, 8, 1, 4242)
        assert (h.job_id, h.step_id, h.host) == ("job-42", "7", "node-a")
        assert os.path.getsize(w.path) == fmt.file_size(capacity)
        assert snap.records.dtype == RECORD_DTYPE


@pytest.mark.parametrize("kind", [
    pytest.param("python"),
    pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="C ring writer not built")),
])
def test_full_u64_fields(tmp_path, kind):
    w = make_writer(tmp_path, 16, kind)
    w.begin(1, 2**32 - 1, 2**64 - 1, 2**64 - 1, -(2**31), 255, 255)
    w.close()
    (r,) = read_ring(w.path).to_dicts()
    assert (r["group_id"], r["group_seq"], r["nbytes"], r["peer"]) == (2**32 - 1, 2**64 - 1, 2**64 - 1, -(2**31))


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_writer_never_overwrites_a_previous_ring(tmp_path, kind):
    w1 = make_writer(tmp_path, 16, kind)
    w1.begin(1, 2, 3, 4)
    w1.write_meta("group", gid=2, name="g", desc="", ranks=[0, 3], backend="nccl")
    w1.close()
    w2 = make_writer(tmp_path, 16, kind)
    w2.close()
    assert read_ring(tmp_path / "rank-00003.ring.1").header.write_counter == 1
    assert read_ring(tmp_path / "rank-00003.ring").header.write_counter == 0
    assert read_meta(tmp_path / "rank-00003.meta.jsonl.1")[0][0]["gid"] == 2


# ---------------------------------------------------------------------------
# 2. A reader beside a live writer in another process.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [16, 1024])
@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_reader_beside_live_writer(tmp_path, kind, capacity):
    ready = FORK.Event()
    child = FORK.Process(target=writer_child, args=(str(tmp_path), capacity, kind, ready), daemon=True)
    child.start()
    path = tmp_path / fmt.ring_name(IDENT.rank)
    try:
        assert ready.wait(10), "writer child did not start"
        reads = nonempty = 0
        last_max = 0
        deadline = time.monotonic() + 0.75 * SCALE
        while time.monotonic() < deadline:
            snap = read_ring(path)
            reads += 1
            assert not errors(snap), [str(p) for p in snap.problems]
            assert len(being_written(snap)) <= 1, [str(p) for p in snap.problems]
            recs = snap.records
            assert len(recs) <= capacity
            check_contiguous(recs)
            check_against_gen(recs, exact_times=kind == "python")
            if len(recs):
                nonempty += 1
                first, last = int(recs["seq"][0]), int(recs["seq"][-1])
                assert first > snap.dropped and last <= snap.dropped + capacity
                assert len(recs) + snap.lost in (last - snap.dropped, last - snap.dropped + 1)
                assert last >= last_max  # the writer only moves forward
                last_max = last
        assert child.is_alive(), "the writer child died"
        assert nonempty > 10 and last_max > capacity, (reads, nonempty, last_max)
    finally:
        child.kill()
        child.join(10)
    # After SIGKILL the same invariants hold.
    snap = read_ring(path)
    assert not errors(snap) and len(being_written(snap)) <= 1
    check_contiguous(snap.records)
    check_against_gen(snap.records, exact_times=kind == "python")



@pytest.mark.parametrize("kind", KIND_PARAMS)
@pytest.mark.parametrize("copied", ["torn", "a lap old"])
@pytest.mark.parametrize("then", ["written", "lapped", "unchanged"])
@pytest.mark.parametrize("last", [None, 12])
def test_a_slot_copied_mid_write_is_read_again_and_never_leaves_a_gap(tmp_path, kind, copied, then, last,
                                                                     monkeypatch):
    """The race behind a rare live-read gap, made exact. The copy finds the slot of seq 30 torn, or
    still holding seq 14 (a reader preempted mid-copy while the writer lapped the ring; a writer
    thread between taking its number and writing). The re-read then finds seq 30 written, or the
    ring lapped (seq 30 and all older are overwritten by then), or the slot unchanged (seq 30 lost,
    nothing older dropped for it)."""
    from megatrace.trace import ring_reader

    w = make_writer(tmp_path, 16, kind)
    off = fmt.HEADER_SIZE + (30 - 1) % 16 * fmt.RECORD_SIZE
    for seq in range(1, 41):
        w.begin(*gen(seq)[:7])
        if seq == 14:
            old = Path(w.path).read_bytes()[off:off + fmt.RECORD_SIZE]
    fd = os.open(w.path, os.O_RDWR)
    good = os.pread(fd, fmt.RECORD_SIZE, off)
    if copied == "torn":  # one byte of seq 30's nbytes changed: its checksum no longer matches
        os.pwrite(fd, good[:24] + bytes([good[24] ^ 0xA5]) + good[25:], off)
    else:
        os.pwrite(fd, old, off)
    slept = []

    def the_writer_moves_during_the_retry_sleep(_seconds):
        if not slept:
            if then == "written":
                os.pwrite(fd, good, off)
            elif then == "lapped":
                for seq in range(41, 57):
                    w.begin(*gen(seq)[:7])
        slept.append(True)

    monkeypatch.setattr(ring_reader, "time",
                        type("T", (), {"sleep": staticmethod(the_writer_moves_during_the_retry_sleep)}))
    try:
        snap = read_ring(w.path, last=last)
    finally:
        os.close(fd)
    assert slept, "the odd slot was not read again"
    first = 25 if last is None else 41 - last
    expect = {"written": list(range(first, 41)), "lapped": list(range(31, 41)),
              "unchanged": [s for s in range(first, 41) if s != 30]}[then]
    assert snap.records["seq"].tolist() == expect
    assert snap.lost == (then == "unchanged")
    assert snap.dropped == expect[0] - 1 if then != "unchanged" else first - 1
    assert not [p for p in snap.problems if p.severity == "error"] or (copied, then) == ("torn", "unchanged")
    w.close()


def _beating_writer_child(directory: str, kind: str, ready) -> None:
    w = make_writer(directory, 1024, kind)
    ready.set()
    seq = 0
    while True:
        seq += 1
        w.begin(*gen(seq)[:7])
        w.beat()


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_the_counter_and_heartbeat_are_never_seen_half_written(tmp_path, kind):
    """Another process reading the header beside a live writer sees the write counter only move forward and
    the heartbeat never 0 once it beat. (struct.pack_into zero-fills before it writes: a reader saw a
    counter of 0 about ten times a second, and a live snapshot then shrank to its first record.)

    The words are read with aligned 8-byte loads (a read-only mapping): what the writer stores. A ``pread``
    can itself copy a word half old, half new (the kernel's copy is not word-atomic: CI saw a heartbeat read
    49 ns back once); readers read the live words until two reads agree (``read_header_bytes``, below)."""
    ready = FORK.Event()
    child = FORK.Process(target=_beating_writer_child, args=(str(tmp_path), kind, ready), daemon=True)
    child.start()
    try:
        assert ready.wait(10), "writer child did not start"
        fd = os.open(tmp_path / fmt.ring_name(IDENT.rank), os.O_RDONLY)
        header = mmap.mmap(fd, fmt.HEADER_SIZE, prot=mmap.PROT_READ)
        words = memoryview(header).cast("Q")
        try:
            last_counter = last_beat = reads = 0
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                for _ in range(1000):
                    counter = words[fmt.WRITE_COUNTER_OFFSET // 8]
                    beat = words[fmt.HEARTBEAT_OFFSET // 8]
                    assert counter >= last_counter, (last_counter, counter)
                    assert beat >= last_beat, (last_beat, beat)
                    last_counter, last_beat = counter, beat
                reads += 1000
        finally:
            words.release()
            header.close()
            os.close(fd)
        assert child.is_alive() and last_counter > 1000 and last_beat > 0, (reads, last_counter, last_beat)
    finally:
        child.kill()
        child.join(10)

# ---------------------------------------------------------------------------
# 3. SIGKILL mid-write.
# ---------------------------------------------------------------------------
@settings(max_examples=16 * SCALE, deadline=None)
@given(kind=st.sampled_from(KINDS), capacity=st.sampled_from([16, 64, 1000]), delay=st.floats(0, 0.03))
def test_sigkill_mid_write(kind, capacity, delay):
    with tempfile.TemporaryDirectory() as d:
        ready = FORK.Event()
        child = FORK.Process(target=writer_child, args=(d, capacity, kind, ready), daemon=True)
        child.start()
        try:
            assert ready.wait(10)
            time.sleep(delay)  # a duration (drawn), not a wait: where in the stream the kill lands
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.join(10)
        assert child.exitcode == -signal.SIGKILL
        snap = read_ring(Path(d) / fmt.ring_name(IDENT.rank))
        assert not snap.header.closed_cleanly
        assert not errors(snap), [str(p) for p in snap.problems]
        assert len(being_written(snap)) <= 1
        assert len([p for p in snap.problems if "completion" in p.message]) <= 1
        recs = snap.records
        check_contiguous(recs)
        check_against_gen(recs, exact_times=kind == "python")
        counter = snap.header.write_counter
        if not len(recs):
            assert counter == 0
            return
        last = int(recs["seq"][-1])
        # The counter is written after the record. One exception, outside our code: on the CI's VM,
        # about 1 kill in 1,000 under load leaves the header page without any write made after the
        # ring was created (the child read its own counter back each time), so the file says 0.
        # The readers must then ignore the counter, which is what the rest of this test checks.
        assert last in (counter, counter + 1) or counter == 0, (last, counter)
        assert snap.dropped == max(0, last - capacity)
        window = min(last, capacity)
        assert len(recs) + snap.lost == window
        # at most the slot being overwritten is missing, and only with a warning saying so
        assert len(recs) >= window - 1
        if len(recs) < window:
            assert being_written(snap)
        # Completions trail entries by COMPLETE_LAG pending records (at most 8 seqs, as every 4th is
        # completed at once); everything older carries its final state.
        settled = recs[recs["seq"] < last - 2 * COMPLETE_LAG]
        assert (settled["state"] == gen_np(settled["seq"])["state"]).all()


# ---------------------------------------------------------------------------
# 4. Truncation.
# ---------------------------------------------------------------------------
def _closed_ring(directory: str, capacity: int, n: int, kind: str = "python") -> Path:
    """A ring with gen(1..n) written, settled (completions applied) and closed."""
    w = make_writer(directory, capacity, kind)
    write_gen(w, kind, n)
    w.close()
    return w.path


def _by_seq(records: np.ndarray) -> dict[int, tuple]:
    return {int(r["seq"]): tuple(int(r[f]) for f in FIELDS) for r in records}


@FAST
@given(kind=st.sampled_from(KINDS), capacity=st.sampled_from([16, 24]), n=st.integers(0, 60),
       cut=st.floats(0, 1, exclude_max=True))
def test_truncated_file(kind, capacity, n, cut):
    with tempfile.TemporaryDirectory() as d:
        path = _closed_ring(d, capacity, n, kind)
        full = read_ring(path)
        size = fmt.file_size(capacity)
        length = int(cut * size)
        with open(path, "r+b") as fh:
            fh.truncate(length)
        if length < fmt.HEADER_SIZE:
            with pytest.raises(RingFormatError, match=str(path)):
                read_ring(path)
            return
        snap = read_ring(path)
        assert len(snap.problems) == 1
        p = snap.problems[0]
        assert p.path == str(path) and p.offset == length and str(path) in str(p) and str(length) in str(p)
        complete_slots = (length - fmt.HEADER_SIZE) // fmt.RECORD_SIZE
        expect = {s: r for s, r in _by_seq(full.records).items() if (s - 1) % capacity < complete_slots}
        assert _by_seq(snap.records) == expect
        if n <= capacity:  # unwrapped: what survives is a prefix
            assert sorted(expect) == list(range(1, len(expect) + 1))


# ---------------------------------------------------------------------------
# 5. Bit flips.
# ---------------------------------------------------------------------------
@FAST
@given(kind=st.sampled_from(KINDS), capacity=st.sampled_from([16, 20]), n=st.integers(0, 50), data=st.data())
def test_bit_flips_in_records(kind, capacity, n, data):
    with tempfile.TemporaryDirectory() as d:
        path = _closed_ring(d, capacity, n, kind)
        full = read_ring(path)
        assert full.problems == []
        blob = bytearray(path.read_bytes())
        slots = data.draw(st.lists(st.integers(0, capacity - 1), min_size=1, max_size=6, unique=True))
        flips = {s: data.draw(st.integers(0, fmt.RECORD_SIZE * 8 - 1)) for s in slots}
        before = {s: bytes(blob[slot_offset(s):slot_offset(s) + fmt.RECORD_SIZE]) for s in slots}
        for s, bit in flips.items():
            blob[slot_offset(s) + bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(blob))
        snap = read_ring(path)

        expect = _by_seq(full.records)
        problems = {p.offset: p for p in snap.problems}
        for s, bit in flips.items():
            byte = bit // 8
            was_empty = not any(before[s])
            if was_empty:  # a flip in an empty slot is garbage where nothing was: reported, nothing returned
                p = problems.pop(slot_offset(s))
                assert p.severity == "error" and p.path == str(path)
                continue
            seq = fmt.RECORD_SEQ.unpack_from(before[s])[0]
            if byte >= fmt.TAIL_OFFSET:  # the head is intact: kept as entered, with a warning
                p = problems.pop(slot_offset(s) + fmt.TAIL_OFFSET)
                assert p.severity == "warning" and "completion" in p.message and str(seq) in p.message
                expect[seq] = expect[seq][:-2] + (0, int(fmt.State.ENQUEUED))
            else:
                p = problems.pop(slot_offset(s))
                assert p.severity == "error" and p.path == str(path), str(p)
                del expect[seq]
            assert str(path) in str(p) and f"offset {p.offset}" in str(p)
        assert problems == {}, [str(p) for p in problems.values()]
        assert _by_seq(snap.records) == expect
        # lost counts the window's missing records; the window ends at most one past the newest valid
        # record (the write counter is not checksummed), so corrupting the newest two undercounts by one.
        corrupted = len([s for s in slots if any(before[s]) and flips[s] // 8 < fmt.TAIL_OFFSET])
        assert min(corrupted, 1) <= snap.lost <= corrupted


_MAGIC_VERSION = range(0, 12)
_GEOMETRY = range(12, 24)


@settings(max_examples=60 * SCALE, deadline=None)
@given(bit=st.integers(0, (fmt.HEADER_CHECK_OFFSET + 4) * 8 - 1))
def test_bit_flip_in_header(bit):
    with tempfile.TemporaryDirectory() as d:
        path = _closed_ring(d, 16, 20)
        full = read_ring(path)
        blob = bytearray(path.read_bytes())
        blob[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(blob))
        byte = bit // 8
        world = int.from_bytes(blob[32:36], "little", signed=True)
        implausible_world = byte in range(32, 36) and not 1 <= world <= fmt.MAX_WORLD_SIZE  # bounds the analysis
        if byte in _MAGIC_VERSION or byte in _GEOMETRY or implausible_world:
            with pytest.raises(RingFormatError) as info:
                read_ring(path)
            msg = str(info.value)
            assert str(path) in msg and "offset" in msg
            return
        snap = read_ring(path)
        assert [(p.offset, p.severity) for p in snap.problems] == [(fmt.HEADER_CHECK_OFFSET, "error")]
        assert "header checksum" in snap.problems[0].message and str(path) in str(snap.problems[0])
        assert _by_seq(snap.records) == _by_seq(full.records)


# ---------------------------------------------------------------------------
# 6. Meta file.
# ---------------------------------------------------------------------------
@FAST
@given(groups=st.lists(st.tuples(st.integers(0, 2**32 - 1), st.text(max_size=12),
                                 st.lists(st.integers(0, 4095), max_size=8)), min_size=1, max_size=6),
       cut=st.floats(0, 1, exclude_min=True, exclude_max=True))
def test_meta_torn_last_line(groups, cut):
    with tempfile.TemporaryDirectory() as d:
        w = make_writer(d, 16, "python")
        w.write_meta("process", rank=3, world_size=8)
        for gid, name, ranks in groups:
            w.write_meta("group", gid=gid, name=name, desc=f"desc {name}", ranks=ranks, backend="nccl")
        w.close()
        data = w.meta_path.read_bytes()
        entries, problems = read_meta(w.meta_path)
        assert problems == [] and len(entries) == len(groups) + 1
        assert entries[0]["kind"] == "process"
        for e, (gid, name, ranks) in zip(entries[1:], groups):
            assert (e["kind"], e["gid"], e["name"], e["ranks"], e["backend"]) == ("group", gid, name, ranks, "nccl")
            assert isinstance(e["t_mono_ns"], int)
        lines = data.splitlines(keepends=True)
        start = len(data) - len(lines[-1])
        cut_at = start + max(1, int(cut * len(lines[-1])))  # inside the last line, before its newline
        assume(cut_at < len(data))
        w.meta_path.write_bytes(data[:cut_at])
        torn_entries, torn_problems = read_meta(w.meta_path)
        assert torn_entries == entries[:-1]
        assert [(p.offset, p.severity) for p in torn_problems] == [(start, "warning")]
        assert str(w.meta_path) in str(torn_problems[0])


def test_meta_bad_line_in_the_middle_is_an_error_and_the_rest_is_kept(tmp_path):
    path = tmp_path / fmt.meta_name(0)
    good = [json.dumps({"kind": "group", "gid": i, "name": str(i), "desc": "", "ranks": [0, 1], "backend": "gloo"})
            for i in range(3)]
    path.write_text(good[0] + "\n" + "{not json\n" + good[1] + "\n" + "[1, 2]\n" + good[2] + "\n")
    entries, problems = read_meta(path)
    assert [e["gid"] for e in entries] == [0, 1, 2]
    assert [(p.offset, p.severity) for p in problems] == [(len(good[0]) + 1, "error"),
                                                          (len(good[0]) + len(good[1]) + 12, "error")]
    missing, problems = read_meta(tmp_path / "nope.meta.jsonl")
    assert missing == [] and problems[0].severity == "warning"


# ---------------------------------------------------------------------------
# 7. The worked example in docs/trace-format.md is what the code computes.
# ---------------------------------------------------------------------------
SPEC = Path(__file__).resolve().parents[1] / "docs" / "trace-format.md"


def _spec_dump(text: str, first_row: str) -> bytes:
    """The hex dump whose first row starts with ``first_row`` (rows like ``00: 2a 00 ...``)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(first_row))
    out = b""
    for line in lines[start:]:
        line = line.strip()
        if not line or ":" not in line[:3]:
            break
        out += bytes.fromhex(line.split(":", 1)[1])
    return out


@pytest.mark.skipif(not SPEC.exists(), reason="docs not shipped")
def test_worked_example_in_the_spec(tmp_path):
    text = SPEC.read_text()
    rec = _spec_dump(text, "00: 2a")
    assert len(rec) == fmt.RECORD_SIZE
    seq, gseq, t_enq, nbytes, gid, peer, op, dtype, flags, hc, t_c, state, tc = fmt.RECORD.unpack(rec)
    assert (seq, gseq, t_enq, nbytes, gid, peer, op, dtype, flags, t_c, state) == (
        42, 7, 5_000_000_000, 1 << 20, 2480671174, -1, fmt.Op.ALL_REDUCE, fmt.Dtype.BFLOAT16,
        fmt.Flag.ASYNC | fmt.Flag.DEVICE, 5_000_250_000, fmt.State.COMPLETED)
    assert hc == fmt.head_check(rec[:44]) == 1495074727
    assert tc == fmt.tail_check(t_c, state, seq) == 85386001
    assert "1495074727" in text and "85386001" in text and "184576838" in text
    assert fmt.tail_check(0, 1, 42) == 184576838
    entered_tail = _spec_dump(text, "30: 00 00")
    assert entered_tail == fmt.RECORD_TAIL.pack(0, 1, 184576838)
    # The reader takes it as written, wherever the spec's bytes are put in a ring.
    w = make_writer(tmp_path, 64, "python")
    w.close()
    blob = bytearray(w.path.read_bytes())
    blob[slot_offset(41):slot_offset(42)] = rec
    fmt.WRITE_COUNTER.pack_into(blob, fmt.WRITE_COUNTER_OFFSET, 42)
    w.path.write_bytes(bytes(blob))
    snap = read_ring(w.path)
    assert snap.problems == [] and snap.to_dicts() == [{
        "seq": 42, "group_seq": 7, "t_enqueue": 5_000_000_000, "nbytes": 1 << 20, "group_id": 2480671174,
        "peer": -1, "op": 1, "dtype": 3, "flags": 5, "t_complete": 5_000_250_000, "state": 2}]


# -- whose directory: the writer refuses one another user made or can change (docs/security.md) --------------

OTHER_UID = 4242  # another user (the tests run as root in CI: chown makes their files and links)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making another user's files needs root")


@needs_root
def test_a_directory_another_user_made_first_is_refused_and_its_planted_link_never_written(tmp_path):
    """Issue 20, item 1: the attacker makes the job's step directory first (mode 0777), with the victim's
    meta file as a link to a file of the victim's that the attacker picked."""
    victim, step = planted_step_dir(tmp_path)
    with pytest.raises(OSError, match=f"cannot use trace directory {step}: .*owned by uid {OTHER_UID}"):
        w = RingWriter(step, RingIdentity(rank=0, world_size=1))
        w.write_meta("env", vars={"SECRET_THING": "x"})
    assert victim.read_text() == "keep\n"
    assert sorted(p.name for p in step.iterdir()) == [fmt.meta_name(0)]  # no ring made in there either


@needs_root
def test_a_directory_under_one_another_user_can_change_is_refused(tmp_path):
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, OTHER_UID, OTHER_UID)  # they could rename our directory away and put theirs in its place
    with pytest.raises(OSError, match="a directory above it is owned by uid 4242"):
        RingWriter(parent / "mine", RingIdentity(rank=0, world_size=1))
    shared = tmp_path / "world-writable"
    shared.mkdir()
    shared.chmod(0o777)  # writable by everyone, not sticky
    with pytest.raises(OSError, match="writable by everyone and not sticky"):
        RingWriter(shared / "mine", RingIdentity(rank=0, world_size=1))
    shared.chmod(0o1777)  # sticky, like /tmp and /dev/shm: nobody can replace what we made in it
    RingWriter(shared / "mine", RingIdentity(rank=0, world_size=1)).close()


def test_the_directories_made_are_private_and_the_files_0600(tmp_path):
    old = os.umask(0)  # even with the most permissive umask
    try:
        w = RingWriter(tmp_path / "a" / "b", RingIdentity(rank=0, world_size=1))
        w.write_meta("env", vars={})
        w.close()
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b"):
        assert d.stat().st_mode & 0o777 == 0o700, d
    for name in (fmt.ring_name(0), fmt.meta_name(0)):
        assert (tmp_path / "a" / "b" / name).stat().st_mode & 0o777 == 0o600, name


def test_without_megatrace_dir_each_user_has_a_base_of_their_own():
    """Issue 20, item 6: outside Slurm the first user must not own the base every user writes under."""
    from megatrace.trace.settings import TracerSettings

    d = TracerSettings.from_env({"MEGATRACE_JOB_ID": "j1", "MEGATRACE_STEP_ID": "0"}).directory
    assert d.parent.name == f"megatrace-{os.geteuid()}" and d.name == "j1.0"


@needs_root
def test_another_users_base_planted_under_our_name_turns_tracing_off_with_a_warning(tmp_path, monkeypatch):
    from megatrace.trace import settings as tsettings

    planted = tmp_path / f"megatrace-{os.geteuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, OTHER_UID, OTHER_UID)
    monkeypatch.setattr(tsettings, "default_base", lambda uid=None: planted)
    d = tsettings.TracerSettings.from_env({"MEGATRACE_JOB_ID": "j2"}).directory
    with pytest.raises(OSError, match="owned by uid 4242"):
        RingWriter(d, RingIdentity(rank=0, world_size=1))
    assert list(planted.iterdir()) in ([], [d])


@pytest.mark.parametrize("length", [HEADER_USED, fmt.HEADER_SIZE, fmt.WRITE_COUNTER_OFFSET + 10])
def test_a_header_read_with_its_live_words_read_again_is_the_file_s_bytes(tmp_path: Path, length: int) -> None:
    """``read_header_bytes`` splices the live words (read again until two reads agree) back in their place: on a
    file no one writes, it returns exactly what one ``pread`` does; a file shorter than the live words as it is."""
    w = RingWriter(tmp_path, IDENT, capacity=64)
    for seq in range(1, 40):
        w.begin(*gen(seq)[:7])
    w.beat()
    path = tmp_path / fmt.ring_name(IDENT.rank)
    whole = path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_header_bytes(fd, length) == whole[:length]
    finally:
        os.close(fd)
    w.close()
    short = tmp_path / "short.ring"
    short.write_bytes(whole[:fmt.WRITE_COUNTER_OFFSET + 10])
    fd = os.open(short, os.O_RDONLY)
    try:
        assert read_header_bytes(fd, length) == whole[:min(length, fmt.WRITE_COUNTER_OFFSET + 10)]
    finally:
        os.close(fd)

