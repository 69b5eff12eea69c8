"""Two-level gather of node streams to MPI rank 0 (mpi4py, imported lazily), robust to missing nodes.

The collector's MPI ranks (one per node) form groups of ``group_size``
consecutive ranks; the first rank of each group is its *leader*, and rank 0
leads group 0 and is the *root*. First the root's word (``announce``: where the
bundle is) goes down the tree, root to leaders to members. Then every rank sends
its stream of messages (:mod:`megatrace.collect.payload`: a header, then chunks)
to its leader, and each leader relays every message to the root as it comes: no
process holds more than one message of another, whatever the node count and the
ring size. At 4,096 nodes and groups of 32 the root hears from 128 leaders, not
4,096 ranks.

Why point-to-point and not ``Gatherv``: a collective either completes for
everyone or never, so one dead or wedged node (the very situation a hang
collection runs in) would stall it, and it cannot say who is missing. Here the
receiving side probes (``Iprobe``) for each expected sender until a deadline,
then moves on and names whoever did not finish; senders use non-blocking sends
with deadlines too. Every finished stream is acknowledged, and no rank calls
``MPI_Finalize`` (which waits for dead peers): each leaves with ``os._exit``
once its messages are through or its deadline has passed.

Deadlines, from each rank's start, with ``timeout`` T: a rank that has not heard
the root's word by 0.25 T goes on without it, a leader stops waiting for members
at 0.5 T, the root stops waiting for leaders at 0.75 T, a sender stops waiting
for its acknowledgement at T.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

TAG_PAYLOAD = 7101  # member -> leader
TAG_FRAME = 7102  # leader -> root
TAG_ACK = 7103
TAG_DONE = 7104
TAG_HELLO = 7105  # root -> leader -> member: the root's word
DONE_FINALIZE, DONE_EXIT = b"\x02", b"\x03"  # the root's last word: finalize together, or just leave
DONE_WAIT_S = 900.0  # how long a task waits for the root to finish the bundle and the analysis
FINALIZE_ALARM_S = 30  # MPI_Finalize is a barrier: it never returns if a peer died; SIGALRM ends it
POLL_S = 0.002
DEFAULT_GROUP_SIZE = 32  # leaders = nodes / 32: 128 leaders at the root for 4,096 nodes
DEFAULT_TIMEOUT_S = 60.0
# Every message travels in an envelope: what it is, and whose stream it belongs to.
_ENVELOPE = struct.Struct("<BI")
MESSAGE, END, MISSING, LEADER_DONE = 1, 2, 3, 4


class Receiver(Protocol):
    """The root's side: every rank's messages in its order, then its end, or why it is missing."""

    def message(self, rank: int, data: bytes) -> None: ...

    def end(self, rank: int) -> None: ...

    def missing(self, rank: int, reason: str) -> None: ...


@dataclass
class GatherOutcome:
    rank: int
    size: int
    received: int = 0  # streams that reached the root whole (root only)
    missing: int = 0  # ranks whose stream did not (root only)
    arrived: list[int] = field(default_factory=list)  # MPI ranks whose stream reached the root (root only)
    bytes_received: int = 0  # message bytes through the root (root only)
    largest_message: int = 0  # bytes of the largest message the root received


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


def _receive(comm: Any, MPI: Any, status: Any, source: int, tag: int) -> tuple[int, bytes] | None:
    """One waiting message of ``tag`` (from ``source``, or any), without blocking: (sender, bytes)."""
    if not comm.Iprobe(source=source, tag=tag, status=status):
        return None
    src = status.Get_source()
    buf = bytearray(status.Get_count(MPI.BYTE))
    comm.Recv([buf, MPI.BYTE], source=src, tag=tag)
    return src, bytes(buf)


def _receive_by(comm: Any, MPI: Any, source: int, tag: int, deadline: float) -> bytes | None:
    status = MPI.Status()
    while True:
        got = _receive(comm, MPI, status, source, tag)
        if got is not None:
            return got[1]
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


def _ack_all(comm: Any, MPI: Any, ranks: list[int], deadline: float) -> None:
    reqs = [comm.Isend([b"\x01", MPI.BYTE], dest=r, tag=TAG_ACK) for r in ranks]
    for req in reqs:
        _wait(req, deadline)


def _await_ack(comm: Any, MPI: Any, src: int, deadline: float) -> bool:
    buf = bytearray(1)
    return _wait(comm.Irecv([buf, MPI.BYTE], source=src, tag=TAG_ACK), deadline)


def _envelope(kind: int, rank: int, body: bytes = b"") -> bytes:
    return _ENVELOPE.pack(kind, rank) + body


def _open(data: bytes) -> tuple[int, int, bytes] | None:
    if len(data) < _ENVELOPE.size:
        return None
    kind, rank = _ENVELOPE.unpack_from(data)
    return kind, rank, data[_ENVELOPE.size:]


def _own_stream(produce: Callable[[bytes | None], Iterable[bytes]], word: bytes | None, rank: int,
                send: Callable[[bytes], bool]) -> bool:
    """Send this rank's messages, each in its envelope, with ``send``, then its end; False once a send failed."""
    try:
        for msg in produce(word):
            if not send(_envelope(MESSAGE, rank, msg)):
                return False
    except Exception:  # a producer that fails mid-stream ends it: the root names what is incomplete
        pass
    return send(_envelope(END, rank))


