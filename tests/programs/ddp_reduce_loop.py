"""A plain DDP training script of the kind people run, with nothing of MegaTrace in it.

Each iteration gathers "experience" (CPU work, like stepping an environment), trains a small
policy network with DistributedDataParallel (its gradient all-reduces happen inside backward),
and reduces the episode score to rank 0 with ``dist.reduce``, as RL and metric-logging code does.

    torchrun --nproc-per-node 4 ddp_reduce_loop.py [--iterations N] [--seconds S]

Runs until N iterations or S seconds, whichever comes first; rank 0 prints the mean score.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def experience(policy: nn.Module, steps: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Roll the policy out in a toy environment: observations and the actions that scored well."""
    obs = torch.randn(steps, 16, generator=generator)
    with torch.no_grad():
        for _ in range(20):  # the environment's own work
            obs = torch.tanh(obs @ torch.eye(16) * 0.9 + 0.1 * torch.randn(steps, 16, generator=generator))
    target = (obs.sum(dim=1) > 0).long()
    return obs, target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=600.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    model = nn.parallel.DistributedDataParallel(policy, bucket_cap_mb=0.01)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1000 + rank)
    start = time.monotonic()
    for it in range(args.iterations):
        out_of_time = torch.tensor([float(time.monotonic() - start > args.seconds)])
        dist.all_reduce(out_of_time, op=dist.ReduceOp.MAX)  # every rank stops at the same iteration
        if out_of_time.item():
            break
        obs, target = experience(policy, 256, gen)
        for _ in range(4):  # a few epochs over the batch
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(obs), target)
            loss.backward()
            opt.step()
        score = torch.tensor([float((model(obs).argmax(dim=1) == target).float().mean())])
        dist.reduce(score, dst=0)
        if rank == 0 and it % 10 == 0:
            print(f"iteration {it}: mean score {score.item() / dist.get_world_size():.3f}", flush=True)
    # The DDP model goes before the process group. Dropped last (when main() returns), its Reducer releases
    # the gloo group while holding the GIL, and ~ProcessGroupGloo joins a worker thread that may at that moment
    # be freeing a finished call's tensor, which needs the GIL: a deadlock at exit inside torch 2.13 (the class
    # of pytorch#56297), seen here in 4 of some 40 runs, with MegaTrace and without it.
    del model, opt
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if os.environ.get("OMP_NUM_THREADS") is None:
        torch.set_num_threads(1)
    main()
