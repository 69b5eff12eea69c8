"""``read_ring(path, last=K)`` and ``read_tails``: the newest K records, read from near the write counter.

The reference is the full read restricted to its newest K sequence numbers
(``_trimmed`` below): same records, ``dropped`` counting everything older than
the window, ``overwritten`` the part the ring itself overwrote, ``partial`` set
when older records were left unread, and ``lost`` the window's torn or
corrupted records. Rings are written with the real writers (the deterministic
stream of tests/helpers/ring_stream.py); damage is made by editing bytes of the file.
"""

from __future__ import annotations

import errno
import os
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers.ring_stream import (FAST, FORK, IDENT, KIND_PARAMS, KINDS, being_written, check_against_gen,
                                 check_contiguous, errors, make_writer, slot_offset, write_gen, writer_child)

from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_reader import RingFormatError, RingSnapshot, read_ring, read_tails
from megatrace.trace.ring_tail import batch_tails


def _ring(directory: str | Path, capacity: int, n: int, kind: str = "python", close: bool = True) -> Path:
    """A ring with gen(1..n) written (settled and closed unless ``close`` is False)."""
    w = make_writer(str(directory), capacity, kind)
    write_gen(w, kind, n)
    if close:
        w.close()
    return w.path


def _trimmed(full: RingSnapshot, last: int) -> tuple:
    """What ``read_ring(last=K)`` must return, from a full read: (records, dropped, lost, partial, overwritten)."""
    max_seq = full.dropped + full.lost + len(full.records)
    start = max(full.dropped, max_seq - last)
    keep = full.records[full.records["seq"] > start]
    return keep, start, (max_seq - start) - len(keep), start > full.dropped, full.dropped


def _summary(snap: RingSnapshot) -> tuple:
    return snap.records, snap.dropped, snap.lost, snap.partial, snap.overwritten


def _assert_same(got: RingSnapshot, want: tuple) -> None:
    recs, dropped, lost, partial, overwritten = want
    assert got.records.dtype == recs.dtype
    assert got.records.tobytes() == recs.tobytes(), (got.records["seq"].tolist(), recs["seq"].tolist())
    assert (got.dropped, got.lost, got.partial, got.overwritten) == (dropped, lost, partial, overwritten)


def _problems(snap: RingSnapshot) -> list[tuple]:
    return sorted((p.offset, p.severity, p.message) for p in snap.problems)


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def _set_counter(path: Path, value: int) -> None:
    _patch(path, fmt.WRITE_COUNTER_OFFSET, fmt.WRITE_COUNTER.pack(value))


# ---------------------------------------------------------------------------
# Clean rings: every size, wrapped or not, K smaller or larger than the ring.
# ---------------------------------------------------------------------------
@FAST
@given(kind=st.sampled_from(KINDS), capacity=st.sampled_from([16, 17, 20, 32, 100]), n=st.integers(0, 260),
       last=st.integers(1, 140), close=st.booleans())
def test_tail_is_the_full_read_trimmed(kind, capacity, n, last, close):
    with tempfile.TemporaryDirectory() as d:
        path = _ring(d, capacity, n, kind, close)
        full = read_ring(path)
        tail = read_ring(path, last=last)
        want = _trimmed(full, last)
        _assert_same(tail, want)
        _assert_same(read_tails([path], last)[0], want)
        assert tail.problems == [] and tail.header == full.header
        check_contiguous(tail.records)
        assert len(tail.records) == min(last, n, capacity)


def test_unwrapped_ring_shorter_than_k_is_complete(tmp_path):
    path = _ring(tmp_path, 1024, 50)
    snap = read_ring(path, last=256)
    assert snap.records["seq"].tolist() == list(range(1, 51))
    assert (snap.dropped, snap.overwritten, snap.lost, snap.partial) == (0, 0, 0, False)


def test_unwrapped_ring_longer_than_k_is_partial(tmp_path):
    path = _ring(tmp_path, 1024, 500)
    snap = read_ring(path, last=100)
    assert snap.records["seq"].tolist() == list(range(401, 501))
    assert (snap.dropped, snap.overwritten, snap.lost, snap.partial) == (400, 0, 0, True)
    check_against_gen(snap.records, exact_times=True)


