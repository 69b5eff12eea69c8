"""This host's process table for the rings still open: is each writer running, stopped, ending or gone.

Read once at load time (:func:`probe`, into ``NodeFacts.probe``) and judged by
:mod:`megatrace.analyze.liveness`. A pid is trusted only if its process started before its ring was
created (a recycled pid is not the writer); a process already exiting, or with SIGKILL pending, is gone
(a launcher's kill still tearing down a big process); one with SIGTERM pending is ending.
"""

from __future__ import annotations

import os
import signal
import socket
import time

from megatrace.load.traceset import ProcessProbe, RankInfo

RUNNING, STOPPED, GONE = "running", "stopped", "gone"
ENDING = "ending"  # a SIGTERM waits to be delivered: asked to end from outside, a moment before its signal mark
START_SLACK_NS = 5_000_000_000  # a writer's process started at most this long after its ring was created
PF_EXITING = 0x4  # /proc/<pid>/stat flags: the process is exiting (killed, tearing down its memory)


def local_names() -> set[str]:
    names = {socket.gethostname()}
    node = os.environ.get("SLURMD_NODENAME")
    if node:
        names.add(node)
    return names


def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):
        return 100


def process_state(pid: int, ring_created_mono_ns: int, proc: str = "/proc") -> str:
    """RUNNING, STOPPED, ENDING or GONE for the writer ``pid`` of a ring created at ``ring_created_mono_ns``."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read(4096).decode("ascii", "replace")
    except OSError:
        return GONE
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
    if len(fields) < 20:
        return GONE
    state, start_ticks = fields[0], int(fields[19]) if fields[19].isdigit() else 0
    if start_ticks * 1_000_000_000 // _clock_ticks() > ring_created_mono_ns + START_SLACK_NS:
        return GONE  # this pid now belongs to a process younger than the ring
    if state in ("Z", "X", "x"):
        return GONE
    pending = _pending(pid, proc)
    if (int(fields[6]) if fields[6].isdigit() else 0) & PF_EXITING or pending & (1 << (signal.SIGKILL - 1)):
        return GONE  # killed a moment ago and still tearing down: it runs no more of its program
    if state in ("T", "t"):
        return STOPPED
    # A SIGTERM not yet delivered (a loaded host schedules it late): a launcher or the scheduler is ending it. It
    # is no rank that outlived the others, whatever its program then does with the signal.
    return ENDING if pending & (1 << (signal.SIGTERM - 1)) else RUNNING


def _pending(pid: int, proc: str) -> int:
    """The signals waiting to be delivered to ``pid`` (``SigPnd`` | ``ShdPnd`` of its status, a bit mask)."""
    try:
        with open(f"{proc}/{pid}/status", "rb") as f:
            status = f.read(8192).decode("ascii", "replace")
    except OSError:
        return 0
    mask = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            try:
                mask |= int(line.split(":", 1)[1].strip(), 16)
            except ValueError:
                continue
    return mask


def probe(infos: list[RankInfo]) -> ProcessProbe | None:
    """The states of the open rings' writers on this host; None when no such ring is here."""
    names = local_names()
    mine = [i for i in infos if not i.closed_cleanly and i.pid > 0 and i.host in names]
    if not mine:
        return None
    states = {i.rank: process_state(i.pid, i.anchor_mono_ns) for i in mine}
    return ProcessProbe(next(iter(names & {i.host for i in mine})), time.monotonic_ns(), states)
