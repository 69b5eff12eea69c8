"""Network checks: all-reduce bus bandwidth and a node x node bandwidth/latency matrix.

The all-reduce runs through NCCL (torch.distributed, one GPU per task) when
every task has torch and a GPU: the path training takes. Otherwise it runs over
MPI (mpi4py), the host network path a CPU-only allocation (and this project's
CI) has; ``--net-backend torch`` forces torch.distributed (gloo without GPUs).
The matrix always goes over MPI among the first tasks of the nodes. :func:`judge_matrix` reads the matrix the way a
delay matrix is read: a node whose whole row is slow is a bad node, a single
slow cell between good nodes is a bad link; bandwidth and latency alike.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatrace.check.results import ProbeResult, Status, Subject


@dataclass(frozen=True)
class NetThresholds:
    slow_ratio: float = 0.5  # bandwidth below this share of the allocation's median is slow
    min_busbw_gbps: float = 0.0  # an absolute floor for the all-reduce (per site, configs/thresholds.yaml)
    slow_latency_ratio: float = 3.0  # latency above this multiple of the typical (the other nodes') is slow...
    latency_floor_us: float = 20.0  # ...when also above this: microseconds of noise on a fast fabric are no fault


def allreduce_busbw(comm: Any, nbytes: int, iters: int = 5, delay_s: float = 0.0) -> float:
    """Bus bandwidth (GB/s) of an all-reduce of ``nbytes`` over ``comm``, as nccl-tests defines it.

    ``delay_s``: an injected wait before each call on this task (a slow node, for drills and tests).
    """
    from mpi4py import MPI

    n = comm.Get_size()
    buf = np.ones(max(nbytes // 4, 1), np.float32)
    out = np.empty_like(buf)
    comm.Allreduce(buf, out, op=MPI.SUM)  # warm-up: connection setup
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(iters):
        time.sleep(delay_s)
        comm.Allreduce(buf, out, op=MPI.SUM)
    elapsed = comm.allreduce(time.perf_counter() - t, op=MPI.MAX) / iters
    algbw = buf.nbytes / elapsed / 1e9
    return algbw * 2 * (n - 1) / n if n > 1 else algbw


BACKENDS = ("auto", "mpi", "torch")


def choose_backend(comm: Any, wanted: str) -> str:
    """``"nccl"``, ``"gloo"`` or ``"mpi"``: the same on every task (every task must call it)."""
    if wanted == "mpi":
        return "mpi"
    if wanted == "auto" and not comm.allreduce(int(_gpu_hint()), op=_max()):
        return "mpi"  # no task has a GPU device: do not pay torch's import
    try:
        import torch
        import torch.distributed as dist

        torch_ok = dist.is_available()
        gpu = torch_ok and torch.cuda.is_available() and dist.is_nccl_available()
    except Exception:  # noqa: BLE001  (a broken torch install: fall back to MPI, or fail below when forced)
        torch_ok = gpu = False
    everywhere_torch = comm.allreduce(int(torch_ok), op=_min()) == 1
    everywhere_gpu = comm.allreduce(int(gpu), op=_min()) == 1
    if wanted == "torch":
        if not everywhere_torch:
            raise RuntimeError("--net-backend torch: torch.distributed is missing on some task")
        return "nccl" if everywhere_gpu else "gloo"
    return "nccl" if everywhere_gpu else "mpi"


def _gpu_hint() -> bool:
    """This task may have a GPU: an NVIDIA device node exists and CUDA_VISIBLE_DEVICES does not hide them all."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1", "NoDevFiles")
    return os.path.exists("/dev/nvidia0") and not hidden


def _min() -> Any:
    from mpi4py import MPI

    return MPI.MIN


