"""The ``3d`` engine: the hand-written Megatron-style TP x PP x DP job (the demo's original).

Tensor parallelism by autograd functions around ``dist.all_reduce`` (:mod:`megatrace.demo.model`),
a 1F1B (or GPipe) pipeline whose activations and gradients move with ``batch_isend_irecv``
(:mod:`megatrace.demo.pipeline`), and one flat DP gradient all_reduce (or reduce-scatter +
all-gather) per step (:mod:`megatrace.demo.comm`). Every call goes through the public
``torch.distributed`` functions, each preceded by the fault injector's gate. What a rank issues
per step is :func:`megatrace.schedule.expected_collectives_per_step`.
"""

from __future__ import annotations

import argparse

from megatrace.demo.comm import Comm, create_groups
from megatrace.demo.model import LR, MomentumSGD, build_stage
from megatrace.demo.pipeline import StageRunner
from megatrace.demo.runtime import Session, StepResult
from megatrace.schedule import schedule_for


def train(session: Session, args: argparse.Namespace) -> int:
    """Train this rank's (pp, dp, tp) shard of the 3D job for ``args.steps`` steps."""
    session.start()
    layout, rank, injector = session.layout, session.env.rank, session.injector
    groups = create_groups(layout, rank, session.timeout)
    comm = Comm(layout, groups, injector.before_comm)
    coords = layout.coords(rank)
    model = build_stage(coords.pp, layout.layers_per_stage or 1, coords.tp, layout.tp, comm)
    params = list(model.parameters())
    optimizer = MomentumSGD(params, lr=LR)
    pp_ranks = layout.group_of("pp", rank)
    runner = StageRunner(model, comm,
                         prev=pp_ranks[coords.pp - 1] if coords.pp > 0 else None,
                         next=pp_ranks[coords.pp + 1] if coords.pp < layout.pp - 1 else None,
                         dp_rank=coords.dp, compute_ms=args.compute_ms, slowdown=injector.slowdown,
                         on_action=lambda phase, mb: session.phase(phase, mb, gate=False))
    actions = schedule_for(layout, coords.pp)
    session.ready()

    def step(n: int) -> StepResult:
        stats = runner.run(n, actions)
        session.phase("optimizer", gate=False)
        comm.average_gradients(params, args.dp_mode)
        optimizer.step()
        return StepResult(stats.compute_s, stats.loss)

    session.run_steps(args.steps, step)
    session.finish()
    return 0
