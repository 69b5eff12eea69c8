"""The prolog, epilog and health check call the site's Slurm: the directories the site config names,
else the bin and sbin beside the slurmd that runs them, never a directory someone else can write."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parent.parent / "slurm" / "megatrace-lib.sh"
SYSTEM = "/usr/sbin:/usr/bin:/sbin:/bin"
SHOW = f'LOG_TAG=megatrace-test; . {LIB}; read_site_conf; use_site_slurm; echo "PATH=$PATH"; echo "CONF=${{SLURM_CONF:-}}"'

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the scripts trust only root's directories: needs root")


def _prefix(root: Path, mode: int = 0o755) -> Path:
    """A Slurm installed under a prefix: bin/ and sbin/ (root's, as `make install` leaves them)."""
    for d in (root, root / "bin", root / "sbin"):
        d.mkdir(exist_ok=True)
        os.chmod(d, mode)
    return root


def _show(tmp_path: Path, conf: str = "", argv0: list[str] | None = None) -> dict[str, str]:
    site = tmp_path / "site.conf"
    site.write_text(conf)
    os.chmod(site, 0o644)
    script = SHOW.replace(f". {LIB};", f". {LIB}; SITE_CONF={site};")
    argv = (argv0 or ["bash"]) + ["-c", script]
    out = subprocess.run(argv, capture_output=True, text=True, env={"PATH": SYSTEM}, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    lines["stderr"] = out.stderr
    return lines


def test_the_slurm_beside_the_running_slurmd_comes_first(tmp_path: Path) -> None:
    """Run under a process whose executable is <prefix>/sbin/slurmd, as slurmd runs a prolog."""
    prefix = _prefix(tmp_path / "slurm-26.05")
    slurmd = prefix / "sbin" / "slurmd"
    shutil.copy("/bin/bash", slurmd)
    got = _show(tmp_path, argv0=[str(slurmd)])
    assert got["PATH"] == f"{prefix}/bin:{prefix}/sbin:{SYSTEM}", got


def test_the_site_configs_slurm_bin_wins_and_slurm_conf_is_passed_on(tmp_path: Path) -> None:
    prefix = _prefix(tmp_path / "opt-slurm")
    got = _show(tmp_path, f"SLURM_BIN={prefix}/bin:{prefix}/sbin\nSLURM_CONF={prefix}/etc/slurm.conf\n")
    assert got["PATH"] == f"{prefix}/bin:{prefix}/sbin:{SYSTEM}" and got["CONF"] == f"{prefix}/etc/slurm.conf"


def test_outside_slurmd_and_without_a_setting_the_system_path_stays(tmp_path: Path) -> None:
    assert _show(tmp_path)["PATH"] == SYSTEM


@pytest.mark.parametrize("bad", ["writable", "relative", "link", "not-root"])
def test_a_slurm_directory_others_could_change_is_never_put_on_roots_path(tmp_path: Path, bad: str) -> None:
    prefix = _prefix(tmp_path / "p")
    target = f"{prefix}/bin"
    if bad == "writable":
        os.chmod(prefix / "bin", 0o777)
    elif bad == "relative":
        target = "p/bin"
    elif bad == "link":
        (tmp_path / "link").symlink_to(prefix / "bin")
        target = str(tmp_path / "link")
    else:
        os.chown(prefix / "bin", 65534, 65534)
    got = _show(tmp_path, f"SLURM_BIN={target}\n")
    assert got["PATH"] == SYSTEM and "ignoring Slurm directory" in got["stderr"], got
