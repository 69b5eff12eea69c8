"""The lines of a Megatrace NCCL-patch log (``rank_<R>.log``), in both formats the patch has written.

* newer: ``[save_count 3] [1755590104.253968145] [Rank 0] Fun AllReduce Data 25165824 stream 0x55919d27b4b0
  opCount 12`` with an optional trailing `` groupHash <int>``: each ``save_count`` is one dump of a ring
  of lines, and dumps overlap;
* older (the Infrawaves release): ``[1746686438.086068203] [Rank 0] Fun AllReduce Data 1 stream
  0x55f615683660``: no dump number, no opCount, no groupHash; the file is one list of calls. A call's
  place in its communicator is then its place on its stream; a run of send/recv on one stream with no
  other call in between is one NCCL group (``batch_isend_irecv``: one launch), as an opCount would say.

:func:`parse_log` returns each rank's unique calls in time order as tuples
``(wall ns, Fun, Data, stream, opCount, groupHash or None)``; errors name the file and line.
"""

from __future__ import annotations

import re
from pathlib import Path

from megatrace.files import read_input
from megatrace.load.importers.common import INT64_MAX, MAX_RANKS, Fields, ImportFormatError
from megatrace.load.importers.sniff import NCCL_LOG_RE
from megatrace.load.traceset import LoadProblem
from megatrace.trace.ring_format import Op

LINE_RE = re.compile(r"^\[save_count (\d+)\] \[(\d+)\.(\d{1,9})\] \[Rank (\d+)\] Fun (\w+) Data (\d+) "
                     r"stream (0x[0-9a-fA-F]+|\(nil\)|0) opCount (\d+)(?: groupHash (-?\d+))?\s*$")
OLD_LINE_RE = re.compile(r"^\[(\d+)\.(\d{1,9})\] \[Rank (\d+)\] Fun (\w+) Data (\d+) "
                         r"stream (0x[0-9a-fA-F]+|\(nil\)|0)\s*$")
FUNCS: dict[str, Op] = {"AllReduce": Op.ALL_REDUCE, "AllGather": Op.ALL_GATHER, "ReduceScatter": Op.REDUCE_SCATTER,
                        "Broadcast": Op.BROADCAST, "Reduce": Op.REDUCE, "Send": Op.SEND, "Recv": Op.RECV,
                        "AllToAll": Op.ALL_TO_ALL}
OP_SLOTS = 1 << 16  # calls per opCount kept apart in the sequence key (an NCCL group of more calls is unheard of)
EXPECTED = ("'[save_count N] [SEC.NSEC] [Rank R] Fun NAME Data N stream 0x.. opCount N [groupHash N]' or "
            "'[SEC.NSEC] [Rank R] Fun NAME Data N stream 0x..'")


def parse_log(path: Path, problems: list[LoadProblem],
              dumps: dict[int, list[int]] | None = None) -> tuple[int, list[tuple]]:
    """(rank, unique calls in time order) of one ``rank_<R>.log``; errors name the file and line. ``dumps``, when
    given, receives save_count -> [first, last] line time of each dump (the window it covers; one dump, 0, for
    the older format)."""
    m = NCCL_LOG_RE.match(path.name)
    rank = int(m.group(1)) if m else None
    seen: dict[tuple, int] = {}
    try:
        data = read_input(path)
    except OSError as exc:
        raise ImportFormatError(f"{path}: unreadable: {exc.strerror}") from None
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    last = len(lines) - 1 if lines and lines[-1] == "" else len(lines)
    hashes: set[bool] = set()
    formats: set[str] = set()
    for no, line in enumerate(lines[:last], start=1):
        if not line.strip():
            continue
        got = LINE_RE.match(line)
        old = OLD_LINE_RE.match(line) if got is None else None
        if got is None and old is None:
            if no == last and not data.endswith(b"\n"):
                problems.append(LoadProblem("warning", "nccl-log-torn", f"{path}, line {no}: last line cut off "
                                            f"(the patch was writing it); skipped", paths=(str(path),)))
                continue
            raise ImportFormatError(f"{path}, line {no}: not a Megatrace NCCL log line: {line[:120]!r} (expected "
                                    f"{EXPECTED})")
        if got is not None:
            save, sec, frac, line_rank, func, count, stream, op_count, ghash = got.groups()
        else:
            (sec, frac, line_rank, func, count, stream), save, op_count, ghash = old.groups(), "0", None, None
        formats.add("new" if got is not None else "old")
        if len(formats) > 1:
            raise ImportFormatError(f"{path}, line {no}: a line of the {'older' if old else 'newer'} log format "
                                    f"among lines of the other (logs of two builds mixed)")
        at = Fields(f"{path}, line {no}")  # each number, checked for the int64 column it goes into
        save = at.decimal("save_count", save, what="a dump number from 0 to 2**63-1")
        line_rank = at.decimal("Rank", line_rank, hi=MAX_RANKS - 1, what=f"a rank below {MAX_RANKS}")
        sec = at.decimal("time", sec, hi=INT64_MAX // 1_000_000_000 - 1, what="seconds since 1970, before 2262")
        count = at.decimal("Data", count, what="an element count from 0 to 2**63-1")
        if op_count is not None:
            op_count = at.decimal("opCount", op_count, hi=INT64_MAX // OP_SLOTS - 1, what="a launch count below 2**47")
        ghash = None if ghash is None else at.decimal("groupHash", ghash, -(1 << 63), (1 << 64) - 1)
        if rank is not None and line_rank != rank:
            raise ImportFormatError(f"{path}, line {no}: [Rank {line_rank}] in the file of rank {rank} (files of "
                                    f"different ranks mixed up?)")
        rank = line_rank if rank is None else rank
        if func not in FUNCS:
            raise ImportFormatError(f"{path}, line {no}: unknown function {func!r} (known: {', '.join(FUNCS)})")
        hashes.add(ghash is not None)
        t = sec * 1_000_000_000 + int(frac.ljust(9, "0"))
        key = (t, func, count, stream, op_count, ghash) if op_count is not None else (t, func, count, stream, no)
        seen.setdefault(key, no)  # the same call in several (overlapping) dumps
        if dumps is not None:
            span = dumps.setdefault(save, [t, t])
            span[0], span[1] = min(span[0], t), max(span[1], t)
    if len(hashes) > 1:
        raise ImportFormatError(f"{path}: some lines carry a groupHash and some do not (logs of two builds mixed)")
    if rank is None:
        raise ImportFormatError(f"{path}: no calls in it, and no rank in its name (expected rank_<R>.log)")
    calls = sorted(seen, key=lambda k: (k[0], seen[k]))
    return rank, (_stream_places(calls) if formats == {"old"} else calls)


def _stream_places(calls: list[tuple]) -> list[tuple]:
    """Calls of the older format (``(t, Fun, Data, stream, line)``) with an opCount: per stream, each collective
    its own, a run of send/recv on the stream with no other call of the rank in between one shared."""
    counter: dict[str, int] = {}
    out = []
    prev = None  # (stream, was a send/recv) of the rank's previous call
    for t, func, count, stream, _ in calls:
        p2p = func in ("Send", "Recv")
        if not (p2p and prev == (stream, True)):
            counter[stream] = counter.get(stream, -1) + 1
        out.append((t, func, count, stream, counter[stream], None))
        prev = (stream, p2p)
    return out
