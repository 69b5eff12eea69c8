"""Job output logs of the lab demo under real Slurm (``megatrace lab up``; 4 nodes, 8 ranks, TP2·PP2·DP2 over gloo,
``srun --kill-on-bad-exit=1``): what ``slurm-<id>.out`` holds when a rank crashes or hangs. Recorded with the
scripts of tests/test_slurm_lab.py (``_demo_job``, ``--comm-timeout 20``), file paths rewritten.

srun reports a task's exit after the tracebacks the others printed when its connection closed (its lines lag
the ranks' own), then says it ends the step and reports every other task ``Terminated``: the crash must be
told from the tasks Slurm ended after it, and the silent rank the others failed waiting for from them too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity

DATA = Path(__file__).resolve().parent / "data" / "real"


@pytest.mark.parametrize("name, rank, kind, said", [
    ("lab-demo-crash-rank2.slurm-145.out", 2, Kind.CRASHED_PROCESS, "task 2 on n2: exit code 1"),
    ("lab-demo-hang-rank5.slurm-146.out", 5, Kind.NO_TRACE, "task 5 on n3: terminated (Slurm ending the step)"),
    ("lab-demo-commhang-rank3.slurm-147.out", 3, Kind.NO_TRACE, "task 3 on n2: terminated (Slurm ending the step)"),
])
def test_the_culprit_is_named_first(tmp_path: Path, name: str, rank: int, kind: Kind, said: str) -> None:
    result = analyze(DATA / name, out_dir=tmp_path)
    top = result.findings[0]
    assert (top.severity, top.kind, top.subject.rank) == (Severity.CRITICAL, kind, rank), top.verdict
    assert said in " ".join(map(str, top.evidence)), top.evidence
    others = [f for f in result.findings[1:] if f.severity == Severity.CRITICAL]
    assert not others, [f.verdict for f in others]  # the tasks Slurm ended afterwards are no second culprit


def test_the_tasks_slurm_ended_after_the_crash_were_ended_by_it(tmp_path: Path) -> None:
    procs = analyze(DATA / "lab-demo-crash-rank2.slurm-145.out", out_dir=tmp_path).trace.facts.procs
    assert procs[2].crashed and procs[2].exit_code == 1
    assert all(procs[r].killed_by_launcher and not procs[r].crashed for r in (1, 4, 5, 7)), procs
    # ranks 0, 3 and 6 printed their own failed collective: their end is that failure's, not a cause
    assert not any(procs[r].crashed for r in (0, 3, 6) if r in procs), procs
