"""How long a stop must last to be a hang in NCCL-patch logs, which hold enqueue times only.

Such a log ends at its last enqueue, when the ranks that wait had all blocked, so the stop it shows is a
lower bound of the hang's length. Hand-written logs: four ranks in two TP groups, calls every 10 ms, rank 3
stopping; the last calls of the others come 15 ms after its stop (1.5 times its usual gap).
"""

from __future__ import annotations

from pathlib import Path

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity

PERIOD_NS = 10_000_000
T0_NS = 1_796_000_000 * 10**9


def _write(out: Path, waiting: tuple[int, ...], world_last: bool = True, steps: int = 30) -> None:
    """Every rank calls a world all-reduce and its TP group's all-reduce each step; rank 3 stops before the last
    step, ``waiting`` ranks enter its calls (15 ms after rank 3's stop; the world's only if ``world_last``), the
    others stop with rank 3."""
    out.mkdir()
    tp = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    for rank in range(4):
        lines = []
        for step in range(steps + 1):
            if step == steps and rank not in waiting:
                break
            base = T0_NS + step * PERIOD_NS + (5_000_000 if step == steps else 0)
            for k, (members, jitter) in enumerate((((0, 1, 2, 3), 0), (tp[rank], 1_000_000))):
                if step == steps and k == 0 and not world_last:
                    continue
                t = base + jitter + 50_000 * rank
                ghash = 1000 + sum(1 << m for m in members)
                lines.append(f"[save_count 1] [{t // 10**9}.{t % 10**9:09d}] [Rank {rank}] Fun AllReduce "
                             f"Data {256 * (k + 1)} stream 0x{0x5000 + 0x100 * rank + k:x} opCount {step} "
                             f"groupHash {ghash}")
        (out / f"rank_{rank}.log").write_text("\n".join(lines) + "\n")
    (out / "config.yaml").write_text("TP: 2\nPP: 1\nworld_size: 4\n")


def test_a_stop_the_whole_job_waits_for_is_a_hang_at_once(tmp_path: Path) -> None:
    _write(tmp_path / "logs", waiting=(0, 1, 2))
    top = analyze(tmp_path / "logs").findings[0]
    assert top.kind == Kind.COMPUTE_HANG and top.subject.rank == 3, top.verdict
    assert top.severity == Severity.CRITICAL, top.verdict
    assert "3 ranks wait for it" in top.verdict, top.verdict


def test_a_stop_only_part_of_the_job_waits_for_stays_a_possible_hang(tmp_path: Path) -> None:
    # ranks 0 and 1 were cut before their next call (a snapshot); rank 2 waits for rank 3 in their TP group
    _write(tmp_path / "logs", waiting=(2,), world_last=False)
    top = analyze(tmp_path / "logs").findings[0]
    assert top.kind == Kind.COMPUTE_HANG and top.subject.rank == 3, top.verdict
    assert top.severity == Severity.WARNING and top.verdict.startswith("possible hang"), top.verdict