def gather(comm: Any, produce: Callable[[bytes | None], Iterable[bytes]], receiver: Receiver | None,
           group_size: int = DEFAULT_GROUP_SIZE, timeout: float = DEFAULT_TIMEOUT_S, start: float | None = None,
           announce: bytes | None = None) -> GatherOutcome:
    """Bring every rank's ``produce(word)`` messages to rank 0, which hands them to ``receiver``.

    ``word`` is rank 0's ``announce``, or None on a rank it did not reach in time. ``produce`` is
    called once on every rank. On rank 0, ``receiver`` hears each rank's messages in order, then
    ``end``, or ``missing`` with a reason when its stream did not finish by the deadline.
    """
    from mpi4py import MPI

    start = time.monotonic() if start is None else start
    rank, size = comm.Get_rank(), comm.Get_size()
    group_size = max(2, int(group_size))
    out = GatherOutcome(rank, size)
    leader = rank - rank % group_size
    t_word, t_members = start + 0.25 * timeout, start + 0.5 * timeout
    t_leaders, t_end = start + 0.75 * timeout, start + timeout
    if rank != leader:
        word = _receive_by(comm, MPI, leader, TAG_HELLO, t_word)
        if _own_stream(produce, word, rank, lambda env: _send(comm, MPI, env, leader, TAG_PAYLOAD, t_end)):
            _await_ack(comm, MPI, leader, t_end)
        return out

    word = announce if rank == 0 else _receive_by(comm, MPI, 0, TAG_HELLO, t_word)
    members = members_of(leader, size, group_size)
    down = members + (leaders(size, group_size)[1:] if rank == 0 else [])  # the word goes on down the tree
    word_reqs = [comm.Isend([word, MPI.BYTE], dest=r, tag=TAG_HELLO) for r in down] if word is not None else []
    if rank == 0:
        assert receiver is not None
        relay = _Root(out, receiver, size, group_size)

        def deliver(env: bytes) -> bool:
            relay.take(*_open(env))  # type: ignore[misc]  (an envelope made or checked here)
            return True
    else:
        def deliver(env: bytes) -> bool:  # a leader forwards each envelope as it came: it names its rank
            return _send(comm, MPI, env, 0, TAG_FRAME, t_end)

    if not _own_stream(produce, word, rank, deliver):
        return out  # the root is gone or silent: nobody to relay to
    ended = _relay_members(comm, MPI, members, leader, deliver, t_members,
                           relay if rank == 0 else None, t_leaders)
    if ended is None:
        return out
    _ack_all(comm, MPI, ended, t_end)
    for req in word_reqs:
        _wait(req, min(t_end, time.monotonic() + 1.0))
    if rank != 0:
        if _send(comm, MPI, _envelope(LEADER_DONE, rank), 0, TAG_FRAME, t_end):
            _await_ack(comm, MPI, 0, t_end)
        return out
    _ack_all(comm, MPI, relay.done_leaders, min(t_end, time.monotonic() + 5.0))
    return out


