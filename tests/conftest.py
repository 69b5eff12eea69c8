"""Fixtures shared by test modules: the local Slurm lab (4 virtual nodes on this host)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MEGATRACE = str(Path(sys.executable).parent / "megatrace")


def lab_unavailable(why: str) -> None:
    """Skip on a developer machine that cannot run the lab; under CI the lab is required: fail."""
    if os.environ.get("CI"):
        pytest.fail(f"the Slurm lab is required under CI: {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def lab() -> dict:
    """``megatrace lab up --nodes 4`` (idempotent: a lab that is up is used as it is); its status."""
    if os.geteuid() != 0:
        lab_unavailable("the lab runs Slurm daemons: run the tests as root")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        lab_unavailable("neither Slurm nor apt-get on this machine")
    proc = subprocess.run([MEGATRACE, "lab", "up", "--nodes", "4"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"lab up failed:\n{proc.stdout}\n{proc.stderr}"
    out = subprocess.run([MEGATRACE, "lab", "status", "--json"], capture_output=True, text=True, timeout=60).stdout
    status = json.loads(out)
    assert status["up"] and len(status["nodes"]) == 4, status
    return status