def torch_allreduce_busbw(comm: Any, nbytes: int, backend: str, local_rank: int, timeout_s: float,
                          iters: int = 5) -> float:
    """Bus bandwidth (GB/s) of a torch.distributed all-reduce of ``nbytes`` (``backend``: nccl or gloo).

    The rendezvous address comes from task 0 over MPI (its host and a free port); NCCL runs on GPU
    ``local_rank`` modulo the GPUs this task sees. The process group is destroyed before returning.
    """
    import datetime
    import socket

    import torch
    import torch.distributed as dist

    addr = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:  # a free port (a tiny race with other processes; the store retries nothing)
            s.bind(("", 0))
            port = s.getsockname()[1]
        host = os.environ.get("MEGATRACE_CHECK_ADDR") or socket.gethostname()
        addr = f"tcp://{host}:{port}"
    addr = comm.bcast(addr, root=0)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=addr, rank=comm.Get_rank(), world_size=comm.Get_size(),
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
        dist.all_reduce(buf)  # warm-up: connection setup
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        mine = time.perf_counter() - t
    finally:
        dist.destroy_process_group()
    elapsed = comm.allreduce(mine, op=_max()) / iters
    n = comm.Get_size()
    algbw = buf.numel() * 4 / elapsed / 1e9
    return algbw * 2 * (n - 1) / n if n > 1 else algbw


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every pair of ``n`` members once (the circle method)."""
    m = n + (n % 2)
    ring = list(range(m))
    rounds = []
    for _ in range(m - 1):
        pairs = [(ring[i], ring[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(a, b) for a, b in pairs if a < n and b < n])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return rounds


def pair_matrix(comm: Any, nbytes: int, iters: int = 3, delay_s: float = 0.0,
                lat_iters: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Ping-pong between every pair of ``comm``'s members: (bandwidth GB/s, latency µs), [n, n], NaN on the diagonal.

    Every member must call it; the result is complete on every member. Each pair first exchanges one untimed
    message (connection setup); bandwidth is the mean of ``iters`` round trips of ``nbytes``, latency half the
    fastest of ``lat_iters`` round trips of 8 bytes (a hiccup of the scheduler does not make a slow link; a slow
    path is slow every time).
    ``delay_s``: an injected wait before each message this member sends (a slow node, for drills and tests).
    """
    from mpi4py import MPI

    n, me = comm.Get_size(), comm.Get_rank()
    bw = np.full((n, n), np.nan)
    lat = np.full((n, n), np.nan)
    big = np.ones(max(nbytes, 1), np.uint8)
    small = np.ones(8, np.uint8)
    for pairs in round_robin(n):
        comm.Barrier()
        for a, b in pairs:
            if me not in (a, b):
                continue
            peer = b if me == a else a
            for buf, count in ((small, lat_iters), (big, iters)):
                got = np.empty_like(buf)
                rtts = []
                for k in range(count + 1):  # the first: untimed
                    t = time.perf_counter()
                    if me == a:
                        time.sleep(delay_s)
                        comm.Send(buf, dest=peer, tag=7)
                        comm.Recv(got, source=peer, tag=7)
                    else:
                        comm.Recv(got, source=peer, tag=7)
                        time.sleep(delay_s)
                        comm.Send(buf, dest=peer, tag=7)
                    if k:
                        rtts.append(time.perf_counter() - t)
                if buf is small:
                    lat[a, b] = lat[b, a] = min(rtts) / 2 * 1e6
                else:
                    bw[a, b] = bw[b, a] = 2 * buf.nbytes / statistics.fmean(rtts) / 1e9
    bw_all = np.empty_like(bw)
    comm.Allreduce(np.nan_to_num(bw, nan=0.0), bw_all, op=MPI.MAX)
    lat_all = np.empty_like(lat)
    comm.Allreduce(np.nan_to_num(lat, nan=0.0), lat_all, op=MPI.MAX)
    np.fill_diagonal(bw_all, np.nan)
    np.fill_diagonal(lat_all, np.nan)
    return bw_all, lat_all


def judge_matrix(nodes: list[str], bw: np.ndarray, t: NetThresholds = NetThresholds(),
                 lat: np.ndarray | None = None) -> list[ProbeResult]:
    """A slow row is a slow node; a slow cell between two good nodes is a slow link: for the bandwidth ``bw``
    (GB/s) and, when given, the latency ``lat`` (µs) of the same pairs."""
    n = len(nodes)
    if n < 3:  # with two nodes a slow link and a slow node look the same: report the pair
        if n == 2 and not np.isnan(bw[0, 1]):
            shown = "" if lat is None or np.isnan(lat[0, 1]) else f", {lat[0, 1]:.1f} µs"
            return [ProbeResult("net.pair", Status.OK, Subject(nodes[0], peer=nodes[1]), f"{nodes[0]} ↔ {nodes[1]}: "
                                f"{bw[0, 1]:.2f} GB/s{shown}", round(float(bw[0, 1]), 3))]
        return []
    res = []
    row_med = np.nanmedian(bw, axis=1)
    overall = float(np.nanmedian(row_med))  # the typical node's: one slow node is half the cells of a small matrix
    bad_rows = {i for i in range(n) if row_med[i] < t.slow_ratio * overall}
    for i in sorted(bad_rows):
        res.append(ProbeResult("net.node", Status.FAIL, Subject(nodes[i]),
                               f"point-to-point bandwidth to the other nodes {row_med[i]:.2f} GB/s, "
                               f"{row_med[i] / overall:.0%} of the median node's {overall:.2f} GB/s",
                               round(float(row_med[i]), 3), round(overall * t.slow_ratio, 3),
                               "Check this node's NIC (link rate, errors, PCIe) and its switch port; drain it."))
    for i in range(n):
        for j in range(i + 1, n):
            if i in bad_rows or j in bad_rows or np.isnan(bw[i, j]):
                continue
            if bw[i, j] < t.slow_ratio * overall:
                res.append(ProbeResult("net.link", Status.WARN, Subject(nodes[i], peer=nodes[j]),
                                       f"link {nodes[i]} ↔ {nodes[j]}: {bw[i, j]:.2f} GB/s, "
                                       f"{bw[i, j] / overall:.0%} of the median", round(float(bw[i, j]), 3),
                                       round(overall * t.slow_ratio, 3),
                                       "Check the route between these two nodes (cables, switch, adaptive routing)."))
    typical_lat = None
    if lat is not None:
        lat_res, typical_lat = _judge_latency(nodes, lat, t)
        res += lat_res
    if not res:
        shown = "" if typical_lat is None else f"; latency median {typical_lat:.1f} µs (max {np.nanmax(lat):.1f})"
        res.append(ProbeResult("net.matrix", Status.OK, Subject(nodes[0]),
                               f"{n} nodes, pairwise bandwidth median {overall:.2f} GB/s "
                               f"(min {np.nanmin(bw):.2f}){shown}", round(overall, 3)))
    return res


