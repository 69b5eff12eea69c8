"""The full read of a ring: copy every slot, then (after the re-reads of the odd ones) keep the window."""

from __future__ import annotations

import os

import numpy as np

from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_header import (ReadProblem, RingHeader, RingSnapshot, geometry_error, parse_header,
                                         read_header_bytes, torn_problems, unreadable_problems)
from megatrace.trace.ring_io import pread_all
from megatrace.trace.ring_records import RECORD_DTYPE, SlotCopy, validate_ring


def copy_full(fd: int, path: str) -> tuple[RingHeader, list[ReadProblem], SlotCopy]:
    """The header, its problems and a copy of every slot, with the slots to read again."""
    size = os.fstat(fd).st_size
    header, problems = parse_header(path, read_header_bytes(fd, fmt.HEADER_SIZE), size)
    cap = header.capacity
    expected = fmt.file_size(cap)
    if problems and size != expected:
        raise geometry_error(path, cap, size, expected)
    # Read no more than the capacity allows: a sparse file far larger than that costs nothing more.
    body = pread_all(fd, min(size, expected) - fmt.HEADER_SIZE, fmt.HEADER_SIZE)
    n_slots = len(body) // fmt.RECORD_SIZE
    if len(body) + fmt.HEADER_SIZE < expected:
        got = len(body) + fmt.HEADER_SIZE
        problems.append(ReadProblem(path, got, f"file truncated: {got} of {expected} bytes; "
                                               f"slots {n_slots}..{cap - 1} are lost"))
    raw = body[:n_slots * fmt.RECORD_SIZE].reshape(n_slots, fmt.RECORD_SIZE)  # (its own buffer: writable, no copy)
    slots = np.arange(n_slots, dtype=np.uint64)
    empty, head_ok, tail_ok, summary = validate_ring(raw, cap)

    # A live writer may be mid-record: the slots that failed are read again, a few times. A re-read
    # may only return a record that fits this snapshot (at most one past its newest record):
    # a slot the writer has since refilled on a later lap is skipped as "raced", not mixed in.
    # A live ring's slot that holds a record a whole lap older than the newest was copied before
    # the writer refilled it (a reader preempted mid-copy, or a writer thread between taking its
    # number and writing): it is re-read too, so the copy does not skip the record it now holds.
    seqs = raw.view(RECORD_DTYPE).reshape(-1)["seq"]  # a view: follows the re-reads
    if summary is not None:
        newest = summary.newest
    else:
        newest = int(seqs[head_ok].max()) if head_ok.any() else 0
    limit = max(newest, min(header.write_counter, newest + 1)) + 1
    live = not header.closed_cleanly
    # Every slot empty or whole, and no slot a lap behind (the usual copy, of a finished or a quiet ring): no suspect
    quiet = summary if summary is not None and summary.clean and not (live and newest > cap) else None

    def suspects() -> np.ndarray:
        if quiet is not None:
            return _NO_ROWS
        odd = ~empty & (~head_ok | ~tail_ok)
        if live and newest > cap:
            odd |= head_ok & (seqs <= np.uint64(newest - cap))
        return np.flatnonzero(odd)

    copy = SlotCopy(raw, slots, limit, cap, empty, head_ok, tail_ok, suspects, np.zeros(n_slots, bool), quiet)
    return header, problems, copy


_NO_ROWS = np.zeros(0, np.intp)


def _drop_records_written_during_read(valid: np.ndarray, header: RingHeader) -> np.ndarray:
    """Keep a live snapshot contiguous: drop records numbered past the write counter + 1, and the ones they lapped.

    The header, with the counter, is copied before the body. A fast writer that laps slots while
    the body is copied leaves later slots holding records newer than the counter and earlier ones
    still holding the previous lap, which is older than the window: keeping the newer ones would
    leave a gap. (A counter below the newest record by more than a lap is damaged: ignored.)
    """
    if header.writer_state != fmt.WriterState.OPEN or not len(valid):
        return valid
    limit = header.write_counter + 1
    cap = header.capacity
    newest = int(valid["seq"][-1])
    if newest <= limit or limit + cap < newest:
        return valid
    later = valid["seq"][valid["seq"] > limit].astype(np.int64)
    # Each later record overwrote, during the copy, the record its slot held when the counter was
    # read: the newest such is `cutoff`. Everything up to it counts as overwritten, so the snapshot
    # stays one contiguous run instead of keeping older records across the gap.
    laps = (later - limit + cap - 1) // cap
    cutoff = int((later - laps * cap).max())
    return valid[(valid["seq"] <= limit) & (valid["seq"].astype(np.int64) > cutoff)]


