"""Collection at scale: emulated nodes on one host, measured, then a stated model extrapolated to 4,096 nodes.

    python bench/collection_scale.py [--nodes 4 8 16 32] [--ranks-per-node 8] [--records 65536]
                                     [--group-size 32] [--root-link-gbps 100] [--fs-gbps 800] [-o DIR] [--keep]

Each emulated node is one process of ``mpiexec`` (the documented mode: ``MEGATRACE_NODE_NAME``, one ring
directory per node, docs/collect.md) running ``megatrace collect --trigger end --analysis none`` on rings of
realistic size and content: ``--records`` slots per ring (the tracer's default, 65,536: 4 MiB), wrapped, filled
with a training loop's calls (TP all-reduces, PP send/recv, a DP all-reduce per step) with jittered times. For
every node count it measures, in the same run:

* the collection's wall time, and a plain parallel copy of the same files into the job directory (``cp``, one
  process per node): the baseline;
* the root's and a group leader's peak RSS and CPU seconds (``/usr/bin/time`` around each process);
* from the node payloads as the collector packs them (``collect.payload.pack_node``): the bytes through the
  root and the largest MPI message (a leader's frame: its group's payloads in one message).

Then the model at 4,096 nodes x ``--ranks-per-node`` (printed with its inputs): every node snapshots and
compresses its rings in parallel (the measured CPU seconds of a member); the root receives every other node's
payload through one link (``--root-link-gbps``) and decodes and writes it (its measured CPU seconds per byte);
a leader holds its group's payloads and a frame of them; the root one frame and one decoded payload. Targets of
issue 26 (root and leader memory <= 1 GiB, no message over 256 MiB, trigger to findings.json <= 60 s, the full
rings in the job directory within a parallel copy + 20 %) are marked OK or MISSED.

On a 2-core machine the emulated nodes share two cores: wall times at many nodes measure that sharing, which is
why the model is built from per-process CPU seconds and byte counts, not from the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatrace.collect.node import NodeSnapshot
from megatrace.collect.payload import pack_node
from megatrace.simulate.rings import MONO0_NS, RingHead, records, write_meta, write_ring
from megatrace.trace import ring_format as fmt

BIN = Path(sys.executable).parent
MPIEXEC = shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec")
TIME = "/usr/bin/time"
TARGET_NODES = 4096
TARGET_RSS_MIB = 1024
TARGET_MESSAGE_MIB = 256
TARGET_VERDICT_S = 60.0
MIB = 1 << 20


def node_name(i: int) -> str:
    return f"node{i:05d}"


# -- rings ------------------------------------------------------------------------------------------------------

def loop_records(rank: int, n: int, seed: int) -> np.ndarray:
    """``n`` records of a training loop: per step 16 TP all-reduces (2-16 MiB), 8 PP sends and recvs (1 MiB) and
    a DP all-reduce (256 MiB), with jittered compute between calls and transfer times by size."""
    rng = np.random.default_rng(seed)
    step_ops = [int(fmt.Op.ALL_REDUCE)] * 16 + [int(fmt.Op.SEND), int(fmt.Op.RECV)] * 4 + [int(fmt.Op.ALL_REDUCE)]
    step_gid = [1] * 16 + [2, 2] * 4 + [3]
    step_bytes = [2 * MIB, 16 * MIB] * 8 + [MIB] * 8 + [256 * MIB]
    k = np.arange(n)
    pos = k % len(step_ops)
    op = np.array(step_ops, np.uint16)[pos]
    gid = np.array(step_gid, np.uint32)[pos]
    nbytes = np.array(step_bytes, np.uint64)[pos]
    group_seq = np.zeros(n, np.uint64)
    for g in (1, 2, 3):
        at = gid == g
        group_seq[at] = np.arange(1, at.sum() + 1)
    gap = rng.gamma(4.0, 250_000.0, n).astype(np.int64)  # ~1 ms of compute before each call
    took = (nbytes // 20_000).astype(np.int64) + rng.integers(5_000, 50_000, n)  # ~20 GB/s plus latency
    t_enqueue = MONO0_NS + np.cumsum(gap + took) - took
    peer = np.where(op == int(fmt.Op.SEND), rank + 1, np.where(op == int(fmt.Op.RECV), rank - 1, -1))
    return records(1, op, gid, group_seq, nbytes, peer, t_enqueue, t_enqueue + took,
                   np.full(n, int(fmt.State.COMPLETED), np.uint8))


def write_nodes(base: Path, nodes: int, per_node: int, capacity: int) -> None:
    """``base/<node>/`` for each node: its ranks' rings (``capacity`` slots, wrapped once and a quarter) and
    meta files; reused when present."""
    stamp = base / "params.json"
    params = {"nodes": nodes, "per_node": per_node, "capacity": capacity}
    if stamp.exists() and json.loads(stamp.read_text()) == params:
        return
    shutil.rmtree(base, ignore_errors=True)
    t = time.perf_counter()
    world = nodes * per_node
    for i in range(nodes):
        d = base / node_name(i)
        d.mkdir(parents=True)
        for local in range(per_node):
            rank = i * per_node + local
            head = RingHead(rank, world, local, node_name(i), 10_000 + rank, job_id="77")
            write_ring(d / fmt.ring_name(rank), head, loop_records(rank, capacity + capacity // 4, rank), capacity)
            write_meta(d / fmt.meta_name(rank), head, [{"gid": g, "name": n, "desc": n, "ranks": [rank]}
                                                      for g, n in ((1, "tp"), (2, "pp"), (3, "dp"))])
    stamp.write_text(json.dumps(params))
    print(f"  wrote {world} rings of {fmt.file_size(capacity) / MIB:.0f} MiB in {time.perf_counter() - t:.0f} s",
          file=sys.stderr)


def payload_sizes(base: Path, nodes: int) -> list[int]:
    """Each node's payload as the collector packs it (the rings and meta files, compressed)."""
    sizes = []
    for i in range(nodes):
        d = base / node_name(i)
        files = {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name.startswith("rank-")}
        sizes.append(len(pack_node(NodeSnapshot(node_name(i), files, {}))))
    return sizes


