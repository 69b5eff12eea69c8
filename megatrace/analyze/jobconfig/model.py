"""The job configuration as data: each field's value with where it came from, by source precedence.

Sources, highest precedence first (:data:`KINDS`):

``explicit``     a layout given by the user (``layout.yaml``, ``--layout``, ``--tp/--pp/--dp``)
``arguments``    the trainer's own command line and config files (Megatron-LM, DeepSpeed, torchtitan)
``environment``  the launcher's environment and the ring headers (WORLD_SIZE, SLURM_*, hosts)
``groups``       inferred from the process groups the tracer recorded
``derived``      computed from the fields above (e.g. DP = world / (TP x PP x CP))

A field keeps every value offered for it; the chosen one is the first by
precedence, and values that differ from it are kept as ``alternatives`` so a
contradiction can be reported with both sources named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KINDS = ("explicit", "arguments", "environment", "groups", "derived")

# Fields of job.yaml, by section. Sizes are integers, features booleans or short strings.
PARALLEL_FIELDS = ("world_size", "tp", "pp", "dp", "cp", "ep", "vpp", "dp_replicate", "dp_shard", "order")
BATCH_FIELDS = ("micro_batch", "global_batch", "grad_accum", "microbatches")
FEATURE_FIELDS = ("framework", "sequence_parallel", "distributed_optimizer", "zero_stage", "recompute",
                  "recompute_method", "overlap_grad_reduce", "overlap_param_gather", "schedule")
CLUSTER_FIELDS = ("nodes", "tasks_per_node", "gpus_per_node", "launcher")
FIELDS = PARALLEL_FIELDS + BATCH_FIELDS + FEATURE_FIELDS + CLUSTER_FIELDS


@dataclass(frozen=True)
class Value:
    """One value offered for a field, and the source that offered it."""

    value: Any
    kind: str  # one of KINDS
    source: str  # in words: "Megatron-LM argument --tensor-model-parallel-size", "environment WORLD_SIZE", ...

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "source": f"{self.kind}: {self.source}"}


@dataclass(frozen=True)
class Issue:
    """A consistency problem or an input that could not be used; becomes a finding."""

    code: str  # world-size, groups-disagree, sources-disagree, batch, unparseable-config, ...
    severity: str  # "error", "warning" or "info"
    message: str
    fields: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "severity": self.severity, "message": self.message, "fields": list(self.fields)}


@dataclass
class JobConfig:
    """Everything known about the job's configuration; see :func:`megatrace.analyze.jobconfig.build_job_config`."""

    offered: dict[str, list[Value]] = field(default_factory=dict)
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> {node, local_rank, gpu, gpu_source}
    environment: dict[str, Any] = field(default_factory=dict)  # nccl settings, slurm, versions
    inference: dict[str, Any] = field(default_factory=dict)  # what the process groups showed
    issues: list[Issue] = field(default_factory=list)
    job_id: str = ""

    def offer(self, name: str, value: Any, kind: str, source: str) -> None:
        """Record a value for ``name`` (ignored when None)."""
        if name not in FIELDS:
            raise KeyError(f"unknown job field {name!r}")
        if kind not in KINDS:
            raise KeyError(f"unknown source kind {kind!r}")
        if value is not None:
            self.offered.setdefault(name, []).append(Value(value, kind, source))

    def chosen(self, name: str) -> Value | None:
        """The value of highest precedence (the first offered of the best kind)."""
        values = self.offered.get(name) or []
        return min(values, key=lambda v: KINDS.index(v.kind)) if values else None

    def get(self, name: str, default: Any = None) -> Any:
        v = self.chosen(name)
        return default if v is None else v.value

    def has(self, name: str, *, kinds: tuple[str, ...] = KINDS) -> bool:
        return any(v.kind in kinds for v in self.offered.get(name) or ())

    def value_of(self, name: str, kinds: tuple[str, ...]) -> Value | None:
        """The best value of ``name`` among sources of ``kinds`` only."""
        values = [v for v in self.offered.get(name) or () if v.kind in kinds]
        return min(values, key=lambda v: KINDS.index(v.kind)) if values else None

    def alternatives(self, name: str) -> list[Value]:
        """Offered values that differ from the chosen one (a contradiction between sources)."""
        best = self.chosen(name)
        return [v for v in self.offered.get(name) or () if best is not None and v.value != best.value]

    def issue(self, code: str, severity: str, message: str, *fields: str) -> None:
        self.issues.append(Issue(code, severity, message, tuple(fields)))

    def sizes_label(self) -> str:
        """E.g. ``TP2·PP2·DP2`` (CP, EP and VPP when above 1); "unknown" without TP/PP/DP."""
        parts = [f"{n.upper()}{self.get(n)}" for n in ("tp", "cp", "pp", "dp", "ep", "vpp")
                 if self.get(n) is not None and (n in ("tp", "pp", "dp") or self.get(n) != 1)]
        return "·".join(parts) if parts else "unknown"
