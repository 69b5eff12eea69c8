"""Start markers (``rank-NNNNN.init``) and what each node's collector found of the rendezvous endpoint.

A rank writes its start marker as it enters ``init_process_group`` (:mod:`megatrace.trace.init_marker`);
``nodes/<node>.json`` holds the collector's lookup of the rendezvous address on that node. Both are read
here, at load time; :mod:`megatrace.analyze.startup` judges them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megatrace.files import open_input, read_fd
from megatrace.load.traceset import LoadProblem
from megatrace.trace.init_marker import MAX_MARKER_BYTES, InitMarker, marker_name, parse_marker

NODE_FACTS_LIMIT = 64 << 20  # a node's facts file (bounded like every input)


def read_markers(directory: Path, names: list[str], problems: list[LoadProblem]) -> dict[int, InitMarker]:
    """rank -> start marker, for each ``rank-NNNNN.init`` in ``names`` (files of ``directory``)."""
    out: dict[int, InitMarker] = {}
    for name in names:
        path = directory / name
        try:
            fd = open_input(path)
            try:
                mk = parse_marker(read_fd(fd, MAX_MARKER_BYTES + 1, name))
            finally:
                os.close(fd)
        except OSError as exc:
            problems.append(LoadProblem("warning", "init-marker", f"{path}: unreadable start marker "
                                        f"({exc.strerror or exc})", paths=(str(path),)))
            continue
        if mk is None or name != marker_name(mk.rank):
            problems.append(LoadProblem("warning", "init-marker", f"{path}: not a start marker of this rank "
                                        "(bad JSON, a field of the wrong type, or another rank's number); ignored",
                                        paths=(str(path),)))
            continue
        out[mk.rank] = mk
    return out


def rendezvous_facts(directory: Path, problems: list[LoadProblem]) -> dict[str, dict[str, dict[str, Any]]]:
    """endpoint -> node -> what that node's collector found (``resolves``, ``error``, ``connects``)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    nodes = directory / "nodes"
    if not nodes.is_dir() or nodes.is_symlink():
        return out
    for path in sorted(nodes.glob("*.json"))[:4096]:
        try:
            fd = open_input(path)
            try:
                facts = json.loads(read_fd(fd, NODE_FACTS_LIMIT, path.name))
            finally:
                os.close(fd)
        except (OSError, ValueError, RecursionError):
            problems.append(LoadProblem("info", "node-facts", f"{path}: unreadable node facts; ignored",
                                        paths=(str(path),)))
            continue
        rdv = facts.get("rendezvous") if isinstance(facts, dict) else None
        if not isinstance(rdv, dict):
            continue
        node = str(facts.get("node") or path.stem)[:128]
        for endpoint, res in list(rdv.items())[:8]:
            if isinstance(endpoint, str) and isinstance(res, dict):
                out.setdefault(endpoint[:300], {})[node] = res
    return out
