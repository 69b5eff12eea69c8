"""Fault injection inside one demo worker (the specs are in :mod:`megatrace.demo.faults`).

``hang``, ``crash`` and ``slow`` act at the Python level, between the demo's own
calls. ``commhang`` and ``slowlink`` act *below* the ``torch.distributed`` API:
they patch methods of the C++ ``ProcessGroup`` class, so a tracer hooking
``dist.all_reduce`` or ``dist.isend`` sees the call entered on time.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

from megatrace.config import Layout
from megatrace.demo.faults import (CommHangFault, CrashFault, FaultSpec, HangFault, PHASES, SlowFault,
                                   SlowLinkFault, format_fault)

# ProcessGroup methods behind the collectives the demo issues (names differ across torch versions).
COLLECTIVE_METHODS = ("allreduce", "allreduce_coalesced", "reduce_scatter_single", "_reduce_scatter_base",
                      "reduce_scatter_tensor_coalesced", "all_gather_single", "_allgather_base",
                      "allgather_into_tensor_coalesced")


def _say(message: str) -> None:
    print(f"megatrace demo: {message}", file=sys.stderr, flush=True)


def block_forever() -> None:
    """Sleep until killed (what a wedged rank looks like from outside)."""
    while True:
        time.sleep(3600)


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
        self._commhang_from: int | None = None

    # -- notifications from the training loop ---------------------------------------------------
    def install(self) -> None:
        """Patch the ProcessGroup class for commhang / slowlink faults (call after init_process_group)."""
        for fault in self.faults:
            if isinstance(fault, CommHangFault):
                self._commhang_from = fault.step
                self._patch_collectives()
            elif isinstance(fault, SlowLinkFault):
                self._patch_send(fault)

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

    def before_comm(self) -> None:
        """Called right before every collective / p2p call: an armed hang stops the rank here."""
        if self._hang_armed is not None:
            _say(f"injected hang on rank {self.rank} at step {self.step} ({self.phase}) before a "
                 f"communication call ({format_fault(self._hang_armed)})")
            block_forever()

    def end_step(self) -> None:
        """An armed hang that met no communication call in its phase stops the rank at the step's end."""
        self.before_comm()

    def slowdown(self) -> float:
        """The factor by which this rank's compute runs slower at the current step."""
        factor = 1.0
        for fault in self.faults:
            if isinstance(fault, SlowFault) and self.step >= fault.from_step:
                factor *= fault.factor
        return factor

    # -- below-the-API patches --------------------------------------------------------------------
    def _patch_collectives(self) -> None:
        from torch._C._distributed_c10d import ProcessGroup

        for name in COLLECTIVE_METHODS:
            if hasattr(ProcessGroup, name):
                setattr(ProcessGroup, name, self._commhang_wrapper(name, getattr(ProcessGroup, name)))

    def _commhang_wrapper(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        def patched(pg: Any, *args: Any, **kwargs: Any) -> Any:
            if self._commhang_from is not None and self.step >= self._commhang_from:
                _say(f"injected commhang on rank {self.rank} at step {self.step}: ProcessGroup.{name} "
                     f"on group {getattr(pg, 'group_desc', '?')} never returns")
                block_forever()
            return orig(pg, *args, **kwargs)

        return patched

    def _patch_send(self, fault: SlowLinkFault) -> None:
        from torch._C._distributed_c10d import ProcessGroup

        other = fault.ranks[1] if fault.ranks[0] == self.rank else fault.ranks[0]
        pp_ranks = self.layout.group_of("pp", self.rank)
        delay_s = fault.delay_ms / 1000.0
        orig = ProcessGroup.send

        def send(pg: Any, tensors: Any, dst: int, *args: Any, **kwargs: Any) -> Any:
            if getattr(pg, "group_desc", "") == "pp" and pp_ranks[dst] == other:
                time.sleep(delay_s)
            return orig(pg, tensors, dst, *args, **kwargs)

        ProcessGroup.send = send
