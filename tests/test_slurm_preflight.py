"""The node preflight the prolog runs for traced jobs (megatrace-check's node probes); no daemons needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatrace.check.host import HostThresholds, judge_host, read_host, read_injected
from megatrace.check.results import Status

CHECK = str(Path(sys.executable).parent / "megatrace-check")


def test_a_healthy_node_passes(tmp_path):
    facts = read_host(ring_dir=str(tmp_path / "rings"), node="n1", site_dir=tmp_path / "no-such-dir")
    results = {r.probe: r for r in judge_host(facts, "n1", HostThresholds(min_free_shm_mib=0))}
    assert all(r.status == Status.OK for r in results.values()), results
    assert {"node.injected", "node.ring_dir", "node.tracer"} <= set(results)


@pytest.mark.skipif(os.geteuid() != 0, reason="a root-owned site directory needs root")
def test_an_injected_failure_fails_with_its_text_first(tmp_path):
    site = tmp_path / "site"
    site.mkdir(mode=0o755)
    (site / "fail-preflight-n2").write_text("drill: bad node\n")
    env = {**os.environ, "MEGATRACE_SITE_DIR": str(site)}
    argv = [CHECK, "--only", "node.injected", "--ring-dir", str(tmp_path)]
    assert subprocess.run(argv + ["--node", "n1"], env=env, capture_output=True).returncode == 0
    done = subprocess.run(argv + ["--node", "n2"], env=env, capture_output=True, text=True)
    assert done.returncode == 4
    first = done.stdout.splitlines()[0]  # the prolog's drain reason
    assert first.startswith("FAIL n2") and "node.injected" in first and "drill: bad node" in first


def test_a_failure_file_anyone_could_write_is_ignored(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    os.chmod(site, 0o777)
    (site / "fail-preflight-n2").write_text("planted\n")
    found = read_injected("n2", site)
    assert found is not None and "ignored" in found and "text" not in found
    (res,) = [r for r in judge_host({"injected": found}, "n2") if r.probe == "node.injected"]
    assert res.status == Status.WARN  # reported, never a drain


def test_too_little_space_fails(tmp_path):
    facts = read_host(ring_dir=str(tmp_path / "not" / "yet"))
    (res,) = [r for r in judge_host(facts, "n1", HostThresholds(min_free_ring_mib=1 << 40)) if r.probe == "node.ring_dir"]
    assert res.status == Status.FAIL and "MiB free" in res.message
