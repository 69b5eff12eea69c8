"""The files beside the rings: group lines of the meta files, ``procs.json`` (process facts), ``layout.yaml``.

Every one is input: a wrong type is dropped, an unreadable file is a :class:`LoadProblem`, never a traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megatrace.config import Layout, LayoutError, layout_from_dict
from megatrace.files import read_input
from megatrace.load.traceset import GroupInfo, LoadProblem, NodeFacts, ProcFact, name_list, plural, rank_list

SIDE_FILE_LIMIT = 16 << 20  # layout.yaml and procs.json are a few KiB


def _members(raw) -> tuple[int, ...] | None:
    try:
        return tuple(int(r) for r in raw)
    except (TypeError, ValueError):
        return None


def merge_groups(metas: dict[int, list[dict]], used: dict[int, set[int]],
                 problems: list[LoadProblem]) -> dict[int, GroupInfo]:
    """Merge group lines of all ranks; check that members agree; infer groups seen only in records."""
    # Every member of a group writes the same member list: each distinct list is converted and hashed
    # once (thousands of ranks, lists of hundreds), then recognised by identity.
    by_members: dict[int, dict[int, tuple[tuple[int, ...], list[int]]]] = {}  # gid -> id(members) -> ...
    first: dict[int, dict] = {}
    seen_lists: dict[tuple, tuple[int, ...] | None] = {}
    canonical: dict[tuple[int, ...], tuple[int, ...]] = {}
    by_id: dict[int, tuple[object, tuple[int, ...] | None]] = {}  # parsed lists shared by several entries
    # Ranks that wrote the same line share one entry (load/rings.py): each distinct entry is looked at once, with
    # the ranks that hold it, in the order entries first appear (so versions and first lines come out as if
    # every rank's entries were walked one by one).
    holders: dict[int, tuple[dict, list[int]]] = {}
    for rank, entries in metas.items():
        for e in entries:
            held = holders.get(id(e))
            if held is None:
                holders[id(e)] = (e, [rank])
            else:
                held[1].append(rank)
    for e, ranks in holders.values():
        if e.get("kind") != "group" or not isinstance(e.get("gid"), int):
            continue
        listed = e.get("ranks") or ()
        known = by_id.get(id(listed))
        if known is not None and known[0] is listed:
            members = known[1]
        else:
            try:
                raw = tuple(listed)
                members = seen_lists[raw] if raw in seen_lists else seen_lists.setdefault(raw, _members(raw))
            except TypeError:  # unhashable members: convert (and fail) the slow way
                members = _members(listed)
            if members is not None:
                members = canonical.setdefault(members, members)
            by_id[id(listed)] = (listed, members)
        if members is None:
            continue
        slot = by_members.setdefault(e["gid"], {})
        if id(members) in slot:
            slot[id(members)][1].extend(ranks)
        else:
            slot[id(members)] = (members, ranks)
        first.setdefault(e["gid"], e)
    versions = {gid: dict(slot.values()) for gid, slot in by_members.items()}
    groups: dict[int, GroupInfo] = {}
    disagree: list[str] = []
    disagree_ranks: set[int] = set()
    for gid, seen in versions.items():
        members = max(seen, key=lambda m: len(seen[m]))  # the majority; a tie: the lowest reporting rank
        e = first[gid]
        groups[gid] = GroupInfo(gid, str(e.get("name", "")), str(e.get("desc", "")), members,
                                str(e.get("backend", "")))
        if len(seen) > 1:
            detail = "; ".join(f"ranks {rank_list(sorted(set(r)), 4)} say {rank_list(m, 4)}" for m, r in seen.items())
            disagree.append(f"group {gid} ({e.get('desc') or e.get('name')}): {detail}; using {rank_list(members, 4)}")
            disagree_ranks.update(r for rs in seen.values() for r in rs)
    if disagree:
        problems.append(LoadProblem(
            "error", "group-disagreement",
            f"the members of {plural(len(disagree), 'group')} disagree across ranks (a group id reused for "
            f"different groups, or meta files of different runs): {name_list(disagree, 3)}",
            ranks=tuple(sorted(disagree_ranks))))
    unknown = {gid: users for gid, users in used.items() if gid not in groups and gid != 0}
    for gid, users in sorted(unknown.items()):
        groups[gid] = GroupInfo(gid, "", "", tuple(sorted(users)), inferred=True)
    if unknown:
        problems.append(LoadProblem(
            "warning", "unknown-groups",
            f"{plural(len(unknown), 'group')} used in records without a meta line (meta files missing or torn); their "
            f"members are inferred from the ranks that used them, so ranks that never entered them are not "
            f"known: groups {name_list([str(g) for g in sorted(unknown)])}"))
    return groups


def node_facts(directory: Path, problems: list[LoadProblem]) -> NodeFacts:
    """The process facts of ``procs.json`` (the launcher's and the collector's word on each rank), if any."""
    path = directory / "procs.json"
    if not os.path.lexists(path):
        return NodeFacts()
    try:
        try:
            data = json.loads(read_input(path, SIDE_FILE_LIMIT))
        except RecursionError:
            raise ValueError("nested too deeply") from None
        procs = {}
        for key, p in (data.get("ranks") or {}).items():
            procs[int(key)] = ProcFact(int(key), p.get("pid"), p.get("exit_code"), p.get("signal"),
                                       bool(p.get("killed_by_launcher", False)), _typed(p.get("alive"), bool),
                                       _typed(p.get("state"), str), _typed(p.get("wchan"), str),
                                       _typed(p.get("node"), str), _frames(p.get("stack")))
        return NodeFacts(procs, data.get("outcome"), data.get("message"))
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        problems.append(LoadProblem("warning", "procs", f"{path}: unreadable process facts ({why[:200]}); ignored",
                                    paths=(str(path),)))
        return NodeFacts()


def _frames(value: Any) -> tuple[str, ...]:
    """A process's stack frames from procs.json (a list of strings; anything else is no stack)."""
    if not isinstance(value, list):
        return ()
    return tuple(f[:200] for f in value[:8] if isinstance(f, str))


