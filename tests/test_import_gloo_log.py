"""Job output logs of real gloo jobs under torchrun, faults from outside: no watchdog positions in them, only the
ranks' failed collectives (gloo's "Timed out waiting ...", "Connection reset by peer") and torchrun's failure
summary. ``megatrace analyze LOG`` must name the rank the others failed waiting for (the one that printed
nothing), and a killed or crashed rank as the crash, where torchrun's own "Root Cause" names merely the first
rank to exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

WORLD = 4
PROGRAM = """
import datetime, os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=6))
rank = dist.get_rank()
t = torch.ones(1000)
for i in range(100000):
    dist.all_reduce(t)
    if i == 20:
        open(os.path.join(sys.argv[1], f"rank-{rank}"), "w").write(str(os.getpid()))
    if i == 60 and str(rank) == os.environ.get("CRASH_RANK"):
        raise ValueError("bad batch")  # the rank's own error
    time.sleep(0.01)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(tmp_path: Path, fault, crash_rank: str = "") -> Path:
    """Run the program under torchrun (its output in one file, as Slurm writes it); ``fault(pids)`` from outside."""
    (tmp_path / "train.py").write_text(PROGRAM)
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    log = tmp_path / "slurm-77.out"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                                 "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                                 str(tmp_path / "train.py"), str(pids_dir)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, CRASH_RANK=crash_rank, OMP_NUM_THREADS="1"))
        try:
            deadline = time.monotonic() + 120
            while len(list(pids_dir.iterdir())) < WORLD and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            fault({int(p.name.split("-")[1]): int(p.read_text()) for p in pids_dir.iterdir()})
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return log


def test_the_rank_the_others_failed_waiting_for_is_named(tmp_path: Path) -> None:
    def stop_rank_1(pids: dict[int, int]) -> None:
        os.kill(pids[1], signal.SIGSTOP)
        time.sleep(12)  # gloo's 6 s timeout fires on the others
        os.kill(pids[1], signal.SIGCONT)  # (so torchrun's SIGTERM can end it)

    log = _job(tmp_path, stop_rank_1)
    assert "Timed out waiting" in log.read_text()
    top = analyze(log).findings[0]
    assert top.subject.rank == 1 and top.severity == Severity.CRITICAL, top.verdict
    assert top.kind == Kind.NO_TRACE and "3 ranks wait for it" in top.verdict, top.verdict
    assert "printed nothing" in top.remediation


def test_a_rank_killed_from_outside_is_the_crash(tmp_path: Path) -> None:
    log = _job(tmp_path, lambda pids: os.kill(pids[2], signal.SIGKILL))
    top = analyze(log).findings[0]
    assert top.kind == Kind.CRASHED_PROCESS and top.subject.rank == 2, top.verdict
    assert any("SIGKILL" in str(e) for e in top.evidence), top.evidence


def test_a_rank_that_raised_its_own_error_is_the_crash(tmp_path: Path) -> None:
    log = _job(tmp_path, lambda pids: None, crash_rank="3")
    top = analyze(log).findings[0]
    assert top.kind == Kind.CRASHED_PROCESS and top.subject.rank == 3, top.verdict
    assert any("bad batch" in str(e) for e in top.evidence), top.evidence
