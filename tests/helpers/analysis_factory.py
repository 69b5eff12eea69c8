"""A small factory of hand-built traces for the analysis tests, written with the real RingWriter.

Times are milliseconds on one true timeline. Each rank's records are written
with explicit monotonic timestamps; a host's clock error (``skew_ms``) shifts
its header's wall anchor, exactly what a badly synchronised node looks like.

    b = TraceBuilder(world=4, hosts={0: "h0", 1: "h0", 2: "h1", 3: "h1"})
    tp = b.group("tp", [2, 3])
    b.collective(tp, at=10.0)                  # all members enter at 10 ms, complete at 11 ms
    b.p2p(0, 2, pp, at=12.0, recv_only=True)   # rank 2 posted its recv, rank 0 never sent
    b.write(tmp_path)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from megatrace.config import Layout, save_layout
from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_writer import RingIdentity, RingWriter

MS = 1_000_000
MONO_BASE = 10_000 * MS  # monotonic clock value at t = 0 ms
WALL_BASE = 1_700_000_000_000 * MS  # wall clock at t = 0 ms


@dataclass
class Rec:
    t: float  # enqueue, ms
    op: int
    gid: int
    seq: int
    nbytes: int = 1024
    peer: int = -1
    dtype: int = int(fmt.Dtype.FLOAT32)
    flags: int = 0
    done: float | None = None  # completion, ms; None: never completed
    state: int = int(fmt.State.COMPLETED)


@dataclass
class Group:
    gid: int
    name: str
    desc: str
    ranks: tuple[int, ...]


@dataclass
class TraceBuilder:
    world: int
    hosts: dict[int, str] = field(default_factory=dict)  # default: one host "node0"
    job_id: str = "job-1"
    skew_ms: dict[str, float] = field(default_factory=dict)  # host -> wall clock error
    capacity: int = 1024
    backend: str = "nccl"  # the process groups' backend: a GPU job by default ("gloo": a CPU-only one)

    def __post_init__(self) -> None:
        self.records: dict[int, list[Rec]] = {r: [] for r in range(self.world)}
        self.groups: list[Group] = []
        self._seq: dict[tuple, int] = {}
        self.world_group = self.group("default", "default_pg", list(range(self.world)), name="0")

    # -- building ----------------------------------------------------------------------------------
    def group(self, kind: str, desc: str | list[int], ranks: list[int] | None = None, name: str = "") -> Group:
        """``group("tp", [2, 3])`` or ``group("tp", "tp", [2, 3])``."""
        if ranks is None:
            ranks, desc = desc, kind  # type: ignore[assignment]
        g = Group(gid=1000 + len(self.groups), name=name or str(len(self.groups)), desc=str(desc),
                  ranks=tuple(ranks))
        self.groups.append(g)
        return g

    def _next(self, key: tuple) -> int:
        self._seq[key] = self._seq.get(key, 0) + 1
        return self._seq[key]

    def collective(self, g: Group, at: float, dur: float = 1.0, op: int = int(fmt.Op.ALL_REDUCE),
                   nbytes: int = 4096, enter: dict[int, float] | None = None, skip: tuple[int, ...] = (),
                   stuck: tuple[int, ...] = (), failed: tuple[int, ...] = (), stuck_all: bool = False,
                   override: dict[int, dict] | None = None) -> int:
        """One collective on every member except ``skip``; returns its group_seq.

        Members enter at ``at`` (or ``enter[rank]``) and all complete ``dur`` after the last arrival,
        except ``stuck`` (never complete) and ``failed`` (fail then).
        """
        enter = enter or {}
        members = [r for r in g.ranks if r not in skip]
        last = max([enter.get(r, at) for r in g.ranks if r not in skip] or [at])
        seq = 0
        for r in g.ranks:
            if r in skip:
                continue
            s = self._next(("c", r, g.gid))
            seq = max(seq, s)
            rec = Rec(enter.get(r, at), op, g.gid, s, nbytes)
            if stuck_all or r in stuck:
                rec.done, rec.state = None, int(fmt.State.ENQUEUED)
            elif r in failed:
                rec.done, rec.state = last + dur, int(fmt.State.FAILED)
            else:
                rec.done = last + dur
            for k, v in (override or {}).get(r, {}).items():
                setattr(rec, k, v)
            self.records[r].append(rec)
        assert members, "a collective needs at least one member"
        return seq

    def p2p(self, src: int, dst: int, g: Group, at: float, dur: float = 1.0, nbytes: int = 2048,
            send_only: bool = False, recv_only: bool = False, stuck: bool = False,
            recv_nbytes: int | None = None, flags: int = 0) -> None:
        """A send from ``src`` and the matching recv on ``dst`` (either side may be left out or stuck)."""
        done = None if stuck else at + dur
        state = int(fmt.State.ENQUEUED if stuck else fmt.State.COMPLETED)
        if not recv_only:
            s = self._next(("s", src, g.gid, dst))
            self.records[src].append(Rec(at, int(fmt.Op.SEND), g.gid, s, nbytes, dst, flags=flags,
                                         done=None if send_only and stuck else done, state=state))
        if not send_only:
            s = self._next(("r", dst, g.gid, src))
            self.records[dst].append(Rec(at, int(fmt.Op.RECV), g.gid, s, recv_nbytes or nbytes, src, flags=flags,
                                         done=done, state=state))

    def pending(self, rank: int, op: int, g: Group, at: float, peer: int = -1) -> None:
        """A call entered on ``rank`` that never completes (with the right per-group sequence)."""
        key = ("c", rank, g.gid) if op not in (fmt.Op.SEND, fmt.Op.RECV) else \
            ("s" if op == fmt.Op.SEND else "r", rank, g.gid, peer)
        self.records[rank].append(Rec(at, int(op), g.gid, self._next(key), peer=peer, done=None,
                                      state=int(fmt.State.ENQUEUED)))

    def healthy_steps(self, groups: list[Group], steps: int, start: float = 1.0, period: float = 10.0) -> float:
        """``steps`` rounds of one collective per group; returns the time after the last."""
        t = start
        for _ in range(steps):
            for k, g in enumerate(groups):
                self.collective(g, at=t + k * 2.0)
            t += period
        return t

    # -- writing -----------------------------------------------------------------------------------
    def host(self, rank: int) -> str:
        return self.hosts.get(rank, "node0")

    def write(self, root: Path, *, skip_ranks: tuple[int, ...] = (), closed: bool | set[int] = False,
              procs: dict[int, dict] | None = None, outcome: str | None = None, layout: Layout | None = None,
              job_ids: dict[int, str] | None = None, empty_ranks: tuple[int, ...] = (),
              no_meta: tuple[int, ...] = ()) -> Path:
        """Write ``root/rings/*``, plus ``layout.yaml`` and ``procs.json`` when given."""
        rings = root / "rings"
        rings.mkdir(parents=True, exist_ok=True)
        for rank in range(self.world):
            if rank in skip_ranks:
                continue
            host = self.host(rank)
            ident = RingIdentity(rank=rank, world_size=self.world, local_rank=rank % 8,
                                 job_id=(job_ids or {}).get(rank, self.job_id), host=host, pid=1000 + rank)
            w = RingWriter(rings, ident, self.capacity, use_native=False)
            for rec in ([] if rank in empty_ranks else sorted(self.records[rank], key=lambda r: r.t)):
                h = w.begin(rec.op, rec.gid, rec.seq, rec.nbytes, rec.peer, rec.dtype, rec.flags,
                            _now=lambda t=rec.t: MONO_BASE + int(t * MS))
                if rec.done is not None:
                    w.complete(h, rec.state, _now=lambda t=rec.done: MONO_BASE + int(t * MS))
                elif rec.state == fmt.State.FAILED:
                    w.complete(h, rec.state, _now=lambda t=rec.t: MONO_BASE + int(t * MS))
            if rank not in no_meta:
                w.write_meta("process", rank=rank, world_size=self.world, host=host, pid=1000 + rank)
                for g in self.groups:
                    if rank in g.ranks:
                        w.write_meta("group", gid=g.gid, name=g.name, desc=g.desc, ranks=list(g.ranks),
                                     backend=self.backend)
            else:
                w.meta_path.unlink()
            if closed is True or (isinstance(closed, set) and rank in closed):
                w.close()
            _set_anchor(w.path, WALL_BASE + int(self.skew_ms.get(host, 0.0) * MS), MONO_BASE)
        if layout is not None:
            save_layout(layout, root / "layout.yaml")
        if procs is not None or outcome is not None:
            data = {"outcome": outcome or "failed", "message": "",
                    "ranks": {str(r): {"pid": 1000 + r, "exit_code": 0, "signal": None, "killed_by_launcher": False,
                                       **(procs or {}).get(r, {})} for r in range(self.world)}}
            (root / "procs.json").write_text(json.dumps(data))
        return root


def _set_anchor(path: Path, wall_ns: int, mono_ns: int) -> None:
    """Rewrite a ring header's clock anchors (and its checksum)."""
    with open(path, "r+b") as fh:
        static = bytearray(fh.read(fmt.HEADER_STATIC.size))
        fields = list(fmt.HEADER_STATIC.unpack(bytes(static)))
        fields[9], fields[10] = wall_ns, mono_ns
        packed = fmt.HEADER_STATIC.pack(*fields)
        fh.seek(0)
        fh.write(packed)
        fh.seek(fmt.HEADER_CHECK_OFFSET)
        fh.write(fmt.HEADER_CHECK.pack(fmt.header_check(packed)))