def _typed(value: Any, kind: type) -> Any:
    """``value`` when it is a ``kind`` (a side file is input: a wrong type is dropped), else None."""
    return value if isinstance(value, kind) and not (kind is not bool and isinstance(value, bool)) else None


def fit_layout(layout: Layout, world: int, source: str, problems: list[LoadProblem]) -> Layout | None:
    """``layout`` if it fits a world of ``world`` ranks; otherwise None and a problem naming ``source``."""
    if layout.world_size != world:
        problems.append(LoadProblem(
            "error", "layout",
            f"{source}: layout world size {layout.world_size} (tp {layout.tp} × pp {layout.pp} × dp {layout.dp}) "
            f"does not fit the trace's {world} ranks; analysing without a layout"))
        return None
    return layout


def resolve_layout(directory: Path, layout: Layout | None, world: int,
                   problems: list[LoadProblem]) -> Layout | None:
    """The given layout, else ``layout.yaml`` of ``directory``, if it fits ``world`` ranks."""
    if layout is not None:
        return fit_layout(layout, world, "the given layout", problems)
    path = directory / "layout.yaml"
    if not os.path.lexists(path):
        return None
    try:
        return fit_layout(read_layout_file(path), world, str(path), problems)
    except LayoutError as exc:
        problems.append(LoadProblem("error", "layout", f"{exc}; analysing without a layout", paths=(str(path),)))
        return None


def read_layout_file(path: Path) -> Layout:
    """``layout.yaml`` as a regular file (never another user's link); errors name the line, never quote it."""
    import yaml

    try:
        text = read_input(path, SIDE_FILE_LIMIT).decode("utf-8")
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except OSError as exc:
        raise LayoutError(f"{path}: cannot read layout: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise LayoutError(f"{path}: cannot read layout: not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise LayoutError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', None) or 'parse error'}") from None
    except RecursionError:
        raise LayoutError(f"{path}: not valid YAML: nested too deeply") from None
    return layout_from_dict(data, str(path))
