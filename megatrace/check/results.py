"""What a preflight probe reports: one result per check and subject (node, GPU, link)."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any


class Status(str, enum.Enum):
    """Ordered from good to bad; ``worst()`` of a list decides the exit status."""

    OK = "ok"
    SKIP = "skip"  # nothing to check here (no GPU expected, a counter the device does not support)
    WARN = "warn"
    FAIL = "fail"

    @property
    def rank(self) -> int:
        return list(Status).index(self)


@dataclass(frozen=True)
class Subject:
    """What a result is about: a node, one GPU of it (index, UUID, PCI bus id), one of its NIC ports, or its
    link to a peer node."""

    node: str
    gpu: int | None = None
    uuid: str | None = None
    pci_bus: str | None = None
    peer: str | None = None  # the other end of a network link
    port: str | None = None  # an InfiniBand/RoCE port, "<device>/<port>" as sysfs names it: "mlx5_0/1"

    def label(self) -> str:
        """How the table names it: ``n1``, ``n1 GPU2``, ``n1 mlx5_0/1``, ``n1 ↔ n3``."""
        if self.peer is not None:
            return f"{self.node} ↔ {self.peer}"
        if self.gpu is not None:
            return f"{self.node} GPU{self.gpu}"
        return self.node if self.port is None else f"{self.node} {self.port}"


@dataclass(frozen=True)
class ProbeResult:
    probe: str  # e.g. "gpu.temperature"
    status: Status
    subject: Subject
    message: str
    value: Any = None  # what was measured
    threshold: Any = None  # what it was held against
    remediation: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = self.status.value
        return out

    def drain_reason(self) -> str:
        """A short reason for ``scontrol update state=drain reason=...`` (``sinfo -R`` shows it), naming the GPU
        or the NIC port first: ``megatrace: GPU1 XID 79 ...``, ``megatrace: mlx5_1/1 is 1: DOWN``."""
        text = self.message
        if self.subject.gpu is not None:
            where = f"GPU{self.subject.gpu} "
        elif self.subject.port is not None:
            where = f"{self.subject.port} "
            text = text.removeprefix(f"port {self.subject.port} ")  # the port's messages start by naming it
        else:
            where = ""
        return f"megatrace: {where}{text}"[:120]


def worst(results: list[ProbeResult]) -> Status:
    """The worst status; a check that had nothing to look at (SKIP) does not hide the others' OK."""
    checked = [r.status for r in results if r.status != Status.SKIP]
    if not checked:
        return Status.SKIP if results else Status.OK
    return max(checked, key=lambda s: s.rank)
