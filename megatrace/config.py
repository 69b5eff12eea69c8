"""The job's parallel layout: world size, TP x PP x DP, rank order, schedule, placement.

A :class:`Layout` answers the questions the analyzer and the demo keep asking:
which (pp, dp, tp) coordinates a global rank has, and which ranks form each
tensor-, pipeline- and data-parallel group. It is stored as ``layout.yaml``
with strict keys, so a typo is an error that names the file and the key.

Rank orders (the first named dimension varies fastest):

* ``tp-dp-pp`` (Megatron-LM's default): ``rank = tp + TP * (dp + DP * pp)``
* ``tp-pp-dp`` (Megatron-LM's ``--use-tp-pp-dp-mapping``): ``rank = tp + TP * (pp + PP * dp)``
* any other permutation of the three (e.g. ``dp-tp-pp``), read the same way

The job's other facts (batch sizes, features, sources) live in
:mod:`megatrace.analyze.jobconfig` and its ``job.yaml``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from megatrace.errors import MegatraceError

ORDERS = ("tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "dp-pp-tp", "pp-tp-dp", "pp-dp-tp")
SCHEDULES = ("1f1b", "gpipe")
GROUP_KINDS = ("tp", "pp", "dp")


class LayoutError(MegatraceError, ValueError):
    """An invalid layout; the message names the field (and the file when there is one)."""


class RankCoords(NamedTuple):
    """Position of a rank in the 3D grid."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class RankPlacement:
    """Where a rank runs."""

    host: str
    local_rank: int


