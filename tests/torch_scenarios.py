"""Rank programs for tests/test_torch_hook.py: ``python torch_scenarios.py SCENARIO`` under RANK/WORLD_SIZE.

Each scenario is a real torch.distributed (gloo) program. The tracer is switched
on by the environment (MEGATRACE_ENABLE=1 and the autoload .pth), exactly as in
a traced job; the scenarios never import megatrace themselves unless they test
the marker API.
"""

from __future__ import annotations

import json
import os
from functools import partial
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
OUT = Path(os.environ.get("SCENARIO_OUT", "."))


def every_op() -> None:
    """Call each traced function once; note which ones gloo rejects."""
    dist.init_process_group("gloo")
    pair = dist.new_group([0, 1], group_desc="pair")
    t = torch.arange(4, dtype=torch.float32) + RANK
    outcome: dict[str, str] = {}

    def attempt(name: str, fn) -> None:
        try:
            work = fn()
            if work is not None and hasattr(work, "wait"):
                work.wait()
            outcome[name] = "ok"
        except (RuntimeError, ValueError) as exc:
            outcome[name] = f"failed: {exc}"[:200]
        dist.barrier(group=pair)  # keep ranks in step after a failure

    attempt("all_reduce", lambda: dist.all_reduce(t))
    attempt("all_reduce_async", lambda: dist.all_reduce(t, async_op=True))
    attempt("all_gather", lambda: dist.all_gather([torch.zeros(4) for _ in range(WORLD)], t))
    attempt("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.zeros(4 * WORLD), t))
    attempt("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2 * WORLD)))
    attempt("broadcast", lambda: dist.broadcast(t, src=1))
    attempt("reduce", lambda: dist.reduce(t, dst=1))
    attempt("gather", lambda: dist.gather(t, [torch.zeros(4) for _ in range(WORLD)] if RANK == 0 else None,
                                          dst=0))
    attempt("scatter", lambda: dist.scatter(torch.zeros(4), [t] * WORLD if RANK == 1 else None, src=1))
    attempt("all_to_all_single", lambda: dist.all_to_all_single(torch.zeros(4), torch.ones(4)))
    attempt("barrier", lambda: dist.barrier())
    peer = 1 - RANK
    if RANK == 0:
        attempt("send", lambda: dist.send(t, dst=peer))
        attempt("isend", lambda: dist.isend(t, dst=peer))
    else:
        attempt("recv", lambda: dist.recv(t, src=peer))
        attempt("irecv", lambda: dist.irecv(t, src=peer))
    ops = [dist.P2POp(dist.isend, t.clone(), peer), dist.P2POp(dist.irecv, torch.zeros(4), peer)]
    if RANK == 1:
        ops.reverse()
    attempt("batch_isend_irecv", lambda: [w.wait() for w in dist.batch_isend_irecv(ops)] and None)
    (OUT / f"outcome-{RANK}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


def wedged_peer() -> None:
    """Rank 1 is late to an all_reduce until the test says go: rank 0 sits inside it meanwhile."""
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    if RANK == 1:
        go = OUT / "go"
        deadline = time.monotonic() + 60
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    dist.destroy_process_group()


def many_ops() -> None:
    """More collectives than a small ring holds."""
    dist.init_process_group("gloo")
    t = torch.ones(1)
    for _ in range(int(os.environ.get("SCENARIO_OPS", "100"))):
        dist.all_reduce(t)
    dist.destroy_process_group()


def groups_and_markers() -> None:
    """Groups from new_group, new_subgroups and a device mesh; markers from the public API."""
    import megatrace

    dist.init_process_group("gloo")
    sub, _ = dist.new_subgroups(group_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
    t = torch.ones(2)
    for step in range(3):
        megatrace.step()
        megatrace.phase("forward", microbatch=0)
        dist.all_reduce(t, group=sub)
        dist.all_reduce(t, group=mesh.get_group("tp"))
        megatrace.phase("optimizer")
        dist.all_reduce(t, group=mesh.get_group("dp"))
    dist.destroy_process_group()


def async_poll() -> None:
    """Gloo async works completed through the poller (the CPU twin of the device-event path)."""
    from megatrace.trace.completion import CompletionPoller
    from megatrace.trace.torch_hook import TRACER, _work_probe

    dist.init_process_group("gloo")
    writer = TRACER.writer
    poller = CompletionPoller()
    t = torch.ones(4)
    handles = []
    for i in range(5):
        handle = writer.begin(1, 4242, i + 1, 16)
        if RANK == 1:
            time.sleep(0.05)  # rank 0's works stay incomplete for a while
        work = dist.all_reduce.__wrapped__(t, async_op=True)  # the untraced original
        poller.add(_work_probe(work), partial(writer.complete, handle))
        handles.append((handle, work))
    for _, work in handles:
        work.wait()
    deadline = time.monotonic() + 5
    while poller.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    poller.stop()
    dist.destroy_process_group()


def _flight_recorder_counts() -> dict[str, int]:
    """torch's own count of this rank's collectives: (group name, op) -> calls, from the Flight Recorder."""
    import pickle
    from collections import Counter

    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False))
    return dict(Counter(f"{e['process_group'][0]} {e['profiling_name'].split(':')[-1]}" for e in dump["entries"]))


def cpp_callers() -> None:
    """Collectives issued from C++ (DDP's reducer, functional collectives) and from Python, counted by torch."""
    import torch.distributed._functional_collectives as funcol

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
    metric = torch.ones(2)
    dist.all_reduce(metric)
    dist.reduce(metric, dst=0)
    funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD).wait()
    funcol.all_gather_tensor(torch.ones(4), 0, dist.group.WORLD).wait()
    pair = dist.new_group([0, 1])
    if RANK < 2:
        dist.broadcast(metric, src=0, group=pair)
    peer_next, peer_prev = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(3), peer_next),
                                         dist.P2POp(dist.irecv, torch.empty(3), peer_prev)]):
        work.wait()
    if RANK == 0:
        dist.send(torch.ones(5), 1)
    elif RANK == 1:
        dist.recv(torch.empty(5), 0)
    dist.barrier()
    (OUT / f"fr-{RANK}.json").write_text(json.dumps(_flight_recorder_counts()))
    dist.destroy_process_group()


if __name__ == "__main__":
    {"every_op": every_op, "wedged_peer": wedged_peer, "many_ops": many_ops,
     "groups_and_markers": groups_and_markers, "async_poll": async_poll,
     "cpp_callers": cpp_callers}[sys.argv[1]]()
