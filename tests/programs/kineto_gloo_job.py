"""One rank of a small gloo job under torch.profiler: compute, all_reduce, broadcast, a send/recv ring step.

Usage: kineto_gloo_job.py RANK WORLD OUT_DIR PORT ITERATIONS. Writes OUT_DIR/trace-rank<RANK>.json (or .json.gz
for rank 0: both forms are read) with ``export_chrome_trace``; the rank comes from ``distributedInfo``.
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    rank, world, out, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    iterations = int(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    a, x = torch.rand(256, 256), torch.ones(4096)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(iterations):
            for _ in range(90):  # a fixed amount of work (~60 ms): a throttled rank takes longer
                a = torch.tanh(a @ a)
            dist.all_reduce(x)
            dist.broadcast(x, src=0)
            if rank % 2 == 0 and rank + 1 < world:
                dist.send(x[:16], rank + 1)
            elif rank % 2 == 1:
                dist.recv(x[:16], rank - 1)
        dist.barrier()
    path = os.path.join(out, f"trace-rank{rank}.json")
    prof.export_chrome_trace(path)
    if rank == 0:
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
