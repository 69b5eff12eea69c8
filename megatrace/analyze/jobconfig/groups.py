"""TP/PP/DP (and CP/EP) sizes and the rank order, inferred from the process groups the tracer recorded.

In a rank order such as Megatron-LM's ``tp-cp-ep-dp-pp`` every parallel
dimension has a *stride*: TP groups are runs of consecutive ranks (stride 1),
the next dimension's groups step by TP, the next by TP x CP, and so on. So each
recorded group whose members form an arithmetic progression, and whose class
(stride, size) partitions the world, is one dimension; sorted by stride they
give the order, and a stride with no groups of its own reveals a dimension
whose groups were never created (or never used): its size is known, its name
only guessed, so it is shown but not used for the layout.

Which dimension is which comes from, in this order: the groups' descriptions
(``group_desc`` such as "tp" or Megatron-LM's "TENSOR_MODEL_PARALLEL_GROUP");
point-to-point traffic (pipeline stages exchange activations, so PP carries the
send/recv records); collective counts (TP all-reduces every layer of every
microbatch, DP once or twice per step); and, with nothing else to go on,
Megatron-LM's default order (TP innermost).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from megatrace.config import ORDERS

NAMES = ("tp", "cp", "ep", "dp", "pp")
LAYOUT_NAMES = ("tp", "dp", "pp")  # what a megatrace.config.Layout can express
DEFAULT_ORDER = ("tp", "dp", "pp")  # Megatron-LM's default, fastest first
# Words in a group description that name its dimension (lower case; a description naming two is a
# combined group such as Megatron-LM's TENSOR_AND_DATA_PARALLEL_GROUP and gives no hint).
# (torch's DeviceMesh describes its groups "mesh_<dim name>")
DESC_HINTS = {"tp": re.compile(r"^(mesh_)?tp$|tensor"), "pp": re.compile(r"^(mesh_)?pp$|pipe"),
              "cp": re.compile(r"^(mesh_)?cp$|context"),
              "ep": re.compile(r"^(mesh_)?ep$|expert"), "dp": re.compile(r"^(mesh_)?dp$|data")}


@dataclass(frozen=True)
class GroupUse:
    """One recorded group: its members, description and how many records of each kind it carried."""

    ranks: tuple[int, ...]
    desc: str = ""
    collectives: int = 0
    p2p: int = 0


@dataclass
class Dim:
    """One parallel dimension: size, stride in ranks, and how its name was decided."""

    name: str | None
    size: int
    stride: int
    seen: bool  # groups of this dimension were recorded (False: a gap between the recorded ones)
    how: str = ""
    collectives: int = 0
    p2p: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "stride": self.stride, "seen": self.seen, "how": self.how}


@dataclass
class Inference:
    """What the groups say: the dimensions (fastest first), their sizes, the layout order, notes."""

    world: int
    dims: list[Dim] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def sizes(self) -> dict[str, int]:
        """Named dimensions' sizes; a name not found is absent (size 1 when the chain is complete)."""
        return {d.name: d.size for d in self.dims if d.name}

    @property
    def complete(self) -> bool:
        """Every rank is placed by recorded groups: the dimensions multiply to the world, all were seen and
        all have names. (A gap's name is a guess: it is shown, never used for the layout.)"""
        prod = 1
        for d in self.dims:
            prod *= d.size
        return bool(self.dims) and prod == self.world and all(d.name and d.seen for d in self.dims)

    def layout_sizes(self) -> tuple[dict[str, int], str] | None:
        """(tp, dp, pp sizes, order) for a :class:`~megatrace.config.Layout`: CP and EP fold into DP when
        they sit next to it in the order (Megatron-LM's data-parallel group with context parallelism)."""
        if not self.complete:
            return None
        dims = [(d.name, d.size) for d in self.dims]
        merged: list[list[Any]] = []
        for name, size in dims:
            if name in ("cp", "ep", "dp") and merged and merged[-1][0] in ("cp", "ep", "dp"):
                merged[-1] = ["dp" if "dp" in (name, merged[-1][0]) else merged[-1][0], merged[-1][1] * size]
            else:
                merged.append([name, size])
        if any(n not in LAYOUT_NAMES for n, _ in merged) or len({n for n, _ in merged}) != len(merged):
            return None
        present = [n for n, _ in merged]
        order = list(present)
        for i, name in enumerate(DEFAULT_ORDER):
            if name not in present:
                order.insert(min(i, len(order)), name)
        sizes = {n: 1 for n in LAYOUT_NAMES} | {n: s for n, s in merged}
        text = "-".join(order)
        return (sizes, text) if text in ORDERS else None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dims": [d.to_dict() for d in self.dims], "complete": self.complete}
        got = self.layout_sizes()
        if got is not None:
            out["layout"] = {**got[0], "order": got[1]}
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def _stride(members: tuple[int, ...]) -> int | None:
    if len(members) < 2:
        return None
    step = members[1] - members[0]
    if step <= 0 or any(b - a != step for a, b in zip(members, members[1:])):
        return None
    return step


