"""Liveness: real processes of this host in each state, and the judgement over heartbeats and ring states."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.outside import wait_for

from megatrace.analyze.liveness import FROZEN_NS, assess
from megatrace.load.probe import ENDING, GONE, RUNNING, STOPPED, process_state
from megatrace.load.traceset import ProcessProbe, RankInfo

S = 1_000_000_000


def _info(rank: int, *, closed: bool = False, beat: int = 0, pulse: int = 0, pid: int = 0, host: str = "h",
          signal_ns: int = 0) -> RankInfo:
    return RankInfo(rank, host, rank, pid, f"rank-{rank}.ring", "job", "", closed, 10, 0, 0, 0, 0, heartbeat_ns=beat,
                    pulse_ns=pulse, signal_ns=signal_ns)


def test_process_state_of_a_running_a_stopped_and_a_gone_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        created = time.monotonic_ns()
        assert process_state(proc.pid, created) == RUNNING
        os.kill(proc.pid, signal.SIGSTOP)
        assert wait_for(lambda: process_state(proc.pid, created) == STOPPED, timeout=5, step=0.02)
        os.kill(proc.pid, signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()
    assert process_state(proc.pid, created) == GONE


def test_a_pid_younger_than_its_ring_is_not_the_writer() -> None:
    """A recycled pid: the process now holding it started long after the ring was created."""
    assert process_state(os.getpid(), ring_created_mono_ns=0) == GONE
    assert process_state(os.getpid(), ring_created_mono_ns=time.monotonic_ns()) == RUNNING


def _proc_copy(root, pid: int, *, flags_or: int = 0, pending: str | None = None) -> str:
    """A copy of this process's ``/proc/<pid>/stat`` and ``status``, with the flags or a pending mask changed."""
    d = root / str(pid)
    d.mkdir(parents=True)
    stat = open(f"/proc/{pid}/stat").read()
    head, rest = stat[:stat.rfind(")") + 2], stat[stat.rfind(")") + 2:].split(" ")
    rest[6] = str(int(rest[6]) | flags_or)
    (d / "stat").write_text(head + " ".join(rest))
    status = open(f"/proc/{pid}/status").read()
    if pending is not None:
        status = "\n".join(f"ShdPnd:\t{pending}" if line.startswith("ShdPnd:") else line for line in status.splitlines())
    (d / "status").write_text(status)
    return str(root)


def test_a_process_killed_a_moment_ago_and_still_tearing_down_is_gone(tmp_path) -> None:
    """A launcher's SIGKILL takes a while to tear down a big process: exiting, or with SIGKILL pending, it runs
    none of its program any more (it must not count as a rank that outlived the others)."""
    me = os.getpid()
    assert process_state(me, time.monotonic_ns(), _proc_copy(tmp_path / "plain", me)) == RUNNING
    assert process_state(me, time.monotonic_ns(), _proc_copy(tmp_path / "exiting", me, flags_or=0x4)) == GONE
    kill = f"{1 << (signal.SIGKILL - 1):016x}"
    assert process_state(me, time.monotonic_ns(), _proc_copy(tmp_path / "killed", me, pending=kill)) == GONE
    term = f"{1 << (signal.SIGTERM - 1):016x}"  # asked to end, not yet scheduled to: no survivor of the others
    assert process_state(me, time.monotonic_ns(), _proc_copy(tmp_path / "termed", me, pending=term)) == ENDING


def test_a_rank_whose_heartbeat_stopped_while_the_others_beat_is_frozen() -> None:
    infos = [_info(0, beat=100 * S), _info(1, beat=100 * S - FROZEN_NS - S), _info(2, beat=100 * S)]
    live = assess(infos, [0, 0, 0], {"h": 0}, {0: 99 * S, 1: 95 * S, 2: 99 * S}, None)
    assert set(live.frozen) == {1} and not live.crashed and live.observed_ns == 100 * S


