"""Verdicts on the demo's torch-API engines (DDP, FSDP2, DTensor TP, pipelining), faults from outside.

Each engine runs as `megatrace demo --engine E` does (2 local ranks on gloo, traced); the fault is
what an incident does to one of its processes: SIGSTOP (the verdict is taken on the live rings,
while the rank stays stopped), or SIGKILL (the verdict after the run ends).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.trace.ring_reader import RingFormatError, read_ring
from helpers.outside import Throttle, wait_for

pytest.importorskip("torch")

SIZES = {"ddp": ["--dp", "2"], "fsdp": ["--dp", "2"], "tp": ["--tp", "2", "--dp", "1"], "pipeline": ["--pp", "2"]}
# A straggler is slower than the ranks doing the same work: the pipeline's stages differ, so it runs two
# pipelines (stage 0 of the second, rank 1, has rank 0 for a peer), as pipeline jobs run with DP.
THROTTLED_SIZES = {**SIZES, "pipeline": ["--pp", "2", "--dp", "2"]}
VICTIM = 1


class DemoRun:
    """``megatrace demo --engine ENGINE`` in a session of its own, long enough to be faulted."""

    def __init__(self, engine: str, out: Path, steps: int = 400, sizes: list[str] | None = None) -> None:
        self.out = out
        sizes = SIZES[engine] if sizes is None else sizes
        ranks = 1
        for value in sizes[1::2]:
            ranks *= int(value)
        self.ranks = max(ranks, 2)
        argv = [sys.executable, "-m", "megatrace.cli", "demo", "--engine", engine, "--ranks", str(self.ranks),
                *sizes, "--steps", str(steps), "-o", str(out)]
        self.log = (out.parent / f"{out.name}.log").open("w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, PYTHONWARNINGS="ignore"))

    def victim_pid(self, min_records: int = 30, timeout: float = 180) -> int:
        """The victim's pid once both ranks have recorded ``min_records`` calls (past start-up)."""
        rings = [self.out / "rings" / f"rank-{r:05d}.ring" for r in range(self.ranks)]

        def going() -> int | None:
            try:
                snaps = [read_ring(p) for p in rings]
                if all(s.header.write_counter >= min_records for s in snaps):
                    return snaps[VICTIM].header.pid
            except (OSError, ValueError, RingFormatError):  # a ring being created reads as no ring yet
                pass
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-3000:]
            return None

        return wait_for(going, timeout, step=0.2, awaited=f"the demo to get going ({min_records} calls on every rank)")

    def end(self, timeout: float = 120) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture
def runs():
    started: list[DemoRun] = []
    yield started
    for run in started:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()


@pytest.mark.parametrize("engine", list(SIZES))
def test_a_rank_stopped_from_outside_is_named_on_the_live_rings(engine: str, tmp_path: Path, runs) -> None:
    run = DemoRun(engine, tmp_path / "demo")
    runs.append(run)
    pid = run.victim_pid()
    os.kill(pid, signal.SIGSTOP)
    try:  # until the live rings show it (the others wait on the stopped rank)
        wait_for(lambda: analyze(run.out).findings[0].kind == Kind.COMPUTE_HANG, timeout=60)
        top = analyze(run.out).findings[0]
    finally:
        os.kill(pid, signal.SIGCONT)
        os.killpg(run.proc.pid, signal.SIGKILL)
        run.end()
    assert top.kind == Kind.COMPUTE_HANG and top.subject.rank == VICTIM, top.verdict
    assert top.severity == Severity.CRITICAL and "stopped running" in top.verdict


@pytest.mark.parametrize("engine", list(SIZES))
def test_a_rank_killed_from_outside_is_the_crashed_process(engine: str, tmp_path: Path, runs) -> None:
    run = DemoRun(engine, tmp_path / "demo")
    runs.append(run)
    os.kill(run.victim_pid(), signal.SIGKILL)
    run.end()
    top = analyze(run.out).findings[0]
    assert top.kind == Kind.CRASHED_PROCESS and top.subject.rank == VICTIM, top.verdict
    assert top.severity == Severity.CRITICAL


@pytest.mark.parametrize("engine", list(THROTTLED_SIZES))
def test_a_rank_throttled_from_outside_is_the_straggler(engine: str, tmp_path: Path, runs) -> None:
    run = DemoRun(engine, tmp_path / "demo", steps=150, sizes=THROTTLED_SIZES[engine])
    runs.append(run)
    with Throttle(run.victim_pid()):
        run.end(timeout=300)
    result = analyze(run.out)
    top = result.findings[0]
    assert top.kind == Kind.STRAGGLER and top.subject.rank == VICTIM, [f.verdict for f in result.findings[:3]]
    # the victim's pipeline neighbour arrives late only because it waits on the victim: no straggler of its own
    others = [f.verdict for f in result.findings if f.kind == Kind.STRAGGLER and f.subject.rank != VICTIM]
    assert not others, others
