"""Which Slurm the lab runs: a prefix is checked before anything starts, a tarball is recognised by its top
directory, and the chosen release's commands come first on PATH. (The build itself and the lab on it run in
`make test-slurm-release`, which CI runs on Slurm 26.05.3.)"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from megatrace.lab import LabError
from megatrace.lab.slurm_install import SlurmInstall, _tarball_version, activate, from_prefix

MEGATRACE = str(Path(sys.executable).parent / "megatrace")


def _tarball(path: Path, top: str) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(f"{top}/configure")
        data = b"#!/bin/sh\n"
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def test_a_prefix_without_slurm_is_refused_naming_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "sbin").mkdir()
    (tmp_path / "sbin" / "slurmctld").write_text("")
    with pytest.raises(LabError) as err:
        from_prefix(tmp_path)
    assert "not a Slurm installation" in str(err.value) and "sbin/slurmd" in str(err.value)
    assert "sbin/slurmctld" not in str(err.value)


def test_the_release_is_read_from_the_tarballs_top_directory(tmp_path: Path) -> None:
    assert _tarball_version(_tarball(tmp_path / "a.tar.gz", "slurm-26.05.3")) == "26.05.3"
    with pytest.raises(LabError, match="not a Slurm source tarball"):
        _tarball_version(_tarball(tmp_path / "b.tar.gz", "munge-0.5.15"))
    (tmp_path / "c.tar.gz").write_bytes(b"not a tarball")
    with pytest.raises(LabError, match="not a readable tarball"):
        _tarball_version(tmp_path / "c.tar.gz")


def test_the_labs_release_comes_first_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/opt/s/bin:/bin")
    activate(SlurmInstall(Path("/opt/s")))
    assert os.environ["PATH"] == "/opt/s/bin:/opt/s/sbin:/usr/bin:/bin"
    activate(SlurmInstall())  # Debian's: PATH as it is
    assert os.environ["PATH"] == "/opt/s/bin:/opt/s/sbin:/usr/bin:/bin"


def test_lab_up_on_a_bogus_prefix_says_so_before_starting_anything(tmp_path: Path) -> None:
    done = subprocess.run([MEGATRACE, "lab", "up", "--slurm", str(tmp_path), "--lab-dir", str(tmp_path / "lab")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"--slurm {tmp_path}: not a Slurm installation" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "lab").exists()
    both = subprocess.run([MEGATRACE, "lab", "up", "--slurm", str(tmp_path), "--slurm-source", __file__],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "not both" in both.stderr
