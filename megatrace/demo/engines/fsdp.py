"""The ``fsdp`` engine: FSDP2 (``torch.distributed.fsdp.fully_shard``) over a 1D ``DeviceMesh`` of the world.

Each block is sharded on its own, then the root, as FSDP2's documentation recommends: every rank
keeps a 1/dp shard of each parameter (a ``DTensor``), and FSDP all-gathers a block's parameters
before its forward and again before its backward (they are freed after the forward), and
reduce-scatters its gradients after the backward. Every rank trains on its own slice of the data;
the script all-reduces the loss for its metrics. A mesh over the whole world uses the default group.

Per step: per block, 2 all_gather + 1 reduce_scatter (FSDP); 1 all_reduce (metrics).
"""

from __future__ import annotations

import argparse

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from megatrace.demo.engines.common import LR, MomentumSGD, batch, build_blocks, train_step
from megatrace.demo.runtime import Session, StepResult


def train(session: Session, args: argparse.Namespace) -> int:
    """Train this rank's FSDP shard for ``args.steps`` steps."""
    session.start()
    rank, world = session.env.rank, session.env.world_size
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model, clock = build_blocks(0, session.layout.layers_per_stage or 1, args.compute_ms, session.injector.slowdown)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = MomentumSGD(list(model.parameters()), lr=LR)  # DTensor shards: the update is local
    session.ready()

    def step(n: int) -> StepResult:
        x, target = batch(n, rank, 0)
        loss = train_step(session, model, clock, optimizer, x, target)
        dist.all_reduce(loss, group=mesh.get_group("dp"))
        return StepResult(clock.spent_s, float(loss) / world)

    session.run_steps(args.steps, step)
    session.finish()
    return 0
