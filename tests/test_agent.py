"""The node agent: pure hang rules, live writers (a real child process that stops completing), and two agents
that confirm a hang together through the state directory and run a real mpiexec collector.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.outside import wait_for

from megatrace.collect.agent import (Agent, AgentConfig, StepsAgent, default_collect_cmd, default_state_dir,
                                     node_pattern, pid_alive, request_trigger, scan)
from megatrace.collect.detect import (DONE, EXITED, FINISHED, HEALTHY, PROGRESSING, STALLED, SUSPECT, AgentStatus,
                                      RankObservation, RankVerdict, assess_rank, job_confirmed, node_state)

BIN = Path(sys.executable).parent
MPIEXEC = shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec")
S = 1_000_000_000

# A real writer: 20 ms all-reduces (group 1) until, in mode "hang", record N+1 is entered and never completes
# (in mode "finish", the ring is closed after N records and the writer exits).
WRITER = r"""
import os, sys, time
from megatrace.trace.ring_writer import RingIdentity, RingWriter
d, rank, world, mode, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
w = RingWriter(d, RingIdentity(rank=rank, world_size=world, job_id="42", host=os.environ.get("NODE", "h")),
               capacity=1024)
w.write_meta("group", gid=1, name="0", desc="default_pg", ranks=list(range(world)), backend="gloo")
print("ready", flush=True)
seq = 0
while True:
    seq += 1
    if mode == "finish" and seq > n:
        w.close()
        sys.exit(0)
    if mode == "hang" and seq > n:
        w.begin(1, 1, seq, 4)
        print("hung", time.monotonic_ns(), flush=True)
        time.sleep(3600)
    h = w.begin(1, 1, seq, 4)
    time.sleep(0.02)
    w.complete(h)
    time.sleep(0.03)
"""


class Writers:
    """Child writer processes, killed (by pid) at the end of the test."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, d: Path, rank: int, world: int, mode: str, n: int = 10) -> subprocess.Popen:
        d.mkdir(parents=True, exist_ok=True)
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(d), str(rank), str(world), mode, str(n)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "NODE": d.name})
        self.procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


@pytest.fixture
def writers():
    w = Writers()
    yield w
    w.close()


def _hung_at(p: subprocess.Popen) -> int:
    word, t = p.stdout.readline().split()
    assert word == "hung"
    return int(t)


# -- pure rules -----------------------------------------------------------------------------------

def _obs(last_s: float, outstanding_s: float | None = None, closed: bool = False, records: int = 5) -> RankObservation:
    return RankObservation(rank=0, pid=1, file="rank-00000.ring", closed=closed, records=records,
                           last_activity_ns=int(last_s * S),
                           outstanding_since_ns=None if outstanding_s is None else int(outstanding_s * S),
                           outstanding_op="all_reduce" if outstanding_s is not None else None)


def test_a_rank_is_stalled_only_after_the_hang_timeout_without_progress() -> None:
    assert assess_rank(_obs(100), 109 * S, 10).state == PROGRESSING
    assert assess_rank(_obs(100), 111 * S, 10).state == STALLED
    assert "no new record" in assess_rank(_obs(100), 111 * S, 10).reason
    # an all-reduce entered 20 s ago, while another thread still writes records: stalled in it
    v = assess_rank(_obs(119, outstanding_s=100), 121 * S, 10)
    assert v.state == STALLED and "all_reduce outstanding" in v.reason
    assert assess_rank(_obs(100, closed=True), 500 * S, 10).state == FINISHED
    assert assess_rank(_obs(100), 101 * S, 10, alive=False).state == EXITED


def test_a_node_is_suspect_when_none_of_its_unfinished_ranks_progresses() -> None:
    def v(state: str) -> RankVerdict:
        return RankVerdict(0, state, "", 0.0)

    assert node_state([]) == "no-ranks"
    assert node_state([v(FINISHED), v(FINISHED)]) == DONE
    assert node_state([v(STALLED), v(EXITED), v(FINISHED)]) == SUSPECT
    assert node_state([v(STALLED), v(PROGRESSING)]) == HEALTHY


