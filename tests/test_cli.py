"""The command-line shape: help on every command, one-line errors, exit codes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from megatrace.cli import check_main, main


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_group_help_lists_every_command_with_a_full_sentence(runner: CliRunner) -> None:
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    for name, command in main.commands.items():
        summary = command.get_short_help_str(limit=100)
        assert f"  {name}" in result.output and summary.endswith("."), (name, summary)


@pytest.mark.parametrize("name", sorted(main.commands))
def test_every_command_has_help_with_examples(runner: CliRunner, name: str) -> None:
    result = runner.invoke(main, [name, "--help"], prog_name="megatrace")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: megatrace {name}")
    assert "Example" in result.output


def test_run_of_a_missing_program_is_one_error_line_without_traceback(runner: CliRunner) -> None:
    result = runner.invoke(main, ["run", "--", "/nonexistent/program"])
    assert result.exit_code == 1
    assert result.output.strip() == "Error: cannot run '/nonexistent/program': No such file or directory"


def test_run_requires_a_command(runner: CliRunner) -> None:
    result = runner.invoke(main, ["run"])
    assert result.exit_code == 2 and "Missing argument" in result.output


def test_megatrace_check_reports_what_it_checked(runner: CliRunner, tmp_path) -> None:
    limits = tmp_path / "limits.yaml"
    limits.write_text("node: {min_free_shm_mib: 0, min_free_job_mib: 0}\n")  # a container's /dev/shm is small
    result = runner.invoke(check_main, ["--only", "node", "--thresholds", str(limits), "--node", "n1",
                                        "--json", str(tmp_path / "c.json")])
    assert result.exit_code == 0, result.output
    verdict = result.output.splitlines()[-1]
    assert verdict.startswith("verdict: ok (1 node(s), ") and " 0 checks" not in verdict
    assert json.loads((tmp_path / "c.json").read_text())["results"]