def test_a_heartbeat_a_moment_late_is_no_stop() -> None:
    infos = [_info(0, beat=100 * S), _info(1, beat=100 * S - FROZEN_NS // 2)]
    live = assess(infos, [0, 0], {"h": 0}, {0: 99 * S, 1: 99 * S}, None)
    assert not live.culprits()


def test_a_stopped_process_is_frozen_and_a_running_one_without_beats_is_wedged() -> None:
    infos = [_info(0, beat=100 * S), _info(1, beat=100 * S), _info(2, beat=90 * S)]
    probe = ProcessProbe("h", 100 * S, {0: RUNNING, 1: STOPPED, 2: RUNNING})
    live = assess(infos, [0, 0, 0], {"h": 0}, {0: 99 * S, 1: 99 * S, 2: 89 * S}, probe)
    assert "state T" in live.frozen[1] and "wedged" in live.frozen[2] and 0 not in live.frozen


def test_the_first_process_gone_crashed_not_those_the_launcher_killed_after_it() -> None:
    """Rank 2 killed; rank 1 exits on the error; ranks 0 and 3 killed by the launcher 60 ms later."""
    ms = 1_000_000
    infos = [_info(0, pulse=100 * S + 60 * ms), _info(1, closed=True), _info(2, pulse=100 * S),
             _info(3, pulse=100 * S + 65 * ms)]
    probe = ProcessProbe("h", 200 * S, {0: GONE, 2: GONE, 3: GONE})
    live = assess(infos, [0] * 4, {"h": 0}, {r: 99 * S for r in range(4)}, probe)
    assert set(live.crashed) == {2} and "outlived" in live.crashed[2]


MS = 1_000_000


def test_the_rank_that_died_before_the_launchers_sigterm_crashed_however_close_the_others_went() -> None:
    """torchrun: rank 2 killed; 25 ms later the launcher's SIGTERM ends the rest before any closes its ring.
    Timing alone cannot tell this from a job ended as a whole; the marks can."""
    infos = [_info(r, pulse=100 * S + 25 * MS, signal_ns=100 * S + 24 * MS) for r in (0, 1, 3)]
    infos.insert(2, _info(2, pulse=100 * S))
    probe = ProcessProbe("h", 200 * S, {r: GONE for r in range(4)})
    live = assess(infos, [0] * 4, {"h": 0}, {r: 99 * S for r in range(4)}, probe)
    assert set(live.crashed) == {2} and not live.ended_together
    assert "ranks [0, 1, 3] were ended by SIGTERM after it" in live.crashed[2]


@pytest.mark.parametrize("late", ["none", "unmarked-without-pulse", "killed-after-the-signal"])
def test_a_job_whose_processes_were_ended_by_sigterm_ended_together(late: str) -> None:
    """A time limit: SIGTERM to every rank (one without the C writer cannot say so, one killed by the
    SIGKILL that follows), wherever their last pulses fell."""
    infos = [_info(r, pulse=100 * S - r * 40 * MS, signal_ns=100 * S + r * MS) for r in range(4)]
    if late == "unmarked-without-pulse":
        infos[3] = _info(3, beat=99 * S)
    elif late == "killed-after-the-signal":
        infos[3] = _info(3, pulse=100 * S + 900 * MS)
    probe = ProcessProbe("h", 200 * S, {r: GONE for r in range(4)})
    live = assess(infos, [0] * 4, {"h": 0}, {r: 98 * S for r in range(4)}, probe)
    assert live.ended_together and not live.culprits()


def test_a_process_whose_pulse_goes_on_but_whose_heartbeat_stopped_has_a_wedged_interpreter() -> None:
    infos = [_info(0, beat=100 * S, pulse=100 * S), _info(1, beat=100 * S - FROZEN_NS - S, pulse=100 * S)]
    live = assess(infos, [0, 0], {"h": 0}, {0: 99 * S, 1: 90 * S}, None)
    assert set(live.frozen) == {1} and "wedged" in live.frozen[1]


def test_a_rank_whose_sigterm_is_still_pending_ended_with_the_others() -> None:
    """A job killed as a whole on a loaded host: three ranks handled the SIGTERM (marked, gone), the fourth is not
    scheduled yet (SIGTERM pending, no mark, its process still there). It did not outlive them: nobody crashed
    (before, the first three were named crashed, "while rank 3 outlived it": a CI failure of
    test_a_job_killed_as_a_whole_is_no_hang[sigterm])."""
    infos = [_info(r, pulse=100 * S - r * 10 * MS, signal_ns=100 * S + r * MS) for r in range(3)]
    infos.append(_info(3, pulse=100 * S - 5 * MS))
    probe = ProcessProbe("h", 200 * S, {0: GONE, 1: GONE, 2: GONE, 3: ENDING})
    live = assess(infos, [0] * 4, {"h": 0}, {r: 98 * S for r in range(4)}, probe)
    assert live.ended_together and not live.culprits(), live
    unmarked = [_info(r, pulse=100 * S - r * 10 * MS) for r in range(3)] + [infos[3]]
    died = assess(unmarked, [0] * 4, {"h": 0}, {r: 98 * S for r in range(4)},
                  ProcessProbe("h", 200 * S, {0: GONE, 1: GONE, 2: GONE, 3: RUNNING}))
    assert set(died.crashed), "(the twin: a rank that truly outlives unmarked deaths still makes them crashes)"


def test_a_rank_that_unwinds_after_the_others_were_ended_went_with_them() -> None:
    """A job killed as a whole where one rank's SIGTERM came late: its collective failed as the others went, it
    raised and closed its tracer (no mark). It went with the job: no crash, the job ended together (the CI failure
    of test_a_job_killed_as_a_whole_is_no_hang[sigterm], reproduced with real torchrun in test_real_programs)."""
    infos = [_info(r, pulse=100 * S - r * MS, signal_ns=100 * S + r * MS) for r in range(3)]
    infos.append(_info(3, closed=True, pulse=100 * S + 20 * MS))
    probe = ProcessProbe("h", 200 * S, {0: GONE, 1: GONE, 2: GONE})
    live = assess(infos, [0] * 4, {"h": 0}, {r: 99 * S for r in range(4)}, probe)
    assert live.ended_together and not live.culprits() and live.followers == [3], live
    # twin: a rank that closed its tracer before any SIGTERM reached the job finished first; it is no follower,
    # and the ranks marked by SIGTERM after it are still no crash.
    early = infos[:3] + [_info(3, closed=True, pulse=99 * S)]
    live = assess(early, [0] * 4, {"h": 0}, {r: 99 * S for r in range(4)}, probe)
    assert not live.ended_together and not live.followers and not live.crashed, live


def test_processes_all_gone_at_once_with_no_ring_closed_ended_together() -> None:
    infos = [_info(r, beat=100 * S + r * 1000) for r in range(4)]
    probe = ProcessProbe("h", 200 * S, {r: GONE for r in range(4)})
    live = assess(infos, [0] * 4, {"h": 0}, {r: 99 * S for r in range(4)}, probe)
    assert live.ended_together and not live.culprits() and not live.alive


@pytest.mark.parametrize("closed", [True, False])
def test_a_ring_without_heartbeat_or_probe_names_nobody(closed: bool) -> None:
    """Imported traces and the NCCL interposer's rings carry no heartbeat: nothing is guessed."""
    infos = [_info(0, closed=closed), _info(1)]
    live = assess(infos, [0, 0], {"h": 0}, {0: 5 * S, 1: 9 * S}, None)
    assert not live.culprits() and not live.ended_together and live.observed_ns == 9 * S
