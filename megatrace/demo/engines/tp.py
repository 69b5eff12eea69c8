"""The ``tp`` engine: DTensor tensor parallelism (``parallelize_module``) on a ``DeviceMesh``, plus DP.

The mesh is ``dp`` x ``tp`` (``init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))``;
with dp 1 a 1D ``tp`` mesh). In every block ``fc1`` is a ``ColwiseParallel`` and ``fc2`` a
``RowwiseParallel`` linear: ``fc2``'s forward all-reduces its partial sums and ``fc1``'s backward
the gradient of its input (for every block whose input needs one: all but the first), as
functional collectives issued by DTensor. Distributing the weights at start-up scatters the
sharded ones and broadcasts the replicated biases. With dp > 1 the script averages the local
gradients over the DP group with one flat all_reduce per step, and the loss for its metrics.

Per step: TP group: ``layers`` all_reduce forward + ``layers - 1`` backward; DP group (dp > 1):
2 all_reduce (gradients, loss).
"""

from __future__ import annotations

import argparse

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from megatrace.demo.engines.common import LR, MomentumSGD, average_gradients, batch, build_blocks, train_step
from megatrace.demo.runtime import Session, StepResult


def build_mesh(dp: int, tp: int) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The TP mesh and, with dp > 1, the DP mesh, both views of one ``dp`` x ``tp`` device mesh."""
    if dp == 1:
        return init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)), None
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["tp"], mesh["dp"]


def train(session: Session, args: argparse.Namespace) -> int:
    """Train this rank's tensor-parallel shard for ``args.steps`` steps."""
    session.start()
    layout = session.layout
    layers = layout.layers_per_stage or 1
    tp_mesh, dp_mesh = build_mesh(layout.dp, layout.tp)
    dp_rank = layout.coords(session.env.rank).dp
    model, clock = build_blocks(0, layers, args.compute_ms, session.injector.slowdown)
    plan = {f"{i}.{name}": style for i in range(layers)
            for name, style in (("fc1", ColwiseParallel()), ("fc2", RowwiseParallel()))}
    parallelize_module(model, tp_mesh, plan)
    params = list(model.parameters())
    optimizer = MomentumSGD(params, lr=LR)
    dp_group = dp_mesh.get_group() if dp_mesh is not None else None
    sync = None if dp_group is None else lambda: average_gradients(params, dp_group, layout.dp)
    session.ready()

    def step(n: int) -> StepResult:
        x, target = batch(n, dp_rank, 0)  # the same microbatch on every TP rank of a replica
        loss = train_step(session, model, clock, optimizer, x, target, before_update=sync)
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
        return StepResult(clock.spent_s, float(loss) / layout.dp)

    session.run_steps(args.steps, step)
    session.finish()
    return 0
