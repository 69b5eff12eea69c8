"""Fault injection inside one demo worker (the specs are in :mod:`megatrace.demo.faults`).

``hang``, ``crash`` and ``slow`` act at the Python level, between the training loop's own
steps. ``commhang`` acts *below* every caller of a process group, DDP's reducer, FSDP,
DTensor and pipelining included: it stops this process's gloo threads (transport loop and
``ProcessGroupGloo`` workers) for good, so the rank's next collective is entered, recorded
by the tracer, and never completes, and its peers wait in the same collective. ``slowlink``
delays ``ProcessGroup.send`` between two ranks, under the ``torch.distributed`` functions but
above the c10d operator where the tracer records: the send is recorded late and the peer's
receive, posted earlier, waits the delay out. For that, a rank with a slow link posts the
receives of each ``batch_isend_irecv`` before its sends, as the 3D demo's own batches do
(torch's pipelining lists the sends first, and the delay would hold up the receives behind them).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from megatrace.config import Layout
from megatrace.demo.faults import (CommHangFault, CrashFault, FaultSpec, HangFault, PHASES, SlowFault,
                                   SlowLinkFault, format_fault)

# Thread names of gloo's TCP transport loop and of ProcessGroupGloo's workers (torch 2.x).
COMM_THREAD_PREFIXES = ("gloo_", "pt_gloo")
FREEZE_SIGNAL = signal.SIGUSR2


def _say(message: str) -> None:
    print(f"megatrace demo: {message}", file=sys.stderr, flush=True)


def block_forever() -> None:
    """Sleep until killed (what a wedged rank looks like from outside)."""
    while True:
        time.sleep(3600)


class FreezeError(RuntimeError):
    """The communication threads of this process cannot be stopped here."""


def freeze_comm_threads() -> int:
    """Stop every gloo thread of this process where it is, for good; return how many were stopped.

    Each gets :data:`FREEZE_SIGNAL`, whose handler is libc's ``pause()``: the thread sleeps inside
    the handler until the process dies. The main thread runs on: its next collective is entered,
    and waits forever for a worker that never runs it. SIGTERM and SIGKILL still end the process.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    tgkill = getattr(libc, "tgkill", None)
    if tgkill is None or not os.path.isdir("/proc/self/task"):
        raise FreezeError("commhang needs Linux with glibc 2.30 or newer (tgkill, /proc/self/task)")
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(FREEZE_SIGNAL, ctypes.cast(libc.pause, ctypes.c_void_p))
    frozen = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # the thread has just exited
            continue
        if name.startswith(COMM_THREAD_PREFIXES) and tgkill(os.getpid(), int(tid), FREEZE_SIGNAL) == 0:
            frozen += 1
    if not frozen:
        raise FreezeError("no gloo thread found in this process (is the process group initialised?)")
    return frozen


class FaultInjector:
    """The faults that concern one rank, driven by the training loop's step and phase notifications."""

    def __init__(self, faults: list[FaultSpec], rank: int, layout: Layout) -> None:
        self.rank = rank
        self.layout = layout
        self.faults = [f for f in faults
                       if (rank in f.ranks if isinstance(f, SlowLinkFault) else f.rank == rank)]
        self.step = -1
        self.phase = ""
        self._hang_armed: HangFault | None = None
        self._commhang = next((f for f in self.faults if isinstance(f, CommHangFault)), None)
        self._frozen = False

    # -- notifications from the training loop ---------------------------------------------------
    def install(self) -> None:
        """Patch the ProcessGroup class for a slowlink fault (call after init_process_group)."""
        links = [f for f in self.faults if isinstance(f, SlowLinkFault)]
        for fault in links:
            self._patch_send(fault)
        if links:
            _receives_first()

    def start_step(self, step: int) -> None:
        self.step, self.phase = step, ""
        for fault in self.faults:
            if isinstance(fault, CrashFault) and fault.step == step:
                _say(f"injected crash on rank {self.rank} at step {step} ({format_fault(fault)})")
                sys.stdout.flush()
                os._exit(1)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        for fault in self.faults:
            if (isinstance(fault, HangFault) and self._hang_armed is None
                    and (self.step, PHASES.index(phase)) >= (fault.step, PHASES.index(fault.phase))):
                self._hang_armed = fault

    def before_comm(self, p2p: bool = False) -> None:
        """Called right before a communication call, or where a phase that issues them starts.

        An armed hang stops the rank here. From the commhang fault's step on, the first call that
        is not point-to-point stops the rank's communication threads: that call never returns.
        """
        self._stop_if_hang()
        fault = self._commhang
        if fault is not None and not p2p and not self._frozen and self.step >= fault.step:
            threads = freeze_comm_threads()
            self._frozen = True
            _say(f"injected commhang on rank {self.rank} at step {self.step} ({self.phase or 'start'}): "
                 f"{threads} gloo threads stopped, the next collective never returns ({format_fault(fault)})")

    def _stop_if_hang(self) -> None:
        if self._hang_armed is not None:
            _say(f"injected hang on rank {self.rank} at step {self.step} ({self.phase}) before a "
                 f"communication call ({format_fault(self._hang_armed)})")
            block_forever()

    def end_step(self) -> None:
        """An armed hang that met no communication call in its phase stops the rank at the step's end."""
        self._stop_if_hang()

    def slowdown(self) -> float:
        """The factor by which this rank's compute runs slower at the current step."""
        factor = 1.0
        for fault in self.faults:
            if isinstance(fault, SlowFault) and self.step >= fault.from_step:
                factor *= fault.factor
        return factor

    # -- below-the-API patches --------------------------------------------------------------------
    def _patch_send(self, fault: SlowLinkFault) -> None:
        import torch.distributed as dist
        from torch._C._distributed_c10d import ProcessGroup

        other = fault.ranks[1] if fault.ranks[0] == self.rank else fault.ranks[0]
        delay_s = fault.delay_ms / 1000.0
        orig = ProcessGroup.send

        def send(pg: Any, tensors: Any, dst: int, *args: Any, **kwargs: Any) -> Any:
            try:
                peer = dist.get_global_rank(pg, dst)
            except (RuntimeError, ValueError):  # a group torch.distributed does not know: not the link
                peer = None
            if peer == other:
                time.sleep(delay_s)
            return orig(pg, tensors, dst, *args, **kwargs)

        ProcessGroup.send = send


def _receives_first() -> None:
    """Make ``dist.batch_isend_irecv`` post a batch's receives before its sends (gloo runs them as listed)."""
    import torch.distributed as dist

    orig = dist.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list: list[Any]) -> Any:
        ops = list(p2p_op_list)
        ops.sort(key=lambda op: getattr(op.op, "__name__", "") != "irecv")  # stable: receives, then sends
        return orig(ops)

    batch_isend_irecv.__doc__ = orig.__doc__
    dist.batch_isend_irecv = batch_isend_irecv
