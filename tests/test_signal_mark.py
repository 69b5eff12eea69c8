"""The SIGTERM mark: a process ended from outside says so in its ring header; a SIGKILL, a forked
child's SIGTERM and a program's own handler leave no mark, and the process ends exactly as before."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatrace.trace.ring_reader import read_ring

pytest.importorskip("megatrace.trace._ringfast", reason="C hot path not built (no compiler at install)")

WRITER = textwrap.dedent("""
    import os, signal, sys, time
    from megatrace.trace.ring_writer import RingIdentity, RingWriter
    mode = sys.argv[2]
    if mode == "own-handler":
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
    w = RingWriter(sys.argv[1], RingIdentity(rank=0, world_size=1), capacity=16)
    w.start_pulse()
    w.begin(1, 0, 1, 8, -1, 0, 0)
    print(w.fast.marks_signal(), signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
    if mode == "child":
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        print("child ended", flush=True)
    if mode == "closing":
        print("closing", flush=True)
    if mode in ("closed", "closing"):
        w.close()
        print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
    time.sleep(60)
""")


def _run(tmp_path: Path, mode: str, sig: int) -> tuple[int, list[str], object]:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lines = [proc.stdout.readline().strip()]
    if mode in ("child", "closed"):
        lines.append(proc.stdout.readline().strip())
    proc.send_signal(sig)
    proc.wait(timeout=30)
    return proc.returncode, lines, read_ring(tmp_path / "rank-00000.ring").header


def test_a_process_ended_by_sigterm_marks_its_ring_and_still_ends_by_it(tmp_path: Path) -> None:
    code, lines, header = _run(tmp_path, "plain", signal.SIGTERM)
    assert lines == ["True True"]  # Python's own view of the disposition is unchanged
    assert code == -signal.SIGTERM
    assert header.signal == signal.SIGTERM
    assert header.anchor_mono_ns < header.signal_ns and not header.closed_cleanly


def test_a_sigkill_leaves_no_mark(tmp_path: Path) -> None:
    code, _, header = _run(tmp_path, "plain", signal.SIGKILL)
    assert code == -signal.SIGKILL and header.signal == 0 and header.signal_ns == 0


def test_a_forked_child_ended_by_sigterm_does_not_speak_for_the_rank(tmp_path: Path) -> None:
    code, lines, header = _run(tmp_path, "child", signal.SIGKILL)
    assert lines[1] == "child ended" and code == -signal.SIGKILL
    assert header.signal == 0


def test_a_programs_own_sigterm_handler_is_left_alone(tmp_path: Path) -> None:
    code, lines, header = _run(tmp_path, "own-handler", signal.SIGTERM)
    assert lines == ["False False"] and code == 7 and header.signal == 0


def test_a_closed_ring_gives_the_signal_back(tmp_path: Path) -> None:
    code, lines, header = _run(tmp_path, "closed", signal.SIGTERM)
    assert lines == ["True True", "True"] and code == -signal.SIGTERM
    assert header.closed_cleanly and header.signal == 0


def test_a_sigterm_while_the_ring_closes_finds_it_closed_or_marked(tmp_path: Path) -> None:
    """A launcher's SIGTERM can reach a rank while its tracer closes the ring (the rank is ending on its own
    error): the ring must then read closed or marked, never neither (which reads as a crash)."""
    for attempt in range(12):
        out = tmp_path / str(attempt)
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out), "closing"], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout is not None
        proc.stdout.readline()
        assert proc.stdout.readline().strip() == "closing"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        header = read_ring(out / "rank-00000.ring").header
        assert header.closed_cleanly or header.signal == signal.SIGTERM, attempt