def test_the_job_is_hung_when_every_live_agent_with_running_ranks_suspects() -> None:
    now = 1000 * S

    def a(node: str, state: str, age_s: float = 0.0, onset: int | None = None) -> AgentStatus:
        return AgentStatus(node, state, now - int(age_s * S), onset_wall_ns=onset)

    ok, ev = job_confirmed([a("n1", SUSPECT, onset=5), a("n2", SUSPECT, onset=3)], now, 20)
    assert ok and ev["onset_wall_ns"] == 3
    assert not job_confirmed([a("n1", SUSPECT), a("n2", HEALTHY)], now, 20)[0]
    ok, ev = job_confirmed([a("n1", SUSPECT), a("n2", HEALTHY, age_s=60)], now, 20)  # n2's agent went silent
    assert ok and ev["silent_agents"] == ["n2"]
    assert job_confirmed([a("n1", SUSPECT), a("n2", DONE)], now, 20)[0]
    # n3's agent has not reported yet: wait for it, for a while; then it counts as silent
    ok, ev = job_confirmed([a("n1", SUSPECT)], now, 20, expected=["n1", "n3"], watched_s=5)
    assert not ok and ev["waiting_for_agents"] == ["n3"]
    ok, ev = job_confirmed([a("n1", SUSPECT)], now, 20, expected=["n1", "n3"], watched_s=25)
    assert ok and ev["silent_agents"] == ["n3"]
    assert not job_confirmed([a("n1", DONE), a("n2", DONE)], now, 20)[0]


# -- live writers -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_live_writer_that_stops_completing_is_flagged_and_a_healthy_one_is_not(writers: Writers,
                                                                                 tmp_path: Path) -> None:
    timeout = 1.5
    writers.start(tmp_path / "healthy", 0, 2, "run")
    hung = writers.start(tmp_path / "hung", 1, 2, "hang", n=5)
    onset = _hung_at(hung)
    flagged_at = None
    end = time.monotonic() + 3 * timeout + 1  # a fixed window, watched throughout: the healthy one never flags
    while time.monotonic() < end:
        now = time.monotonic_ns()
        (good,), _ = scan(str(tmp_path / "healthy"), now, timeout, pid_alive)
        assert good.state == PROGRESSING, good
        (bad,), _ = scan(str(tmp_path / "hung"), now, timeout, pid_alive)
        if bad.state == STALLED and flagged_at is None:
            flagged_at = now
            assert "all_reduce outstanding" in bad.reason
        elif flagged_at is None:
            assert now - onset <= (timeout + 0.1) * S, "not flagged within the hang timeout"
        time.sleep(0.1)  # the window's sampling period (a duration: nothing to wait for)
    assert flagged_at is not None and flagged_at - onset <= (timeout + 0.5) * S
    # a writer killed with its ring open is "exited" at once
    os.kill(writers.procs[0].pid, signal.SIGKILL)
    writers.procs[0].wait(timeout=10)
    (gone,), _ = scan(str(tmp_path / "healthy"), time.monotonic_ns(), timeout, pid_alive)
    assert gone.state == EXITED


def _agent(tmp_path: Path, node: str, cmd: list[str], timeout: float = 1.0) -> Agent:
    return Agent(AgentConfig(state_dir=str(tmp_path / "state"), ring_dir=str(tmp_path / node), node=node,
                             job_id="42", job_dir=str(tmp_path), hang_timeout_s=timeout, poll_s=0.2,
                             collect_cmd=cmd))