def _median(values: list[float]) -> float | None:
    """The median of the finite values (None: none)."""
    finite = [v for v in values if np.isfinite(v)]
    return statistics.median(finite) if finite else None


def _judge_latency(nodes: list[str], lat: np.ndarray, t: NetThresholds) -> tuple[list[ProbeResult], float | None]:
    """Latency outliers of a matrix of three or more nodes, and the typical latency (None: nothing measured).

    A node is slow when most of its links are: its row's lower median (of two links, the faster) above
    ``slow_latency_ratio`` times the median latency between the other nodes, and above ``latency_floor_us``.
    The others are the reference, not the median row: with three nodes, two of the three rows hold the slow
    node. A link between two good nodes is slow above that ratio of the good nodes' median, and the floor.
    Both warn: small-message latency over MPI from Python is a proxy that CPU contention on the node also
    raises, so it names the node without draining it (a node slow enough to matter fails on bandwidth too).
    """
    n = len(nodes)
    res: list[ProbeResult] = []
    bad: set[int] = set()
    for i in range(n):
        row = sorted(float(lat[i, j]) for j in range(n) if j != i and np.isfinite(lat[i, j]))
        ref = _median([float(lat[j, k]) for j in range(n) for k in range(j + 1, n) if i not in (j, k)])
        if not row or not ref:
            continue
        mine = row[(len(row) - 1) // 2]  # the lower median: a single slow link does not make a slow node
        limit = max(t.slow_latency_ratio * ref, t.latency_floor_us)
        if mine > limit:
            bad.add(i)
            res.append(ProbeResult("net.latency", Status.WARN, Subject(nodes[i]),
                                   f"point-to-point latency to the other nodes {mine:.1f} µs, {mine / ref:.1f}x the "
                                   f"{ref:.1f} µs between the others", round(mine, 1), round(limit, 1),
                                   "Check this node's NIC (errors, its PCIe slot and NUMA node), CPU power states "
                                   "(C-states, the frequency governor), other processes on its CPUs, and whether "
                                   "MPI/NCCL fell back to TCP."))
    good = [i for i in range(n) if i not in bad]
    typical = _median([float(lat[i, j]) for i in good for j in good if i < j])
    if not typical:  # every node slow, or nothing measured between the good ones
        return res, typical if typical is not None else _median([float(v) for v in lat[np.triu_indices(n, 1)]])
    limit = max(t.slow_latency_ratio * typical, t.latency_floor_us)
    for i in good:
        for j in good:
            if i < j and np.isfinite(lat[i, j]) and lat[i, j] > limit:
                res.append(ProbeResult("net.latency", Status.WARN, Subject(nodes[i], peer=nodes[j]),
                                       f"link {nodes[i]} ↔ {nodes[j]}: latency {lat[i, j]:.1f} µs, "
                                       f"{lat[i, j] / typical:.1f}x the median {typical:.1f} µs",
                                       round(float(lat[i, j]), 1), round(limit, 1),
                                       "Check the route between these two nodes (cables, switch hops, adaptive "
                                       "routing, congestion)."))
    return res, typical


VIA = {"mpi": "MPI", "nccl": "NCCL (torch.distributed)", "gloo": "gloo (torch.distributed)"}


def judge_busbw(busbw: float, node: str, nranks: int, t: NetThresholds = NetThresholds(),
                backend: str = "mpi") -> ProbeResult:
    status = Status.FAIL if busbw < t.min_busbw_gbps else Status.OK
    return ProbeResult("net.allreduce", status, Subject(node), f"all-reduce over {nranks} ranks through "
                       f"{VIA.get(backend, backend)}: bus bandwidth {busbw:.2f} GB/s", round(busbw, 3), t.min_busbw_gbps,
                       "" if status == Status.OK else "Below the site's floor: run nccl-tests and check the fabric.")
