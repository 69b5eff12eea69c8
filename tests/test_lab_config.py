"""The lab's configuration files and its CLI, without daemons or root."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from megatrace.cli import main
from megatrace.lab import LabError
from megatrace.lab.paths import LabPaths
from megatrace.lab.slurmconf import MARKER, LabSpec, install_slurm_conf, render_site_conf, render_slurm_conf


@pytest.fixture
def paths(tmp_path: Path) -> LabPaths:
    return LabPaths(root=tmp_path / "lab", libexec=tmp_path / "libexec", site_conf_dir=tmp_path / "etc-megatrace",
                    slurm_conf=tmp_path / "etc-slurm" / "slurm.conf", plugstack_dir=tmp_path / "plugstack.conf.d")


def test_slurm_conf_has_the_verified_multi_slurmd_settings(paths):
    text = render_slurm_conf(LabSpec(nodes=4), paths)
    assert text.startswith(MARKER)
    for line in ("ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
                 "SlurmUser=root", "PrologFlags=Alloc", "SchedulerParameters=nohold_on_prolog_fail",
                 f"SlurmdSpoolDir={paths.root}/spool/%n", f"SlurmdPidFile={paths.root}/run/slurmd-%n.pid",
                 f"Prolog={paths.prolog}", f"Epilog={paths.epilog}"):
        assert line in text.splitlines(), line
    assert "NodeName=n[1-4] " in text and "Port=17001-17004" in text and "OverSubscribe=FORCE:4" in text


def test_one_node_lab_has_no_ranges(paths):
    text = render_slurm_conf(LabSpec(nodes=1), paths)
    assert "NodeName=n1 " in text and "Port=17001 " in text


def test_the_lab_never_replaces_a_sites_slurm_conf(paths):
    paths.slurm_conf.parent.mkdir(parents=True)
    paths.slurm_conf.write_text("ClusterName=production\n")
    with pytest.raises(LabError, match="not written by the lab"):
        install_slurm_conf(LabSpec(), paths)
    assert paths.slurm_conf.read_text() == "ClusterName=production\n"


def test_slurm_conf_is_rewritten_only_when_it_changes(paths):
    assert install_slurm_conf(LabSpec(nodes=2), paths) is True
    assert install_slurm_conf(LabSpec(nodes=2), paths) is False
    assert install_slurm_conf(LabSpec(nodes=3), paths) is True
    assert paths.lab_slurm_conf.read_text() == paths.slurm_conf.read_text()


def test_site_conf_names_the_check_command_and_directories(paths):
    keys = dict(line.split("=", 1) for line in render_site_conf(paths).splitlines() if "=" in line
                and not line.startswith("#"))
    assert set(keys) == {"MEGATRACE_BIN", "CHECK_CMD", "LOCAL_DIR", "FALLBACK_DIR", "HEALTH_ARGS", "HEALTH_ALERTS",
                         "HEALTH_TIMEOUT"}
    assert keys["HEALTH_ARGS"].startswith("--resume-after 2 --thresholds ")
    assert keys["CHECK_CMD"].split()[0].endswith("/megatrace-check")
    assert "--node {node} --ring-dir {ring_base} --only node --only gpu --thresholds" in keys["CHECK_CMD"]


@pytest.mark.parametrize("args", [["lab", "--help"], ["lab", "up", "--help"], ["lab", "down", "--help"],
                                  ["lab", "status", "--help"], ["lab", "demo", "--help"]])
def test_lab_help(args):
    result = CliRunner().invoke(main, args, prog_name="megatrace")
    assert result.exit_code == 0 and "Usage: megatrace lab" in result.output


def test_status_of_a_lab_that_never_ran(tmp_path):
    result = CliRunner().invoke(main, ["lab", "status", "--lab-dir", str(tmp_path / "nothing")])
    assert result.exit_code == 1 and "lab down" in result.output