@pytest.mark.parametrize("n", [1000, 1024, 1025, 1100, 3000])
def test_wrapped_ring(tmp_path, n):
    path = _ring(tmp_path, 1024, n)
    snap = read_ring(path, last=100)
    assert snap.records["seq"].tolist() == list(range(n - 99, n + 1))
    assert snap.dropped == n - 100 and snap.overwritten == max(0, n - 1024) and snap.partial
    assert snap.lost == 0 and snap.problems == []
    (batch,) = read_tails([path], 100)
    _assert_same(batch, _summary(snap))


@pytest.mark.parametrize("n", [0, 1, 30, 98])
def test_a_ring_smaller_than_k_never_wrapped_is_read_in_the_batch(tmp_path, n):
    """(A ring sized to its records, as ``megatrace simulate`` writes them: not read again on its own.)"""
    path = _ring(tmp_path, 100, n)
    (batch,) = batch_tails([path], 128)
    assert batch is not None
    _assert_same(batch, _summary(read_ring(path)))
    assert batch.records["seq"].tolist() == list(range(1, n + 1))


@pytest.mark.parametrize("n", [99, 100, 150])
def test_a_ring_smaller_than_k_that_may_have_wrapped_is_read_on_its_own(tmp_path, n):
    path = _ring(tmp_path, 100, n)
    assert batch_tails([path], 128) == [None]
    _assert_same(read_tails([path], 128)[0], _summary(read_ring(path)))


@pytest.mark.parametrize("last", [1022, 1023, 1024, 5000])
def test_k_as_large_as_the_ring_reads_it_all(tmp_path, last):
    path = _ring(tmp_path, 1024, 3000)
    snap = read_ring(path, last=last)
    k = min(last, 1024)
    assert snap.records["seq"].tolist() == list(range(3001 - k, 3001))
    assert snap.dropped == 3000 - k and snap.overwritten == 3000 - 1024 and snap.partial == (k < 1024)


def test_last_must_be_positive(tmp_path):
    path = _ring(tmp_path, 16, 5)
    with pytest.raises(ValueError):
        read_ring(path, last=0)
    with pytest.raises(ValueError):
        read_tails([path], 0)


# ---------------------------------------------------------------------------
# The write counter: lagging by one (writer killed between the record and the counter), by more
# (stale), or garbage. Only the first is trusted; the others fall back to the full read.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [60, 1030])
def test_counter_lagging_by_one_still_finds_the_newest_record(tmp_path, n):
    path = _ring(tmp_path, 1024, n, close=False)
    _set_counter(path, n - 1)
    full = read_ring(path)
    assert full.records["seq"][-1] == n
    for snap in (read_ring(path, last=32), read_tails([path], 32)[0]):
        _assert_same(snap, _trimmed(full, 32))
        assert snap.records["seq"][-1] == n


@pytest.mark.parametrize("counter", [0, 10, 97, 2**40, 2**64 - 1])
def test_stale_or_garbage_counter_falls_back_to_the_full_read(tmp_path, counter):
    path = _ring(tmp_path, 1024, 100)
    _set_counter(path, counter)
    full = read_ring(path)
    for snap in (read_ring(path, last=32), read_tails([path], 32)[0]):
        _assert_same(snap, _trimmed(full, 32))
        assert _problems(snap) == _problems(full)


# ---------------------------------------------------------------------------
# Damage inside the window is reported exactly as the full read reports it.
# ---------------------------------------------------------------------------
def _torn_next_head(path: Path, n: int, capacity: int) -> int:
    """Half of record n + 1's head written into its slot (the writer died mid-record); returns its offset."""
    off = slot_offset(n % capacity)
    head = fmt.RECORD_HEAD.pack(n + 1, 1, 2, 3, 4, 5, 6, 7, 8)
    _patch(path, off, head[:20])
    return off


@pytest.mark.parametrize("n", [50, 1000, 2500])
def test_torn_newest_record_is_a_warning(tmp_path, n):
    path = _ring(tmp_path, 1024, n, close=False)
    off = _torn_next_head(path, n, 1024)
    full = read_ring(path)
    for snap in (read_ring(path, last=64), read_tails([path], 64)[0]):
        _assert_same(snap, _trimmed(full, 64))
        assert [p.offset for p in being_written(snap)] == [off]
        assert not errors(snap) and snap.records["seq"][-1] == n
        assert _problems(snap) == _problems(full)