# -- runs -------------------------------------------------------------------------------------------------------

@dataclass
class Proc:
    rss_mib: float
    cpu_s: float


@dataclass
class Row:
    nodes: int
    wall_s: float
    copy_s: float
    root: Proc
    leader: Proc | None
    member: Proc  # the median member (by CPU seconds): what every node does for itself
    raw_bytes: int
    payloads: list[int]
    group_size: int

    @property
    def through_root(self) -> int:
        return sum(self.payloads[1:])

    @property
    def largest_message(self) -> int:
        groups = [self.payloads[g:g + self.group_size] for g in range(0, len(self.payloads), self.group_size)]
        return max([sum(g) for g in groups[1:]] + [max(self.payloads)])


def collect(base: Path, job: Path, nodes: int, group_size: int, timeout: float, stats: Path) -> float:
    """One ``megatrace collect`` per emulated node under mpiexec; each process's peak RSS and CPU into ``stats``."""
    stats.mkdir(parents=True, exist_ok=True)
    wrapper = (f'export MEGATRACE_NODE_NAME=$(printf node%05d "$PMI_RANK"); exec {TIME} -f "%M %U %S" '
               f'-o {stats}/proc-"$PMI_RANK" "$@"')
    argv = [sys.executable, "-m", "megatrace.cli", "collect", "--ring-dir", f"{base}/%n", "--job-dir", str(job),
            "--job-id", "77", "--no-system", "--trigger", "end", "--analysis", "none", "--group-size",
            str(group_size), "--timeout", str(timeout)]
    t = time.perf_counter()
    subprocess.run([MPIEXEC, "-n", str(nodes), "sh", "-c", wrapper, "sh", *argv], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout + 120)
    return time.perf_counter() - t


def read_proc(stats: Path, rank: int) -> Proc:
    rss_kib, user, system = stats.joinpath(f"proc-{rank}").read_text().split()[-3:]
    return Proc(int(rss_kib) / 1024, float(user) + float(system))


