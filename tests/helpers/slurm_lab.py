"""The local Slurm lab (``megatrace lab up``: 4 virtual nodes on this host): skipping where it cannot run, and
submitting jobs to it. Used by tests/conftest.py (the ``lab`` fixture), tests/test_slurm_lab.py,
tests/test_lab_programs.py and tests/test_nccl_lab.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PYTHON = sys.executable


def lab_unavailable(why: str) -> None:
    """Skip on a developer machine that cannot run the lab; under CI the lab is required: fail."""
    if os.environ.get("CI"):
        pytest.fail(f"the Slurm lab is required under CI: {why}")
    pytest.skip(why)


def run(argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def clean_env(**extra: str) -> dict[str, str]:
    """The submitting environment without any MEGATRACE*/SLURM* variable of the test process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRACE", "SLURM_", "SPANK_"))}
    env.update(extra)
    return env


def sbatch(script: str, cwd: Path, *args: str, env: dict[str, str] | None = None,
           user: str | None = None) -> subprocess.CompletedProcess:
    path = cwd / "job.sh"
    path.write_text("#!/bin/bash\n" + script)
    path.chmod(0o755)
    argv = ["sbatch", "--parsable", "-o", str(cwd / "out-%j.txt"), *args, str(path)]
    if user:
        argv = ["runuser", "-u", user, "--", *argv]
    return run(argv, cwd=cwd, env=env or clean_env())


def submit(script: str, cwd: Path, *args: str, **kw) -> str:
    proc = sbatch(script, cwd, *args, **kw)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_info(job_id: str) -> dict[str, str]:
    out = run(["scontrol", "show", "job", "-o", job_id]).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)
