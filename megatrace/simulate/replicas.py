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
    sim = _Simulation(layout, _replica_classes(layout, faults), _FaultTable(faults), costs, layers)
    while sim.ready:
        sim.run(sim.ready.popleft(), steps)
    return Classes(sim.replicas, [[r.out for r in cls] for cls in sim.ranks], sim.done)


def _replica_classes(layout: Layout, faults: list[FaultSpec]) -> list[list[int]]:
    """The DP replicas each class stands for: every replica without a fault in one, each other one alone."""
    faulty = sorted({layout.coords(r).dp for f in faults for r in (f.ranks if isinstance(f, SlowLinkFault)
                                                                    else (f.rank,))})
    normal = [d for d in range(layout.dp) if d not in set(faulty)]
    return ([normal] if normal else []) + [[d] for d in faulty]


class _FaultTable:
    """The faults by rank (the first of each kind but slowdowns, which multiply), and slow links' delays."""

    def __init__(self, faults: list[FaultSpec]) -> None:
        self.slow: dict[int, list[SlowFault]] = defaultdict(list)
        self.hang: dict[int, HangFault] = {}
        self.commhang: dict[int, CommHangFault] = {}  # (an entry is removed once its collective is entered)
        self.crash: dict[int, CrashFault] = {}
        self.link_ms: dict[tuple[int, int], float] = defaultdict(float)
        for f in faults:
            if isinstance(f, SlowFault):
                self.slow[f.rank].append(f)
            elif isinstance(f, HangFault):
                self.hang.setdefault(f.rank, f)
            elif isinstance(f, CommHangFault):
                self.commhang.setdefault(f.rank, f)
            elif isinstance(f, CrashFault):
                self.crash.setdefault(f.rank, f)
            elif isinstance(f, SlowLinkFault):
                self.link_ms[tuple(sorted(f.ranks))] += f.delay_ms

    def factor(self, r: _Rank) -> float:
        """How much slower rank ``r`` computes in its current step."""
        out = 1.0
        for f in self.slow.get(r.rank, ()):
            if r.step >= f.from_step:
                out *= f.factor
        return out


class _Simulation:
    """The event simulation's state: every class rank, the calls' arrivals and completions, who waits on what."""

    def __init__(self, layout: Layout, replicas: list[list[int]], faults: _FaultTable, costs: StepCosts,
                 layers: int) -> None:
        tp, pp = layout.tp, layout.pp
        self.tp, self.replicas, self.faults, self.costs = tp, replicas, faults, costs
        self.programs = [stage_program(layout, s, costs, layers) for s in range(pp)]
        self.ranks = [[_Rank(c, s * tp + t, s, layout.rank_of(s, reps[0], t)) for s in range(pp) for t in range(tp)]
                      for c, reps in enumerate(replicas)]
        self.enq: dict[tuple, list[float]] = defaultdict(list)
        self.done: dict[tuple, float] = {}
        self.never: set[tuple] = set()  # instances a commhang keeps from completing
        self.waiters: dict[tuple, list[_Rank]] = defaultdict(list)
        self.ready: deque[_Rank] = deque(r for cls in self.ranks for r in cls)

    def members(self, key: tuple) -> int:
        return {"tp": self.tp, "dp": len(self.replicas)}.get(key[0], 2)

    def cost(self, key: tuple) -> float:
        if key[0] == "tp":
            return self.costs.tp_ms
        if key[0] == "dp":
            return self.costs.dp_ms
        _, c, src, dst, _n = key
        a, b = self.ranks[c][src].rank, self.ranks[c][dst].rank
        return self.costs.p2p_ms + self.faults.link_ms.get((min(a, b), max(a, b)), 0.0)

    def call_key(self, r: _Rank, kind: str, to: int) -> tuple:
        """The key of rank ``r``'s next call of ``kind`` (``to``: a p2p call's neighbour stage), counted."""
        if kind == "tp":
            key: tuple = ("tp", r.c, r.stage, r.counters["tp"])
            r.counters["tp"] += 1
        elif kind == "dp":
            key = ("dp", r.li, r.counters["dp"])
            r.counters["dp"] += 1
        else:
            other = r.li + to * self.tp
            src, dst = (r.li, other) if kind == "send" else (other, r.li)
            n = r.counters[(src, dst)]
            r.counters[(src, dst)] += 1
            key = ("p2p", r.c, src, dst, n)
        return key

    def enter(self, r: _Rank, item: Item) -> list[tuple]:
        """Rank ``r`` enters the calls of ``item``: recorded, and completed where it was the last to arrive."""
        keys = []
        commhang = self.faults.commhang
        for k, op in enumerate(item.ops):
            key = self.call_key(r, op.kind, op.to)
            t = r.clock + k * EPS_MS
            out = r.out
            out.kind.append(KINDS.index(op.kind))
            out.seq.append(key[-1] + 1)
            out.to.append(op.to)
            out.t_enq.append(t)
            out.key.append(key)
            if op.kind in ("tp", "dp") and r.rank in commhang and r.step >= commhang[r.rank].step:
                del commhang[r.rank]  # its first collective from that step on never returns
                self.never.add(key)
            arrivals = self.enq[key]
            arrivals.append(t)
            if len(arrivals) == self.members(key) and key not in self.never:
                self.done[key] = max(arrivals) + self.cost(key)
                self.ready.extend(self.waiters.pop(key, ()))
            keys.append(key)
        return keys

    def run(self, r: _Rank, steps: int) -> None:
        """Run rank ``r`` until it waits for a call not completed, stops (hang, crash) or ends ``steps`` steps."""
        crash, hang = self.faults.crash, self.faults.hang
        while r.step < steps and not r.out.stopped:
            prog = self.programs[r.stage]
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
                r.clock += item.ms * self.faults.factor(r)
                r.idx += 1
                continue
            if r.pending is None:
                if r.armed:
                    r.out.stopped = "hang"
                    return
                r.pending = self.enter(r, item)
            missing = [k for k in r.pending if k not in self.done]
            if missing:
                self.waiters[missing[0]].append(r)
                return
            r.clock = max(self.done[k] for k in r.pending)
            r.pending = None
            r.idx += 1
