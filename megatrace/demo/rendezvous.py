"""Reaching the job's rendezvous (``MASTER_ADDR:MASTER_PORT``) in bounded time, or a one-line reason why not.

torch's own ``env://`` rendezvous retries an unresolvable or unreachable address until the process group's
timeout (30 minutes by default), printing a warning several times a second. The demo instead resolves the
address first (a name that does not resolve fails at once) and connects with its own timeout
(``--rendezvous-timeout``); once connected, the store takes the process group's timeout, so a rank that
starts late is still waited for as long as torch would.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

from megatrace.demo.env import DistEnv
from megatrace.errors import MegatraceError

DEFAULT_TIMEOUT_S = 60.0


class RendezvousError(MegatraceError):
    """The rendezvous address cannot be resolved or reached: the message says which, and why."""


def resolve(addr: str, port: int) -> None:
    """Raise :class:`RendezvousError` when ``addr`` does not resolve."""
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise RendezvousError(f"MASTER_ADDR {addr!r} does not resolve on {socket.gethostname()} ({reason}); "
                              "set MASTER_ADDR to an address every node can reach") from None


def connect(env: DistEnv, timeout_s: float, store_timeout: timedelta) -> Any:
    """The job's TCPStore (rank 0 hosts it), reached within ``timeout_s``; raises :class:`RendezvousError`."""
    import torch.distributed as dist

    resolve(env.master_addr, env.master_port)
    try:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, env.rank == 0,
                              timedelta(seconds=timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        role = "host" if env.rank == 0 else "reach"
        raise RendezvousError(f"rank {env.rank} cannot {role} the rendezvous {env.master_addr}:{env.master_port} "
                              f"within {timeout_s:g} s: {first}") from None
    store.set_timeout(store_timeout)
    return store
