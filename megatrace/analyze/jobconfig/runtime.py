"""The job as its environment and ring headers describe it: world, nodes, placement, NCCL settings, versions.

Inputs are plain values per rank: the ring header facts (host, local rank), the
tracer's meta ``process`` line (versions) and ``env`` line (filtered environment).
Every value is offered with kind ``environment``; per-rank facts become the
``ranks`` table (rank -> node, local rank, GPU).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from megatrace.analyze.jobconfig.model import JobConfig

# Communication settings recorded in job.yaml (the rules engine compares them across ranks).
NCCL_PREFIXES = ("NCCL_", "TORCH_NCCL_")
VERSION_KEYS = ("torch", "cuda", "nccl", "driver")


def _int(value: Any) -> int | None:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None


def slurm_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` ("4(x2),2") as one count per node ([4, 4, 2]); [] when unreadable."""
    out: list[int] = []
    for part in str(text).split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return []
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def gpu_of(local_rank: int | None, visible: str | None) -> tuple[str | None, str]:
    """(GPU, how it was found) of a rank from its local rank and CUDA_VISIBLE_DEVICES."""
    devices = [d.strip() for d in str(visible).split(",") if d.strip()] if visible else []
    if len(devices) == 1:
        return devices[0], "CUDA_VISIBLE_DEVICES (one device per rank)"
    if devices and local_rank is not None and 0 <= local_rank < len(devices):
        return devices[local_rank], "CUDA_VISIBLE_DEVICES[local rank]"
    if local_rank is not None and local_rank >= 0:
        return str(local_rank), ("local rank (outside CUDA_VISIBLE_DEVICES)" if devices
                                 else "local rank (no CUDA_VISIBLE_DEVICES)")
    return None, "unknown"


def read_runtime(job: JobConfig, world: int, hosts: Mapping[int, str], local_ranks: Mapping[int, int],
                 process: Mapping[int, Mapping[str, Any]], env: Mapping[int, Mapping[str, str]],
                 world_source: str = "ring headers (torch.distributed world size)",
                 origin: str = "ring headers") -> None:
    """Offer world size, node and task counts and the placement; record NCCL settings and versions.
    ``world_source``: where the world size came from; ``origin``: where the hosts came from (an imported trace
    has no ring headers)."""
    job.offer("world_size", world, "environment", world_source)
    if env:
        common = dict(env[min(env)])  # launcher variables are the same on every rank but the rank ones
        for name, field in (("WORLD_SIZE", "world_size"), ("SLURM_NTASKS", "world_size"),
                            ("SLURM_JOB_NUM_NODES", "nodes"), ("SLURM_NNODES", "nodes"),
                            ("LOCAL_WORLD_SIZE", "tasks_per_node"), ("SLURM_NTASKS_PER_NODE", "tasks_per_node"),
                            ("SLURM_GPUS_ON_NODE", "gpus_per_node")):
            value = _int(common.get(name))
            if value is not None and value > 0:
                job.offer(field, value, "environment", f"environment {name}")
        gpus = re.fullmatch(r"(?:[\w-]+:)?(\d+)", str(common.get("SLURM_GPUS_PER_NODE", "")).strip())
        if gpus:  # "8" or "h100:8"
            job.offer("gpus_per_node", int(gpus.group(1)), "environment", "environment SLURM_GPUS_PER_NODE")
        visible = {str(e.get("CUDA_VISIBLE_DEVICES", "")) for e in env.values()}
        if len(visible) == 1 and len(next(iter(visible)).split(",")) > 1:  # every rank sees all of its node's GPUs
            job.offer("gpus_per_node", len(next(iter(visible)).split(",")), "environment",
                      "environment CUDA_VISIBLE_DEVICES (devices listed)")
        per_node = slurm_tasks_per_node(common.get("SLURM_TASKS_PER_NODE", "")) if "SLURM_TASKS_PER_NODE" in common \
            else []
        if per_node and len(set(per_node)) == 1:
            job.offer("tasks_per_node", per_node[0], "environment", "environment SLURM_TASKS_PER_NODE")
        launcher = ("slurm" if "SLURM_PROCID" in common else "torchrun" if "TORCHELASTIC_RUN_ID" in common
                    or "GROUP_RANK" in common else "environment" if "RANK" in common else None)
        job.offer("launcher", launcher, "environment", "environment (SLURM_PROCID / TORCHELASTIC_RUN_ID / RANK)")
    if hosts:
        job.offer("nodes", len(set(hosts.values())), "environment", f"{origin} (distinct hosts)")
        per_host = Counter(hosts.values())
        if len(set(per_host.values())) == 1:
            job.offer("tasks_per_node", next(iter(per_host.values())), "environment", f"{origin} (ranks per host)")
    for rank in sorted(set(hosts) | set(local_ranks) | set(env)):
        e = env.get(rank, {})
        local = local_ranks.get(rank)
        if local is None or local < 0:
            local = next((_int(e[k]) for k in ("LOCAL_RANK", "SLURM_LOCALID") if _int(e.get(k)) is not None), None)
        gpu, how = gpu_of(local, e.get("CUDA_VISIBLE_DEVICES"))
        job.ranks[rank] = {"node": hosts.get(rank), "local_rank": local, "gpu": gpu, "gpu_source": how}
    nccl: dict[str, Any] = {}
    names = sorted({n for e in env.values() for n in e if n.startswith(NCCL_PREFIXES)})
    for name in names:
        by_rank = {r: e.get(name) for r, e in env.items()}
        values = set(by_rank.values())
        nccl[name] = by_rank[min(by_rank)] if len(values) == 1 else _by_node(by_rank, hosts)
    job.environment["nccl"] = nccl
    versions: dict[str, Any] = {}
    for key in VERSION_KEYS:
        by_rank = {r: str(p[key]) for r, p in process.items() if isinstance(p, Mapping) and p.get(key)}
        if by_rank:
            versions[key] = next(iter(set(by_rank.values()))) if len(set(by_rank.values())) == 1 \
                else _by_node(by_rank, hosts)
    job.environment["versions"] = versions
    slurm = {k: v for k, v in (dict(env[min(env)]) if env else {}).items() if k.startswith("SLURM_JOB") or k in (
        "SLURM_NNODES", "SLURM_NTASKS", "SLURM_TASKS_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE",
        "SLURM_CPUS_PER_TASK")}
    if slurm:
        job.environment["slurm"] = slurm


def _by_node(by_rank: Mapping[int, Any], hosts: Mapping[int, str]) -> dict[str, Any]:
    """A setting that differs: ``{"differs": True, "by_node": {host: value or {rank: value}}}``."""
    nodes: dict[str, dict[int, Any]] = {}
    for rank, value in sorted(by_rank.items()):
        nodes.setdefault(hosts.get(rank, "?"), {})[rank] = value
    out = {h: (next(iter(set(v.values()))) if len(set(v.values())) == 1 else v) for h, v in nodes.items()}
    return {"differs": True, "by_node": out}
