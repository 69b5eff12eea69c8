"""``megatrace analyze``: verdict first, findings.json, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from analysis_factory import TraceBuilder
from click.testing import CliRunner

from megatrace.cli import main


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def hung(tmp_path: Path) -> Path:
    b = TraceBuilder(world=4)
    tp01, tp23 = b.group("tp", [0, 1]), b.group("tp", [2, 3])
    b.healthy_steps([tp01, tp23], steps=3)
    b.collective(tp23, at=900.0, skip=(3,), stuck=(2,))
    return b.write(tmp_path / "hung")


def healthy(tmp_path: Path) -> Path:
    b = TraceBuilder(world=2)
    b.healthy_steps([b.group("tp", [0, 1])], steps=3)
    return b.write(tmp_path / "ok", closed=True)


def test_the_verdict_comes_first_and_findings_json_is_written(runner: CliRunner, tmp_path: Path) -> None:
    trace = hung(tmp_path)
    result = runner.invoke(main, ["analyze", str(trace)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0].startswith("VERDICT [critical] rank 3 (host node0, GPU 3) stopped outside")
    doc = json.loads((trace / "findings.json").read_text())
    assert doc["schema"] == "megatrace.findings" and doc["version"] == 1
    assert doc["verdict"] == doc["findings"][0]["verdict"]
    first = doc["findings"][0]
    assert first["kind"] == "compute-hang" and first["subject"]["rank"] == 3 and first["severity"] == "critical"
    assert set(first) >= {"id", "severity", "kind", "subject", "verdict", "evidence", "remediation", "confidence"}


def test_fail_on_returns_3_when_a_finding_is_at_or_above_it(runner: CliRunner, tmp_path: Path) -> None:
    trace = hung(tmp_path)
    out = tmp_path / "f.json"
    assert runner.invoke(main, ["analyze", str(trace), "--fail-on", "critical", "--json", str(out)]).exit_code == 3
    assert out.exists()
    ok = healthy(tmp_path)
    assert runner.invoke(main, ["analyze", str(ok), "--fail-on", "warning"]).exit_code == 0
    assert runner.invoke(main, ["analyze", str(ok), "--fail-on", "info"]).exit_code == 3


def test_a_directory_that_is_not_a_trace_is_one_error_line(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(main, ["analyze", str(tmp_path)])
    assert result.exit_code == 1
    text = result.output.strip()
    assert text.startswith(f"Error: {tmp_path}: not a trace directory (it is empty): found none of MegaTrace ring "
                           "files (rank-NNNNN.ring") and len(text.splitlines()) == 1, text
    for looked_for in ("Flight Recorder dumps", "rank_<R>.log", "NCCL Inspector", "--format"):
        assert looked_for in text


def test_layout_sizes_on_the_command_line(runner: CliRunner, tmp_path: Path) -> None:
    trace = hung(tmp_path)
    result = runner.invoke(main, ["analyze", str(trace), "--tp", "2"])  # dp derived: 4 / 2
    assert result.exit_code == 0 and "pp=0 dp=1 tp=1" in result.stdout.splitlines()[0]
    result = runner.invoke(main, ["analyze", str(trace), "--tp", "3"])
    assert result.exit_code == 0 and "do not divide the trace's world size 4" in result.stdout


def test_layout_file_and_sizes_are_exclusive(runner: CliRunner, tmp_path: Path) -> None:
    trace = hung(tmp_path)
    layout = tmp_path / "layout.yaml"
    layout.write_text("world_size: 4\ntp: 2\npp: 1\ndp: 2\n")
    result = runner.invoke(main, ["analyze", str(trace), "--layout", str(layout), "--tp", "2"])
    assert result.exit_code == 2 and "either --layout or --tp/--pp/--dp" in result.output
    assert runner.invoke(main, ["analyze", str(trace), "--layout", str(layout)]).exit_code == 0
    layout.write_text("world_size: 4\ntp: 2\npp: 1\ndp: 2\nbogus: 1\n")
    result = runner.invoke(main, ["analyze", str(trace), "--layout", str(layout)])
    assert result.exit_code == 1 and "unknown key 'bogus'" in result.output
