"""Plain PyTorch programs (tests/programs/, nothing of MegaTrace in them) under torchrun, faults from outside.

Each program is traced only by the environment (``MEGATRACE_ENABLE=1``); faults are what an incident
does to a process: SIGSTOP, SIGKILL, the whole job killed at once. ``megatrace analyze`` then runs on
the rings, live (while the fault holds) or after the end, as a user would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.trace.ring_reader import RingFormatError, read_ring
from helpers.outside import Throttle, wait_for

pytest.importorskip("torch")

PROGRAMS = Path(__file__).with_name("programs")
DDP = PROGRAMS / "ddp_reduce_loop.py"
PLAYER = PROGRAMS / "player_trainers.py"
WORLD = 4
HANG_KINDS = {Kind.COMPUTE_HANG, Kind.COMM_HANG, Kind.CRASHED_PROCESS, Kind.EXITED_EARLY, Kind.DEADLOCK,
              Kind.POSSIBLE_HANG, Kind.PARTIAL_STOP, Kind.NO_TRACE}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A torchrun job of one program, traced into ``out/rings``."""

    def __init__(self, program: Path, out: Path, *args: str) -> None:
        self.rings = out / "rings"
        env = dict(os.environ, MEGATRACE_ENABLE="1", MEGATRACE_DIR=str(self.rings), MEGATRACE_JOB_ID="real",
                   PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                   PYTHONFAULTHANDLER="1")  # a SIGABRT from a test writes every thread's Python stack to job.log
        self.log = (out / "job.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-addr",
             "127.0.0.1", "--master-port", str(_free_port()), str(program), *args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def pid(self, rank: int, warm_records: int = 40, timeout: float = 120) -> int:
        """The pid of ``rank`` once every rank has recorded ``warm_records`` calls (training is under way)."""

        def warm() -> int | None:
            try:
                snaps = [read_ring(self.rings / f"rank-{r:05d}.ring") for r in range(WORLD)]
                if all(s.header.write_counter >= warm_records for s in snaps):
                    return snaps[rank].header.pid
            except (OSError, ValueError, RingFormatError):  # a ring being created reads as no ring yet
                pass
            assert self.proc.poll() is None, (self.rings.parent / "job.log").read_text()[-3000:]
            return None

        return wait_for(warm, timeout, step=0.2, awaited=f"the job to warm up ({warm_records} calls on every rank)")

    def worker_pids(self) -> list[int]:
        """The ranks' processes (torchrun starts each in a session of its own), from their ring headers."""
        pids = []
        for path in sorted(self.rings.glob("rank-*.ring")):
            try:
                pid = read_ring(path).header.pid
            except (OSError, ValueError, RingFormatError):  # a ring being created reads as no ring yet
                continue
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().find(b"tests/programs/") >= 0:
                    pids.append(pid)
            except OSError:
                pass
        return pids

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """Signal the launcher and every rank at once (a time limit, a cancel).

        SIGKILL goes to processes stopped first. One ``kill`` after another is no single moment: on a loaded host
        this process can be held off the CPU for tens of milliseconds between two of them, while the ranks already
        killed close their sockets and the others' collectives fail and unwind, which is a crash's signature (CI
        saw ranks 1 and 3 close their tracers 20 ms after ranks 0 and 2 vanished). A stopped process cannot run
        until its SIGKILL ends it, so every rank goes as if at one moment, as a slurmstepd's kill loop in C makes it.
        """
        pids = [self.proc.pid, *self.worker_pids()]
        for step in ([signal.SIGSTOP] if sig == signal.SIGKILL else []) + [sig]:
            for pid in pids:
                try:
                    os.kill(pid, step)
                except ProcessLookupError:
                    pass

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None or self.worker_pids():
            self.kill_all()
            self.proc.wait()
        if not self.log.closed:
            self.log.close()


@pytest.fixture
def jobs():
    started: list[Job] = []
    yield started
    for job in started:
        job.stop()


PERFORMANCE = {Kind.STRAGGLER, Kind.SLOW_LINK, Kind.SLOW_RANK_NETWORK, Kind.STEP_SLOWDOWN}


def _top(rings: Path):
    result = analyze(rings)
    return result, result.findings[0]


def test_a_healthy_ddp_script_is_healthy(tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(DDP, tmp_path, "--iterations", "30")
    jobs.append(job)
    assert job.wait() == 0
    result, top = _top(job.rings)
    assert top.kind == Kind.HEALTHY, top.verdict
    assert not [f for f in result.findings if f.kind in HANG_KINDS]
    # DDP's gradient all-reduces are in the trace: 4 backward passes per iteration, one bucket each or more.
    assert result.match.summary()["collective_instances"] >= 30 * 5


@pytest.mark.parametrize("program", [DDP, PLAYER], ids=["ddp", "player-trainers"])
def test_a_stopped_rank_is_named_while_it_hangs(program: Path, tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(program, tmp_path, "--iterations", "100000", "--seconds", "120")
    jobs.append(job)
    pid = job.pid(2)
    os.kill(pid, signal.SIGSTOP)
    try:
        # A duration, not a wait: the rank stays stopped for seconds, as in an incident, before anyone looks (its
        # peers block on it meanwhile, and its heartbeat falls behind theirs by more than FROZEN_NS, 3 s).
        time.sleep(4)
        result, top = _top(job.rings)  # live: the job hangs while we look
    finally:
        os.kill(pid, signal.SIGCONT)
    assert top.kind == Kind.COMPUTE_HANG and top.subject.rank == 2, top.verdict
    assert top.severity == Severity.CRITICAL and "stopped running" in top.verdict
    assert "GPU" not in top.verdict and top.subject.local_rank is None  # a gloo job on CPUs: no GPU to name
    assert any("state T" in str(e) for e in top.evidence), top.evidence
    partial = [f for f in result.findings if f.kind == Kind.PARTIAL_STOP]
    assert not partial or 2 not in partial[0].subject.ranks


@pytest.mark.parametrize("program", [DDP, PLAYER], ids=["ddp", "player-trainers"])
def test_a_killed_rank_is_the_crashed_process(program: Path, tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(program, tmp_path, "--iterations", "100000", "--seconds", "120")
    jobs.append(job)
    os.kill(job.pid(2), signal.SIGKILL)
    assert job.wait() != 0
    _, top = _top(job.rings)
    assert top.kind == Kind.CRASHED_PROCESS and top.subject.rank == 2, top.verdict
    assert top.severity == Severity.CRITICAL


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_job_killed_as_a_whole_is_no_hang(sig: int, tmp_path: Path, jobs: list[Job]) -> None:
    """A time limit or a cancel: every rank killed at the same moment while training ran normally."""
    job = Job(DDP, tmp_path, "--iterations", "100000", "--seconds", "120")
    jobs.append(job)
    job.pid(0, warm_records=200)
    job.kill_all(sig)
    job.wait()
    result = analyze(job.rings)
    healthy = [f for f in result.findings if f.kind == Kind.HEALTHY]
    assert len(healthy) == 1 and "ended as a whole" in healthy[0].verdict, _diagnosis(result)
    # Nothing stopped (a job sharing 2 cores among 4 ranks may still show a rank slower than the others:
    # that is performance, which this test does not judge).
    alarms = [f.verdict for f in result.at_least(Severity.WARNING) if f.kind not in PERFORMANCE]
    assert not alarms, alarms


def test_a_rank_whose_sigterm_comes_late_goes_with_the_job(tmp_path: Path, jobs: list[Job]) -> None:
    """A cancel that reaches one rank late (a loaded host): the others are ended by SIGTERM, its all-reduce fails as
    they go, it raises and closes its tracer. It went with the job: no crash, no hang (the CI failure of the test
    above, made certain: torchrun is held stopped meanwhile, so that it cannot end rank 3 first)."""
    job = Job(DDP, tmp_path, "--iterations", "100000", "--seconds", "120")
    jobs.append(job)
    job.pid(0, warm_records=200)
    ring3 = job.rings / "rank-00003.ring"
    late = read_ring(ring3).header.pid
    os.kill(job.proc.pid, signal.SIGSTOP)  # the launcher, delayed
    try:
        for pid in job.worker_pids():
            if pid != late:
                os.kill(pid, signal.SIGTERM)
        # rank 3 fails in its next all-reduce and unwinds (a timeout fails below, with the diagnosis)
        unwound = wait_for(lambda: read_ring(ring3).header.closed_cleanly or not Path(f"/proc/{late}").exists(), 60,
                           step=0.1)
        stuck = "" if unwound else _where_it_is(late, job)
    finally:
        os.kill(job.proc.pid, signal.SIGCONT)
    job.kill_all(signal.SIGTERM)
    job.wait()
    result = analyze(job.rings)
    assert read_ring(ring3).header.closed_cleanly, _diagnosis(result) + stuck
    healthy = [f for f in result.findings if f.kind == Kind.HEALTHY]
    assert len(healthy) == 1 and "ended as a whole" in healthy[0].verdict, _diagnosis(result)
    assert "rank 3 closed the tracer after the others were ended" in str(healthy[0].evidence), _diagnosis(result)
    assert not [f for f in result.findings if f.kind in HANG_KINDS], _diagnosis(result)


def _where_it_is(pid: int, job: Job) -> str:
    """Where a process that should have ended is: its threads' kernel wait channels, then (SIGABRT, caught by
    PYTHONFAULTHANDLER) every thread's Python stack, from the job's log."""
    lines = ["", f"pid {pid} still running:"]
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            lines.append(f"  thread {task.name} {state} in {(task / 'wchan').read_text() or '-'}")
        except OSError:
            pass
    os.kill(pid, signal.SIGABRT)
    wait_for(lambda: _state(pid) in ("Z", "X", ""), 10, step=0.1)  # (a zombie: its launcher is stopped)
    job.log.flush()
    return "\n".join(lines) + "\n" + (job.rings.parent / "job.log").read_text()[-12000:]


def _state(pid: int) -> str:
    """A process's state letter (R, S, D, Z...), "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _diagnosis(result) -> str:
    """What the analysis saw, for a failure's message: its findings, each rank's end and the liveness judgement."""
    lines = [f"{f.severity.name} {f.kind.value}: {f.verdict} | {f.evidence[:3]}" for f in result.findings[:6]]
    for i in result.trace.rank_info:
        lines.append(f"rank {i.rank}: pid {i.pid} closed {i.closed_cleanly} signal_ns {i.signal_ns} "
                     f"pulse_ns {i.pulse_ns} heartbeat_ns {i.heartbeat_ns} records {i.n_records}")
    hang = result.results.get("hang")
    lines.append(f"probe {result.trace.facts.probe}; liveness {getattr(hang, 'liveness', None)}")
    return "\n".join(lines)


def test_a_live_job_silent_everywhere_is_a_stall_not_healthy(tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(PLAYER, tmp_path, "--iterations", "100000", "--seconds", "120", "--pause-at", "30", "--pause-s", "60")
    jobs.append(job)
    job.pid(0, warm_records=60)
    looks = []

    def stalled():  # the pause starts at iteration 30
        looks.append(_top(job.rings))
        return looks[-1][1] if looks[-1][1].kind == Kind.STALL else None

    stall = wait_for(stalled, timeout=90, step=2)
    result, top = looks[-1]
    assert stall is not None, top.verdict
    assert stall.severity == Severity.WARNING and "alive" in stall.verdict
    assert not [f for f in result.findings if f.kind == Kind.HEALTHY]


def test_a_rank_throttled_from_outside_is_the_straggler(tmp_path: Path, jobs: list[Job]) -> None:
    """Rank 3 stopped 50 ms of every 100 ms: DDP's gradient all-reduces wait for it, in bursts."""
    job = Job(DDP, tmp_path, "--iterations", "100000", "--seconds", "30")
    jobs.append(job)
    with Throttle(job.pid(3)):
        assert job.wait() == 0
    result, top = _top(job.rings)
    assert top.kind == Kind.STRAGGLER and top.subject.rank == 3, [f.verdict for f in result.findings[:3]]
    assert top.severity == Severity.WARNING
    assert not [f for f in result.findings if f.kind in HANG_KINDS]
