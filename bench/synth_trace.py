"""Synthetic ring traces at scale, written straight into the ring format with numpy, and an analysis timer.

    python bench/synth_trace.py --ranks 4096 [--tp 8] [--pp 8] [--records 2000] [--hang RANK] [-o DIR] [--keep]
                                [--mode full|hang]

Every rank runs the same step: per microbatch a forward (recv from the previous
stage, two TP all-reduces, send to the next) then the backwards in the other
direction, then one DP all-reduce. With ``--hang R`` rank R stops before its
first TP all-reduce of the last step; a small simulator decides, for every
other rank, which call it ends up blocked in (rendezvous send/recv,
collectives complete when all members are there). Then it loads and analyses
the trace (``--mode hang``: the quick, hang-only analysis) and prints the time of
each stage and the peak memory. ``bench/analysis_scale.py`` compares both modes
at 1,024, 4,096 and 16,384 ranks against the targets.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from megatrace.config import Layout, save_layout
from megatrace.trace import ring_format as fmt
from megatrace.simulate.rings import MONO0_NS, RingHead, records
from megatrace.simulate.rings import write_ring as write_ring_file

MS = 1_000_000
STEP_NS = 100 * MS
MONO0 = MONO0_NS
TP_AR, DP_AR, SEND, RECV = int(fmt.Op.ALL_REDUCE), int(fmt.Op.ALL_REDUCE), int(fmt.Op.SEND), int(fmt.Op.RECV)


def gid(layout: Layout, kind: str, rank: int) -> int:
    """A group id per (kind, lowest member): tp 1xxxxxxx, pp 2xxxxxxx, dp 3xxxxxxx."""
    return {"tp": 10_000_000, "pp": 20_000_000, "dp": 30_000_000}[kind] + layout.group_of(kind, rank)[0]


def step_ops(layout: Layout, rank: int, microbatches: int) -> list[tuple[str, int, int]]:
    """One step of ``rank`` as (kind, group id, peer): kind in tp, dp, send, recv."""
    c = layout.coords(rank)
    tp_gid, pp_gid, dp_gid = (gid(layout, k, rank) for k in ("tp", "pp", "dp"))
    prev = layout.rank_of(c.pp - 1, c.dp, c.tp) if c.pp > 0 else None
    nxt = layout.rank_of(c.pp + 1, c.dp, c.tp) if c.pp < layout.pp - 1 else None
    ops: list[tuple[str, int, int]] = []
    for _ in range(microbatches):
        ops += [("recv", pp_gid, prev)] if prev is not None else []
        ops += [("tp", tp_gid, -1), ("tp", tp_gid, -1)]
        ops += [("send", pp_gid, nxt)] if nxt is not None else []
    for _ in range(microbatches):
        ops += [("recv", pp_gid, nxt)] if nxt is not None else []
        ops += [("tp", tp_gid, -1), ("tp", tp_gid, -1)]
        ops += [("send", pp_gid, prev)] if prev is not None else []
    return ops + [("dp", dp_gid, -1)]


def simulate_last_step(layout: Layout, plans: dict[int, list], hung: int) -> dict[int, int]:
    """Index of the op each rank is blocked in (== len: finished the step); the hung rank never enters it."""
    stop = {r: len(p) for r, p in plans.items()}
    stop[hung] = next(k for k, op in enumerate(plans[hung]) if op[0] == "tp")
    pos = {r: 0 for r in plans}
    count: dict[tuple, int] = {}  # (rank, kind, gid, peer) -> calls completed so far, to match instances
    members = {}
    for r in plans:
        for kind in ("tp", "dp"):
            members[(r, kind)] = layout.group_of(kind, r)
    progress = True
    while progress:
        progress = False
        for r, plan in plans.items():
            while pos[r] < stop[r]:
                kind, gid, peer = plan[pos[r]]
                if kind in ("tp", "dp"):
                    key = (kind, gid)
                    mine = count.get((r,) + key, 0)
                    ready = all(pos[m] < stop[m] and plans[m][pos[m]][:2] == (kind, gid)
                                and count.get((m,) + key, 0) == mine for m in members[(r, kind)])
                    if not ready:
                        break
                    for m in members[(r, kind)]:
                        count[(m,) + key] = mine + 1
                        pos[m] += 1
                else:
                    other = "recv" if kind == "send" else "send"
                    if not (pos[peer] < stop[peer] and plans[peer][pos[peer]] == (other, gid, r)):
                        break
                    pos[r] += 1
                    pos[peer] += 1
                progress = True
    return {r: pos[r] if r != hung else stop[r] for r in plans}


def write_ring(path: Path, rank: int, world: int, ops: list[tuple[str, int, int]], times: np.ndarray,
               done: np.ndarray) -> None:
    """Write one ring file: header, then records with both checksums, as the writer would."""
    kinds = [o[0] for o in ops]
    op = np.array([SEND if k == "send" else RECV if k == "recv" else TP_AR for k in kinds], np.int64)
    seqs, counters = [], {}
    for key in ops:
        counters[key] = counters.get(key, 0) + 1
        seqs.append(counters[key])
    recs = records(1, op, np.array([o[1] for o in ops], np.int64), np.array(seqs, np.int64),
                   np.where(op == TP_AR, 1 << 20, 1 << 18), np.array([o[2] for o in ops], np.int64),
                   MONO0 + times, np.where(done, MONO0 + times + MS // 2, 0),
                   np.where(done, int(fmt.State.COMPLETED), int(fmt.State.ENQUEUED)))
    head = RingHead(rank, world, rank % 8, f"node{rank // 8:05d}", 100000 + rank, job_id="synthetic")
    write_ring_file(path, head, recs)


def generate(out: Path, ranks: int, tp: int, pp: int, records: int, microbatches: int, hung: int | None) -> Layout:
    layout = Layout(world_size=ranks, tp=tp, pp=pp, dp=ranks // (tp * pp), microbatches=microbatches).validate()
    rings = out / "rings"
    rings.mkdir(parents=True, exist_ok=True)
    plans = {r: step_ops(layout, r, microbatches) for r in range(ranks)}
    longest = max(len(p) for p in plans.values())
    steps = max(2, records // longest)
    blocked = simulate_last_step(layout, plans, hung) if hung is not None else None
    for r in range(ranks):
        plan = plans[r]
        per_step = len(plan)
        n_full = steps - 1 if blocked is not None else steps
        last = plan[:blocked[r] + (1 if blocked[r] < per_step and r != hung else 0)] if blocked is not None else []
        ops = plan * n_full + last
        k = np.arange(len(ops))
        times = (k // per_step) * STEP_NS + (k % per_step) * (STEP_NS // (per_step + 1))
        done = np.ones(len(ops), bool)
        if blocked is not None and r != hung and blocked[r] < per_step:
            done[-1] = False
        write_ring(rings / fmt.ring_name(r), r, ranks, ops, times, done)
        meta = [{"kind": "group", "gid": gid(layout, k, r), "name": f"{k}{layout.group_of(k, r)[0]}", "desc": k,
                 "ranks": layout.group_of(k, r)} for k in ("tp", "pp", "dp")]
        (rings / fmt.meta_name(r)).write_text("".join(json.dumps(m) + "\n" for m in meta))
    save_layout(layout, out / "layout.yaml")
    return layout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--records", type=int, default=2000, help="records per rank (about)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--hang", type=int, default=None, help="rank that stops in the last step")
    p.add_argument("-o", "--out", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the generated trace")
    p.add_argument("--mode", choices=["full", "hang"], default="full",
                   help="analysis mode: full, or hang (megatrace analyze --quick)")
    args = p.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="megatrace-synth-"))
    t0 = time.perf_counter()
    generate(out, args.ranks, args.tp, args.pp, args.records, args.microbatches, args.hang)
    print(f"generated {args.ranks} ranks in {time.perf_counter() - t0:.1f} s -> {out}", file=sys.stderr)

    from megatrace.analyze.engine import analyze

    result = analyze(out, mode=args.mode)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"mode {args.mode}, ranks {args.ranks}, records loaded {len(result.trace.records):,}, "
          f"instances {len(result.match.collectives):,}, pairs {result.match.index.n_pairs:,}")
    print("timings: " + ", ".join(f"{k} {v:.2f} s" for k, v in result.timings.items()))
    print(f"peak RSS {peak_mib:.0f} MiB")
    print(f"verdict: {result.findings[0].verdict}")
    if not args.keep and args.out is None:
        shutil.rmtree(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
