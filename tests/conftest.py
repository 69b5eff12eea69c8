"""Fixtures shared by test modules: the local Slurm lab (4 virtual nodes on this host), and headless Chromium
(``browser``, from tests/helpers/browser.py). Shared helpers that are not fixtures: tests/helpers/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.browser import browser  # noqa: F401  (the fixture)
from helpers.slurm_lab import lab_unavailable

MEGATRACE = str(Path(sys.executable).parent / "megatrace")


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
    _use_lab_slurm()
    return status


def _use_lab_slurm() -> None:
    """A lab up on a Slurm under a prefix (lab up --slurm-source): its commands first on PATH, for every test."""
    from megatrace.lab import daemons
    from megatrace.lab.control import lab_slurm
    from megatrace.lab.paths import LabPaths
    from megatrace.lab.slurm_install import activate

    try:
        state = daemons.load_state(LabPaths.default())
    except (OSError, ValueError):  # (not this user's to read, or not JSON: no lab of ours)
        return
    if any(d.alive() for d in daemons.recorded(state)):
        activate(lab_slurm(state))


def pytest_configure(config: pytest.Config) -> None:
    _use_lab_slurm()



def pytest_unconfigure(config: pytest.Config) -> None:
    """One last line: what was skipped, and why (each reason says how to get those tests to run)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if not skipped:
        return
    reasons: dict[str, int] = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    detail = "; ".join(f"{n} because {why}" for why, n in sorted(reasons.items(), key=lambda x: -x[1]))
    reporter.write_line(f"megatrace: {len(skipped)} skipped: {detail}", yellow=True)
