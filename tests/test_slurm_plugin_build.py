"""The SPANK plugin builds with hardening flags and exports only what Slurm looks up; the scripts parse."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _need(path: str) -> None:
    if not os.path.exists(path):
        if os.environ.get("CI"):
            pytest.fail(f"{path} is required under CI (apt: libslurm-dev)")
        pytest.skip(f"no {path}")


def test_the_plugin_exports_only_the_spank_symbols(tmp_path):
    _need("/usr/include/slurm/spank.h")
    if not shutil.which("cc") or not shutil.which("nm"):
        pytest.skip("no C compiler / nm")
    src = tmp_path / "spank_plugin"
    shutil.copytree(ROOT / "spank_plugin", src, ignore=shutil.ignore_patterns("*.o", "*.so", "megatrace.conf"))
    proc = subprocess.run(["make", "-C", str(src), "CFLAGS=-O2 -Werror"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(src / "megatrace.so")], capture_output=True,
                             text=True).stdout.split()
    exported = sorted(s for s in symbols if s.startswith(("slurm_", "plugin_", "mt_")) or s in ("main",))
    assert exported == ["plugin_name", "plugin_type", "plugin_version", "slurm_spank_exit", "slurm_spank_init",
                        "slurm_spank_init_post_opt", "slurm_spank_task_exit", "slurm_spank_task_init",
                        "slurm_spank_user_init"]
    flags = subprocess.run(["readelf", "-d", str(src / "megatrace.so")], capture_output=True, text=True).stdout
    assert "BIND_NOW" in flags or "NOW" in flags  # -z now (full RELRO)


def test_the_plugstack_snippet_is_optional_and_names_the_executable(tmp_path):
    src = tmp_path / "spank_plugin"
    shutil.copytree(ROOT / "spank_plugin", src, ignore=shutil.ignore_patterns("*.o", "*.so", "megatrace.conf"))
    proc = subprocess.run(["make", "-C", str(src), "megatrace.conf", "LIBDIR=/opt/mt/lib",
                           "MEGATRACE_BIN=/opt/mt/bin/megatrace", "PLUGSTACK_ARGS=check=off"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    line = [ln for ln in (src / "megatrace.conf").read_text().splitlines() if not ln.startswith("#")]
    assert line == ["optional /opt/mt/lib/megatrace.so megatrace=/opt/mt/bin/megatrace check=off"]


@pytest.mark.parametrize("script", ["prolog", "epilog"])
def test_the_scripts_parse_and_do_nothing_for_untraced_jobs(script, tmp_path):
    path = ROOT / "slurm" / script
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    assert os.access(path, os.X_OK)
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "1", "SLURM_JOB_UID": str(os.getuid()),
           "SLURM_JOB_GID": str(os.getgid()), "SLURMD_NODENAME": "nonexistent-node"}
    proc = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""


@pytest.mark.parametrize("script", ["prolog", "epilog", "healthcheck"])
def test_the_scripts_say_their_error_policy_and_keep_it(script):
    """No -e nor global pipefail (a prolog or epilog that fails drains the node), and the header says why."""
    text = (ROOT / "slurm" / script).read_text()
    header = text[:text.index("\nset ")]
    assert "Error policy:" in header and "without -e and pipefail" in header
    assert [line for line in text.splitlines() if line.startswith("set ")] == ["set -u -f"]
    assert "set -e" not in text and "errexit" not in text
    assert ". \"$lib\"" in text and "lib=${0%/*}/megatrace-lib.sh" in text  # the root-owned library beside it


def test_the_epilog_hands_over_the_exit_record_only_when_read_whole():
    """head | as_user: with pipefail, and the copy is renamed into place only when both sides succeeded."""
    text = (ROOT / "slurm" / "epilog").read_text()
    assert 'handed=$(set -o pipefail; head -c 4000000 -- "$exits" | as_user' in text
    pipes = re.findall(r"[^|]\|\s*as_user", text)  # a pipe into as_user, not an ||
    assert len(pipes) == 1, pipes