@dataclass(frozen=True)
class Layout:
    """The parallel layout of a job (see the module docstring for rank orders)."""

    world_size: int
    tp: int
    pp: int
    dp: int
    microbatches: int = 1
    schedule: str = "1f1b"
    order: str = "tp-dp-pp"
    layers_per_stage: int | None = None
    ranks: dict[int, RankPlacement] = field(default_factory=dict, hash=False)

    def validate(self, source: str | None = None) -> Layout:
        """Raise :class:`LayoutError` naming the first bad field; return ``self`` when valid."""
        where = f"{source}: " if source else ""
        for name in ("world_size", "tp", "pp", "dp", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{where}{name} must be a positive integer, got {value!r}")
        if self.layers_per_stage is not None and (
                not isinstance(self.layers_per_stage, int) or self.layers_per_stage < 1):
            raise LayoutError(f"{where}layers_per_stage must be a positive integer, got {self.layers_per_stage!r}")
        if self.world_size != self.tp * self.pp * self.dp:
            raise LayoutError(f"{where}world_size {self.world_size} != tp*pp*dp = "
                              f"{self.tp}*{self.pp}*{self.dp} = {self.tp * self.pp * self.dp}")
        if self.order not in ORDERS:
            raise LayoutError(f"{where}order {self.order!r} is not one of {', '.join(ORDERS)}")
        if self.schedule not in SCHEDULES:
            raise LayoutError(f"{where}schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        for rank, placement in self.ranks.items():
            if not 0 <= rank < self.world_size:
                raise LayoutError(f"{where}ranks: rank {rank} is outside the world of {self.world_size} ranks")
            if not isinstance(placement, RankPlacement):
                raise LayoutError(f"{where}ranks: rank {rank} has no host/local_rank placement")
        return self

    def strides(self) -> dict[str, int]:
        """Rank distance between neighbours along each dimension ({"tp": 1, "dp": TP, "pp": TP*DP} by default)."""
        out, stride = {}, 1
        for name in self.order.split("-"):
            out[name] = stride
            stride *= getattr(self, name)
        return out

    def coords(self, rank: int) -> RankCoords:
        """The (pp, dp, tp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the world of {self.world_size} ranks")
        tp, rest = rank % self.tp, rank // self.tp
        if self.order == "tp-dp-pp":
            return RankCoords(pp=rest // self.dp, dp=rest % self.dp, tp=tp)
        if self.order == "tp-pp-dp":
            return RankCoords(pp=rest % self.pp, dp=rest // self.pp, tp=tp)
        s = self.strides()
        return RankCoords(pp=rank // s["pp"] % self.pp, dp=rank // s["dp"] % self.dp, tp=rank // s["tp"] % self.tp)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """The global rank at coordinates (pp, dp, tp)."""
        for name, value, size in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp)):
            if not 0 <= value < size:
                raise LayoutError(f"{name} index {value} is outside 0..{size - 1}")
        if self.order == "tp-dp-pp":
            return tp + self.tp * (dp + self.dp * pp)
        if self.order == "tp-pp-dp":
            return tp + self.tp * (pp + self.pp * dp)
        s = self.strides()
        return tp * s["tp"] + dp * s["dp"] + pp * s["pp"]

    def _groups(self, kind: str) -> list[list[int]]:
        sizes = {"tp": self.tp, "pp": self.pp, "dp": self.dp}
        if kind not in sizes:
            raise LayoutError(f"group kind {kind!r} is not one of {', '.join(GROUP_KINDS)}")
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(tuple(self.group_of(kind, rank)), None)
        return sorted(list(g) for g in seen)

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The sorted global ranks of the ``kind`` group ("tp", "pp" or "dp") that holds ``rank``."""
        c = self.coords(rank)
        if kind == "tp":
            return sorted(self.rank_of(c.pp, c.dp, t) for t in range(self.tp))
        if kind == "pp":
            return sorted(self.rank_of(p, c.dp, c.tp) for p in range(self.pp))
        if kind == "dp":
            return sorted(self.rank_of(c.pp, d, c.tp) for d in range(self.dp))
        raise LayoutError(f"group kind {kind!r} is not one of {', '.join(GROUP_KINDS)}")

    def tp_groups(self) -> list[list[int]]:
        """All tensor-parallel groups, ordered by their lowest rank."""
        return self._groups("tp")

    def pp_groups(self) -> list[list[int]]:
        """All pipeline-parallel groups, ordered by their lowest rank (within a group, rank order is stage order)."""
        return self._groups("pp")

    def dp_groups(self) -> list[list[int]]:
        """All data-parallel groups, ordered by their lowest rank."""
        return self._groups("dp")

    def to_dict(self) -> dict[str, Any]:
        """A plain dict in field order (``ranks`` as {rank: {host, local_rank}})."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "ranks"}
        out["ranks"] = {r: dataclasses.asdict(p) for r, p in sorted(self.ranks.items())}
        return out


_FIELDS = {f.name for f in dataclasses.fields(Layout)}
_PLACEMENT_FIELDS = {f.name for f in dataclasses.fields(RankPlacement)}


def layout_from_dict(data: Any, source: str = "<dict>") -> Layout:
    """Build and validate a layout from a mapping with strict keys."""
    if not isinstance(data, dict):
        raise LayoutError(f"{source}: expected a mapping of layout fields, got {type(data).__name__}")
    for key in data:
        if key not in _FIELDS:
            raise LayoutError(f"{source}: unknown key {key!r} (known: {', '.join(sorted(_FIELDS))})")
    for key in ("world_size", "tp", "pp", "dp"):
        if key not in data:
            raise LayoutError(f"{source}: missing required key {key!r}")
    ranks: dict[int, RankPlacement] = {}
    for rank, placement in (data.get("ranks") or {}).items():
        if not isinstance(placement, dict) or set(placement) - _PLACEMENT_FIELDS or not placement:
            raise LayoutError(f"{source}: ranks: rank {rank}: expected keys {', '.join(sorted(_PLACEMENT_FIELDS))}, "
                              f"got {placement!r}")
        try:
            ranks[int(rank)] = RankPlacement(host=str(placement.get("host", "")),
                                             local_rank=int(placement.get("local_rank", 0)))
        except (TypeError, ValueError):
            raise LayoutError(f"{source}: ranks: rank {rank!r}: not an integer rank/local_rank") from None
    fields = {k: v for k, v in data.items() if k != "ranks"}
    return Layout(**fields, ranks=ranks).validate(source)


def read_yaml(path: str | Path, error: type[Exception] = LayoutError, what: str = "layout") -> Any:
    """The parsed content of a YAML file; an unreadable file, one that is not UTF-8 text, or bad YAML raises
    ``error`` naming the file."""
    try:
        return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: cannot read {what}: not UTF-8 text (byte {exc.start} is 0x{exc.object[exc.start]:02x})"
                    ) from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {exc}") from None


def load_layout(path: str | Path) -> Layout:
    """Read ``layout.yaml``; errors name the file and the bad key or field."""
    return layout_from_dict(read_yaml(path), str(path))


def save_layout(layout: Layout, path: str | Path) -> None:
    """Write ``layout`` as YAML, fields in declaration order."""
    Path(path).write_text(yaml.safe_dump(layout.validate().to_dict(), sort_keys=False))