@pytest.mark.slow
def test_one_hung_node_beside_a_healthy_one_is_not_a_job_hang(writers: Writers, tmp_path: Path) -> None:
    writers.start(tmp_path / "n1", 0, 2, "hang", n=3)
    writers.start(tmp_path / "n2", 1, 2, "run")
    ran = tmp_path / "collector-ran"
    cmd = [sys.executable, "-c", f"open({str(ran)!r}, 'a').write('{{trigger}}')"]
    a1, a2 = _agent(tmp_path, "n1", cmd), _agent(tmp_path, "n2", cmd)
    end = time.monotonic() + 3.0  # a fixed window, three hang timeouts: no job hang may be declared in it
    states = set()
    while time.monotonic() < end:
        states.add((a1.poll(), a2.poll()))
        time.sleep(0.2)  # the agents' poll period (a duration: nothing to wait for)
    assert (SUSPECT, HEALTHY) in states and not ran.exists() and not (tmp_path / "state" / "hang.json").exists()
    # a request through the state directory (the batch script's USR1 trap) runs the collector once
    request_trigger(str(tmp_path / "state"), "timelimit")
    a2.poll(), a1.poll(), a2.poll()
    assert ran.read_text() == "timelimit"
    # and SIGUSR1 to an agent does the same, for its own trigger
    old = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    try:
        a1.install_signals()
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: a1.requested, timeout=5, step=0.05, awaited="the agent's SIGUSR1 handler")
        assert a1.requested == ["timelimit"]  # already collected for that reason: not run again
        a1.poll()
        assert ran.read_text() == "timelimit"
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@pytest.mark.slow
def test_every_step_is_watched_and_a_hang_of_the_second_is_collected_into_its_folder(writers: Writers,
                                                                                     tmp_path: Path) -> None:
    """A short setup step (step-0) runs and ends, then the training step (step-1) starts after the agent and
    hangs: its hang is confirmed and collected with step-1's rings into <job dir>/step-1; step-0's job-wide
    trigger request is no business of a finished step."""
    node = tmp_path / "node"
    (node / "step-0").mkdir(parents=True)
    setup = writers.start(node / "step-0", 0, 1, "finish", n=20)
    log: list[str] = []
    ran = tmp_path / "collector-ran"
    cmd = [sys.executable, "-c", f"import sys; open({str(ran)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')",
           "{trigger}"]
    agent = StepsAgent(AgentConfig(state_dir=str(tmp_path / "state"), ring_dir=None, node="n1", job_id="42",
                                   job_dir=str(tmp_path), hang_timeout_s=1.0, poll_s=0.2, collect_cmd=cmd),
                       str(node), str(tmp_path / "job"), log=log.append)
    assert agent.poll() == HEALTHY and list(agent.steps) == ["step-0"]
    setup.wait(timeout=30)  # its writer closed its ring: the step finished
    writers.start(node / "step-1", 0, 1, "hang", n=3)

    def collected() -> bool:  # the agent polled until it has collected
        if ran.exists():
            return True
        agent.poll()
        return False

    wait_for(collected, timeout=15, step=0.2)  # (a timeout fails below, with the agent's log)
    assert list(agent.steps) == ["step-0", "step-1"], log
    assert ran.read_text().split() == ["hang"], log
    step1 = agent.steps["step-1"].cfg
    assert step1.ring_dir == str(node / "step-1") and step1.out_dir == str(tmp_path / "job" / "step-1")
    assert (tmp_path / "state" / "step-1" / "hang.json").exists()
    assert not (tmp_path / "state" / "step-0" / "hang.json").exists()
    assert any("step-0 finished: no longer watched" in m for m in log), log


