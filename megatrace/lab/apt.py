"""Debian packages for the lab: install what is missing (apt-get), showing a helper's output only when it fails."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from megatrace.lab import LabError

Log = Callable[[str], None]


def run_quiet(argv: list[str], what: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    """Run a helper; its output is shown only when it fails."""
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise LabError(f"{what} failed (exit {proc.returncode}): {' '.join(argv)}\n{tail}")


def apt_install(missing: list[str], log: Log) -> None:
    if not missing:
        return
    if not shutil.which("apt-get"):
        raise LabError(f"missing {', '.join(missing)} and no apt-get: install them with your package manager")
    log(f"lab: apt-get install {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run_quiet(["apt-get", "update", "-qq"], "apt-get update", env=env)
    run_quiet(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], "apt-get install", env=env)
