"""The registry of preflight probes: every name a result may carry, by family (what ``--only`` accepts).

Kept free of imports so that ``megatrace-check --help`` and the validation of ``--only`` cost nothing.
"""

from __future__ import annotations

PROBES: dict[str, tuple[str, ...]] = {
    "gpu": ("nvml", "count", "driver", "xid", "temperature", "clocks", "ecc", "remap", "retired", "power", "pcie",
            "pcie_gen", "memory", "mig", "persistence", "nvlink", "dcgm"),
    "node": ("facts", "injected", "tracer", "plugin", "shm", "job_dir", "ring_dir", "ib", "ib_errors", "ib_rate", "cpus", "mem_bytes",
             "kernel", "versions", "gpu_driver", "clock"),
    "net": ("allreduce", "node", "link", "matrix", "pair", "latency", "gather"),
}
KNOWN = frozenset(f"{family}.{name}" for family, names in PROBES.items() for name in names) | frozenset(PROBES)


def unknown(names: tuple[str, ...] | list[str]) -> list[str]:
    """The names among ``names`` that are neither a family (``gpu``) nor a probe (``gpu.ecc``)."""
    return [n for n in names if n not in KNOWN]


def listing(width: int = 96) -> str:
    """The probes, a family a line (for ``--help``)."""
    lines = []
    for family, names in PROBES.items():
        line = f"{family}.{{"
        for i, name in enumerate(names):
            piece = name + ("," if i < len(names) - 1 else "}")
            if len(line) + len(piece) > width:
                lines.append(line)
                line = "    "
            line += piece
        lines.append(line)
    return "\n".join(lines)
