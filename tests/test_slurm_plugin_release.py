"""A SPANK plugin built for another Slurm release is caught: megatrace-check names it (Slurm would skip it and
drop --megatrace without a word), and `make install` refuses headers of another release than the host's."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatrace.check.plugin import elf_symbol_u32, plugstack_plugins, release, running_release, same_release
from megatrace.lab.slurm_install import BUILD_ROOT

ROOT = Path(__file__).resolve().parent.parent
CHECK = str(Path(sys.executable).parent / "megatrace-check")
OTHER = 0x1A0503  # Slurm 26.05.3


def _need_toolchain() -> None:
    if not Path("/usr/include/slurm/spank.h").exists() or not shutil.which("cc"):
        if os.environ.get("CI"):
            pytest.fail("/usr/include/slurm/spank.h and cc are required under CI (apt: libslurm-dev, gcc)")
        pytest.skip("no Slurm headers or C compiler")


def _headers(tmp_path: Path, number: int) -> Path:
    """A copy of this host's Slurm headers claiming release ``number`` (as another release's headers would)."""
    inc = tmp_path / f"include-{number:x}"
    shutil.copytree("/usr/include/slurm", inc / "slurm")
    version = inc / "slurm" / "slurm_version.h"
    version.write_text(re.sub(r"#define SLURM_VERSION_NUMBER 0x[0-9a-fA-F]+", f"#define SLURM_VERSION_NUMBER 0x{number:x}",
                              version.read_text()))
    return inc


def _header_release(include: Path) -> int | None:
    m = re.search(r"#define SLURM_VERSION_NUMBER 0x([0-9a-fA-F]+)", _read(include / "slurm" / "slurm_version.h"))
    return int(m[1], 16) if m else None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _real_headers() -> list[Path]:
    """Slurm headers of real releases on this machine: Debian's, and those of the lab's source builds."""
    return [Path("/usr/include"), *sorted(Path(BUILD_ROOT).glob("*/include"))]


def _this_release_headers() -> Path:
    """Headers of the release that runs (Debian's, or the source build a lab runs on)."""
    running = running_release()
    found = [inc for inc in _real_headers() if running and (n := _header_release(inc)) and same_release(n, running)]
    if not found:
        pytest.skip(f"no headers of the running Slurm {release(running)} on this machine")
    return found[0]


def _other_release_headers(tmp_path: Path) -> tuple[Path, int]:
    """Headers of another release than the running one: a real one where this machine has it (Debian's under a lab
    on a source build, a source build's under Debian's lab), else a copy of this host's claiming 26.05.3."""
    running = running_release()
    for inc in _real_headers():
        n = _header_release(inc)
        if n is not None and running is not None and not same_release(n, running):
            return inc, n
    return _headers(tmp_path, OTHER), OTHER


def _build(tmp_path: Path, include: Path | None = None) -> Path:
    src = tmp_path / "spank_plugin"
    shutil.copytree(ROOT / "spank_plugin", src, ignore=shutil.ignore_patterns("*.o", "*.so", "megatrace.conf"))
    args = ["make", "-C", str(src)] + ([f"SLURM_INCLUDE={include}"] if include else [])
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return src


def _site(tmp_path: Path, plugin: Path) -> dict[str, str]:
    """A slurm.conf directory whose plugstack includes a snippet naming ``plugin``, as `make install` lays it."""
    etc = tmp_path / "etc"
    (etc / "plugstack.conf.d").mkdir(parents=True)
    (etc / "slurm.conf").write_text("ClusterName=x\n")
    (etc / "plugstack.conf").write_text(f"include {etc}/plugstack.conf.d/*.conf\n")
    (etc / "plugstack.conf.d" / "megatrace.conf").write_text(f"optional {plugin} megatrace=/bin/true\n")
    return {**os.environ, "SLURM_CONF": str(etc / "slurm.conf")}


def test_the_release_a_plugin_was_built_for_is_read_from_its_file(tmp_path: Path) -> None:
    _need_toolchain()
    src = _build(tmp_path, _headers(tmp_path, OTHER))
    assert elf_symbol_u32(src / "megatrace.so", "plugin_version") == OTHER
    assert elf_symbol_u32(src / "megatrace.so", "no_such_symbol") is None
    with pytest.raises(ValueError):
        elf_symbol_u32(src / "megatrace.c", "plugin_version")


@pytest.mark.parametrize("stale", [True, False], ids=["other-release", "this-release"])
def test_megatrace_check_names_a_plugin_built_for_another_release(tmp_path: Path, stale: bool) -> None:
    _need_toolchain()
    running = running_release()
    if running is None:
        pytest.skip("no scontrol on PATH")
    other, number = _other_release_headers(tmp_path)
    src = _build(tmp_path, other if stale else _this_release_headers())
    env = _site(tmp_path, src / "megatrace.so")
    assert plugstack_plugins(Path(env["SLURM_CONF"]).with_name("plugstack.conf")) == [str(src / "megatrace.so")]
    out = tmp_path / "check.json"
    done = subprocess.run([CHECK, "--only", "node.plugin", "--node", "n1", "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=60)
    (result,) = [r for r in json.loads(out.read_text())["results"] if r["probe"] == "node.plugin"]
    if stale:
        assert done.returncode == 3, done.stdout + done.stderr  # a warning: the node is not drained
        assert f"built for Slurm {release(number)}" in done.stdout and f"{release(running)} runs" in done.stdout, \
            done.stdout
        assert "make -C spank_plugin" in result["remediation"]
    else:
        assert done.returncode == 0, done.stdout + done.stderr
        assert result["status"] == "ok" and "fits Slurm" in result["message"]


def test_make_install_refuses_headers_of_another_release_unless_told(tmp_path: Path) -> None:
    _need_toolchain()
    if running_release() is None:
        pytest.skip("no Slurm on this host to compare with")
    inc, number = _other_release_headers(tmp_path)
    src = _build(tmp_path, inc)
    stage = tmp_path / "stage"
    base = ["make", "-C", str(src), "install", f"SLURM_INCLUDE={inc}", f"DESTDIR={stage}"]
    refused = subprocess.run(base, capture_output=True, text=True)
    assert refused.returncode != 0 and "refusing to install" in refused.stderr, refused.stderr
    assert release(number).rsplit(".", 1)[0] in refused.stderr, refused.stderr
    assert not stage.exists()
    staged = subprocess.run(base + ["SLURM_RELEASE_CHECK=0"], capture_output=True, text=True)
    assert staged.returncode == 0, staged.stderr
    assert list(stage.rglob("megatrace.so"))
    here = _this_release_headers()
    same = subprocess.run(["make", "-C", str(_build(tmp_path / "here", here)), "install", f"SLURM_INCLUDE={here}",
                           f"DESTDIR={tmp_path / 'ok'}"], capture_output=True, text=True)
    assert same.returncode == 0, same.stderr