def parallel_copy(base: Path, dest: Path, nodes: int) -> float:
    dest.mkdir(parents=True)
    t = time.perf_counter()
    procs = [subprocess.Popen(["cp", "-r", str(base / node_name(i)), str(dest)]) for i in range(nodes)]
    for p in procs:
        p.wait()
    return time.perf_counter() - t


def measure(base: Path, work: Path, nodes: int, group_size: int, timeout: float) -> Row:
    shutil.rmtree(work, ignore_errors=True)
    job = work / "job"
    job.mkdir(parents=True)
    wall = collect(base, job, nodes, group_size, timeout, work / "stats")
    doc = json.loads((job / "megatrace-77" / "collection.json").read_text())
    missing = doc["nodes"]["missing"]
    if missing:
        raise SystemExit(f"{nodes} nodes: nodes missing from the collection: {missing}")
    copy = parallel_copy(base, work / "copy", nodes)
    procs = {r: read_proc(work / "stats", r) for r in range(nodes)}
    leaders = [r for r in range(group_size, nodes, group_size)]
    members = sorted((p for r, p in procs.items() if r % group_size), key=lambda p: p.cpu_s) or [procs[0]]
    raw = sum(p.stat().st_size for p in base.glob("node*/rank-*") if int(p.parent.name[4:]) < nodes)
    row = Row(nodes, wall, copy, procs[0], procs[leaders[0]] if leaders else None, members[len(members) // 2], raw,
              payload_sizes(base, nodes), group_size)
    shutil.rmtree(work, ignore_errors=True)
    return row


# -- the model --------------------------------------------------------------------------------------------------

def root_seconds_per_byte(rows: list[Row]) -> float:
    """The root's CPU seconds per byte it receives beyond what a member does for itself: the slope of a line
    through the rows (its fixed costs, the bundle's index and collection.json, are the intercept); one row: the
    ratio."""
    x = np.array([r.through_root for r in rows], float)
    y = np.array([max(r.root.cpu_s - r.member.cpu_s, 0.0) for r in rows])
    if len(rows) > 1 and np.ptp(x) > 0:
        return max(float(np.polyfit(x, y, 1)[0]), 0.0)
    return float(y[-1] / max(x[-1], 1.0))


def model(rows: list[Row], link_gbps: float, fs_gbps: float) -> dict[str, float]:
    """The collection of ``TARGET_NODES`` nodes as this design does it, from the measured rows (sizes: the last).

    Every node snapshots and compresses its rings at once (a member's CPU seconds); the root then receives
    every other node's payload through its link and decodes and writes it (:func:`root_seconds_per_byte`).
    Memory: a leader holds its group's payloads, then joins them into a frame (two copies); the root holds a
    frame as received and as bytes, and one node's decoded payload, beside a member's own footprint. The
    parallel copy: every node writes its own rings to the shared filesystem, at ``fs_gbps`` together.
    """
    row = rows[-1]
    n, g = TARGET_NODES, row.group_size
    payload = statistics.mean(row.payloads)
    through = (n - 1) * payload
    root_cpu_per_byte = root_seconds_per_byte(rows)
    receive_s = through / (link_gbps * 1e9 / 8) + through * root_cpu_per_byte
    frame = g * payload
    raw_node = row.raw_bytes / row.nodes
    return {"payload_mib": payload / MIB, "through_root_gib": through / (1 << 30), "largest_message_mib": frame / MIB,
            "member_s": row.member.cpu_s, "root_receive_s": receive_s, "collection_s": row.member.cpu_s + receive_s,
            "root_mb_s": 1e-6 / max(root_cpu_per_byte, 1e-12),
            "leader_rss_mib": row.member.rss_mib + 2 * frame / MIB,
            "root_rss_mib": row.member.rss_mib + (2 * frame + raw_node) / MIB,
            "copy_s": n * raw_node / (fs_gbps * 1e9 / 8)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--records", type=int, default=65536, help="ring slots per rank (the tracer's default)")
    p.add_argument("--group-size", type=int, default=32, help="nodes per leader (the collector's default)")
    p.add_argument("--timeout", type=float, default=300.0, help="the collector's --timeout")
    p.add_argument("--root-link-gbps", type=float, default=100.0, help="the root node's network link, for the model")
    p.add_argument("--fs-gbps", type=float, default=800.0,
                   help="the shared filesystem's aggregate write bandwidth, for the model's parallel copy")
    p.add_argument("-o", "--out", type=Path, default=None, help="where the rings go (reused when present)")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    if MPIEXEC is None or not os.access(TIME, os.X_OK):
        raise SystemExit("needs mpiexec (make install: the mpich wheel) and /usr/bin/time")
    root = args.out or Path(tempfile.mkdtemp(prefix="megatrace-collection-"))
    base = root / "nodes"
    rows = []
    try:
        write_nodes(base, max(args.nodes), args.ranks_per_node, args.records)
        for nodes in sorted(args.nodes):
            print(f"  {nodes} nodes: collecting", file=sys.stderr)
            rows.append(measure(base, root / "work", nodes, args.group_size, args.timeout))
    finally:
        if not args.keep and args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    print_tables(rows, args)
    return 0


def print_tables(rows: list[Row], args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(f"\nmachine: {os.cpu_count()} CPUs, load {load[0]:.1f}; {args.ranks_per_node} ranks per node, rings of "
          f"{fmt.file_size(args.records) / MIB:.1f} MiB, groups of {args.group_size} nodes\n")
    head = (f"{'nodes':>5} {'raw MiB':>8} {'payload MiB':>11} {'wall s':>7} {'cp s':>6} {'wall/cp':>7} "
            f"{'root MiB':>8} {'root cpu s':>10} {'leader MiB':>10} {'member cpu s':>12} {'via root MiB':>12} "
            f"{'largest msg MiB':>15}")
    print(head)
    print("-" * len(head))
    for r in rows:
        leader = f"{r.leader.rss_mib:>10.0f}" if r.leader else f"{'-':>10}"
        print(f"{r.nodes:>5} {r.raw_bytes / MIB:>8.0f} {statistics.mean(r.payloads) / MIB:>11.1f} {r.wall_s:>7.1f} "
              f"{r.copy_s:>6.2f} {r.wall_s / r.copy_s:>7.1f} {r.root.rss_mib:>8.0f} {r.root.cpu_s:>10.1f} {leader} "
              f"{r.member.cpu_s:>12.2f} {r.through_root / MIB:>12.0f} {r.largest_message / MIB:>15.1f}")
    m = model(rows, args.root_link_gbps, args.fs_gbps)
    print(f"\nmodel at {TARGET_NODES:,} nodes x {args.ranks_per_node} ranks, from the rows above: each "
          f"node's payload {m['payload_mib']:.1f} MiB; {m['through_root_gib']:.0f} GiB through the root's "
          f"{args.root_link_gbps:g} Gb/s link and its decoding at {m['root_mb_s']:.0f} MB/s "
          f"({m['root_receive_s']:.0f} s), after the nodes' "
          f"own {m['member_s']:.1f} s; a leader holds {args.group_size} payloads and their frame, the root one frame "
          f"and one decoded payload; the parallel copy at {args.fs_gbps:g} Gb/s takes {m['copy_s']:.0f} s\n")
    checks = [("root peak memory", m["root_rss_mib"], TARGET_RSS_MIB, "MiB"),
              ("leader peak memory", m["leader_rss_mib"], TARGET_RSS_MIB, "MiB"),
              ("largest MPI message", m["largest_message_mib"], TARGET_MESSAGE_MIB, "MiB"),
              ("trigger to findings.json (collection part)", m["collection_s"], TARGET_VERDICT_S, "s"),
              ("full rings in the job directory", m["collection_s"], 1.2 * m["copy_s"], "s")]
    for what, got, limit, unit in checks:
        print(f"  {what:<45} {got:>9.1f} {unit:<3} target <= {limit:.1f} {unit}: {'OK' if got <= limit else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