class _Root:
    """The root's bookkeeping of the other groups: whose stream ended or went missing, which leader is done."""

    def __init__(self, out: GatherOutcome, receiver: Receiver, size: int, group_size: int) -> None:
        self.out, self.receiver, self.size, self.group_size = out, receiver, size, group_size
        self.closed: set[int] = set()  # ranks whose stream ended, or that were named missing
        self.started: set[int] = set()
        self.pending = set(leaders(size, group_size)[1:])
        self.done_leaders: list[int] = []

    def take(self, kind: int, src: int, body: bytes) -> None:
        if src in self.closed:
            return
        if kind == MESSAGE:
            self.started.add(src)
            self.out.bytes_received += len(body)
            self.out.largest_message = max(self.out.largest_message, len(body))
            self.receiver.message(src, body)
        elif kind == END:
            self.closed.add(src)
            self.out.received += 1
            self.out.arrived.append(src)
            self.receiver.end(src)
        elif kind == MISSING:
            self.closed.add(src)
            self.out.missing += 1
            self.receiver.missing(src, body.decode("utf-8", "replace"))

    def frame(self, lead: int, data: bytes) -> None:
        """A message a leader relayed (its own stream's, a member's, or its last word)."""
        opened = _open(data)
        if opened is None or lead not in self.pending:
            return
        kind, src, body = opened
        if kind == LEADER_DONE:
            self.pending.discard(lead)
            self.done_leaders.append(lead)
            self._give_up(lead, "its group leader (MPI rank {lead}) said it was done without it")
        elif src == lead or src in members_of(lead, self.size, self.group_size):
            self.take(kind, src, body)

    def _give_up(self, lead: int, why: str) -> None:
        for r in [lead] + members_of(lead, self.size, self.group_size):
            if r not in self.closed:
                state = "stopped part-way" if r in self.started else "sent nothing"
                self.take(MISSING, r, f"{state}: {why.format(lead=lead)}".encode())

    def deadline(self) -> None:
        for lead in sorted(self.pending):
            self._give_up(lead, "its group leader (MPI rank {lead}) did not relay it to the root within the "
                                "deadline")
        self.pending.clear()


def _relay_members(comm: Any, MPI: Any, members: list[int], leader: int, deliver: Callable[[bytes], bool],
                   t_members: float, root: _Root | None, t_leaders: float) -> list[int] | None:
    """Relay each member's messages with ``deliver`` as they come, until every member's stream ended or the
    deadline; on the root, take the other leaders' messages in the same loop. Returns the members whose
    stream ended, or None once a relay to the root failed."""
    pending, started, ended = set(members), set(), []
    status = MPI.Status()
    while pending or (root is not None and root.pending):
        busy = False
        if pending and (got := _receive(comm, MPI, status, MPI.ANY_SOURCE, TAG_PAYLOAD)) is not None:
            busy = True
            src, data = got
            opened = _open(data)
            if opened is not None and src in pending and opened[1] == src and opened[0] in (MESSAGE, END):
                started.add(src)
                if not deliver(data):
                    return None
                if opened[0] == END:
                    pending.discard(src)
                    ended.append(src)
        if root is not None and root.pending and (got := _receive(comm, MPI, status, MPI.ANY_SOURCE,
                                                                  TAG_FRAME)) is not None:
            busy = True
            root.frame(*got)
        if busy:
            continue
        now = time.monotonic()
        if pending and now >= t_members:
            for r in sorted(pending):
                state = (f"its stream stopped part-way (relayed by its group leader, MPI rank {leader})"
                         if r in started else f"sent nothing to its group leader (MPI rank {leader})")
                if not deliver(_envelope(MISSING, r, f"{state} within the deadline".encode())):
                    return None
            pending.clear()
        if root is not None and root.pending and now >= t_leaders:
            root.deadline()
        time.sleep(POLL_S)
    return ended


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
