"""A player and its trainers, on three process groups, with nothing of MegaTrace in it.

Rank 0 plays: it rolls a policy out and scatters batches of experience to the trainers (the
world group). Ranks 1.. train a copy of the policy with DistributedDataParallel on their own
group, and the first trainer broadcasts the new weights back to the player over a pair group.

    torchrun --nproc-per-node 4 player_trainers.py [--iterations N] [--seconds S] [--pause-at I --pause-s P]

``--pause-at`` makes every rank sit outside communication for ``--pause-s`` seconds at iteration
I (a long checkpoint, say).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

OBS, BATCH = 16, 64


def policy_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(OBS, 64), nn.Tanh(), nn.Linear(64, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument("--pause-s", type=float, default=0.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    trainers = dist.new_group(list(range(1, world)))
    pair = dist.new_group([0, 1])
    policy = policy_net()
    model = nn.parallel.DistributedDataParallel(policy, process_group=trainers) if rank > 0 else None
    opt = torch.optim.SGD(policy.parameters(), lr=0.05) if rank > 0 else None
    gen = torch.Generator().manual_seed(7)
    flat = torch.nn.utils.parameters_to_vector(policy.parameters()).detach()
    start = time.monotonic()
    for it in range(args.iterations):
        out_of_time = torch.tensor([float(time.monotonic() - start > args.seconds)])
        dist.broadcast(out_of_time, src=0)  # the player's clock decides, for every rank at the same iteration
        if out_of_time.item():
            break
        if it == args.pause_at:
            time.sleep(args.pause_s)
        batch = torch.empty(BATCH, OBS + 1)
        if rank == 0:
            with torch.no_grad():
                obs = torch.randn((world - 1) * BATCH, OBS, generator=gen)
                for _ in range(30):  # the environment's work
                    obs = torch.tanh(obs * 1.01 + 0.01 * torch.randn(obs.shape, generator=gen))
                label = (policy(obs).argmax(dim=1) ^ (obs.sum(dim=1) > 0).long()).float()
            chunks = list(torch.cat([obs, label[:, None]], dim=1).chunk(world - 1))
            dist.scatter(batch, [torch.empty_like(batch)] + chunks, src=0)
        else:
            dist.scatter(batch, None, src=0)
            for _ in range(3):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(batch[:, :OBS]), batch[:, OBS].long())
                loss.backward()
                opt.step()
            flat = torch.nn.utils.parameters_to_vector(policy.parameters()).detach()
        if rank < 2:
            dist.broadcast(flat, src=1, group=pair)
            if rank == 0:
                torch.nn.utils.vector_to_parameters(flat, policy.parameters())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
