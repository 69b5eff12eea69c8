"""Inputs another user planted for an admin's ``megatrace analyze`` (issue 20): a FIFO, or a link to a file the
admin can read and the user cannot, named as each importer's input. Every importer refuses them by name, at
once: no read blocks on a FIFO, no link of another user is followed, nothing of the target is quoted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

OTHER_UID = 4242
# format -> a file name that format reads (the FIFO or link stands in for it)
INPUTS = {"nccl-log": "rank_0.log", "flight-recorder": "nccl_trace_rank_0", "inspector": "inspector.log",
          "kineto": "rank0.pt.trace.json", "nccl-ras": "ras.txt", "job-log": "slurm-7.out"}
SECRET = "root-only secret line"


def _analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatrace.cli", "analyze", "--no-report", *args],
                          capture_output=True, text=True, timeout=60)  # a blocked read would time out here


def _plant(tmp_path: Path, name: str, kind: str) -> Path:
    where = tmp_path / "trace"
    where.mkdir()
    target = where / name
    if kind == "fifo":
        os.mkfifo(target)
    else:
        secret = tmp_path / "secret"
        secret.write_text(SECRET + "\n")
        secret.chmod(0o600)
        target.symlink_to(secret)
        os.lchown(target, OTHER_UID, OTHER_UID)
    return target


@pytest.mark.parametrize("fmt", sorted(INPUTS))
@pytest.mark.parametrize("kind", ["fifo", "foreign-link"])
def test_a_planted_input_is_refused_at_once_by_every_importer(tmp_path: Path, fmt: str, kind: str) -> None:
    if kind == "foreign-link" and os.geteuid() != 0:
        pytest.skip("planting another user's link needs root (CI runs as root)")
    target = _plant(tmp_path, INPUTS[fmt], kind)
    for args in (["--format", fmt, str(target.parent)], [str(target.parent)], [str(target)]):
        proc = _analyze(*args)
        assert proc.returncode != 0, (args, proc.stdout)
        assert "Traceback" not in proc.stderr and SECRET not in proc.stdout + proc.stderr, (args, proc.stderr)
    if kind == "fifo":
        assert "neither a directory nor a regular file" in proc.stderr, proc.stderr
    else:  # the file itself named on the command line: refused as the link it is
        assert f"{target}: a symbolic link owned by uid {OTHER_UID}; not followed" in proc.stderr, proc.stderr
