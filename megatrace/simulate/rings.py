"""Ring files written straight from numpy columns: the real format, as the tracer would have left it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_reader import RECORD_DTYPE, head_checks, tail_checks

WALL0_NS = 1_700_000_000 * 10**9  # wall clock at the simulated job's time 0
MONO0_NS = 10**12  # monotonic clock at time 0


@dataclass(frozen=True)
class RingHead:
    """The header fields of one simulated rank."""

    rank: int
    world: int
    local_rank: int
    host: str
    pid: int
    job_id: str = "simulated"
    skew_ns: int = 0  # the host's wall-clock error: shifts the header's wall anchor
    closed: bool = False


def records(seq_start: int, op: np.ndarray, group_id: np.ndarray, group_seq: np.ndarray, nbytes: np.ndarray,
            peer: np.ndarray, t_enqueue: np.ndarray, t_complete: np.ndarray, state: np.ndarray,
            dtype: int = int(fmt.Dtype.BFLOAT16)) -> np.ndarray:
    """Records (``RECORD_DTYPE``) with both checksums; times are monotonic ns (0: no completion)."""
    n = len(op)
    rec = np.zeros(n, RECORD_DTYPE)
    rec["seq"] = np.arange(seq_start, seq_start + n)
    rec["op"], rec["group_id"], rec["group_seq"], rec["nbytes"] = op, group_id, group_seq, nbytes
    rec["peer"], rec["dtype"] = peer, dtype
    rec["t_enqueue"], rec["t_complete"], rec["state"] = t_enqueue, t_complete, state
    raw = rec.view(np.uint8).reshape(n, fmt.RECORD_SIZE)
    rec["head_check"] = head_checks(raw)
    rec["tail_check"] = tail_checks(raw.view("<u4"))
    return rec


def write_ring(path: Path, head: RingHead, recs: np.ndarray, capacity: int | None = None) -> None:
    """One ring file: the header, then ``recs`` in their slots (the newest ``capacity`` when it wrapped)."""
    n = len(recs)
    cap = capacity or 1 << max(4, (max(n, 1) - 1).bit_length())
    body = np.zeros(cap, RECORD_DTYPE)
    if n:
        keep = recs[-cap:]
        body[(keep["seq"] - 1) % cap] = keep
    static = fmt.HEADER_STATIC.pack(
        fmt.MAGIC, fmt.VERSION, fmt.HEADER_SIZE, fmt.RECORD_SIZE, cap, head.rank, head.local_rank, head.world,
        head.pid, WALL0_NS + head.skew_ns, MONO0_NS, 0, head.job_id.encode()[:64].ljust(64, b"\0"),
        b"0".ljust(32, b"\0"), head.host.encode()[:64].ljust(64, b"\0"), b"\0" * 28)
    header = bytearray(fmt.HEADER_SIZE)
    header[:len(static)] = static
    fmt.HEADER_CHECK.pack_into(header, fmt.HEADER_CHECK_OFFSET, fmt.header_check(static))
    fmt.WRITE_COUNTER.pack_into(header, fmt.WRITE_COUNTER_OFFSET, int(recs["seq"][-1]) if n else 0)
    state = fmt.WriterState.CLOSED if head.closed else fmt.WriterState.OPEN
    fmt.WRITER_STATE.pack_into(header, fmt.WRITER_STATE_OFFSET, int(state))
    with open(path, "wb") as fh:
        fh.write(header)
        fh.write(body.tobytes())


def write_meta(path: Path, head: RingHead, groups: list[dict]) -> None:
    """The rank's meta file: its process line, then one line per process group it is in."""
    lines = [{"kind": "process", "t_mono_ns": MONO0_NS, "rank": head.rank, "world_size": head.world,
              "local_rank": head.local_rank, "host": head.host, "pid": head.pid, "argv": ["megatrace-simulate"]}]
    lines += [{"kind": "group", "t_mono_ns": MONO0_NS, **g} for g in groups]
    path.write_text("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))
