"""Unmodified programs under `sbatch --megatrace` on the lab, a rank stopped from outside.

The programs: a plain DDP script (tests/programs/) and the demo's torch-API engines. Nothing of
MegaTrace is in the script: the SPANK plugin traces it, the node agents notice that no rank makes
progress, confirm it across nodes within the hang timeout, collect, and the report names the stopped
rank. Without root (a developer machine) the lab fixture skips, unless CI is set.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from megatrace.trace.ring_reader import RingFormatError, read_ring
from helpers.outside import wait_for
from helpers.slurm_lab import PYTHON, job_info, submit

DDP = Path(__file__).with_name("programs") / "ddp_reduce_loop.py"
RING_BASE = Path("/dev/shm/megatrace")  # the lab's node-local ring base (slurm/megatrace-lib.sh LOCAL_DIR)
HANG_TIMEOUT_S = 30


def _warm_ring(job: str, node: str, rank: int, records: int = 60) -> Path | None:
    for ring in RING_BASE.glob(f"job-{job}.{node}/**/rank-{rank:05d}.ring"):
        try:
            if read_ring(ring).header.write_counter >= records:
                return ring
        except (OSError, ValueError, RingFormatError):  # a ring being created reads as no ring yet
            pass
    return None


# Each program as its srun task runs it (one task per node, rank 2 on n3): the plain DDP script, and the
# demo's torch-API engines (DDP buckets, FSDP2, DTensor TP x DP, pipelining PP x DP) as `python -m megatrace.demo`.
PROGRAMS = {
    "ddp-script": f"{DDP} --iterations 1000000 --seconds 900",
    "engine-ddp": "-m megatrace.demo --engine ddp --dp 4 --steps 100000",
    "engine-fsdp": "-m megatrace.demo --engine fsdp --dp 4 --steps 100000",
    "engine-tp": "-m megatrace.demo --engine tp --tp 2 --dp 2 --steps 100000",
    "engine-pipeline": "-m megatrace.demo --engine pipeline --pp 2 --dp 2 --steps 100000",
}


@pytest.mark.slow
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_the_agents_name_a_rank_stopped_from_outside(lab, tmp_path, program: str):
    script = f"""export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)) OMP_NUM_THREADS=1
srun -N4 -n4 bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID \\
    exec {PYTHON} {PROGRAMS[program]}'
"""
    job = submit(script, tmp_path, f"--megatrace=hang-timeout={HANG_TIMEOUT_S},on-hang=cancel", "-N4", "-n4",
                 "--time=10")
    ring = wait_for(lambda: _warm_ring(job, "n3", 2), timeout=180)
    assert ring is not None, f"rank 2's ring on n3 never filled; job {job_info(job)}"
    pid = read_ring(ring).header.pid
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.time()
    findings = wait_for(lambda: next((tmp_path / f"megatrace-{job}").glob("*/findings.json"), None), timeout=240)
    assert findings is not None, f"no report; job {job_info(job)}"
    elapsed = findings.stat().st_mtime - stopped_at
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    top = json.loads(findings.read_text())["findings"][0]
    assert top["kind"] == "compute-hang" and top["subject"]["rank"] == 2, top["verdict"]
    assert top["subject"]["host"] == "n3" and top["severity"] == "critical", top
    assert "stopped running" in top["verdict"]
    assert elapsed <= HANG_TIMEOUT_S + 60, elapsed
    assert wait_for(lambda: job_info(job).get("JobState") in ("CANCELLED", "FAILED", "COMPLETED"), timeout=120)
