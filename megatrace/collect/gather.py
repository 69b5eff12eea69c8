"""Two-level gather of node payloads to MPI rank 0 (mpi4py, imported lazily), robust to missing nodes.

The collector's MPI ranks (one per node) form groups of ``group_size``
consecutive ranks; the first rank of each group is its *leader*, and rank 0
leads group 0 and is the *root*. Every rank sends its compressed payload to its
leader; each leader sends one frame with its members' payloads to the root. At
4,096 nodes and groups of 64 the root hears from 64 leaders, not 4,096 ranks,
and each leader from 63 members.

Why point-to-point and not ``Gatherv``: a collective either completes for
everyone or never, so one dead or wedged node (the very situation a hang
collection runs in) would stall it, and it cannot say who is missing. Here the
receiving side probes (``Iprobe``) for each expected sender until a deadline,
then moves on and names whoever did not arrive; senders use non-blocking sends
with deadlines too. Every receipt is acknowledged, and no rank calls
``MPI_Finalize`` (which waits for dead peers): each leaves with ``os._exit``
once its messages are through or its deadline has passed.

Deadlines, from each rank's start, with ``timeout`` T: a leader stops waiting
for members at 0.5 T, the root stops waiting for leaders at 0.75 T, a sender
stops waiting for its acknowledgement at T.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatrace.collect.payload import PayloadError, pack_leader, unpack_leader

TAG_PAYLOAD = 7101
TAG_FRAME = 7102
TAG_ACK = 7103
TAG_DONE = 7104
DONE_FINALIZE, DONE_EXIT = b"\x02", b"\x03"  # the root's last word: finalize together, or just leave
DONE_WAIT_S = 900.0  # how long a task waits for the root to finish the bundle and the analysis
FINALIZE_ALARM_S = 30  # MPI_Finalize is a barrier: it never returns if a peer died; SIGALRM ends it
POLL_S = 0.002
DEFAULT_GROUP_SIZE = 32  # leaders = nodes / 32: 128 frames at the root for 4,096 nodes
DEFAULT_TIMEOUT_S = 60.0

# sink(info, payload): info has mpi_rank, status ("ok" or "missing") and, if missing, reason.
Sink = Callable[[dict[str, Any], "bytes | None"], None]


@dataclass
class GatherOutcome:
    rank: int
    size: int
    received: int = 0  # payloads that reached the root (root only)
    missing: int = 0  # ranks that did not (root only)
    arrived: list[int] = field(default_factory=list)  # MPI ranks whose payload reached the root (root only)


def members_of(leader: int, size: int, group_size: int) -> list[int]:
    return list(range(leader + 1, min(size, leader + group_size)))


def leaders(size: int, group_size: int) -> list[int]:
    return list(range(0, size, group_size))


def _wait(req: Any, deadline: float) -> bool:
    while True:
        if req.Test():
            return True
        if time.monotonic() >= deadline:
            try:
                req.Cancel()
            except Exception:
                pass
            return False
        time.sleep(POLL_S)


def _send(comm: Any, MPI: Any, data: bytes, dest: int, tag: int, deadline: float) -> bool:
    req = comm.Isend([data, MPI.BYTE], dest=dest, tag=tag)
    return _wait(req, deadline)


def _recv_from(comm: Any, MPI: Any, sources: list[int], tag: int, deadline: float,
               on_message: Callable[[int, bytes], None]) -> list[int]:
    """Receive one message from each of ``sources`` until ``deadline``; returns those that never sent."""
    pending = set(sources)
    status = MPI.Status()
    while pending:
        if comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
            src = status.Get_source()
            buf = bytearray(status.Get_count(MPI.BYTE))
            comm.Recv([buf, MPI.BYTE], source=src, tag=tag)
            if src in pending:
                pending.discard(src)
                on_message(src, bytes(buf))
            continue
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    return sorted(pending)


def _ack_all(comm: Any, MPI: Any, ranks: list[int], deadline: float) -> None:
    reqs = [comm.Isend([b"\x01", MPI.BYTE], dest=r, tag=TAG_ACK) for r in ranks]
    for req in reqs:
        _wait(req, deadline)


def _await_ack(comm: Any, MPI: Any, src: int, deadline: float) -> bool:
    buf = bytearray(1)
    return _wait(comm.Irecv([buf, MPI.BYTE], source=src, tag=TAG_ACK), deadline)


def gather(comm: Any, produce: Callable[[], bytes], sink: Sink | None, group_size: int = DEFAULT_GROUP_SIZE,
           timeout: float = DEFAULT_TIMEOUT_S, start: float | None = None) -> GatherOutcome:
    """Gather ``produce()`` of every rank of ``comm`` to rank 0, which passes each to ``sink``.

    ``produce`` is called once on every rank (a member's send waits for its leader meanwhile). On
    rank 0, ``sink`` is called for every rank, in arrival order: with its payload, or with ``None`` and
    a reason when it did not arrive by the deadline.
    """
    from mpi4py import MPI

    start = time.monotonic() if start is None else start
    rank, size = comm.Get_rank(), comm.Get_size()
    group_size = max(2, int(group_size))
    out = GatherOutcome(rank, size)
    leader = rank - rank % group_size
    t_members, t_leaders, t_end = start + 0.5 * timeout, start + 0.75 * timeout, start + timeout
    if rank != leader:
        payload = produce()
        if _send(comm, MPI, payload, leader, TAG_PAYLOAD, t_end):
            _await_ack(comm, MPI, leader, t_end)
        return out

    got: list[tuple[dict[str, Any], bytes | None]] = []
    members = members_of(leader, size, group_size)

    def take(src: int, data: bytes) -> None:
        if rank == 0:  # the root writes each payload as it arrives; a leader forwards its group's at once
            _deliver(sink, out, {"mpi_rank": src, "status": "ok"}, data)  # type: ignore[arg-type]
        else:
            got.append(({"mpi_rank": src, "status": "ok"}, data))

    take(rank, produce())

    late = _recv_from(comm, MPI, members, TAG_PAYLOAD, t_members, take)
    for r in late:
        got.append(({"mpi_rank": r, "status": "missing",
                     "reason": f"sent nothing to its group leader (MPI rank {leader}) within the deadline"}, None))
    _ack_all(comm, MPI, [r for r in members if r not in late], t_end)
    if rank != 0:
        if _send(comm, MPI, pack_leader(got), 0, TAG_FRAME, t_end):
            _await_ack(comm, MPI, 0, t_end)
        return out

    assert sink is not None
    for info, payload in got:  # the root's own group: only the members that did not arrive
        _deliver(sink, out, info, payload)
    got.clear()

    def take_frame(src: int, frame: bytes) -> None:
        try:
            entries = unpack_leader(frame)
        except PayloadError as exc:
            entries = [({"mpi_rank": r, "status": "missing", "reason": f"frame of leader {src} unreadable: {exc}"},
                        None) for r in [src] + members_of(src, size, group_size)]
        for info, payload in entries:
            _deliver(sink, out, info, payload)

    other = leaders(size, group_size)[1:]
    silent = _recv_from(comm, MPI, other, TAG_FRAME, t_leaders, take_frame)
    for lead in silent:
        for r in [lead] + members_of(lead, size, group_size):
            _deliver(sink, out, {"mpi_rank": r, "status": "missing",
                                 "reason": f"its group leader (MPI rank {lead}) sent nothing to the root "
                                           "within the deadline"}, None)
    _ack_all(comm, MPI, [lead for lead in other if lead not in silent], min(t_end, time.monotonic() + 5.0))
    return out


def _deliver(sink: Sink, out: GatherOutcome, info: dict[str, Any], payload: bytes | None) -> None:
    if payload is None:
        out.missing += 1
    else:
        out.received += 1
        out.arrived.append(int(info["mpi_rank"]))
    sink(info, payload)


def release(comm: Any, outcome: GatherOutcome, done_wait: float = DONE_WAIT_S) -> bool:
    """End the MPI part once the root has written the bundle; True when ``MPI_Finalize`` ran.

    The root tells every task that reported that it is done; the others wait for that word,
    sleeping between polls (a task spinning in a Finalize barrier would take a core from the root's
    analysis). Then all finalize together under an alarm: MPICH's launcher treats a task that exits
    without MPI_Finalize as failed and kills the rest, but Finalize never returns when a peer died,
    so a task that knows of a dead peer, or never hears from the root, skips it (returns False) and
    the caller leaves with ``os._exit``; the root's word tells every task which way to go.
    """
    import signal

    from mpi4py import MPI

    rank = comm.Get_rank()
    if rank == 0:
        # The word says whether to finalize: not when a task is missing (Finalize would wait for it forever).
        word = DONE_EXIT if outcome.missing else DONE_FINALIZE
        # Also to the ranks that missed the deadline: a slow one (not a dead one) then leaves at once.
        reqs = []
        for r in range(1, comm.Get_size()):
            try:
                reqs.append(comm.Isend([word, MPI.BYTE], dest=r, tag=TAG_DONE))
            except Exception:  # a dead peer's connection: nothing to tell it
                pass
        end = time.monotonic() + 5.0
        for req in reqs:
            try:
                _wait(req, end)
            except Exception:
                pass
        if outcome.missing:
            return False
    else:
        buf = bytearray(1)
        if not _wait(comm.Irecv([buf, MPI.BYTE], source=0, tag=TAG_DONE), time.monotonic() + done_wait):
            return False
        if bytes(buf) != DONE_FINALIZE:
            return False
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # MPI_Finalize holds the GIL: only the default action works
    signal.alarm(FINALIZE_ALARM_S)
    MPI.Finalize()
    signal.alarm(0)
    return True
