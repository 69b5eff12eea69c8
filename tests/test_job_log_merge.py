"""Rings and the job's output together: a traced job that ended without the ring of a rank (its node's copy never
arrived) is analysed with what its output file says of that rank (``--with-log``, the epilog's ``job-end``).

A real torchrun job over gloo, traced by the autoload; rank 3 raises its own error. Its ring is removed as a lost
node's would be: the rings alone then cannot say why rank 3 stopped, its output can."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.torchrun_job import WORLD, torchrun_job

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind
from megatrace.collect.job_end import OUTPUT_REPORT_DIR, finish_job

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

CRASH = 3


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """The job's directory: ``rings/`` (every rank's) and ``slurm-77.out`` (its output, as Slurm writes it)."""
    d = tmp_path_factory.mktemp("merge")
    log = torchrun_job(d, lambda pids: None, crash_rank=str(CRASH),
                       env={"MEGATRACE_ENABLE": "1", "MEGATRACE_DIR": str(d / "rings")})
    assert log == d / "slurm-77.out" and "bad batch" in log.read_text()
    assert len(list((d / "rings").glob("rank-*.ring"))) == WORLD
    return d


def _without_rank(job: Path, dest: Path, rank: int = CRASH) -> Path:
    """A copy of the job's rings without those of ``rank`` (as when its node's epilog never copied them)."""
    shutil.copytree(job / "rings", dest)
    for f in dest.glob(f"rank-{rank:05d}.*"):
        f.unlink()
    return dest


def test_the_rings_alone_cannot_name_the_crash_of_the_rank_without_a_ring(job: Path, tmp_path: Path) -> None:
    """(The twin of the next test: without the output, rank 3's crash is not what the analysis names.)"""
    rings = _without_rank(job, tmp_path / "rings")
    result = analyze(rings, out_dir=tmp_path / "out")
    top = result.findings[0]
    assert not (top.subject.rank == CRASH and top.kind == Kind.CRASHED_PROCESS), top.verdict
    assert "bad batch" not in json.dumps(result.document())


def test_its_output_names_the_crash_of_the_rank_without_a_ring(job: Path, tmp_path: Path) -> None:
    rings = _without_rank(job, tmp_path / "rings")
    result = analyze(rings, out_dir=tmp_path / "out", job_logs=[job / "slurm-77.out"])
    top = result.findings[0]
    assert top.subject.rank == CRASH and top.kind == Kind.CRASHED_PROCESS, top.verdict
    chain = " ".join(map(str, top.evidence))
    assert "no ring; its log (slurm-77.out:" in chain and "ValueError: bad batch" in chain, chain
    merged = [p for p in result.trace.problems if p.code == "job-log"]
    assert merged and f"ranks [{CRASH}]" in merged[0].message, merged


def test_a_job_whose_every_rank_has_a_ring_does_not_read_its_output(job: Path, tmp_path: Path) -> None:
    result = analyze(job / "rings", out_dir=tmp_path / "out", job_logs=[job / "slurm-77.out"])
    said = [p.message for p in result.trace.problems if p.code == "job-log"]
    assert said == ["job output not read (slurm-77.out): every rank of the job has a ring"], said
    assert result.findings[0].subject.rank == CRASH  # (its own ring shows where it stopped)


def test_the_command_merges_the_output_and_says_how_to_rerun_it(job: Path, tmp_path: Path) -> None:
    rings = _without_rank(job, tmp_path / "rings")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "megatrace.cli", "analyze", str(rings), "--with-log",
                           str(job / "slurm-77.out"), "-o", str(out), "--no-report"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"VERDICT [critical] rank {CRASH}") and "crashed" in proc.stdout.splitlines()[0]
    doc = json.loads((out / "findings.json").read_text())
    command = doc["analysis"]["report"]["command"]
    assert command.endswith(f"--with-log {job / 'slurm-77.out'}"), command
    bad = subprocess.run([sys.executable, "-m", "megatrace.cli", "analyze", str(rings), "--with-log",
                          str(tmp_path / "nope.out")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nope.out" in bad.stderr and "Traceback" not in bad.stderr


def test_job_end_hands_the_output_to_the_analysis_of_a_step_missing_a_ring(job: Path, tmp_path: Path) -> None:
    step = tmp_path / "megatrace-77" / "step-0"
    _without_rank(job, step / "rings")
    done = finish_job(str(step.parent), str(step.parent / ".agents"), "n1", ["n1"], wait_s=0,
                      output_files=[str(job / "slurm-77.out")])
    assert f"rank {CRASH}" in done.analysed["step-0"], done.analysed
    top = json.loads((step / "findings.json").read_text())["findings"][0]
    assert top["kind"] == "crashed-process" and top["subject"]["rank"] == CRASH, top


def test_job_end_analyses_the_output_alone_when_no_rank_left_a_ring(job: Path, tmp_path: Path) -> None:
    job_dir = tmp_path / "megatrace-77"
    (job_dir / "step-0").mkdir(parents=True)  # the prolog made it; no rank's tracer ever wrote a ring
    done = finish_job(str(job_dir), str(job_dir / ".agents"), "n1", ["n1"], wait_s=0,
                      output_files=[str(job / "slurm-77.out")])
    assert done.skipped == {"step-0": "no rings"} and OUTPUT_REPORT_DIR in done.analysed, done
    doc = json.loads((job_dir / OUTPUT_REPORT_DIR / "findings.json").read_text())
    top = doc["findings"][0]
    assert top["kind"] == "crashed-process" and top["subject"]["rank"] == CRASH, top
    assert (job_dir / OUTPUT_REPORT_DIR / "report.html").exists()
