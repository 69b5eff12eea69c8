"""Fault injection inside one demo worker (the specs are in :mod:`megatrace.demo.faults`).

``hang``, ``crash`` and ``slow`` act at the Python level, between the demo's own
calls. ``commhang`` and ``slowlink`` act *inside* the communication call: a kernel of
their own sits in front of the c10d operators' CPU kernels (``torch.library``, keeping
the original), registered before the process group exists. The tracer's dispatcher
hook, installed when the process group is created, then sits in front of it, so the
call is recorded as entered on time and hangs, or is late, inside the backend, as a
stuck network would make it. That holds whoever issues the call: the demo, DDP's reducer,
FSDP, DTensor or pipelining. A rank with a slow link also posts the receives of each
``batch_isend_irecv`` before its sends (as the 3D demo's own batches do; torch's pipelining
lists the sends first), so that a late send does not hold up the sender's own receives.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from functools import partial
from typing import Any, Callable

from megatrace.config import Layout
from megatrace.demo.faults import (CommHangFault, CrashFault, FaultSpec, HangFault, PHASES, SlowFault,
                                   SlowLinkFault, format_fault)

# c10d operators behind the collectives the demo issues, and the one behind a send.
COLLECTIVE_OPS = ("allreduce_", "allreduce_coalesced_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
                  "_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_", "reduce_scatter_")
SEND_OP = "send"
P2P_OPS = (SEND_OP, "recv_")


def _say(message: str) -> None:
    print(f"megatrace demo: {message}", file=sys.stderr, flush=True)


def block_forever() -> None:
    """Sleep until killed (what a wedged rank looks like from outside)."""
    while True:
        time.sleep(3600)


class FaultInjector:
    """The faults that concern one rank, driven by the training loop's step and phase notifications."""

    def __init__(self, faults: list[FaultSpec], rank: int, layout: Layout,
                 commhang_ops: tuple[str, ...] = COLLECTIVE_OPS) -> None:
        """``commhang_ops``: the c10d operators a commhang stops in (an engine whose only traffic is
        point-to-point adds :data:`P2P_OPS`)."""
        self.rank = rank
        self.commhang_ops = commhang_ops
        self.layout = layout
        self.faults = [f for f in faults
                       if (rank in f.ranks if isinstance(f, SlowLinkFault) else f.rank == rank)]
        self.step = -1
        self.phase = ""
        self._hang_armed: HangFault | None = None
        self._commhang_from: int | None = None
        self._library: Any = None

    # -- notifications from the training loop ---------------------------------------------------
    def install(self) -> None:
        """Put the commhang / slowlink kernels in place; call *before* init_process_group (see the module doc)."""
        for fault in self.faults:
            if isinstance(fault, CommHangFault):
                self._commhang_from = fault.step
                for op in self.commhang_ops:
                    self._wrap_kernel(op, self._commhang_kernel)
            elif isinstance(fault, SlowLinkFault):
                self._wrap_kernel(SEND_OP, partial(self._slowlink_kernel, fault))
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

    # -- inside the communication call ------------------------------------------------------------
    def _wrap_kernel(self, op: str, inject: Callable[..., None]) -> None:
        """Run ``inject(op, args)`` in front of the CPU kernel of ``c10d::<op>``, then the kernel itself."""
        import torch

        if self._library is None:
            self._library = torch.library.Library("c10d", "IMPL")
        try:
            original = torch.library.get_kernel(f"c10d::{op}", "CPU")
        except RuntimeError:  # not an operator of this torch
            return

        def kernel(keyset: Any, *args: Any) -> Any:
            inject(op, args)
            return original.call_boxed(keyset, *args)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
            self._library.impl(op, kernel, "CPU", with_keyset=True)

    def _commhang_kernel(self, op: str, args: tuple) -> None:
        if self._commhang_from is not None and self.step >= self._commhang_from:
            _say(f"injected commhang on rank {self.rank} at step {self.step}: c10d::{op} on group "
                 f"{_group_desc(args)} never returns")
            block_forever()

    def _slowlink_kernel(self, fault: SlowLinkFault, op: str, args: tuple) -> None:
        other = fault.ranks[1] if fault.ranks[0] == self.rank else fault.ranks[0]
        dst = int(args[2])  # c10d::send(Tensor[] tensors, ProcessGroup process_group, int dst, int tag)
        if _global_rank(args, dst) == other:
            time.sleep(fault.delay_ms / 1000.0)


def _global_rank(args: tuple, group_rank: int) -> int | None:
    """The global rank of ``group_rank`` in the process group of a c10d operator's call (None if unknown)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup

    try:
        return dist.get_global_rank(ProcessGroup.unbox(args[1]), group_rank)
    except Exception:  # noqa: BLE001 - a group torch.distributed does not know: not the link
        return None


def _receives_first() -> None:
    """Make ``dist.batch_isend_irecv`` post a batch's receives before its sends (gloo runs them as listed)."""
    import torch.distributed as dist

    orig = dist.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list: list[Any]) -> Any:
        ops = sorted(p2p_op_list, key=lambda op: getattr(op.op, "__name__", "") != "irecv")  # stable
        return orig(ops)

    batch_isend_irecv.__doc__ = orig.__doc__
    dist.batch_isend_irecv = batch_isend_irecv


def _group_desc(args: tuple) -> str:
    """The description of the process group a c10d operator was called on (its second argument)."""
    from torch._C._distributed_c10d import ProcessGroup

    try:
        return str(ProcessGroup.unbox(args[1]).group_desc)
    except Exception:  # noqa: BLE001
        return "?"
