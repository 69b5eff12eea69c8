"""The ring tests' writers and their deterministic record stream (tests/test_ring.py, tests/test_ring_tail.py).

:func:`make_writer` makes either writer ("python": the pure-Python one on a fake clock, timestamps exact;
"native": the C hot path, when built, on the real clock). :func:`write_gen` writes ``gen(1), gen(2), ...``;
:func:`check_against_gen` checks records read back against it; :func:`writer_child` is a forked writer that
never stops. ``RING_TEST_SCALE=N`` multiplies examples and durations (:data:`SCALE`, :data:`FAST`).
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from megatrace.trace import ring_format as fmt
from megatrace.trace import warnings as mt_warnings
from megatrace.trace.ring_writer import RingIdentity, RingWriter

FIELDS = ("seq", "group_seq", "t_enqueue", "nbytes", "group_id", "peer", "op", "dtype", "flags",
          "t_complete", "state")
HEAD_FIELDS = FIELDS[:9]
IDENT = RingIdentity(rank=3, world_size=8, local_rank=1, job_id="job-42", step_id="7", host="node-a", pid=4242)
# RING_TEST_SCALE=N multiplies examples and durations for a stress run (default 1: the file runs in seconds).
SCALE = max(1, int(os.environ.get("RING_TEST_SCALE", "1")))
FAST = settings(max_examples=25 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FORK = multiprocessing.get_context("fork")

mt_warnings._seen.add("ring-wrap")  # the tests wrap on purpose; keep stderr quiet


def _native_available() -> bool:
    try:
        from megatrace.trace import _ringfast  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("MEGATRACE_PURE_PYTHON") != "1"


NATIVE = _native_available()
# "python": the pure-Python writer, driven by a fake clock, so timestamps are checked exactly.
# "native": the C hot path (what the tracer uses when it was built), on the real monotonic clock.
KINDS = ["python", "native"] if NATIVE else ["python"]
KIND_PARAMS = [pytest.param("python"),
               pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="C ring writer not built"))]


def make_writer(directory, capacity: int, kind: str) -> RingWriter:
    w = RingWriter(directory, IDENT, capacity, use_native=kind == "native")
    assert w.native == (kind == "native")
    return w


class Clock:
    """A settable monotonic clock for ``begin(..., _now=clock)``."""

    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> int:
        return self.t


def errors(snap):
    return [p for p in snap.problems if p.severity == "error"]


def being_written(snap):
    return [p for p in snap.problems if p.severity == "warning" and "being written" in p.message]


def slot_offset(slot: int) -> int:
    return fmt.HEADER_SIZE + slot * fmt.RECORD_SIZE


# ---------------------------------------------------------------------------
# A deterministic record stream, for the cross-process tests. The child writes
# ``gen(seq)``; the parent checks every record it reads against ``gen_np``.
# Final states by seq % 4: completed at once (complete_now), completed late,
# failed late, never completed. "Late" is COMPLETE_LAG records after entry, so
# tails change while the reader runs.
# ---------------------------------------------------------------------------
_FINAL_STATE = (fmt.State.COMPLETED, fmt.State.COMPLETED, fmt.State.FAILED, fmt.State.ENQUEUED)
COMPLETE_LAG = 5


def gen(seq: int) -> tuple[int, int, int, int, int, int, int, int, int, int]:
    """(op, group_id, group_seq, nbytes, peer, dtype, flags, t_enqueue, final state, t_complete).

    The times are what the Python writer's fake clock gives; the native writer uses the real clock.
    """
    state = int(_FINAL_STATE[seq % 4])
    t_enq = 10**12 + seq * 1000
    t_comp = t_enq + 500 + seq % 97 if state != fmt.State.ENQUEUED else 0
    return (1 + seq % 9, (seq % 5) * 1000003 + 7, seq // 5, (seq * 7919) % (1 << 40), seq % 13 - 1,
            seq % 15, (seq * 5) % 32, t_enq, state, t_comp)


def gen_np(seqs: np.ndarray) -> dict[str, np.ndarray]:
    s = seqs.astype(np.int64)
    state = np.asarray(_FINAL_STATE, dtype=np.int64)[s % 4]
    t_enq = 10**12 + s * 1000
    return {"op": 1 + s % 9, "group_id": (s % 5) * 1000003 + 7, "group_seq": s // 5,
            "nbytes": (s * 7919) % (1 << 40), "peer": s % 13 - 1, "dtype": s % 15, "flags": (s * 5) % 32,
            "t_enqueue": t_enq, "state": state,
            "t_complete": np.where(state == fmt.State.ENQUEUED, 0, t_enq + 500 + s % 97)}


def check_against_gen(records: np.ndarray, exact_times: bool) -> None:
    """Every record is exactly one the child wrote: head as generated, tail entered or final."""
    if not len(records):
        return
    exp = gen_np(records["seq"])
    for name in HEAD_FIELDS[1:]:
        if name == "t_enqueue" and not exact_times:
            continue
        got = records[name].astype(np.int64)
        bad = np.flatnonzero(got != exp[name])
        assert not len(bad), f"field {name} of seq {records['seq'][bad[0]]}: {got[bad[0]]} != {exp[name][bad[0]]}"
    state = records["state"].astype(np.int64)
    t_enq = records["t_enqueue"].astype(np.int64)
    t_comp = records["t_complete"].astype(np.int64)
    entered = (state == fmt.State.ENQUEUED) & (t_comp == 0)
    if exact_times:
        final = (state == exp["state"]) & (t_comp == exp["t_complete"])
    else:  # one thread on the monotonic clock: times never go back
        assert (t_enq > 0).all() and (np.diff(t_enq) >= 0).all(), t_enq.tolist()
        final = (state == exp["state"]) & (state != fmt.State.ENQUEUED) & (t_comp >= t_enq)
    bad = np.flatnonzero(~(entered | final))
    assert not len(bad), f"tail of seq {records['seq'][bad[0]]}: state {state[bad[0]]} t {t_comp[bad[0]]}"


def check_contiguous(records: np.ndarray) -> None:
    seqs = records["seq"].astype(np.int64)
    assert (seqs > 0).all()
    gaps = np.flatnonzero(np.diff(seqs) != 1)
    assert not len(gaps), f"seqs not contiguous: ... {seqs[max(0, gaps[0] - 2):gaps[0] + 3].tolist()} ..."


def write_gen(w: RingWriter, kind: str, n_max: int | None = None, ready=None) -> None:
    """Write gen(1), gen(2), ... as fast as possible (forever when n_max is None)."""
    clock = Clock()
    if kind == "python":
        def begin(*a, _b=w.begin):
            return _b(*a, _now=clock)

        def complete(h, st, _c=w.complete):
            _c(h, st, _now=clock)

        def complete_now(h, _c=w.complete_now):
            _c(h, _now=clock)
    else:
        begin, complete, complete_now = w.begin, w.complete, w.complete_now
    pending: deque = deque()
    if ready is not None:
        ready.set()
    seq = 0
    while n_max is None or seq < n_max:
        seq += 1
        op, gid, gseq, nbytes, peer, dtype, flags, t_enq, state, t_comp = gen(seq)
        clock.t = t_enq
        handle = begin(op, gid, gseq, nbytes, peer, dtype, flags)
        if seq % 4 == 0:
            clock.t = t_comp
            complete_now(handle)
        else:
            pending.append((handle, state, t_comp))
        if len(pending) > COMPLETE_LAG:
            handle, state, t_comp = pending.popleft()
            if state != fmt.State.ENQUEUED:
                clock.t = t_comp
                complete(handle, state)
    for handle, state, t_comp in pending:  # a clean shutdown settles what is outstanding
        if state != fmt.State.ENQUEUED:
            clock.t = t_comp
            complete(handle, state)


def writer_child(directory: str, capacity: int, kind: str, ready) -> None:
    """Child process: a writer that never stops (the parent kills it)."""
    write_gen(make_writer(directory, capacity, kind), kind, None, ready)
