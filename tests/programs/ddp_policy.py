"""A small policy-gradient style training script on DistributedDataParallel, written like user code.

The pattern of the scripts MegaTrace must trace with no change (issue 27): every rank collects
its own batch of experience (here a synthetic bandit task, with ``--rollout-ms`` of "environment"
time), runs a few DDP minibatch updates, and then reports with explicit collectives, as such
scripts do: ``dist.reduce`` of the episode return and of the loss to rank 0 (which prints), and
every ``--eval-every`` iterations a ``dist.all_reduce`` of an evaluation score. Nothing here knows
about MegaTrace; run it under torchrun (optionally with ``MEGATRACE_ENABLE=1``)::

    torchrun --nproc-per-node 4 tests/programs/ddp_policy.py --iterations 50

Kept for tests and fault injection from outside (SIGSTOP, throttling, kill -9): it prints one
line per iteration on rank 0 and runs as long as ``--iterations`` says.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

OBS, ACTIONS = 16, 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--rollout", type=int, default=64, help="samples collected per rank and iteration")
    p.add_argument("--minibatches", type=int, default=4, help="DDP updates per iteration")
    p.add_argument("--rollout-ms", type=float, default=5.0, help="simulated environment time per iteration")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.05)
    return p.parse_args()


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(OBS, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh())
        self.head = nn.Linear(128, ACTIONS)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(obs))


def best_action(obs: torch.Tensor) -> torch.Tensor:
    """The hidden rule of the bandit: which action pays, given the observation."""
    return obs[:, :ACTIONS].argmax(dim=1)


def collect(policy: nn.Module, n: int, gen: torch.Generator, rollout_ms: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Observations, sampled actions and their rewards (1 for the paying action, else 0)."""
    obs = torch.randn(n, OBS, generator=gen)
    with torch.no_grad():
        probs = F.softmax(policy(obs), dim=1)
    actions = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    rewards = (actions == best_action(obs)).float()
    time.sleep(rollout_ms / 1000.0)  # the environment's own time
    return obs, actions, rewards


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234 + rank)
    model = DistributedDataParallel(Policy())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for it in range(args.iterations):
        obs, actions, rewards = collect(model.module, args.rollout, gen, args.rollout_ms)
        advantage = rewards - rewards.mean()
        losses = []
        for idx in torch.arange(args.rollout).chunk(args.minibatches):
            logp = F.log_softmax(model(obs[idx]), dim=1).gather(1, actions[idx, None]).squeeze(1)
            loss = -(logp * advantage[idx]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        stats = torch.stack([rewards.mean(), torch.stack(losses).mean()])
        ret = stats[:1].clone()
        dist.reduce(ret, dst=0)
        mean_loss = stats[1:].clone()
        dist.reduce(mean_loss, dst=0)
        if (it + 1) % args.eval_every == 0:
            test_obs = torch.randn(256, OBS, generator=gen)
            with torch.no_grad():
                score = (model(test_obs).argmax(dim=1) == best_action(test_obs)).float().mean().reshape(1)
            dist.all_reduce(score)
            if rank == 0:
                print(f"iteration {it}: eval accuracy {float(score) / world:.3f}", flush=True)
        if rank == 0:
            print(f"iteration {it}: return {float(ret) / world:.3f} loss {float(mean_loss) / world:.4f}",
                  flush=True)
    # DDP's reducer holds the process group: let it go first. Were the reducer the group's last
    # holder, the group would be destroyed with the GIL held, which can deadlock against a gloo
    # worker thread freeing a finished work's tensors (seen on torch 2.13; pytorch/pytorch#56297).
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        raise SystemExit("run me under torchrun, e.g. torchrun --nproc-per-node 2 " + __file__)
    main()
