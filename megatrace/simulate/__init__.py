"""Synthetic traces of the demo's training job at any scale, in the real ring format, with the demo's faults.

``megatrace simulate`` (and :func:`simulate_job`) writes what a traced TP x PP
x DP job of ``--ranks`` ranks would have left: one ring and meta file per rank,
``layout.yaml``, ``procs.json`` (the launcher's view) and ``fault.json`` (the
ground truth, never read by the analysis). The step is the demo's
(:mod:`megatrace.simulate.program`), times come from an event simulation of
the pipelines coupled at the DP sync (:mod:`megatrace.simulate.replicas`);
each rank's arrivals get their own jitter and each host a wall-clock error,
which the analysis must align. One simulated replica stands for all healthy
ones, so 16,384 ranks take seconds to simulate; writing the files dominates.
"""

from __future__ import annotations

import json
import random
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatrace.config import Layout, save_layout
from megatrace.demo.faults import FaultSpec, parse_fault, validate_fault, write_fault_json
from megatrace.simulate.program import StepCosts
from megatrace.simulate.replicas import KINDS, Classes, simulate
from megatrace.simulate.rings import MONO0_NS, RingHead, records, write_meta, write_ring
from megatrace.trace import ring_format as fmt

GID_BASE = {"tp": 10_000_000, "pp": 20_000_000, "dp": 30_000_000}  # + the group's lowest rank
NBYTES = {"tp": 8 << 20, "send": 4 << 20, "recv": 4 << 20, "dp": 256 << 20}
OP_OF = {"tp": fmt.Op.ALL_REDUCE, "send": fmt.Op.SEND, "recv": fmt.Op.RECV, "dp": fmt.Op.ALL_REDUCE}
WRITERS = 8  # threads writing files: creating a file costs milliseconds on some file systems, not CPU


@dataclass
class SimOptions:
    """What to simulate (sizes, steps, faults, noise) and where to write it."""

    tp: int
    pp: int
    dp: int
    out: Path
    steps: int = 8
    microbatches: int = 4
    layers: int = 2  # TP all-reduces per forward or backward of a microbatch
    faults: tuple[str, ...] = ()
    jitter: float = 0.1  # each rank arrives up to this share of its compute early, at random
    skew_ms: float = 2.0  # each host's wall clock is off by up to this much
    gpus_per_node: int = 8
    seed: int = 0
    costs: StepCosts = field(default_factory=StepCosts)


@dataclass
class SimResult:
    out: Path
    layout: Layout
    faults: list[FaultSpec]
    records: int  # written, over all ranks
    simulate_s: float
    write_s: float


