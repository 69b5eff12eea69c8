"""Counting a job's collectives and point-to-point calls two ways: in MegaTrace's rings, and with torch's own instruments.

The reference comes from ``tests/programs/reference/sitecustomize.py`` (put on ``PYTHONPATH`` by
:func:`reference_env`): per rank, the Flight Recorder's entries per process group and op, and the
profiler's ``gloo:*`` events per op. ``ProcessGroupGloo`` records collectives in the Flight
Recorder but not sends and receives, so point-to-point calls are checked per rank and op against
the profiler's ``gloo:send`` / ``gloo:recv`` events. Two facts of gloo (torch 2.13) shape the
comparison: it runs ``reduce_scatter_tensor`` as an all_reduce of the whole buffer and records it
so (name and sizes), hence :data:`GLOO_RUNS_AS`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from megatrace.trace.ring_format import Op
from megatrace.trace.ring_reader import read_meta, read_ring

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "programs" / "reference"
P2P = ("send", "recv")
GLOO_RUNS_AS = {"reduce_scatter": "all_reduce"}  # ring label -> the op gloo's own records name


@dataclass
class RankCounts:
    """One rank's calls: collectives per (process group name, op), point-to-point per op (all groups)."""

    collectives: Counter = field(default_factory=Counter)
    p2p: Counter = field(default_factory=Counter)


def reference_env(directory: Path) -> dict[str, str]:
    """Environment for a job whose ranks should write their reference counts to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(REFERENCE_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "MEGATRACE_TEST_REFERENCE": str(directory)}


def ring_counts(ring_dir: Path) -> dict[int, RankCounts]:
    """Per rank, what its ring holds (markers left out), with group ids resolved to names by the meta file."""
    out: dict[int, RankCounts] = {}
    for path in sorted(ring_dir.glob("rank-*.ring")):
        snap = read_ring(path)
        meta, _ = read_meta(path.with_name(path.name.replace(".ring", ".meta.jsonl")))
        names = {m["gid"]: m["name"] for m in meta if m.get("kind") == "group"}
        counts = RankCounts()
        for rec in snap.records:
            op = Op(int(rec["op"]))
            if op.is_marker:
                continue
            if op.label in P2P:
                counts.p2p[op.label] += 1
            else:
                label = GLOO_RUNS_AS.get(op.label, op.label)
                counts.collectives[(names.get(int(rec["group_id"]), f"gid {int(rec['group_id'])}"), label)] += 1
        out[snap.header.rank] = counts
    return out


def _load(ref_dir: Path) -> dict[int, dict]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in sorted(ref_dir.glob("rank-*.json"))}


def reference_counts(ref_dir: Path) -> dict[int, RankCounts]:
    """Per rank, collectives from the Flight Recorder and point-to-point calls from the profiler."""
    out: dict[int, RankCounts] = {}
    for rank, data in _load(ref_dir).items():
        counts = RankCounts()
        for group, ops in data["fr"].items():
            for op, n in ops.items():
                counts.collectives[(group, op)] += n
        for op in P2P:
            if data["profiler"].get(op):
                counts.p2p[op] = data["profiler"][op]
        out[rank] = counts
    return out


def reference_disagreement(ref_dir: Path) -> dict[int, tuple[Counter, Counter]]:
    """Ranks whose two references disagree on collectives: {rank: (Flight Recorder per op, profiler per op)}."""
    bad = {}
    for rank, data in _load(ref_dir).items():
        fr = Counter()
        for ops in data["fr"].values():
            fr.update(ops)
        prof = Counter({op: n for op, n in data["profiler"].items() if op not in P2P})
        if fr != prof:
            bad[rank] = (fr, prof)
    return bad