def test_torn_completion_of_the_newest_record_is_kept_as_entered(tmp_path):
    n = 300
    path = _ring(tmp_path, 1024, n, close=False)
    slot = (n - 1) % 1024
    _patch(path, slot_offset(slot) + fmt.TAIL_OFFSET, b"\xff\xff\xff")
    full = read_ring(path)
    for snap in (read_ring(path, last=64), read_tails([path], 64)[0]):
        _assert_same(snap, _trimmed(full, 64))
        last = snap.records[-1]
        assert last["seq"] == n and last["state"] == fmt.State.ENQUEUED and last["t_complete"] == 0
        assert [p.offset for p in snap.problems] == [slot_offset(slot) + fmt.TAIL_OFFSET]
        assert _problems(snap) == _problems(full)


def test_corrupted_record_inside_the_window(tmp_path):
    path = _ring(tmp_path, 1024, 2000)
    seq = 1990
    off = slot_offset((seq - 1) % 1024) + 30
    _patch(path, off, b"\x00\x01\x02")
    full = read_ring(path)
    for snap in (read_ring(path, last=64), read_tails([path], 64)[0]):
        _assert_same(snap, _trimmed(full, 64))
        assert snap.lost == 1 and seq not in snap.records["seq"]
        assert [(p.offset, p.severity) for p in snap.problems] == [(slot_offset((seq - 1) % 1024), "error")]


def test_corrupted_record_older_than_the_window_is_not_read(tmp_path):
    path = _ring(tmp_path, 1024, 2000)
    _patch(path, slot_offset((1500 - 1) % 1024) + 30, b"\x00\x01\x02")
    assert errors(read_ring(path))
    for snap in (read_ring(path, last=64), read_tails([path], 64)[0]):
        assert snap.problems == [] and snap.lost == 0
        assert snap.records["seq"].tolist() == list(range(1937, 2001))


def test_truncated_file(tmp_path):
    path = _ring(tmp_path, 1024, 700)
    with open(path, "r+b") as fh:
        fh.truncate(slot_offset(680) + 10)  # slots 680.. (seqs 681..700) are gone, 680 cut in half
    full = read_ring(path)
    for snap in (read_ring(path, last=64), read_tails([path], 64)[0]):
        _assert_same(snap, _trimmed(full, 64))
        assert snap.records["seq"][-1] == 680 and "truncated" in snap.problems[0].message
        assert _problems(snap) == _problems(full)


def test_damaged_header_checksum_is_reported(tmp_path):
    path = _ring(tmp_path, 1024, 100)
    _patch(path, 230, b"x")  # inside the checksummed static header, outside magic/version/geometry
    full = read_ring(path)
    for snap in (read_ring(path, last=32), read_tails([path], 32)[0]):
        _assert_same(snap, _trimmed(full, 32))
        assert _problems(snap) == _problems(full) == [(fmt.HEADER_CHECK_OFFSET, "error", full.problems[0].message)]


# ---------------------------------------------------------------------------
# Many files at once: read_tails gives what read_ring(last=K) gives, file by file, and the exception
# in place of an unreadable file.
# ---------------------------------------------------------------------------
def test_read_tails_of_many_files(tmp_path):
    paths = []
    for k, (cap, n) in enumerate([(16, 0), (16, 5), (64, 1000), (1024, 300), (1024, 5000), (2048, 2048)]):
        d = tmp_path / f"r{k}"
        d.mkdir()
        paths.append(_ring(d, cap, n, close=k % 2 == 0))
    bad = tmp_path / "bad.ring"
    bad.write_bytes(b"not a ring" * 500)
    missing = tmp_path / "missing.ring"
    got = read_tails(paths[:3] + [bad, missing] + paths[3:], 40)
    assert isinstance(got[3], RingFormatError) and str(bad) in str(got[3])
    assert isinstance(got[4], OSError)
    for p, snap in zip(paths, got[:3] + got[5:], strict=True):
        assert isinstance(snap, RingSnapshot)
        _assert_same(snap, _summary(read_ring(p, last=40)))
        assert snap.header == read_ring(p).header