def steps_for_records(layout: Layout, records: int, microbatches: int, layers: int) -> int:
    """The number of steps that gives the busiest rank about ``records`` records."""
    per_step = (2 * layers * microbatches if layout.tp > 1 else 0) + (4 * microbatches if layout.pp > 2 else
                                                                      2 * microbatches if layout.pp > 1 else 0)
    per_step += 1 if layout.dp > 1 else 0
    return max(2, records // max(per_step, 1))


def simulate_job(opts: SimOptions, progress: Callable[[str], None] = lambda msg: None) -> SimResult:
    """Simulate and write the job; raises :class:`megatrace.demo.faults.FaultError` for a bad fault spec."""
    layout = Layout(world_size=opts.tp * opts.pp * opts.dp, tp=opts.tp, pp=opts.pp, dp=opts.dp,
                    microbatches=opts.microbatches, layers_per_stage=opts.layers).validate()
    faults = []
    for text in opts.faults:
        fault = parse_fault(text)
        validate_fault(fault, layout, opts.steps, text)
        faults.append(fault)
    t0 = time.perf_counter()
    classes = simulate(layout, opts.steps, faults, opts.costs, opts.layers)
    t_sim = time.perf_counter() - t0
    progress(f"simulated {layout.world_size:,} ranks × {opts.steps} steps in {t_sim:.1f} s "
             f"({len(classes.replicas)} distinct replica(s))")
    t0 = time.perf_counter()
    out = Path(opts.out)
    rings = out / "rings"
    rings.mkdir(parents=True, exist_ok=True)
    for stale in rings.glob("rank-*"):
        stale.unlink()
    total = _write_rings(layout, classes, opts, rings, progress)
    save_layout(layout, out / "layout.yaml")
    write_fault_json(out / "fault.json", faults)
    _write_procs(out / "procs.json", layout, classes, faults)
    t_write = time.perf_counter() - t0
    progress(f"wrote {total:,} records of {layout.world_size:,} ranks to {rings} in {t_write:.1f} s")
    return SimResult(out, layout, faults, total, t_sim, t_write)


def _templates(classes: Classes) -> dict[tuple[int, int], tuple[np.ndarray, ...]]:
    """Per (class, local rank): kind, seq, to, t_enqueue (ms), t_complete (ms, NaN: never)."""
    out = {}
    for c, traces in enumerate(classes.traces):
        for li, tr in enumerate(traces):
            done = np.array([classes.done.get(k, np.nan) for k in tr.key], np.float64)
            out[(c, li)] = (np.array(tr.kind, np.int64), np.array(tr.seq, np.int64), np.array(tr.to, np.int64),
                            np.array(tr.t_enq, np.float64), done)
    return out


def _jittered(t_enq: np.ndarray, t_done: np.ndarray, jitter: float, rng: np.random.Generator) -> np.ndarray:
    """Arrive earlier by a random share (up to ``jitter``) of the compute before each block of calls."""
    if not jitter or not len(t_enq):
        return t_enq
    start = np.r_[True, np.diff(t_enq) > 1.5e-3]  # a block's calls are 1 µs apart
    finished = np.where(np.isnan(t_done), t_enq, t_done)
    before = np.r_[0.0, np.maximum.accumulate(finished)[:-1]]  # when the rank's earlier calls had all ended
    block = np.cumsum(start) - 1
    gap = np.maximum(t_enq[start] - before[start], 0.0)
    shift = rng.uniform(0.0, jitter, len(gap)) * gap
    return t_enq - shift[block]


def _write_rings(layout: Layout, classes: Classes, opts: SimOptions, rings: Path,
                 progress: Callable[[str], None]) -> int:
    templates = _templates(classes)
    class_of = classes.class_of()
    hosts = (layout.world_size + opts.gpus_per_node - 1) // opts.gpus_per_node
    skew = random.Random(opts.seed).choices(range(-int(opts.skew_ms * 1000), int(opts.skew_ms * 1000) + 1), k=hosts)
    gids = {kind: np.zeros(layout.world_size, np.int64) for kind in GID_BASE}
    members_of: dict[str, list[list[int]]] = {kind: [[]] * layout.world_size for kind in GID_BASE}
    for kind in GID_BASE:
        for members in getattr(layout, f"{kind}_groups")():
            gids[kind][members] = GID_BASE[kind] + members[0]
            for r in members:
                members_of[kind][r] = members
    total, last_report = 0, time.perf_counter()
    writes: deque[Future] = deque()
    with ThreadPoolExecutor(WRITERS) as pool:
        for rank in range(layout.world_size):
            c = layout.coords(rank)
            kind, seq, to, t_enq, t_done = templates[(int(class_of[c.dp]), c.pp * layout.tp + c.tp)]
            rng = np.random.default_rng((opts.seed, rank))
            t_enq = _jittered(t_enq, t_done, opts.jitter, rng)
            group = np.select([kind == KINDS.index("tp"), kind == KINDS.index("dp")], [gids["tp"][rank], gids["dp"][rank]],
                              gids["pp"][rank])
            peer = np.full(len(kind), -1, np.int64)
            p2p = to != 0
            if p2p.any():
                nbr = {d: layout.rank_of(c.pp + d, c.dp, c.tp) for d in (-1, 1) if 0 <= c.pp + d < layout.pp}
                peer[p2p] = np.where(to[p2p] < 0, nbr.get(-1, -1), nbr.get(1, -1))
            completed = ~np.isnan(t_done)
            ns = lambda ms: MONO0_NS + np.round(ms * 1e6).astype(np.int64)  # noqa: E731
            recs = records(1, np.array([OP_OF[k] for k in KINDS], np.int64)[kind], group, seq,
                           np.array([NBYTES[k] for k in KINDS], np.int64)[kind], peer, ns(t_enq),
                           np.where(completed, ns(np.nan_to_num(t_done)), 0),
                           np.where(completed, int(fmt.State.COMPLETED), int(fmt.State.ENQUEUED)))
            host = rank // opts.gpus_per_node
            head = RingHead(rank, layout.world_size, rank % opts.gpus_per_node, f"node{host:05d}", 100_000 + rank,
                            skew_ns=skew[host] * 1000)
            groups = [{"gid": int(gids[k][rank]), "name": f"{k}{int(gids[k][rank]) - GID_BASE[k]}", "desc": k,
                       "ranks": members_of[k][rank]} for k in GID_BASE]
            writes.append(pool.submit(_write_rank, rings, head, recs, groups))
            if len(writes) > 4 * WRITERS:  # bound what waits in memory
                writes.popleft().result()
            total += len(recs)
            if time.perf_counter() - last_report > 5:
                progress(f"  {rank + 1:,} of {layout.world_size:,} ranks written")
                last_report = time.perf_counter()
        for pending in writes:
            pending.result()
    return total


def _write_rank(rings: Path, head: RingHead, recs: np.ndarray, groups: list[dict]) -> None:
    write_ring(rings / fmt.ring_name(head.rank), head, recs)
    write_meta(rings / fmt.meta_name(head.rank), head, groups)


def _write_procs(path: Path, layout: Layout, classes: Classes, faults: list[FaultSpec]) -> None:
    """The launcher's view: who crashed, who was killed after the job stopped making progress."""
    class_of = classes.class_of()
    stopped = {}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        stopped[rank] = classes.traces[int(class_of[c.dp])][c.pp * layout.tp + c.tp]
    blocked = [r for r, tr in stopped.items() if tr.key and tr.key[-1] not in classes.done or tr.stopped]
    crashed = sorted(r for r, tr in stopped.items() if tr.stopped == "crash")
    if crashed:
        outcome, message = "failed", f"rank {crashed[0]} exited with status 1; killed {len(blocked) - 1} ranks"
    elif blocked:
        outcome, message = "stalled", f"no progress — ranks look hung; killed {len(blocked)} ranks"
    else:
        outcome, message = "ok", "all ranks finished"
    ranks = {}
    for rank in range(layout.world_size):
        if rank in crashed:
            ranks[str(rank)] = {"pid": 100_000 + rank, "exit_code": 1, "signal": None, "killed_by_launcher": False}
        elif outcome != "ok":
            ranks[str(rank)] = {"pid": 100_000 + rank, "exit_code": None, "signal": "SIGTERM",
                                "killed_by_launcher": True}
        else:
            ranks[str(rank)] = {"pid": 100_000 + rank, "exit_code": 0, "signal": None, "killed_by_launcher": False}
    path.write_text(json.dumps({"outcome": outcome, "message": message, "ranks": ranks}, indent=1) + "\n")
