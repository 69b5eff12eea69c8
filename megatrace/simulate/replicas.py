"""Event simulation of the job: the pipeline replicas, each rank's calls and when they complete.

Ranks of replicas without a fault behave identically, so one simulated replica
stands for all of them (a *class*); every replica with a fault is a class of
its own. The classes are coupled where the real job couples them: at the DP
all-reduce closing each step, which completes when every class has arrived.
The simulation is event driven: a rank runs until a call it waits for has not
completed, and is woken when it does. A collective completes a fixed time after
its last member arrived, a point-to-point pair after both sides arrived (plus a
slow link's delay). Faults follow the demo's semantics (:mod:`megatrace.demo.faults`).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from megatrace.config import Layout
from megatrace.demo.faults import (PHASES, CommHangFault, CrashFault, FaultSpec, HangFault, SlowFault,
                                   SlowLinkFault)
from megatrace.simulate.program import Item, StepCosts, stage_program

EPS_MS = 0.001  # between the enqueues of one block of calls
KINDS = ("tp", "send", "recv", "dp")  # record kind codes, by index


@dataclass
class RankTrace:
    """What one simulated rank of a class issued (ms on the job's true timeline)."""

    kind: list[int] = field(default_factory=list)  # index into KINDS
    seq: list[int] = field(default_factory=list)  # per-group sequence (p2p: per channel)
    to: list[int] = field(default_factory=list)  # neighbour stage of a p2p call (-1, +1), else 0
    t_enq: list[float] = field(default_factory=list)
    key: list[tuple] = field(default_factory=list)
    stopped: str = ""  # "hang", "crash" or "" (ran to the end, or blocked waiting)


@dataclass
class Classes:
    """The simulated classes: which replicas each stands for, and every class rank's trace."""

    replicas: list[list[int]]  # class -> DP replica indices it stands for
    traces: list[list[RankTrace]]  # class -> local rank (stage * tp + tp position) -> trace
    done: dict[tuple, float]  # call key -> completion time (absent: never completed)

    def class_of(self) -> np.ndarray:
        """Replica index -> class index."""
        out = np.zeros(sum(len(r) for r in self.replicas), np.int64)
        for c, reps in enumerate(self.replicas):
            out[reps] = c
        return out


class _Rank:
    __slots__ = ("c", "li", "stage", "rank", "step", "idx", "clock", "pending", "armed", "out", "counters")

    def __init__(self, c: int, li: int, stage: int, rank: int) -> None:
        self.c, self.li, self.stage, self.rank = c, li, stage, rank
        self.step = self.idx = 0
        self.clock = 0.0
        self.pending: list[tuple] | None = None
        self.armed = False
        self.out = RankTrace()
        self.counters: dict[tuple, int] = defaultdict(int)


def _phase_index(phase: str) -> int:
    return PHASES.index(phase) if phase in PHASES else -1


def simulate(layout: Layout, steps: int, faults: list[FaultSpec], costs: StepCosts, layers: int) -> Classes:
    """Run ``steps`` training steps of ``layout`` with ``faults``; see the module docstring."""
    tp, pp = layout.tp, layout.pp
    faulty = sorted({layout.coords(r).dp for f in faults for r in (f.ranks if isinstance(f, SlowLinkFault)
                                                                    else (f.rank,))})
    normal = [d for d in range(layout.dp) if d not in set(faulty)]
    replicas = ([normal] if normal else []) + [[d] for d in faulty]
    n_classes = len(replicas)
    programs = [stage_program(layout, s, costs, layers) for s in range(pp)]
    slow: dict[int, list[SlowFault]] = defaultdict(list)
    hang: dict[int, HangFault] = {}
    commhang: dict[int, CommHangFault] = {}
    crash: dict[int, CrashFault] = {}
    link_ms: dict[tuple[int, int], float] = defaultdict(float)
    for f in faults:
        if isinstance(f, SlowFault):
            slow[f.rank].append(f)
        elif isinstance(f, HangFault):
            hang.setdefault(f.rank, f)
        elif isinstance(f, CommHangFault):
            commhang.setdefault(f.rank, f)
        elif isinstance(f, CrashFault):
            crash.setdefault(f.rank, f)
        elif isinstance(f, SlowLinkFault):
            link_ms[tuple(sorted(f.ranks))] += f.delay_ms
    ranks = [[_Rank(c, s * tp + t, s, layout.rank_of(s, reps[0], t)) for s in range(pp) for t in range(tp)]
             for c, reps in enumerate(replicas)]
    enq: dict[tuple, list[float]] = defaultdict(list)
    done: dict[tuple, float] = {}
    never: set[tuple] = set()  # instances a commhang keeps from completing
    waiters: dict[tuple, list[_Rank]] = defaultdict(list)
    ready: deque[_Rank] = deque(r for cls in ranks for r in cls)

    def members(key: tuple) -> int:
        return {"tp": tp, "dp": n_classes}.get(key[0], 2)

    def cost(key: tuple) -> float:
        if key[0] == "tp":
            return costs.tp_ms
        if key[0] == "dp":
            return costs.dp_ms
        _, c, src, dst, _n = key
        a, b = ranks[c][src].rank, ranks[c][dst].rank
        return costs.p2p_ms + link_ms.get((min(a, b), max(a, b)), 0.0)

    def factor(r: _Rank) -> float:
        out = 1.0
        for f in slow.get(r.rank, ()):
            if r.step >= f.from_step:
                out *= f.factor
        return out

    def enter(r: _Rank, item: Item) -> list[tuple]:
        keys = []
        for k, op in enumerate(item.ops):
            if op.kind == "tp":
                key: tuple = ("tp", r.c, r.stage, r.counters["tp"])
                r.counters["tp"] += 1
            elif op.kind == "dp":
                key = ("dp", r.li, r.counters["dp"])
                r.counters["dp"] += 1
            else:
                other = r.li + op.to * tp
                src, dst = (r.li, other) if op.kind == "send" else (other, r.li)
                n = r.counters[(src, dst)]
                r.counters[(src, dst)] += 1
                key = ("p2p", r.c, src, dst, n)
            t = r.clock + k * EPS_MS
            out = r.out
            out.kind.append(KINDS.index(op.kind))
            out.seq.append(key[-1] + 1)
            out.to.append(op.to)
            out.t_enq.append(t)
            out.key.append(key)
            if op.kind in ("tp", "dp") and r.rank in commhang and r.step >= commhang[r.rank].step:
                del commhang[r.rank]  # its first collective from that step on never returns
                never.add(key)
            arrivals = enq[key]
            arrivals.append(t)
            if len(arrivals) == members(key) and key not in never:
                done[key] = max(arrivals) + cost(key)
                ready.extend(waiters.pop(key, ()))
            keys.append(key)
        return keys

    def run(r: _Rank) -> None:
        while r.step < steps and not r.out.stopped:
            prog = programs[r.stage]
            if r.idx == len(prog):  # the step's end
                if r.armed:
                    r.out.stopped = "hang"
                    return
                r.step, r.idx = r.step + 1, 0
                continue
            if r.idx == 0 and r.pending is None and r.rank in crash and r.step >= crash[r.rank].step:
                r.out.stopped = "crash"
                return
            item = prog[r.idx]
            h = hang.get(r.rank)
            if h is not None and (r.step, _phase_index(item.phase)) >= (h.step, PHASES.index(h.phase)):
                r.armed = True
            if item.what == "compute":
                r.clock += item.ms * factor(r)
                r.idx += 1
                continue
            if r.pending is None:
                if r.armed:
                    r.out.stopped = "hang"
                    return
                r.pending = enter(r, item)
            missing = [k for k in r.pending if k not in done]
            if missing:
                waiters[missing[0]].append(r)
                return
            r.clock = max(done[k] for k in r.pending)
            r.pending = None
            r.idx += 1

    while ready:
        run(ready.popleft())
    return Classes(replicas, [[r.out for r in cls] for cls in ranks], done)
