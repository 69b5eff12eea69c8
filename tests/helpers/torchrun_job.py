"""A real torch.distributed program over gloo under torchrun, its output in one file as Slurm writes it, with a
fault from outside: shared by the job-log tests (tests/test_import_gloo_log.py, tests/test_job_log_merge.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

from helpers.outside import wait_for

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
    if i == 60 and os.environ.get("OTHERS_COMPUTE"):
        time.sleep(30)  # the others in a long step of their own when it crashes: no collective of theirs fails
    time.sleep(0.01)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_job(tmp_path: Path, fault: Callable[[dict[int, int]], None], crash_rank: str = "",
                 env: dict[str, str] | None = None) -> Path:
    """Run the program under torchrun (its output in one file, as Slurm writes it); ``fault(pids)`` from outside."""
    (tmp_path / "train.py").write_text(PROGRAM)
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    log = tmp_path / "slurm-77.out"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                                 "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                                 str(tmp_path / "train.py"), str(pids_dir)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, CRASH_RANK=crash_rank, OMP_NUM_THREADS="1", **(env or {})))
        try:
            # every rank past its 20th all-reduce (it wrote its pid), or the job ended early
            wait_for(lambda: len(list(pids_dir.iterdir())) >= WORLD or proc.poll() is not None, 120, step=0.2)
            fault({int(p.name.split("-")[1]): int(p.read_text()) for p in pids_dir.iterdir()})
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return log
