"""One rank of a real NCCL job on one GPU, with nothing of MegaTrace in it (tests/test_gpu_nccl.py).

    python nccl_gpu_job.py collectives STORE   # all-reduce, broadcast, all-gather, reduce-scatter,
                                               # then an all-reduce queued behind 0.5 s of GPU work
    python nccl_gpu_job.py ddp STORE           # a few DistributedDataParallel steps on the GPU
    python nccl_gpu_job.py timeout STORE       # an all-reduce stuck behind a long kernel: the NCCL
                                               # watchdog times it out (set TORCH_NCCL_* as wanted)
    python nccl_gpu_job.py graph STORE         # an all-reduce captured in a CUDA graph, replayed

STORE is a file for torch's FileStore (world size 1). Prints one JSON line of what it did.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

BEHIND_NUMEL = 4096  # the all-reduce queued behind the slow kernel: 16 KiB of float32, a size used nowhere else


def cycles_per_second() -> float:
    """The GPU's clock, measured: torch.cuda._sleep spins for a number of cycles."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(200_000_000)
    torch.cuda.synchronize()
    return 200_000_000 / (time.perf_counter() - start)


def collectives(device: torch.device) -> dict:
    x = torch.ones(1 << 20, device=device)
    for _ in range(5):
        dist.all_reduce(x)
    for _ in range(2):
        dist.broadcast(x, src=0)
    out = torch.empty(1 << 20, device=device)
    for _ in range(2):
        dist.all_gather_into_tensor(out, x)
        dist.reduce_scatter_tensor(out, x)
    torch.cuda.synchronize()
    rate = cycles_per_second()
    behind = torch.ones(BEHIND_NUMEL, device=device)
    torch.cuda._sleep(int(0.5 * rate))  # the stream is busy for 0.5 s: the all-reduce ends after it
    t0 = time.perf_counter()
    dist.all_reduce(behind)
    returned_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    return {"mode": "collectives", "cycles_per_s": rate, "behind_returned_after_s": returned_s,
            "behind_bytes": behind.nbytes}


def ddp(device: torch.device) -> dict:
    model = DistributedDataParallel(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        loss = model(torch.randn(32, 256, device=device)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return {"mode": "ddp", "steps": 5}


def timeout(device: torch.device) -> dict:
    x = torch.ones(1 << 16, device=device)
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(120 * cycles_per_second()))  # far past the group's timeout
    dist.all_reduce(x)  # the fourth: enqueued, never completed before the watchdog fires
    print(json.dumps({"mode": "timeout", "enqueued": 4}), flush=True)
    torch.cuda.synchronize()  # the watchdog aborts the process while this waits
    return {"mode": "timeout", "survived": True}


def graph(device: torch.device) -> dict:
    x = torch.ones(1 << 10, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as CUDA graph capture asks
        for _ in range(3):
            dist.all_reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dist.all_reduce(x)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    return {"mode": "graph", "replayed": 3, "value": float(x[0])}


def main() -> None:
    mode, store_path = sys.argv[1], sys.argv[2]
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.FileStore(store_path, 1)
    group_timeout = timedelta(seconds=10 if mode == "timeout" else 120)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=group_timeout, device_id=device)
    result = {"collectives": collectives, "ddp": ddp, "timeout": timeout, "graph": graph}[mode](device)
    dist.destroy_process_group()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
