"""The ``ddp`` engine: ``DistributedDataParallel`` over the world, as a typical training script uses it.

Every rank holds the whole model (``--layers-per-stage`` blocks) and its own slice of the data.
DDP's start-up (a parameter-shape all_gather and the broadcast of the parameters) and, in every
``backward()``, one all_reduce per gradient bucket come from its C++ reducer; the buckets are kept
small (:data:`BUCKET_CAP_MB`) so that a step has several. After the optimizer step the script
reports metrics the way scripts do: the mean loss with ``dist.all_reduce`` and the number of
samples seen with ``dist.reduce`` to rank 0.

Per step: 2 all_reduce per block (DDP's buckets, from step 1 on), 1 all_reduce + 1 reduce (metrics), all on the default group.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from megatrace.demo.engines.common import LR, MomentumSGD, batch, build_blocks, train_step
from megatrace.demo.runtime import Session, StepResult

# Bucket size cap in MiB. A block's two weights are 16 KiB each: from step 1 on (DDP rebuilds its
# buckets after the first backward, in the order gradients became ready) each weight with its bias
# fills a bucket, two per block. Step 0 runs on DDP's initial buckets (here one). DDP's default,
# 25 MiB, would put this whole model in one bucket.
BUCKET_CAP_MB = 0.01


def train(session: Session, args: argparse.Namespace) -> int:
    """Train this rank's DDP replica for ``args.steps`` steps."""
    session.start()
    rank, world = session.env.rank, session.env.world_size
    model, clock = build_blocks(0, session.layout.layers_per_stage or 1, args.compute_ms, session.injector.slowdown)
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    optimizer = MomentumSGD(list(ddp.parameters()), lr=LR)
    seen = torch.zeros(1)
    session.ready()

    def step(n: int) -> StepResult:
        x, target = batch(n, rank, 0)
        loss = train_step(session, ddp, clock, optimizer, x, target)
        dist.all_reduce(loss)
        seen.add_(len(x))
        samples = seen.clone()
        dist.reduce(samples, dst=0)
        return StepResult(clock.spent_s, float(loss) / world)

    session.run_steps(args.steps, step)
    # The reducer holds the process group: free it first, so that the group is not destroyed with
    # the GIL held, which can deadlock against a gloo worker freeing a work (pytorch/pytorch#56297).
    del ddp, optimizer
    session.finish()
    return 0
