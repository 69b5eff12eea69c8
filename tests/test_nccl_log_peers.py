"""Pipeline peers inferred from NCCL-patch logs that name none: hand-written logs, one case per rule."""

from __future__ import annotations

from pathlib import Path

from megatrace.load import load_trace
from megatrace.trace.ring_format import Op

MS = 1_000_000
T0_NS = 1_796_000_000 * 10**9


def _write(out: Path, calls: dict[int, list[tuple[float, str, int]]]) -> None:
    """``calls``: rank -> (ms, function, opCount); p2p on the pipeline communicator, AllReduce on the world's."""
    out.mkdir()
    for rank, mine in calls.items():
        lines = []
        for ms, fun, op_count in mine:
            t = T0_NS + int(ms * MS)
            stream, ghash = ("0x5000", 7) if fun in ("Send", "Recv") else ("0x6000", 9)
            lines.append(f"[save_count 1] [{t // 10**9}.{t % 10**9:09d}] [Rank {rank}] Fun {fun} Data 512 "
                         f"stream {stream}{rank} opCount {op_count} groupHash {ghash}")
        (out / f"rank_{rank}.log").write_text("\n".join(lines) + "\n")
    (out / "config.yaml").write_text("TP: 1\nPP: 3\nworld_size: 3\n")


def _peers(trace, rank: int) -> list[tuple[str, int]]:
    rec = trace.records
    rows = trace.rows(rank)
    return [(Op(int(rec.op[i])).name, int(rec.peer[i])) for i in range(rows.start, rows.stop)
            if rec.op[i] in (Op.SEND, Op.RECV)]


def test_a_receive_posted_after_two_neighbours_sends_takes_the_one_its_batch_exchanges_with(tmp_path: Path) -> None:
    """Stage 1 posts one batch [recv, send] after both neighbours sent (equally good on timing alone); its send
    can only go to stage 2, so the receive is stage 2's send too (a 1F1B step exchanges with one neighbour),
    not stage 0's, whose send stays without a partner (stage 1 never posted it: what a hang leaves)."""
    _write(tmp_path / "logs", {
        0: [(1.0, "AllReduce", 0), (8.1, "Send", 0), (40.0, "AllReduce", 1)],
        1: [(1.0, "AllReduce", 0), (10.0, "Recv", 0), (10.2, "Send", 0), (20.0, "AllReduce", 1)],
        2: [(1.0, "AllReduce", 0), (9.0, "Recv", 0), (9.1, "Send", 0), (20.0, "AllReduce", 1)],
    })
    trace = load_trace(tmp_path / "logs")
    assert _peers(trace, 1) == [("RECV", 2), ("SEND", 2)]
    assert _peers(trace, 2) == [("RECV", 1), ("SEND", 1)]
    assert _peers(trace, 0) == [("SEND", 1)]
