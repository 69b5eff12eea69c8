"""Tail reads: the newest K records of a ring near its write counter, alone or for many rings in one pass."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from megatrace.files import open_input
from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_header import (HEADER_USED, LIVE_TRIES, LIVE_WORDS, ReadProblem, RingFormatError, RingHeader,
                                         RingSnapshot, parse_header, read_header_bytes, torn_problems, truncation,
                                         unreadable_problems)
from megatrace.trace.ring_io import open_budget, open_heads, pread_rows, read_runs, slot_runs
from megatrace.trace.ring_records import RECORD_DTYPE, SlotCopy, older_or_empty, validate, whole_records
from megatrace.trace.tail_pack import PackedFile, header_span

FRESHER = object()  # tail_snapshot: the counter moved on by more than the window while the tail was read


def copy_tail(fd: int, path: str, header: RingHeader, problems: list[ReadProblem], size: int,
              last: int) -> SlotCopy:
    """A copy of the rows near the write counter (the window, and two past the counter), with those to re-read."""
    cap, counter = header.capacity, header.write_counter
    hi = counter + 1  # the writer may have committed one record past its counter (format section 6.3)
    lo = max(1, hi - last)
    n = hi + 2 - lo  # the candidates for the window, plus one slot to see a counter lagging further
    raw = np.zeros((n, fmt.RECORD_SIZE), np.uint8)
    pread_rows(fd, raw, lo, cap, size)
    cut = truncation(path, cap, size)
    if cut is not None:
        problems.append(cut)
    seqs = np.arange(lo, lo + n, dtype=np.uint64)  # the record each row should hold on this lap
    slots = (seqs - np.uint64(1)) % np.uint64(cap)
    empty, head_ok, tail_ok = validate(raw, slots, cap)

    # A live writer may be mid-record: the rows that failed are read again, and the rows of a live ring
    # the counter calls written that still hold an older lap (copied just before the writer refilled
    # them), a few times.
    # A re-read that returns a later lap than the row's expected record is "raced" and not mixed in
    # (as the full read).
    live = not header.closed_cleanly
    found = raw.view(RECORD_DTYPE).reshape(-1)["seq"]  # a view: follows the re-reads
    committed = seqs <= np.uint64(counter)  # rows past the counter may still hold the older lap

    def suspects() -> np.ndarray:
        odd = ~empty & (~head_ok | ~tail_ok)
        if live:
            odd |= head_ok & committed & (found < seqs)
        return np.flatnonzero(odd)

    return SlotCopy(raw, slots, seqs, cap, empty, head_ok, tail_ok, suspects, np.zeros(n, bool))


def tail_snapshot(fd: int, path: str, header: RingHeader, problems: list[ReadProblem], last: int,
                  copy: SlotCopy) -> RingSnapshot | None | object:
    """The newest ``last`` records of a tail copy, once its odd rows were read again; None when the counter
    cannot be trusted to find them, :data:`FRESHER` when the writer left the window read behind."""
    seqs = copy.limits
    rec = copy.raw.view(RECORD_DTYPE).reshape(-1)
    exact = copy.head_ok & (rec["seq"] == seqs)
    newer = copy.head_ok & (rec["seq"] > seqs)  # the writer lapped this slot while it was read
    if exact[-1] or newer[-1]:  # a record two past the counter: the counter lags more than one record
        now = fmt.WRITE_COUNTER.unpack(os.pread(fd, 8, fmt.WRITE_COUNTER_OFFSET))[0]
        if now <= header.write_counter:
            return None  # a stale counter, not a live writer: the newest records may be anywhere
        if now > header.write_counter + last:
            return FRESHER  # the window read is older than the writer's whole window now: read again
        # else a live writer moved on while the file was read: the snapshot ends where its counter was
    window = _tail_window(header, last, seqs, exact, newer | copy.raced)
    if window is None:
        return None
    max_seq, dropped, overwritten = window
    keep = exact & (seqs > dropped) & (seqs <= max_seq)
    valid = rec[keep].copy()  # rows are in seq order already
    torn = keep & ~copy.tail_ok
    if torn.any():
        fix = torn[keep]
        valid["state"][fix] = fmt.State.ENQUEUED
        valid["t_complete"][fix] = 0
    torn_rows = np.flatnonzero(torn)
    problems += torn_problems(path, copy.slots[torn_rows], seqs[torn_rows])
    unreadable = np.flatnonzero(~copy.empty & (~copy.head_ok | newer) & (seqs > dropped) & (seqs <= max_seq + 1))
    live = not header.closed_cleanly  # after a clean close no record can be half-written: a bad slot is corrupt
    problems += unreadable_problems(path, copy.slots[unreadable], copy.raced[unreadable] | newer[unreadable],
                                    live & (seqs[unreadable] >= max_seq))
    return RingSnapshot(header, valid, problems, dropped, max_seq - dropped - len(valid), dropped > overwritten,
                        overwritten)


def _tail_window(header: RingHeader, last: int, seqs: np.ndarray, exact: np.ndarray,
                 lapped_rows: np.ndarray) -> tuple[int, int, int] | None:
    """(newest seq, dropped, overwritten) of the window found in the rows read; None when it reaches past them."""
    lo = int(seqs[0])
    found = np.flatnonzero(exact[:-1])
    newest = int(seqs[found[-1]]) if len(found) else 0
    if not newest and lo > 1:
        return None  # nothing valid near the counter: let the full read find the newest record
    max_seq = max(newest, min(header.write_counter, newest + 1))
    if max(1, max_seq - last + 1) < lo:
        return None  # the newest records are corrupted: the window reaches below what was read
    dropped = max(0, max_seq - last)
    overwritten = max(0, max_seq - header.capacity)
    # A slot the writer refilled on a later lap while the file was read: that record and every older one
    # are overwritten now (as in the full read, where such a record moves the window past them).
    lapped = np.flatnonzero(lapped_rows[:-1])
    if len(lapped):
        floor = int(seqs[lapped[-1]])
        if floor >= max_seq:
            return None  # the writer lapped the whole window while it was read
        dropped, overwritten = max(dropped, floor), max(overwritten, floor)
    return max_seq, dropped, overwritten


def trim(snap: RingSnapshot, last: int) -> RingSnapshot:
    """A full read restricted to its newest ``last`` sequence numbers."""
    max_seq = snap.dropped + snap.lost + len(snap.records)
    start = max_seq - last
    if start <= snap.dropped:
        return snap
    keep = snap.records[snap.records["seq"] > start]
    return RingSnapshot(snap.header, keep, snap.problems, start, last - len(keep), True, snap.dropped)


def _from_pack(pack: Mapping[str, PackedFile], path: str | os.PathLike[str], i: int, last: int, raw: np.ndarray,
               out: list, heads: list, first: np.ndarray, rows: np.ndarray, caps: np.ndarray,
               sizes: list[int]) -> bool:
    """``read_tails``' reads for file ``i`` from its entry in the tails pack; False when the pack cannot serve it
    (no entry, or a tail shorter than ``last``): it is read from the file."""
    entry = pack.get(os.path.basename(path))
    if entry is None or not entry.first:
        return False
    try:
        header, problems = parse_header(str(path), entry.head, entry.size)
    except RingFormatError:
        return False
    span = header_span(header, entry.size, last) if not problems else None
    got = entry.rows(*span[:2]) if span is not None else None
    if got is None:
        return False
    heads[i], sizes[i] = header, entry.size
    first[i], rows[i], caps[i] = span[0], span[1], span[2]
    stride = last + 2
    raw[i * stride:i * stride + span[1]] = np.frombuffer(got, np.uint8).reshape(-1, fmt.RECORD_SIZE)
    return True


def _read_heads_and_tails(paths: Sequence[str | os.PathLike[str]], which: range, last: int, raw: np.ndarray,
                          out: list, heads: list, first: np.ndarray, rows: np.ndarray, caps: np.ndarray,
                          sizes: list[int], pack: Mapping[str, PackedFile] | None = None) -> None:
    """``read_tails``' reads for the files ``which``, in three passes so that the kernel reads ahead for
    all of them at once when they are not cached: open each file and ask for its header, then read the headers
    (both in one C pass, ``ring_io.open_heads``); ask for each tail and read them (into ``raw``, at each ring's
    rows: one C pass, ``ring_io.read_runs``). A file the C pass leaves to us (a link, not a regular file, an
    error, no extension) is opened and read here, through ``files.open_input``'s checks. A file the tails ``pack``
    holds is not opened at all."""
    stride = last + 2
    todo = [i for i in which
            if not (pack and _from_pack(pack, paths[i], i, last, raw, out, heads, first, rows, caps, sizes))]
    opened = open_heads([paths[i] for i in todo], HEADER_USED, LIVE_WORDS, LIVE_TRIES)
    fds = {i: fd for i, fd in zip(todo, opened.fds.tolist(), strict=True) if fd >= 0}  # (all closed below)
    runs: list[tuple[int, int, int, int]] = []  # (file, offset, bytes, where in raw)
    opened_sizes, heads_read = opened.sizes.tolist(), opened.all_heads()
    try:
        for k, i in enumerate(todo):
            try:
                if i in fds:
                    sizes[i] = opened_sizes[k]
                    blob = heads_read[k]
                else:
                    fds[i] = fd = open_input(paths[i])
                    sizes[i] = os.fstat(fd).st_size
                    blob = read_header_bytes(fd)
                header, problems = parse_header(os.fspath(paths[i]), blob, sizes[i])
            except (RingFormatError, OSError) as exc:
                out[i] = exc
                continue
            heads[i] = header
            # (a ring smaller than the window is read here too while its slots up to two past the counter
            # have never been reused: each row is then a slot of its own)
            span = header_span(header, sizes[i], last) if not problems else None
            if span is None:
                continue  # read on its own later
            first[i], rows[i], caps[i] = span
            for offset, row, count in slot_runs(span[0], span[1], span[2], sizes[i]):
                runs.append((i, offset, count * fmt.RECORD_SIZE, (i * stride + row) * fmt.RECORD_SIZE))
        if runs:
            files, offsets, lengths, at = zip(*runs, strict=True)
            for i, err in zip(files, read_runs([fds[i] for i in files], offsets, lengths, raw, at), strict=True):
                if err and rows[i]:
                    out[i], rows[i] = OSError(err, os.strerror(err), str(paths[i])), 0
    finally:
        for fd in fds.values():
            os.close(fd)


def batch_tails(paths: Sequence[str | os.PathLike[str]], last: int,
                pack: Mapping[str, PackedFile] | None = None) -> list[RingSnapshot | RingFormatError | OSError | None]:
    """The tails of the rings whose tail is spotless, read in batches into one shared buffer (or taken from the
    tails ``pack``) and checked in one vectorised pass; an unreadable file gives its exception, a ring to be read
    on its own None."""
    stride = last + 2  # rows per ring: the window, the slot one past the counter, and one more
    n_paths = len(paths)
    raw = np.zeros((n_paths * stride, fmt.RECORD_SIZE), np.uint8)
    out: list[RingSnapshot | RingFormatError | OSError | None] = [None] * n_paths
    heads: list[RingHeader | None] = [None] * n_paths
    first = np.ones(n_paths, np.uint64)
    rows = np.zeros(n_paths, np.int64)  # rows read; 0: not on the fast path
    caps = np.ones(n_paths, np.uint64)
    sizes = [0] * n_paths
    step = open_budget()
    for lo in range(0, n_paths, step):
        _read_heads_and_tails(paths, range(lo, min(n_paths, lo + step)), last, raw, out, heads, first, rows, caps,
                              sizes, pack)
    _keep_spotless(raw, last, first, rows, caps, heads, out)
    return out


def _keep_spotless(raw: np.ndarray, last: int, first: np.ndarray, rows: np.ndarray, caps: np.ndarray,
                   heads: list, out: list) -> None:
    """Set ``out[i]`` to the snapshot of each ring ``i`` whose tail rows (``stride`` of them per ring in ``raw``)
    are spotless; its records are views into ``raw``."""
    n_paths, stride = len(rows), last + 2
    # Spotless: every slot from the window's oldest record to the counter holds exactly its record, with
    # both checksums right; the slot after the counter holds that record (the counter lags by one) or
    # an older lap or nothing; the slot after that an older lap or nothing (format, section 6.3).
    col = np.arange(stride, dtype=np.int64)[None, :]
    seqs = (first[:, None] + col.astype(np.uint64)).reshape(-1)
    whole = whole_records(raw, seqs).reshape(n_paths, stride)
    n = rows[:, None]
    clean = (rows > 0) & (whole | (col >= n - 2)).all(axis=1)
    ends = np.maximum(rows - 2, 0)
    at_hi = whole[np.arange(n_paths), ends]
    past = (np.arange(n_paths) * stride)[:, None] + np.stack([ends, ends + 1], axis=1)  # counter + 1, counter + 2
    older = older_or_empty(raw[past.reshape(-1)], seqs[past.reshape(-1)], np.repeat(caps, 2)).reshape(n_paths, 2)
    clean &= (at_hi | older[:, 0]) & older[:, 1]
    # The window ends at counter + 1 if that record is there, else at the counter.
    max_seq = first.astype(np.int64) + rows - 3 + at_hi
    dropped = np.maximum(0, max_seq - last)
    start = np.arange(n_paths) * stride + dropped + 1 - first.astype(np.int64)
    stop = np.arange(n_paths) * stride + max_seq + 1 - first.astype(np.int64)
    records = raw.view(RECORD_DTYPE).reshape(-1)
    for i in np.flatnonzero(clean).tolist():
        d, m = int(dropped[i]), int(max_seq[i])
        over = max(0, m - int(caps[i]))
        out[i] = RingSnapshot(heads[i], records[start[i]:stop[i]], [], d, 0, d > over, over)