# ---------------------------------------------------------------------------
# A live writer in another process, then killed.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [64, 4096])
@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_tail_beside_live_writer(tmp_path, kind, capacity):
    last = 40
    ready = FORK.Event()
    child = FORK.Process(target=writer_child, args=(str(tmp_path), capacity, kind, ready), daemon=True)
    child.start()
    path = tmp_path / fmt.ring_name(IDENT.rank)
    try:
        assert ready.wait(10), "writer child did not start"
        reads = newest = 0
        deadline = time.monotonic() + 0.75
        while time.monotonic() < deadline:
            for snap in (read_ring(path, last=last), read_tails([path], last)[0]):
                reads += 1
                assert not errors(snap), [str(p) for p in snap.problems]
                assert len(being_written(snap)) <= 1, [str(p) for p in snap.problems]
                recs = snap.records
                assert len(recs) <= last
                check_contiguous(recs)
                check_against_gen(recs, exact_times=kind == "python")
                if len(recs):
                    first, end = int(recs["seq"][0]), int(recs["seq"][-1])
                    assert first > snap.dropped and end <= snap.dropped + last
                    assert len(recs) + snap.lost in (end - snap.dropped, end - snap.dropped + 1)
                    # a slot lapped while it was read counts as overwritten, with everything older
                    assert max(0, end - capacity) <= snap.overwritten <= snap.dropped
                    assert snap.partial == (snap.dropped > snap.overwritten)
                    assert end >= newest  # the writer only moves forward
                    newest = end
        assert child.is_alive(), "the writer child died"
        assert newest > capacity and reads > 10, (reads, newest)
    finally:
        child.kill()
        child.join(10)
    full = read_ring(path)
    for snap in (read_ring(path, last=last), read_tails([path], last)[0]):
        _assert_same(snap, _trimmed(full, last))
        assert not errors(snap) and len(being_written(snap)) <= 1


@settings(max_examples=8, deadline=None)
@given(kind=st.sampled_from(KINDS), delay=st.floats(0, 0.02))
def test_tail_after_sigkill_mid_write(kind, delay):
    with tempfile.TemporaryDirectory() as d:
        ready = FORK.Event()
        child = FORK.Process(target=writer_child, args=(d, 256, kind, ready), daemon=True)
        child.start()
        try:
            assert ready.wait(10)
            time.sleep(delay)  # a duration (drawn), not a wait: where in the stream the kill lands
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.join(10)
        path = Path(d) / fmt.ring_name(IDENT.rank)
        full = read_ring(path)
        for snap in (read_ring(path, last=50), read_tails([path], 50)[0]):
            _assert_same(snap, _trimmed(full, 50))
            assert not errors(snap) and len(being_written(snap)) <= 1
            check_contiguous(snap.records)
            check_against_gen(snap.records, exact_times=kind == "python")


def test_native_and_python_rings_read_alike():
    with tempfile.TemporaryDirectory() as d:
        for kind in KINDS:
            sub = Path(d) / kind
            sub.mkdir()
            path = _ring(sub, 128, 1000, kind)
            snap = read_ring(path, last=77)
            assert snap.records["seq"].tolist() == list(range(924, 1001))
            check_against_gen(snap.records, exact_times=kind == "python")
            assert np.array_equal(read_tails([path], 77)[0].records, snap.records)


@pytest.fixture(params=["c", "python"])
def batch_io(request, monkeypatch):
    """The tail reader's batch reads in one pass of C, or each file opened and read on its own (no extension)."""
    from megatrace.trace import ring_io

    if request.param == "c":
        if ring_io._open_heads is None:
            pytest.skip("C hot path not built (no compiler at install)")
    else:
        monkeypatch.setattr(ring_io, "_open_heads", None)
        monkeypatch.setattr(ring_io, "_read_runs", None)
    return request.param


