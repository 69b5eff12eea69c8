"""The demo's training step as one program per pipeline stage: what every rank of a stage issues, in order.

Every rank of stage ``s`` (any TP position, any DP replica) runs the same
program, as in the demo job (:mod:`megatrace.demo.pipeline`): per step a head
of compute (optimizer and data), then for each action of the stage's schedule
the exchange block before it (receives first, then the sends of the previous
action, enqueued together and waited together), the action's compute cut by
its TP all-reduces, the last exchange block, and the DP all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrace.config import Layout
from megatrace.schedule import ACT_IN, GRAD_IN, GRAD_OUT, exchange_blocks, schedule_for

PREV, NEXT = -1, 1  # neighbour stage of a point-to-point op


@dataclass(frozen=True)
class CommOp:
    """One call: ``kind`` is "tp", "dp", "send" or "recv"; ``to`` the neighbour stage of a p2p op."""

    kind: str
    to: int = 0


@dataclass(frozen=True)
class Item:
    """A step of a program: ``compute`` (``ms`` of work) or ``calls`` (``ops`` enqueued together, then waited)."""

    what: str  # "compute" or "calls"
    phase: str  # "forward", "backward", "optimizer" (the DP sync and after), or "" (the step's head)
    ms: float = 0.0
    ops: tuple[CommOp, ...] = ()


@dataclass(frozen=True)
class StepCosts:
    """The durations of the simulated step (ms)."""

    forward_ms: float = 2.0  # one microbatch's forward on one stage; a backward takes twice as long
    head_ms: float = 1.0  # optimizer and data before each step's first call
    tp_ms: float = 0.5  # a TP all-reduce, after its last member arrived
    p2p_ms: float = 0.3  # a point-to-point transfer, after both sides arrived
    dp_ms: float = 1.0  # the DP all-reduce, after its last member arrived


def stage_program(layout: Layout, stage: int, costs: StepCosts, layers: int) -> list[Item]:
    """One training step of every rank of ``stage``."""
    actions = schedule_for(layout, stage)
    blocks = exchange_blocks(actions, stage, layout.pp)
    n_tp = layers if layout.tp > 1 else 0
    prog = [Item("compute", "", costs.head_ms)]
    for j in range(len(actions) + 1):
        phase = ("forward" if actions[j][0] == "F" else "backward") if j < len(actions) else "backward"
        ops = []
        for role, _mb in sorted(blocks[j], key=lambda b: b[0] not in (ACT_IN, GRAD_IN)):  # receives first
            to = PREV if role in (ACT_IN, GRAD_OUT) else NEXT
            ops.append(CommOp("recv" if role in (ACT_IN, GRAD_IN) else "send", to))
        if ops:
            prog.append(Item("calls", phase, ops=tuple(ops)))
        if j == len(actions):
            break
        part = costs.forward_ms * (1 if actions[j][0] == "F" else 2) / (n_tp + 1)
        for _ in range(n_tp):
            prog += [Item("compute", phase, part), Item("calls", phase, ops=(CommOp("tp"),))]
        prog.append(Item("compute", phase, part))
    if layout.dp > 1:
        prog.append(Item("calls", "optimizer", ops=(CommOp("dp"),)))
    return prog
