"""``megatrace analyze``: verdict first, findings.json, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.analysis_factory import TraceBuilder
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


def _fr_dumps(where: Path) -> Path:
    """Two ranks' Flight Recorder dumps (gloo, one all_reduce each, rank 1 missing from the last): a foreign
    format, written as torch would."""
    import pickle

    where.mkdir(parents=True)
    for rank in range(2):
        entries = [{"record_id": i, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": i + 1,
                    "p2p_seq_id": 0, "op_id": i + 1, "profiling_name": "gloo:all_reduce",
                    "time_created_ns": 10**18 + i * 10**6, "input_sizes": [[4]], "input_dtypes": ["Float"],
                    "state": "scheduled", "retired": i < 4, "is_p2p": False} for i in range(5 if rank == 0 else 4)]
        dump = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
                "pg_status": {}, "entries": entries}
        (where / f"fr_rank_{rank}").write_bytes(pickle.dumps(dump))
    return where


def test_out_holds_everything_and_nothing_is_written_into_the_input(runner: CliRunner, tmp_path: Path) -> None:
    for trace in (hung(tmp_path), _fr_dumps(tmp_path / "fr")):
        before = sorted(p.name for p in trace.iterdir())
        out = tmp_path / f"out-{trace.name}"
        result = runner.invoke(main, ["analyze", str(trace), "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert sorted(p.name for p in trace.iterdir()) == before
        assert {"findings.json", "report.html", "trace.json", "job.yaml"} <= {p.name for p in out.iterdir()}


def test_an_imported_format_is_analysed_into_a_new_directory_beside_it(runner: CliRunner, tmp_path: Path) -> None:
    dumps = _fr_dumps(tmp_path / "dumps")
    before = sorted(p.name for p in dumps.iterdir())
    result = runner.invoke(main, ["analyze", str(dumps)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in dumps.iterdir()) == before  # not one file written into the foreign input
    beside = tmp_path / "dumps-megatrace"
    assert {"findings.json", "report.html", "job.yaml"} <= {p.name for p in beside.iterdir()}
    job = (beside / "job.yaml").read_text()
    assert "ring headers" not in job and "flight-recorder: the highest rank its files and groups name" in job
    rings = hung(tmp_path)  # ring files: as before, into the trace directory
    assert runner.invoke(main, ["analyze", str(rings)]).exit_code == 0
    assert (rings / "findings.json").exists() and not (tmp_path / "hung-megatrace").exists()


def test_an_output_directory_that_cannot_be_made_is_one_error_line(runner: CliRunner, tmp_path: Path) -> None:
    trace = hung(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = runner.invoke(main, ["analyze", str(trace), "-o", str(blocker / "out")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.strip().splitlines()[-1].startswith("Error: ") and "-o/--out" in result.output


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two simulated jobs of VERDICT_FIRST_RANKS ranks (TP4·PP4·DP16): rank 77 hung at step 2, and a healthy one."""
    from megatrace.cli.analyze import VERDICT_FIRST_RANKS

    root, runner = tmp_path_factory.mktemp("simulated"), CliRunner()
    runs = {"hung": ["--fault", "hang:rank=77,step=2"], "healthy": []}
    for name, fault in runs.items():
        result = runner.invoke(main, ["simulate", "--ranks", str(VERDICT_FIRST_RANKS), "--tp", "4", "--pp", "4",
                                      "--steps", "3", *fault, "-o", str(root / name)])
        assert result.exit_code == 0, result.output
    return {name: root / name for name in runs}


def test_at_scale_a_hang_s_verdict_from_the_quick_pass_comes_before_the_full_analysis(
        simulated: dict[str, Path], tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "megatrace.cli", "analyze", str(simulated["hung"]), "--no-report",
                          "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert run.returncode == 0, run.stdout
    text = run.stdout
    early = text.index("hang verdict from the quick pass")
    final = text.index("\ntrace ")  # the full analysis's summary, after its verdict
    assert early < final
    quick_verdict = text[early:].splitlines()[1]
    assert quick_verdict.startswith("VERDICT [critical] rank 77 ") and "stopped outside communication" in quick_verdict
    assert f"the quick pass's findings: {out / 'findings.json'}" in text[early:final]  # (after its verdict)
    doc = json.loads((out / "findings.json").read_text())  # rewritten by the full analysis
    assert "mode" not in doc["analysis"] and doc["findings"][0]["subject"]["rank"] == 77
    assert quick_verdict == "VERDICT [critical] " + doc["verdict"]


@pytest.mark.parametrize("case", ["healthy", "quick", "fewer-ranks"])
def test_no_early_verdict_without_a_hang_with_quick_or_below_the_scale(
        runner: CliRunner, simulated: dict[str, Path], tmp_path: Path, case: str) -> None:
    trace = {"healthy": simulated["healthy"], "quick": simulated["hung"], "fewer-ranks": hung(tmp_path)}[case]
    quick = ["--quick"] if case == "quick" else []
    args = ["analyze", str(trace), "--no-report", "-o", str(tmp_path / "out"), *quick]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "quick pass" not in result.output
    assert result.stdout.startswith("VERDICT [critical]" if case != "healthy" else "VERDICT [info]")


@pytest.mark.parametrize("fail_on", [None, "warning"])
def test_the_analyze_process_leaves_without_teardown_its_output_whole(tmp_path: Path, fail_on: str | None) -> None:
    """Run as the process (``entry``: the console script, ``python -m megatrace.cli``), ``megatrace analyze`` leaves
    with os._exit once everything is written (no atexit handler runs), with its exit status and all its output; an
    error leaves the usual way; and a program that calls ``main(...)`` itself goes on after the command."""
    import subprocess
    import sys

    trace = hung(tmp_path)
    torn = "import atexit, sys; atexit.register(lambda: print('TORN DOWN', file=sys.stderr)); "
    script = torn + "from megatrace.cli import entry; sys.argv = ['megatrace'] + sys.argv[1:]; entry()"
    args = ["analyze", str(trace), "--no-report", "-o", str(tmp_path / "out")] + (["--fail-on", fail_on] if fail_on
                                                                                   else [])
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == (3 if fail_on else 0), run.stderr
    assert run.stdout.startswith("VERDICT [critical]") and "TORN DOWN" not in run.stderr
    assert f"findings: {tmp_path / 'out' / 'findings.json'}" in run.stderr
    assert json.loads((tmp_path / "out" / "findings.json").read_text())["verdict"] in run.stdout
    other = subprocess.run([sys.executable, "-c", script, "analyze", str(tmp_path / "missing")], capture_output=True,
                           text=True, timeout=300)
    assert other.returncode == 1 and "TORN DOWN" in other.stderr  # (an error: the usual way out)
    caller = torn + ("from megatrace.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
                     "    print('STILL HERE', e.code)")
    inside = subprocess.run([sys.executable, "-c", caller, *args], capture_output=True, text=True, timeout=300)
    assert inside.returncode == 0 and f"STILL HERE {3 if fail_on else 0}" in inside.stdout, inside.stderr
    assert "TORN DOWN" in inside.stderr
