"""Job output logs of real gloo jobs under torchrun, faults from outside: no watchdog positions in them, only the
ranks' failed collectives (gloo's "Timed out waiting ...", "Connection reset by peer") and torchrun's failure
summary. ``megatrace analyze LOG`` must name the rank the others failed waiting for (the one that printed
nothing), and a killed or crashed rank as the crash, where torchrun's own "Root Cause" names merely the first
rank to exit.

The jobs' output files are checked in (tests/data/job_logs/<name>/, written by :mod:`helpers.torchrun_job` with
the faults of :data:`helpers.torch_runs.JOB_LOGS`; tests/helpers/torch_runs.py regenerates them), so these tests
need no torch; tests/test_import_gloo_log_live.py runs such a job live.
"""

from __future__ import annotations

from pathlib import Path

from helpers.torch_runs import unpack

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity


def job_log(name: str, tmp_path: Path) -> Path:
    """The output file of job ``name`` (a key of ``helpers.torch_runs.JOB_LOGS``), as Slurm wrote it."""
    return unpack(f"job_logs/{name}", tmp_path / name) / "slurm-77.out"


def test_the_rank_the_others_failed_waiting_for_is_named(tmp_path: Path) -> None:
    log = job_log("rank1-stopped", tmp_path)  # rank 1 stopped (SIGSTOP) until gloo's 6 s timeout fired on the others
    assert "Timed out waiting" in log.read_text()
    top = analyze(log).findings[0]
    assert top.subject.rank == 1 and top.severity == Severity.CRITICAL, top.verdict
    assert top.kind == Kind.NO_TRACE and "3 ranks wait for it" in top.verdict, top.verdict
    assert "printed nothing" in top.remediation


def test_a_rank_killed_from_outside_is_the_crash(tmp_path: Path) -> None:
    log = job_log("rank2-killed", tmp_path)  # SIGKILL
    top = analyze(log).findings[0]
    assert top.kind == Kind.CRASHED_PROCESS and top.subject.rank == 2, top.verdict
    assert any("SIGKILL" in str(e) for e in top.evidence), top.evidence


def test_a_rank_that_raised_its_own_error_is_the_crash(tmp_path: Path) -> None:
    log = job_log("rank3-raised", tmp_path)
    top = analyze(log).findings[0]
    assert top.kind == Kind.CRASHED_PROCESS and top.subject.rank == 3, top.verdict
    assert any("bad batch" in str(e) for e in top.evidence), top.evidence


def test_a_crash_while_the_others_compute_is_named_from_the_crash_alone(tmp_path: Path) -> None:
    """No failed collective and no watchdog line: the others were in a step of their own when rank 3 raised, and
    torchrun ended them. The log says only how each rank ended, and that is the verdict."""
    log = job_log("rank3-raised-others-compute", tmp_path)
    text = log.read_text()
    assert "bad batch" in text and "Connection" not in text and "Timed out" not in text, text[-3000:]
    result = analyze(log)
    top = result.findings[0]
    assert top.kind == Kind.CRASHED_PROCESS and top.subject.rank == 3, top.verdict
    assert top.severity == Severity.CRITICAL and any("bad batch" in str(e) for e in top.evidence), top.evidence
    assert not [f for f in result.findings if f.kind in (Kind.HEALTHY, Kind.NO_TRACE)], \
        [f.verdict for f in result.findings]
    assert [p.code for p in result.trace.problems if p.code == "crash-only"] == ["crash-only"]