def test_read_tails_of_odd_files_the_same_with_or_without_the_c_pass(tmp_path, batch_io):
    """Rings beside a link to a ring (this user's: followed), a FIFO, a directory, a short file, a missing one: each
    ring's tail as read alone, each odd file its own error, whichever way the batch is read (nothing blocks)."""
    paths = []
    for k, (cap, n) in enumerate([(16, 5), (64, 1000), (1024, 300)]):
        d = tmp_path / f"r{k}"
        d.mkdir()
        paths.append(_ring(d, cap, n, close=k != 1))
    link = tmp_path / "link.ring"
    link.symlink_to(paths[1])
    fifo = tmp_path / "fifo.ring"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.ring"
    folder.mkdir()
    short = tmp_path / "short.ring"
    short.write_bytes(fmt.MAGIC + b"\0" * 100)
    got = read_tails([paths[0], link, fifo, folder, paths[1], short, tmp_path / "missing.ring", paths[2]], 40)
    for p, snap in zip([paths[0], paths[1], paths[1], paths[2]], [got[0], got[1], got[4], got[7]], strict=True):
        assert isinstance(snap, RingSnapshot), snap
        _assert_same(snap, _summary(read_ring(p, last=40)))
        assert snap.header.write_counter == read_ring(p).header.write_counter
    assert isinstance(got[2], OSError) and "not a regular file" in str(got[2])
    assert isinstance(got[3], OSError) and "not a regular file" in str(got[3])
    assert isinstance(got[5], RingFormatError) and str(short) in str(got[5])
    assert isinstance(got[6], FileNotFoundError)


def test_batch_reads_in_c_give_what_python_reads(tmp_path):
    """``open_heads`` and ``read_runs`` in C against their Python twins: the same header bytes and sizes of each
    ring; -1 and the errno for what the caller must read its own way; the same bytes of every run, EBADF for a run
    of a descriptor that is not open."""
    from megatrace.trace import ring_io
    from megatrace.trace.ring_header import HEADER_USED, LIVE_TRIES, LIVE_WORDS, read_header_bytes

    if ring_io._open_heads is None:
        pytest.skip("C hot path not built (no compiler at install)")
    rings = [_ring(tmp_path / f"r{k}", 64, 30 * k + 1) for k in range(3) if not (tmp_path / f"r{k}").mkdir()]
    link = tmp_path / "link.ring"
    link.symlink_to(rings[0])
    short = tmp_path / "short.ring"
    short.write_bytes(b"x" * 100)
    paths = [*rings, link, tmp_path / "missing.ring", tmp_path, short]
    got = ring_io.open_heads(paths, HEADER_USED, LIVE_WORDS, LIVE_TRIES)
    try:
        assert got.fds[:3].min() >= 0 and got.fds[3:6].tolist() == [-1, -1, -1] and got.fds[6] >= 0
        assert got.errs.tolist()[3:6] == [errno.ELOOP, errno.ENOENT, errno.EINVAL] and not got.errs[[0, 1, 2, 6]].any()
        for k in (0, 1, 2, 6):
            with open(paths[k], "rb") as f:
                assert got.head(k) == read_header_bytes(f.fileno()) and got.sizes[k] == os.path.getsize(paths[k])
        assert got.all_heads() == [got.head(k) for k in range(len(paths))]  # (the short file's 100 bytes too)
        fds = [int(got.fds[k]) for k in (0, 1, 2, 6)] + [999_999]
        offsets, lengths, at = [0, 4096, 4100, 10, 0], [300, 640, 64, 90, 8], [0, 300, 940, 1004, 1094]
        runs = []
        for native in (True, False):
            dest = np.zeros(1200, np.uint8)
            if not native:
                saved, ring_io._read_runs = ring_io._read_runs, None
            try:
                errs = ring_io.read_runs(fds, offsets, lengths, dest, at)
            finally:
                if not native:
                    ring_io._read_runs = saved
            runs.append((dest.tobytes(), errs))
        assert runs[0] == runs[1] and runs[0][1] == [0, 0, 0, 0, errno.EBADF]
        assert runs[0][0][:300] == open(rings[0], "rb").read(300)
        with pytest.raises(ValueError):
            ring_io.read_runs(fds[:1], [0], [64], np.zeros(32, np.uint8), [0])
    finally:
        for fd in got.fds.tolist():
            if fd >= 0:
                os.close(fd)
