"""The ``pipeline`` engine: ``torch.distributed.pipelining``, one ``PipelineStage`` per rank, ``Schedule1F1B``.

Stage ``s`` holds blocks ``s * layers_per_stage ...`` of the model. The schedule splits each step's
batch into ``--microbatches`` and moves activations forward and gradients backward with
``batch_isend_irecv``, fusing a stage's send with its next receive as 1F1B does: on the default
group with dp 1; with dp > 1, ``dp`` pipelines on a ``pp`` x ``dp`` ``DeviceMesh`` (rank =
stage * dp + replica, the ``tp-dp-pp`` order), each pipeline on its ``pp`` group, and each stage
averages its gradients with its replicas by one flat all_reduce on its ``dp`` group per step. Stages are built with example inputs and outputs (static shapes), so no shape is exchanged;
the first step still runs torch's warm-up vote (one send/recv each way between neighbours).

Per step: per microbatch, a recv of activations and a send of input gradients unless the first
stage, a send of activations and a recv of output gradients unless the last; dp > 1: 1 all_reduce
on the stage's DP group.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from megatrace.demo.engines.common import LR, MomentumSGD, average_gradients, batch, build_blocks, mse
from megatrace.demo.model import HIDDEN, MICRO_BATCH
from megatrace.demo.runtime import Session, StepResult


class ReportingStage(PipelineStage):
    """A ``PipelineStage`` that says which action (forward or backward of which microbatch) it starts."""

    def __init__(self, *args: Any, on_action: Callable[[str, int], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_action = on_action

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.on_action("forward", fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.on_action("backward", bwd_chunk_id)
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


def whole_batch(step: int, replica: int, microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's inputs and targets for one DP replica: its microbatches, stacked (the schedule splits them)."""
    parts = [batch(step, replica, mb) for mb in range(microbatches)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def train(session: Session, args: argparse.Namespace) -> int:
    """Train this rank's pipeline stage for ``args.steps`` steps."""
    session.start()
    layout = session.layout
    where = layout.coords(session.env.rank)
    stage_index, replica = where.pp, where.dp
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    if layout.dp > 1:
        mesh = init_device_mesh("cpu", (layout.pp, layout.dp), mesh_dim_names=("pp", "dp"))
        pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    layers = layout.layers_per_stage or 1
    model, clock = build_blocks(stage_index * layers, layers, args.compute_ms, session.injector.slowdown)
    first, last = stage_index == 0, stage_index == layout.pp - 1
    # Static shapes; requires_grad says which of them carry a gradient back (all but the data).
    example_in = torch.zeros(MICRO_BATCH, HIDDEN, requires_grad=not first)
    example_out = torch.zeros(MICRO_BATCH, HIDDEN, requires_grad=True)
    stage = ReportingStage(model, stage_index, layout.pp, torch.device("cpu"), input_args=(example_in,),
                           output_args=(example_out,), on_action=lambda phase, mb: session.phase(phase, mb),
                           group=pp_group)
    schedule = Schedule1F1B(stage, n_microbatches=layout.microbatches, loss_fn=mse)
    params = list(model.parameters())
    optimizer = MomentumSGD(params, lr=LR)
    session.ready()

    def step(n: int) -> StepResult:
        clock.spent_s = 0.0
        x, target = whole_batch(n, replica, layout.microbatches)
        losses: list[torch.Tensor] = []
        session.phase("forward", 0)  # before the step's first receive
        schedule.step(*((x,) if first else ()), **({"target": target, "losses": losses} if last else {}))
        session.phase("optimizer")
        if dp_group is not None:
            average_gradients(params, dp_group, layout.dp)
        optimizer.step()
        loss = float(torch.stack(losses).mean()) if last else None
        return StepResult(clock.spent_s, loss)

    session.run_steps(args.steps, step)
    session.finish()
    return 0
