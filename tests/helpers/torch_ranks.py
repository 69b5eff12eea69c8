"""Ranks of tests/torch_scenarios.py as separate processes on real gloo groups, traced, and what they wrote:
:func:`launch`, :func:`finish`, :func:`records` (a rank's ring), :func:`groups` (its group meta lines).
Used by tests/test_torch_hook.py and tests/test_dispatch_hook.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.torchrun_job import free_port

from megatrace.trace.ring_reader import read_meta, read_ring

SCENARIOS = Path(__file__).resolve().parent.parent / "torch_scenarios.py"  # the rank programs


def launch(scenario: str, tmp_path: Path, world: int = 2, **env_extra: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MEGATRACE_ENABLE="1",
                   MEGATRACE_DIR=str(tmp_path / "rings"), MEGATRACE_JOB_ID="test-job",
                   SCENARIO_OUT=str(tmp_path), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env.update(env_extra)
        procs.append(subprocess.Popen([sys.executable, str(SCENARIOS), scenario], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[str]:
    errs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"rank exited {p.returncode}:\n{err[-3000:]}"
        errs.append(err)
    return errs


def records(tmp_path: Path, rank: int) -> list[dict]:
    snap = read_ring(tmp_path / "rings" / f"rank-{rank:05d}.ring")
    assert not [p for p in snap.problems if p.severity == "error"], snap.problems
    return snap.to_dicts()


def groups(tmp_path: Path, rank: int) -> dict[int, dict]:
    entries, problems = read_meta(tmp_path / "rings" / f"rank-{rank:05d}.meta.jsonl")
    assert not problems
    return {e["gid"]: e for e in entries if e["kind"] == "group"}
