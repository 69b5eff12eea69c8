"""Where a demo worker is: rank, world size and rendezvous address, from torchrun-style or Slurm variables."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from megatrace.errors import MegatraceError

DEFAULT_PORT = 29500


class EnvError(MegatraceError, ValueError):
    """The environment does not say which rank this process is."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    under_slurm: bool


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``n[1-4]`` -> ``n1``, ``a[07,9],b`` -> ``a07``, ``n1,n2`` -> ``n1``."""
    m = re.match(r"\s*([^,\[]+)(?:\[([^\]]*)\])?([^,]*)", nodelist)
    if not m or not m.group(1).strip():
        raise EnvError(f"cannot parse the Slurm node list {nodelist!r}")
    prefix, ranges, suffix = m.groups()
    if ranges is None:
        return prefix.strip()
    first = ranges.split(",")[0].split("-")[0].strip()
    return f"{prefix}{first}{suffix}"


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise EnvError(f"{name}={environ[name]!r} is not an integer") from None


def resolve_env(environ: Mapping[str, str]) -> DistEnv:
    """RANK/WORLD_SIZE/LOCAL_RANK, else SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (under srun).

    MASTER_ADDR defaults to the first host of SLURM_NODELIST under srun, else 127.0.0.1;
    MASTER_PORT to ``20000 + SLURM_JOB_ID % 20000`` under Slurm, else 29500.
    """
    under_slurm = "RANK" not in environ and "SLURM_PROCID" in environ
    if "RANK" in environ:
        rank = _int(environ, "RANK")
        world = _int(environ, "WORLD_SIZE") if "WORLD_SIZE" in environ else None
        local = _int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else rank
    elif under_slurm:
        rank = _int(environ, "SLURM_PROCID")
        world = _int(environ, "SLURM_NTASKS") if "SLURM_NTASKS" in environ else None
        local = _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0
    else:
        raise EnvError("no RANK or SLURM_PROCID in the environment: start workers with "
                       "`megatrace demo` (local) or srun")
    if world is None:
        raise EnvError("WORLD_SIZE (or SLURM_NTASKS under srun) is not set")
    if not 0 <= rank < world:
        raise EnvError(f"rank {rank} is outside the world of {world} ranks")
    addr = environ.get("MASTER_ADDR")
    nodelist = environ.get("SLURM_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not addr:
        addr = first_host(nodelist) if under_slurm and nodelist else "127.0.0.1"
    if environ.get("MASTER_PORT"):
        port = _int(environ, "MASTER_PORT")
    elif environ.get("SLURM_JOB_ID", "").isdigit():
        port = 20000 + int(environ["SLURM_JOB_ID"]) % 20000
    else:
        port = DEFAULT_PORT
    return DistEnv(rank, world, local, addr, port, under_slurm)