@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec (make install: the mpich wheel) not available")
def test_two_agents_confirm_a_hang_together_and_collect_it_with_mpiexec(writers: Writers, tmp_path: Path) -> None:
    timeout = 2.0
    job = tmp_path / "job"
    job.mkdir()
    hung = [writers.start(tmp_path / "rings" / node, rank, 2, "hang", n=8 + 4 * rank)
            for rank, node in enumerate(("n1", "n2"))]
    collector = []
    for i, node in enumerate(("n1", "n2")):
        collector += ([":"] if i else []) + [
            "-n", "1", "-env", "MEGATRACE_NODE_NAME", node, str(BIN / "megatrace"), "collect", "--ring-dir",
            f"{tmp_path}/rings/%n", "--job-dir", str(job), "--job-id", "42", "--trigger", "{trigger}",
            "--no-system", "--timeout", "20"]
    agents = []
    try:
        for node in ("n1", "n2"):
            agents.append(subprocess.Popen(
                [str(BIN / "megatrace"), "agent", "--node", node, "--ring-dir", str(tmp_path / "rings" / node),
                 "--job-dir", str(job), "--job-id", "42", "--hang-timeout", str(timeout), "--poll", "0.3",
                 "--nodes", "n[1-2]",
                 "--max-runtime", "45", "--collect-cmd", shlex.join([MPIEXEC, *collector])],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        onset = min(_hung_at(p) for p in hung)
        report = job / "megatrace-42" / "collection.json"
        assert wait_for(report.exists, timeout + 40, step=0.2), "no collection after the hang"
        took = (time.monotonic_ns() - onset) / S
        assert took <= timeout + 60, took
        doc = json.loads(report.read_text())
        assert doc["trigger"]["reason"] == "hang" and doc["nodes"]["collected"] == ["n1", "n2"]
        assert doc["ranks"] == {"world_size": 2, "collected": 2, "missing": [], "in_init_process_group": []}
        state = job / ".megatrace-42"
        hang = json.loads((state / "hang.json").read_text())
        assert hang["suspect"] == ["n1", "n2"] and hang["healthy"] == []
        assert (state / "collect-hang.lock").exists()
        assert json.loads((job / "megatrace-42" / "procs.json").read_text())["outcome"] == "stalled"
        time.sleep(1.0)  # a duration (nothing to wait for): the other agent keeps watching but does not collect again
        assert not (job / "megatrace-42.1").exists()
    finally:
        for p in agents:
            p.send_signal(signal.SIGTERM)
        for p in agents:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_the_agent_command_looks_once_and_requests_collections(writers: Writers, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from megatrace.cli import main

    writers.start(tmp_path / "rings", 0, 1, "run")
    runner = CliRunner()
    args = ["--job-dir", str(tmp_path), "--job-id", "42"]
    result = runner.invoke(main, ["agent", "--once", "--node", "n1", "--ring-dir", str(tmp_path / "rings"), *args])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"node": "n1", "state": HEALTHY}
    status = json.loads((tmp_path / ".megatrace-42" / "agents" / "n1.json").read_text())
    assert status["ranks"][0]["state"] == PROGRESSING
    result = runner.invoke(main, ["agent", "--trigger", "end", *args])
    assert result.exit_code == 0 and (tmp_path / ".megatrace-42" / "triggers" / "end").exists()
    result = runner.invoke(main, ["agent", "--job-dir", str(tmp_path / "nope")])
    assert result.exit_code == 1 and "Error:" in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_a_killed_rank_makes_its_node_suspect_only_after_the_exit_grace(writers: Writers, tmp_path: Path) -> None:
    p = writers.start(tmp_path / "n1", 0, 1, "run")
    agent = _agent(tmp_path, "n1", ["true"], timeout=1.0)  # grace = min(30 s, hang timeout)
    assert agent.poll() == HEALTHY
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=10)
    assert agent.poll() == HEALTHY  # just gone: maybe a scancel that is about to stop this agent too
    time.sleep(1.1)  # a duration, not a wait: the exit grace (the 1 s hang timeout) runs out
    assert agent.poll() == SUSPECT


@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec (make install: the mpich wheel) not available")
def test_a_crashed_rank_with_its_peers_stuck_is_collected_as_a_failure(writers: Writers, tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    crashed = writers.start(tmp_path / "n1", 0, 2, "run")
    stuck = writers.start(tmp_path / "n2", 1, 2, "hang", n=6)
    _hung_at(stuck)
    os.kill(crashed.pid, signal.SIGKILL)
    crashed.wait(timeout=10)
    collector = []
    for i, node in enumerate(("n1", "n2")):
        collector += ([":"] if i else []) + [
            "-n", "1", "-env", "MEGATRACE_NODE_NAME", node, str(BIN / "megatrace"), "collect", "--ring-dir",
            f"{tmp_path}/%n", "--job-dir", str(job), "--job-id", "42", "--trigger", "{trigger}", "--no-system",
            "--no-stacks", "--timeout", "20"]
    agents = [_agent(tmp_path, node, [MPIEXEC, *collector], timeout=1.0) for node in ("n1", "n2")]
    report = job / "megatrace-42" / "collection.json"

    def collected() -> bool:  # the agents polled until one of them has collected
        if report.exists():
            return True
        for a in agents:
            a.poll()
        return False

    wait_for(collected, timeout=20, step=0.2, awaited="the collection of the crash")
    doc = json.loads(report.read_text())
    assert doc["trigger"]["reason"] == "failure" and "ranks 0 are gone" in doc["trigger"]["detail"]
    procs = json.loads((job / "megatrace-42" / "procs.json").read_text())["ranks"]
    assert procs["0"]["alive"] is False and procs["0"]["signal"] and procs["1"]["alive"] is True
    assert procs["1"]["signal"] is None


@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec (make install: the mpich wheel) not available")
def test_a_collector_that_gave_up_in_mpi_start_up_is_run_once_more(writers: Writers, tmp_path: Path) -> None:
    """The hang collector's first step meets a process manager that never answers (its MPI_Init gives up after
    half its --timeout); the agent says so and runs it once more, and the second step collects the hang."""
    import socket

    job = tmp_path / "job"
    job.mkdir()
    hung = writers.start(tmp_path / "n1", 0, 1, "hang", n=4)
    _hung_at(hung)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # accepts and never answers
    collect = [str(BIN / "megatrace"), "collect", "--ring-dir", str(tmp_path / "n1"), "--job-dir", str(job),
               "--job-id", "42", "--trigger", "{trigger}", "--no-system", "--no-stacks", "--timeout", "8"]
    first = tmp_path / "first-step-ran"
    script = (f"if [ -e {shlex.quote(str(first))} ]; then exec {shlex.quote(MPIEXEC)} -n 1 -env "
              f"MEGATRACE_NODE_NAME n1 {shlex.join(collect)}; fi; touch {shlex.quote(str(first))}; "
              f"PMI_PORT=127.0.0.1:{silent.getsockname()[1]} PMI_RANK=0 PMI_SIZE=2 exec {shlex.join(collect)}")
    log: list[str] = []
    agent = Agent(AgentConfig(state_dir=str(tmp_path / "state"), ring_dir=str(tmp_path / "n1"), node="n1",
                              job_id="42", job_dir=str(job), hang_timeout_s=1.0, poll_s=0.2,
                              collect_cmd=["sh", "-c", script]), log=log.append)
    report = job / "megatrace-42" / "collection.json"

    def collected() -> bool:  # the agent polled until it has collected (a poll runs the collector, twice here)
        if report.exists():
            return True
        agent.poll()
        return False

    with silent:
        wait_for(collected, timeout=90, step=0.2, awaited="the hang's collection, at the second try")
    assert first.exists() and json.loads(report.read_text())["trigger"]["reason"] == "hang", log
    gave_up = [m for m in log if "collector (hang) exit 1" in m]
    assert gave_up and "a collector task gave up in MPI_Init (mpi4py's import): Timeout (0:00:04)" in gave_up[0], log
    assert any("collector (hang) failed: trying once more" in m for m in log), log
    assert any("collector (hang) exit 0" in m for m in log), log


def test_a_requeued_job_gets_a_fresh_state_directory() -> None:
    assert default_state_dir("/j", "12", restart="0") == "/j/.megatrace-12"
    assert default_state_dir("/j", "12", restart="2") == "/j/.megatrace-12.r2"


def test_under_slurm_the_agent_collects_every_node_each_from_its_own_ring_directory(monkeypatch) -> None:
    assert node_pattern("/var/megatrace/job-7.n1/step-0", "n1") == "/var/megatrace/job-7.%n/step-0"
    assert node_pattern("/shm/n1/run1", "n1") == "/shm/%n/run1"
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    cfg = AgentConfig(state_dir="/s", ring_dir="/var/megatrace/job-7.n1/step-0", node="n1", job_id="7",
                      job_dir="/home/u", nodes=["n1", "n2", "n3"])
    cmd = default_collect_cmd(cfg)
    assert cmd[0] == "srun" and "--overlap" in cmd and "--mpi=pmi2" in cmd and "--nodes=3" in cmd
    assert cmd[cmd.index("--ring-dir") + 1] == "/var/megatrace/job-7.%n/step-0"


# -- whose rings: the job's user's, of this job (issue 20, item 5) ---------------------------------------------

def _stale_ring(directory: Path, job_id: str, age_s: float = 3600.0) -> None:
    """A ring whose only call was entered ``age_s`` ago and never completed: a stalled rank to an agent."""
    from megatrace.trace.ring_writer import RingIdentity, RingWriter

    w = RingWriter(directory, RingIdentity(rank=0, world_size=1, job_id=job_id, host="h"), capacity=16,
                   use_native=False)
    w.begin(1, 1, 1, 4, _now=lambda: time.monotonic_ns() - int(age_s * S))


def _live_ring(directory: Path, job_id: str) -> None:
    from megatrace.trace.ring_writer import RingIdentity, RingWriter

    w = RingWriter(directory, RingIdentity(rank=0, world_size=1, job_id=job_id, host="h", pid=os.getpid()),
                   capacity=16, use_native=False)
    w.complete(w.begin(1, 1, 1, 4))


@pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root")
def test_the_agent_never_watches_a_directory_another_user_named_after_the_job(tmp_path: Path, monkeypatch) -> None:
    """A directory <base>/<job>.evil with a stale ring made the victim's agent watch it and go suspect."""
    from megatrace.trace import settings as tsettings

    base = tmp_path / "base"
    (base / "77.0").mkdir(parents=True)
    _live_ring(base / "77.0", "77")  # the job's own step: progressing
    evil = base / "77.evil"
    evil.mkdir(mode=0o755)
    _stale_ring(evil, "77")
    for p in (evil, *evil.iterdir()):
        os.lchown(p, 4242, 4242)
    (base / "77.1").mkdir()
    _stale_ring(base / "77.1", "99")  # our own directory, but another job's ring in it
    from megatrace.collect.node import job_ring_dirs

    assert set(job_ring_dirs("77", str(base))) == {str(base / "77.0"), str(base / "77.1")}  # not 77.evil
    monkeypatch.setattr(tsettings, "default_base", lambda uid=None: base)
    agent = Agent(AgentConfig(state_dir=str(tmp_path / "state"), ring_dir=None, node="n1", job_id="77",
                              job_dir=str(tmp_path), hang_timeout_s=60, exit_when_done=False,
                              timelimit_lead_s=None))
    assert set(agent.ring_dirs()) == {str(base / "77.0"), str(base / "77.1")}  # not 77.evil
    assert agent.poll() == HEALTHY
    status = json.loads((tmp_path / "state" / "agents" / "n1.json").read_text())
    assert len(status["ranks"]) == 1 and status["ranks"][0]["state"] == PROGRESSING
