"""A small deterministic simulator of the demo's training step (1F1B, TP x PP x DP), written as rings.

Every rank runs the demo's program: per step a head (optimizer, data), then
for each action of its stage's schedule the exchange block before it
(receives, then sends, waited together), the action's compute cut by its TP
all_reduces, the last exchange, and the DP all_reduce. A collective completes
``tp_ms`` / ``dp_ms`` after its last arrival; a p2p pair ``p2p_ms`` (plus any
link delay) after both sides arrived. Times are exact, so the analysis can be
checked to the microsecond. Records are written with ``TraceBuilder`` (times
in ms).

    sim = PipelineSim(tp=2, pp=2, dp=2, slow={5: 2.0})
    sim.run()
    root = sim.write(tmp_path)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from helpers.analysis_factory import Rec, TraceBuilder

from megatrace.config import Layout
from megatrace.schedule import exchange_blocks, one_f_one_b
from megatrace.trace import ring_format as fmt

AR, SEND, RECV = int(fmt.Op.ALL_REDUCE), int(fmt.Op.SEND), int(fmt.Op.RECV)
EPS = 0.001  # ms between the enqueues of one exchange block (receives first)


@dataclass
class PipelineSim:
    tp: int = 2
    pp: int = 2
    dp: int = 1
    microbatches: int = 2
    steps: int = 5
    layers: int = 2  # TP all_reduces per action (when tp > 1)
    forward_ms: float = 2.0  # a backward takes twice as long
    head_ms: float = 1.0  # optimizer + data before each step's first call
    tp_ms: float = 0.5
    p2p_ms: float = 0.3
    dp_ms: float = 1.0
    slow: dict[int, float] = field(default_factory=dict)  # rank -> compute factor
    slow_from: int = 0  # first step the slow factors apply to
    link_ms: dict[tuple[int, int], float] = field(default_factory=dict)  # extra p2p time between two ranks
    rank_net_ms: dict[int, float] = field(default_factory=dict)  # extra time of every transfer touching a rank
    markers: bool = False
    jitter: float = 0.0  # each stretch of compute varies uniformly by up to this fraction (seeded)
    seed: int = 0

    def __post_init__(self) -> None:
        self.layout = Layout(world_size=self.tp * self.pp * self.dp, tp=self.tp, pp=self.pp, dp=self.dp,
                             microbatches=self.microbatches, layers_per_stage=self.layers).validate()
        self.b = TraceBuilder(world=self.layout.world_size)
        self.groups = {}
        for kind in ("tp", "pp", "dp"):
            for ranks in getattr(self.layout, f"{kind}_groups")():
                g = self.b.group(kind, kind, ranks)
                for r in ranks:
                    self.groups[(kind, r)] = g
        self.step_end: list[float] = []  # per step, when the last rank finished it (ms)
        self.rng = random.Random(self.seed)

    # -- programs --------------------------------------------------------------------------------------------
    def _compute(self, rank: int, step: int, ms: float) -> float:
        """``ms`` of compute on ``rank`` at ``step``: times its slow factor, plus the jitter."""
        noise = 1.0 + self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 1.0
        return ms * noise * (self.slow.get(rank, 1.0) if step >= self.slow_from else 1.0)

    def program(self, rank: int) -> list[tuple]:
        """Items: ("c", ms) compute, ("ops", [op, ...]) enqueue all then wait for all, ("mark", step), ("end", step)."""
        c = self.layout.coords(rank)
        pp_ranks = self.layout.group_of("pp", rank)
        prev = pp_ranks[c.pp - 1] if c.pp > 0 else None
        nxt = pp_ranks[c.pp + 1] if c.pp < self.pp - 1 else None
        actions = one_f_one_b(c.pp, self.pp, self.microbatches)
        blocks = exchange_blocks(actions, c.pp, self.pp)
        n_tp = self.layers if self.tp > 1 else 0
        prog: list[tuple] = []
        for step in range(self.steps):
            if self.markers:
                prog.append(("mark", step))
            prog.append(("c", self._compute(rank, step, self.head_ms)))
            for j in range(len(actions) + 1):
                ops = []
                for role, _mb in sorted(blocks[j], key=lambda x: x[0] not in (4, 6)):  # receives first
                    peer = {4: prev, 5: nxt, 6: nxt, 7: prev}[role]
                    ops.append(("p2p", SEND if role in (5, 7) else RECV, peer))
                if ops:
                    prog.append(("ops", ops))
                if j == len(actions):
                    break
                kind, _ = actions[j]
                part = self.forward_ms * (1 if kind == "F" else 2) / (n_tp + 1)
                for _ in range(n_tp):
                    prog += [("c", self._compute(rank, step, part)), ("ops", [("coll", "tp")])]
                prog.append(("c", self._compute(rank, step, part)))
            if self.dp > 1:
                prog.append(("ops", [("coll", "dp")]))
            prog.append(("end", step))
        return prog

    # -- simulation ------------------------------------------------------------------------------------------
    def run(self) -> PipelineSim:
        world = self.layout.world_size
        progs = {r: self.program(r) for r in range(world)}
        pc = dict.fromkeys(progs, 0)
        clock = dict.fromkeys(progs, 0.0)
        waiting: dict[int, list[tuple]] = {}
        seq: dict[tuple, int] = {}
        enq: dict[tuple, dict[int, float]] = {}  # op key -> rank -> enqueue time
        done: dict[tuple, float] = {}
        self._recs: list[tuple[int, Rec, tuple]] = []
        ends: dict[int, list[float]] = {r: [] for r in progs}

        def key_of(rank: int, op: tuple) -> tuple:
            if op[0] == "coll":
                g = self.groups[(op[1], rank)]
                k = ("c", g.gid)
                n = seq[k + (rank,)] = seq.get(k + (rank,), 0) + 1
                return ("c", g.gid, n), g, n, AR, -1
            _, code, peer = op
            g = self.groups[("pp", rank)]
            src, dst = (rank, peer) if code == SEND else (peer, rank)
            k = ("p", g.gid, src, dst, code)
            n = seq[k] = seq.get(k, 0) + 1
            return ("p", g.gid, src, dst, n), g, n, code, peer

        progress = True
        while progress:
            progress = False
            for r in progs:
                while pc[r] < len(progs[r]):
                    item = progs[r][pc[r]]
                    if item[0] == "mark":
                        self.b.records[r].append(Rec(clock[r], int(fmt.Op.MARK_STEP), 0, item[1], 0,
                                                     done=clock[r]))
                        pc[r] += 1
                        continue
                    if item[0] == "end":
                        ends[r].append(clock[r])
                        pc[r] += 1
                        continue
                    if item[0] == "c":
                        clock[r] += item[1]
                        pc[r] += 1
                        progress = True
                        continue
                    if r not in waiting:
                        keys = []
                        for k, op in enumerate(item[1]):
                            key, g, n, code, peer = key_of(r, op)
                            t = clock[r] + k * EPS
                            enq.setdefault(key, {})[r] = t
                            self._recs.append((r, Rec(t, code, g.gid, n, peer=peer), key))
                            keys.append(key)
                        waiting[r] = keys
                        progress = True
                    if all(k in done for k in waiting[r]):
                        clock[r] = max(done[k] for k in waiting.pop(r))
                        pc[r] += 1
                        progress = True
                        continue
                    break
            for key, who in enq.items():
                if key in done:
                    continue
                if key[0] == "c":
                    g = next(g for g in self.b.groups if g.gid == key[1])
                    if len(who) == len(g.ranks):
                        extra = max((self.rank_net_ms.get(m, 0.0) for m in g.ranks), default=0.0)
                        kind = g.desc
                        done[key] = max(who.values()) + (self.tp_ms if kind == "tp" else self.dp_ms) + extra
                        progress = True
                elif len(who) == 2:
                    _, _, src, dst, _ = key
                    extra = self.link_ms.get((min(src, dst), max(src, dst)), 0.0) \
                        + max(self.rank_net_ms.get(src, 0.0), self.rank_net_ms.get(dst, 0.0))
                    done[key] = max(who.values()) + self.p2p_ms + extra
                    progress = True
        assert all(pc[r] == len(progs[r]) for r in progs), "the simulated program deadlocked"
        for r, rec, key in self._recs:
            rec.done = done[key]
            self.b.records[r].append(rec)
        self.step_end = [max(ends[r][k] for r in progs) for k in range(self.steps)]
        return self

    def write(self, root: Path) -> Path:
        return self.b.write(root, layout=self.layout, closed=True)