def _hint(descs: set[str]) -> str | None:
    names: set[str] = set()
    for desc in descs:
        matched = {name for name, rx in DESC_HINTS.items() if rx.search(desc.lower())}
        if len(matched) == 1:
            names |= matched
    return next(iter(names)) if len(names) == 1 else None


def infer_from_groups(groups: list[GroupUse], world: int) -> Inference:
    """The parallel dimensions that the recorded groups reveal (see the module docstring)."""
    inf = Inference(world)
    merged: dict[tuple[int, ...], dict[str, Any]] = {}
    for g in groups:
        members = tuple(sorted(set(int(r) for r in g.ranks)))
        # A group of the whole world is the default group, unless its description names a dimension.
        if 1 < len(members) < world or (len(members) == world > 1 and _hint({g.desc})):
            slot = merged.setdefault(members, {"descs": set(), "coll": 0, "p2p": 0})
            if g.desc:
                slot["descs"].add(g.desc)
            slot["coll"] += g.collectives
            slot["p2p"] += g.p2p
    classes: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    irregular = 0
    for members, slot in list(merged.items()):
        if len(members) == world and not _hint(slot["descs"]):
            del merged[members]
            continue
        stride = _stride(members)
        if stride is None:
            irregular += 1
        else:
            classes.setdefault((stride, len(members)), []).append(members)
    if irregular:
        inf.notes.append(f"{irregular} group(s) are not evenly strided rank ranges (e.g. embedding groups); "
                         "not used for the layout")
    dims_by_stride: dict[int, tuple[int, list[tuple[int, ...]]]] = {}
    for (stride, size), tuples in sorted(classes.items()):
        covered = sorted(r for t in tuples for r in t)
        aligned = all((t[0] // stride) % size == 0 for t in tuples)
        if covered != list(range(world)) or not aligned:
            continue  # not one dimension of a rank order (partial, overlapping or shifted groups)
        if stride not in dims_by_stride:  # the smallest size at a stride; larger ones combine dimensions
            dims_by_stride[stride] = (size, tuples)
    prod = 1
    for stride, (size, tuples) in sorted(dims_by_stride.items()):
        if stride < prod or stride % prod:
            continue  # a combined group (e.g. TP x DP) spanning dimensions already placed
        if stride > prod:
            inf.dims.append(Dim(None, stride // prod, prod, seen=False))
        dim = Dim(None, size, stride, seen=True)
        descs = set().union(*(merged[t]["descs"] for t in tuples))
        dim.collectives = sum(merged[t]["coll"] for t in tuples)
        dim.p2p = sum(merged[t]["p2p"] for t in tuples)
        hint = _hint(descs)
        if hint:
            dim.name, dim.how = hint, f"group description {sorted(descs)[0]!r}"
        inf.dims.append(dim)
        prod = stride * size
    if not inf.dims:
        inf.notes.append("no recorded group is one dimension of a rank order: sizes unknown from groups")
        return inf
    if prod < world and world % prod == 0:
        inf.dims.append(Dim(None, world // prod, prod, seen=False))
    _name(inf)
    return inf


def data_parallel_world(groups: list[GroupUse], world: int) -> bool:
    """Every collective runs on the whole world and no rank sends to another (DDP, FSDP on one group): with no
    source of sizes, every rank does the same work, which is data parallelism as far as analysis goes."""
    used = [g for g in groups if g.collectives or g.p2p]
    return (world > 1 and bool(used) and not any(g.p2p for g in used)
            and all(len(set(g.ranks)) == world for g in used))


def _name(inf: Inference) -> None:
    """Name the dimensions the descriptions left unnamed (see the module docstring)."""
    taken = {d.name for d in inf.dims if d.name}
    duplicates = [n for n in taken if sum(d.name == n for d in inf.dims) > 1]
    for d in inf.dims:
        if d.name in duplicates:
            d.name, d.how = None, ""
    taken -= set(duplicates)
    free = [d for d in inf.dims if d.seen and d.name is None]
    if "pp" not in taken:
        carriers = sorted((d for d in free if d.p2p), key=lambda d: -d.p2p)
        if carriers:
            carriers[0].name, carriers[0].how = "pp", f"{carriers[0].p2p} point-to-point records (pipeline stages)"
            taken.add("pp")
            free.remove(carriers[0])
    pp = next((d for d in inf.dims if d.name == "pp"), None)
    open_names = [n for n in ("tp", "dp") if n not in taken]
    if len(free) >= 2 and open_names == ["tp", "dp"]:
        busiest = sorted(free, key=lambda d: (-d.collectives, d.stride))
        busiest[0].name, busiest[0].how = "tp", f"most collectives ({busiest[0].collectives}): tensor parallel"
        busiest[-1].name, busiest[-1].how = "dp", f"fewest collectives ({busiest[-1].collectives}): data parallel"
        if busiest[0].collectives == busiest[-1].collectives:
            for d in (busiest[0], busiest[-1]):
                d.how = "assumed: Megatron-LM's default order puts TP innermost"
            inf.notes.append("TP and DP named by assumption (no description, equal traffic): TP is the inner one")
        free = [d for d in free if d.name is None]
        open_names = []
    elif len(free) == 1 and open_names == ["tp", "dp"]:
        d = free[0]
        if pp is not None and pp.p2p and d.collectives:
            tp = d.collectives >= pp.p2p  # TP all-reduces at least once per layer per microbatch; DP once per step
            d.name = "tp" if tp else "dp"
            d.how = (f"{d.collectives} collectives {'≥' if tp else '<'} {pp.p2p} pipeline point-to-point records")
        else:
            d.name = "tp" if d.stride == 1 else "dp"
            d.how = "assumed: Megatron-LM's default order puts TP innermost"
            inf.notes.append(f"dimension of size {d.size} named {d.name} by assumption (no traffic tells TP from DP)")
        free, open_names = [], []
    for d, name in zip(free, open_names, strict=False):
        d.name, d.how = name, "the only name left"
    taken = {d.name for d in inf.dims if d.name}
    gaps = [d for d in inf.dims if not d.seen]
    left = [n for n in DEFAULT_ORDER if n not in taken]
    for d, name in zip(gaps, left, strict=False):
        d.name, d.how = name, "guessed: no groups recorded (the rank stride between the others); named by Megatron-LM's order"
    unnamed = [d for d in inf.dims if d.name is None]
    if unnamed:
        inf.notes.append(f"{len(unnamed)} dimension(s) could not be named: sizes "
                         f"{', '.join(str(d.size) for d in unnamed)}")