def _valid_records(copy: SlotCopy, header: RingHeader) -> np.ndarray:
    """The records with a whole head, sorted by seq; those with a torn completion kept as entered."""
    records = copy.raw.view(RECORD_DTYPE).reshape(-1)
    if copy.quiet is not None:  # every slot empty or whole, none read again: what the scan said of the rows
        q = copy.quiet
        valid = records[q.first:q.last + 1] if q.last - q.first + 1 == q.whole else records[copy.head_ok]
        if not q.ascending:
            valid = valid[np.argsort(valid["seq"], kind="stable")]
        return _drop_records_written_during_read(valid, header)
    torn_tail = copy.head_ok & ~copy.tail_ok
    if torn_tail.any():
        fixed = records[torn_tail].copy()
        fixed["state"] = fmt.State.ENQUEUED
        fixed["t_complete"] = 0
        valid = np.concatenate([records[copy.head_ok & copy.tail_ok], fixed])
    else:
        valid = _rows(records, copy.head_ok)
    seq = valid["seq"]
    if len(seq) > 1 and not (seq[1:] > seq[:-1]).all():  # (a lapped ring, or torn tails moved to the end)
        valid = valid[np.argsort(seq, kind="stable")]  # 5x faster than sort(order=)
    return _drop_records_written_during_read(valid, header)


def _rows(records: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``records[mask]``; a view when the rows are one run (a ring not lapped yet, or every slot of a lapped one)."""
    rows = np.flatnonzero(mask)
    if len(rows) and int(rows[-1]) - int(rows[0]) + 1 == len(rows):
        return records[int(rows[0]):int(rows[-1]) + 1]
    return records[rows]


def full_snapshot(path: str, header: RingHeader, problems: list[ReadProblem], copy: SlotCopy) -> RingSnapshot:
    """The snapshot of a full copy, once its odd slots were read again."""
    cap, raced = header.capacity, copy.raced
    valid = _valid_records(copy, header)
    max_seq = int(valid[-1]["seq"]) if len(valid) else 0
    max_seq = max(max_seq, min(header.write_counter, max_seq + 1))
    dropped = max(0, max_seq - cap)
    # Every slot empty or whole and none raced (the usual copy): no torn or unreadable slot to look for.
    odd = copy.quiet is None and (bool(raced.any()) or not (copy.empty | (copy.head_ok & copy.tail_ok)).all())
    # A slot torn when copied and refilled on a later lap by the re-read: the record it held in this
    # window, and every older one, are overwritten now (as in the tail read). Keeping the older ones
    # would leave a gap where that record was.
    for slot in np.flatnonzero(raced) if odd else ():
        held = max_seq - (max_seq - 1 - int(slot)) % cap  # the newest seq <= max_seq that lives in this slot
        dropped = max(dropped, held)
    # A copy of a live ring is not instantaneous: a slot copied before the writer lapped it
    # holds a record older than the window. It was overwritten: count it dropped, not kept.
    seqs = valid["seq"]
    if len(seqs) and int(seqs[0]) <= dropped:  # (the usual copy has none: no search)
        valid = valid[int(np.searchsorted(seqs, dropped, side="right")):]  # (sorted by seq: a view)
    lost = max(0, max_seq - dropped - len(valid))
    if odd:
        records = copy.raw.view(RECORD_DTYPE).reshape(-1)
        torn = np.flatnonzero(copy.head_ok & ~copy.tail_ok & (records["seq"] > dropped))
        problems += torn_problems(path, torn, records["seq"][torn])
        unreadable = np.flatnonzero(~copy.empty & ~copy.head_ok)
        head_slot = (max_seq) % cap  # where the next record goes: a torn slot here is a record being written
        live = not header.closed_cleanly  # after a clean close no record can be half-written: a bad slot is corrupt
        in_flight = live & ((unreadable == head_slot) | (unreadable == (max_seq - 1) % cap))
        problems += unreadable_problems(path, unreadable, raced[unreadable], in_flight)
    return RingSnapshot(header, valid, problems, dropped, lost, overwritten=dropped)
