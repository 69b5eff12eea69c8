"""Fault specifications for the demo job: parsing ``--fault SPEC`` and checking it against the layout.

Steps count from 0 everywhere. Kinds:

* ``hang:rank=R,step=S[,phase=forward|backward|optimizer]`` rank R stops (sleeps
  forever) right before its first collective/p2p call once step S reaches that phase;
* ``commhang:rank=R,step=S`` rank R enters its first collective of step S and never returns;
* ``slow:rank=R,factor=F[,from_step=S]`` rank R computes F times slower from step S;
* ``crash:rank=R,step=S`` rank R exits with status 1 at the start of step S;
* ``slowlink:ranks=A-B,delay_ms=D`` every point-to-point message between A and B
  (adjacent pipeline stages) arrives D ms late.

The injection itself (in the worker process) lives in :mod:`megatrace.demo.inject`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Union

from megatrace.config import Layout
from megatrace.errors import MegatraceError

PHASES = ("forward", "backward", "optimizer")


class FaultError(MegatraceError, ValueError):
    """A malformed or impossible fault spec; the message names the spec and the bad field."""


@dataclass(frozen=True)
class HangFault:
    kind: ClassVar[str] = "hang"
    rank: int
    step: int
    phase: str = "forward"


@dataclass(frozen=True)
class CommHangFault:
    kind: ClassVar[str] = "commhang"
    rank: int
    step: int


@dataclass(frozen=True)
class SlowFault:
    kind: ClassVar[str] = "slow"
    rank: int
    factor: float
    from_step: int = 0


@dataclass(frozen=True)
class CrashFault:
    kind: ClassVar[str] = "crash"
    rank: int
    step: int


@dataclass(frozen=True)
class SlowLinkFault:
    kind: ClassVar[str] = "slowlink"
    ranks: tuple[int, int]
    delay_ms: float


FaultSpec = Union[HangFault, CommHangFault, SlowFault, CrashFault, SlowLinkFault]
KINDS: dict[str, type] = {cls.kind: cls for cls in (HangFault, CommHangFault, SlowFault, CrashFault,
                                                     SlowLinkFault)}


def _format_value(value: Any) -> str:
    if isinstance(value, tuple):
        return "-".join(map(str, value))
    return format(value, ".15g") if isinstance(value, float) else str(value)


def format_fault(fault: FaultSpec) -> str:
    """The canonical ``--fault`` spec of ``fault`` (``parse_fault(format_fault(f)) == f``)."""
    parts = (f"{f.name}={_format_value(getattr(fault, f.name))}" for f in dataclasses.fields(fault))
    return f"{fault.kind}:{','.join(parts)}"


def fault_to_dict(fault: FaultSpec) -> dict[str, Any]:
    """Ground truth for ``fault.json``: kind, parameters and the canonical spec."""
    data = dataclasses.asdict(fault)
    if "ranks" in data:
        data["ranks"] = list(data["ranks"])
    return {"kind": fault.kind, **data, "spec": format_fault(fault)}


def _convert(spec: str, key: str, raw: str) -> Any:
    if key == "ranks":
        a, sep, b = raw.partition("-")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit():
            raise FaultError(f"--fault {spec}: ranks must look like A-B (two ranks), got {raw!r}")
        return (int(a), int(b))
    if key == "phase":
        if raw not in PHASES:
            raise FaultError(f"--fault {spec}: phase must be one of {', '.join(PHASES)}, got {raw!r}")
        return raw
    if key in ("factor", "delay_ms"):
        try:
            value = float(raw)
        except ValueError:
            raise FaultError(f"--fault {spec}: {key} must be a number, got {raw!r}") from None
        if not value > 0 or value == float("inf"):
            raise FaultError(f"--fault {spec}: {key} must be a positive number, got {raw!r}")
        return value
    try:
        value = int(raw)
    except ValueError:
        raise FaultError(f"--fault {spec}: {key} must be an integer, got {raw!r}") from None
    if value < 0:
        raise FaultError(f"--fault {spec}: {key} must not be negative, got {value}")
    return value


def parse_fault(spec: str) -> FaultSpec:
    """Parse ``KIND:key=value,...`` into a fault dataclass; :class:`FaultError` names what is wrong."""
    kind, sep, body = spec.strip().partition(":")
    if kind not in KINDS:
        raise FaultError(f"--fault {spec}: unknown fault kind {kind!r} (known: {', '.join(KINDS)})")
    cls = KINDS[kind]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in body.split(","))) if sep else ():
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or not raw:
            raise FaultError(f"--fault {spec}: expected key=value, got {item!r}")
        if key not in fields:
            raise FaultError(f"--fault {spec}: unknown key {key!r} for {kind} (known: {', '.join(fields)})")
        if key in values:
            raise FaultError(f"--fault {spec}: key {key!r} given twice")
        values[key] = _convert(spec, key, raw)
    missing = [n for n, f in fields.items()
               if n not in values and f.default is dataclasses.MISSING]
    if missing:
        raise FaultError(f"--fault {spec}: missing {', '.join(missing)} (e.g. {_example(kind)})")
    return cls(**values)


def _example(kind: str) -> str:
    return {"hang": "hang:rank=5,step=3", "commhang": "commhang:rank=5,step=3",
            "slow": "slow:rank=2,factor=2", "crash": "crash:rank=3,step=4",
            "slowlink": "slowlink:ranks=1-5,delay_ms=50"}[kind]


def validate_fault(fault: FaultSpec, layout: Layout, steps: int, text: str | None = None) -> None:
    """Check one fault against the layout and step count; :class:`FaultError` names the field.

    ``text`` is the spec as the user wrote it, quoted in the message (default: the canonical form).
    """
    where = f"--fault {text or format_fault(fault)}"
    is_link = isinstance(fault, SlowLinkFault)
    for rank in fault.ranks if is_link else (fault.rank,):
        if not 0 <= rank < layout.world_size:
            key = f"ranks={fault.ranks[0]}-{fault.ranks[1]}: rank" if is_link else "rank"
            raise FaultError(f"{where}: {key} {rank} is outside the world of {layout.world_size} ranks")
    key = "from_step" if isinstance(fault, SlowFault) else "step"
    step = getattr(fault, key, 0)
    if step >= steps:
        raise FaultError(f"{where}: {key} {step} is not below --steps {steps} (steps count from 0)")
    if isinstance(fault, SlowFault) and fault.factor < 1:
        raise FaultError(f"{where}: factor must be at least 1, got {fault.factor:g}")
    if is_link:
        a, b = (layout.coords(r) for r in fault.ranks)
        if fault.ranks[0] == fault.ranks[1]:
            raise FaultError(f"{where}: ranks: a link needs two different ranks")
        if (a.dp, a.tp) != (b.dp, b.tp) or abs(a.pp - b.pp) != 1:
            raise FaultError(f"{where}: ranks: {fault.ranks[0]} (stage {a.pp}, dp {a.dp}, tp {a.tp}) and "
                             f"{fault.ranks[1]} (stage {b.pp}, dp {b.dp}, tp {b.tp}) are not adjacent stages "
                             "of one pipeline")


def validate_faults(faults: list[FaultSpec], layout: Layout, steps: int) -> None:
    """Check every fault with :func:`validate_fault`."""
    for fault in faults:
        validate_fault(fault, layout, steps)


def write_fault_json(path: str | os.PathLike[str], faults: list[FaultSpec]) -> None:
    """Write the ground truth of injected faults (for tests and benchmarks, never read by the analyzer)."""
    Path(path).write_text(json.dumps({"faults": [fault_to_dict(f) for f in faults]}, indent=2) + "\n")
