"""The start marker: ``rank-NNNNN.init``, written as a rank enters ``init_process_group``.

A rank's ring exists only once ``init_process_group`` has returned (its rank and world size come from
the process group). A job stuck in its rendezvous (an address that does not resolve, a rank that never
arrives) would leave nothing for the agents to watch. So the tracer writes, at the call's entry, a small
JSON file beside where the ring will be: who (rank and world size as the call or the environment gives
them), where it goes (the rendezvous address and port, never a URL's user, password or query), and when.
The agent and the analysis read it (``megatrace.analyze.startup``); a ring of the same rank supersedes it.

Written with the ring's rules (a private directory of this user, ``O_EXCL|O_NOFOLLOW``, mode 0600); an
earlier attempt's marker is moved aside as ``rank-NNNNN.init.N``. Nothing here may raise or block: no
name is resolved, nothing is connected to.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from megatrace.files import create_private, move_aside, private_dir
from megatrace.trace import ring_format as fmt
from megatrace.trace.settings import TracerSettings

MARKER_SUFFIX = ".init"
MAX_MARKER_BYTES = 4096  # what a reader accepts (a marker is ~300 bytes)


def marker_name(rank: int) -> str:
    return f"rank-{rank:05d}{MARKER_SUFFIX}"


def _int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _endpoint(init_method: Any, env: Mapping[str, str]) -> tuple[str, int | None, str]:
    """(address, port, scheme) of the rendezvous: a tcp:// URL's host and port, else MASTER_ADDR/MASTER_PORT."""
    if isinstance(init_method, str) and init_method and not init_method.startswith("env://"):
        try:
            url = urlsplit(init_method)
            if url.scheme == "file":
                return "", None, "file"
            return url.hostname or "", url.port, url.scheme or "?"
        except ValueError:
            return "", None, "?"
    return env.get("MASTER_ADDR", ""), _int(env.get("MASTER_PORT")), "env"


def marker(args: tuple[Any, ...], kwargs: Mapping[str, Any], job_id: str = "",
           env: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The marker's content for a call ``init_process_group(*args, **kwargs)``; None when the rank is unknown."""
    rank = _int(kwargs.get("rank"))
    if rank is None or rank < 0:
        rank = _int(env.get("RANK"))
    world = _int(kwargs.get("world_size"))
    if world is None or world < 0:
        world = _int(env.get("WORLD_SIZE"))
    if rank is None or rank < 0:
        return None
    addr, port, scheme = _endpoint(kwargs.get("init_method", args[1] if len(args) > 1 else None), env)
    store = kwargs.get("store") is not None
    return {"kind": "init", "job_id": job_id[:64], "rank": rank, "world_size": world if world is not None and world > 0 else None,
            "pid": os.getpid(), "host": env.get("SLURMD_NODENAME") or socket.gethostname(),
            "master_addr": "" if store else addr[:255], "master_port": None if store else port,
            "rendezvous": "store" if store else scheme, "t_wall_ns": time.time_ns(), "t_mono_ns": time.monotonic_ns()}


def write_marker(args: tuple[Any, ...], kwargs: Mapping[str, Any], settings: TracerSettings | None = None) -> None:
    """Write this rank's marker; never raises (a tracer problem must not stop the training)."""
    try:
        settings = settings or TracerSettings.from_env()
        content = marker(args, kwargs, settings.job_id)
        if content is None:
            return
        _write(settings.directory, marker_name(content["rank"]), json.dumps(content).encode() + b"\n")
    except Exception:  # noqa: BLE001 - the marker is evidence for a hang, never a reason for one
        return


def _write(directory: Path, name: str, data: bytes) -> None:
    dfd = private_dir(directory)
    try:
        move_aside(dfd, name)  # an earlier attempt of this rank (a restart): kept as rank-NNNNN.init.K
        fd = create_private(dfd, name, os.O_WRONLY)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


@dataclass(frozen=True)
class InitMarker:
    """A marker as read back (every field checked: the file is the job user's, read by root too)."""

    rank: int
    job_id: str
    world_size: int | None
    pid: int
    host: str
    master_addr: str
    master_port: int | None
    rendezvous: str
    t_wall_ns: int
    t_mono_ns: int

    @property
    def endpoint(self) -> str:
        """``ADDR:PORT`` of the rendezvous, or how it was reached (a store object, a file) when not TCP."""
        if self.master_addr:
            return f"{self.master_addr}:{self.master_port if self.master_port is not None else '?'}"
        return {"store": "a store the program made itself", "file": "a shared file"}.get(self.rendezvous,
                                                                                         "an unknown address")


def parse_marker(blob: bytes) -> InitMarker | None:
    """The marker in ``blob``, or None when it is not one (too large, not JSON, a field of the wrong type)."""
    if len(blob) > MAX_MARKER_BYTES:
        return None
    try:
        d = json.loads(blob)
    except ValueError:
        return None
    if not isinstance(d, dict) or d.get("kind") != "init":
        return None

    def num(key: str, lo: int = 0, hi: int = 1 << 62, optional: bool = False) -> int | None:
        v = d.get(key)
        if v is None and optional:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise ValueError(key)
        return v

    def text(key: str) -> str:
        v = d.get(key, "")
        if not isinstance(v, str):
            raise ValueError(key)
        return "".join(c for c in v[:255] if c.isprintable())

    try:
        return InitMarker(rank=num("rank", hi=fmt.MAX_WORLD_SIZE - 1), job_id=text("job_id"), world_size=num("world_size", 1, fmt.MAX_WORLD_SIZE, optional=True),
                          pid=num("pid", 1, 1 << 31), host=text("host"), master_addr=text("master_addr"),
                          master_port=num("master_port", 0, 65535, optional=True), rendezvous=text("rendezvous"),
                          t_wall_ns=num("t_wall_ns"), t_mono_ns=num("t_mono_ns"))  # type: ignore[arg-type]
    except ValueError:
        return None
