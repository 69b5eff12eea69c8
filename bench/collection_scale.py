"""Collection at scale: emulated nodes on one host, measured, then a stated model extrapolated to 4,096 nodes.

    python bench/collection_scale.py [--nodes 4 8 16 32] [--ranks-per-node 8] [--records 65536]
                                     [--group-size 8] [--root-link-gbps 100] [--fs-gbps 800] [-o DIR] [--keep]

Each emulated node is one process of ``mpiexec`` (the documented mode: ``MEGATRACE_NODE_NAME``, one ring
directory per node, docs/collect.md) running ``megatrace collect --trigger end --analysis none`` on rings of
realistic size and content: ``--records`` slots per ring (the tracer's default, 65,536: 4 MiB), wrapped, filled
with a training loop's calls (TP all-reduces, PP send/recv, a DP all-reduce per step) with jittered times. For
every node count it measures, in the same run, both ways the collector moves the rings:

* ``--transfer auto`` (the job directory on a filesystem every node sees, as here): each node writes its own
  rings into the bundle and sends the root its facts and file list;
* ``--transfer stream`` (no shared filesystem): every byte through the gather to the root, in bounded chunks;

and a plain parallel copy of the same files into the job directory (``cp``, one process per node): the
baseline. Per run: the wall time, the root's and a group leader's peak RSS and CPU seconds (``/usr/bin/time``
around each process), and from collection.json the bytes through the root and the largest message it received.
The ``auto`` runs end with the root's quick pass on the bundle (``--analysis quick``): the verdict's time.

Then the model at 4,096 nodes x ``--ranks-per-node`` (printed with its inputs, per way): every node snapshots
its rings at once (a member's CPU seconds). With a shared filesystem the nodes write their rings at
``--fs-gbps`` together, as the parallel copy does, and the root takes one header per node (its CPU seconds per
node: the slope of its CPU seconds against the node count). Streamed, the root receives every node's bytes
through one link (``--root-link-gbps``) and decodes and writes them (its CPU seconds per byte). Memory: the
largest RSS measured (a leader and the root hold one message of another node at a time), plus the root's index
of each further node (its facts and collection.json entries, three times their JSON bytes as Python objects).
Targets of issue 26 (root and leader memory <= 1 GiB, no message over 256 MiB, trigger to findings.json <= 60 s,
the full rings in the job directory within a parallel copy + 20 %) are marked OK or MISSED. The verdict's time
at 4,096 nodes is extrapolated from the auto runs' quick passes (by their slope against the ranks: use node
counts a few times apart, as the default's).

On a 2-core machine the emulated nodes share two cores: wall times at many nodes measure that sharing, which is
why the model is built from per-process CPU seconds and byte counts, not from the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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
INDEX_OBJECT_FACTOR = 3  # Python objects of parsed JSON against the JSON's bytes


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


# -- runs -------------------------------------------------------------------------------------------------------

@dataclass
class Proc:
    rss_mib: float
    cpu_s: float


@dataclass
class Row:
    nodes: int
    transfer: str
    wall_s: float
    copy_s: float
    root: Proc
    leader: Proc | None
    member: Proc  # the median member (by CPU seconds): what every node does for itself
    raw_bytes: int
    through_root: int  # message bytes the root received (collection.json)
    largest_message: int
    written_by_nodes: int  # files
    node_local_s: float  # a node's snapshot, digests and own writes: CPU seconds (median, from its facts)
    group_size: int
    analysis_s: float  # the root's quick pass on the bundle (auto rows; 0 for stream rows, which skip it)
    ranks: int
    index_bytes: int  # per node: its facts file and its share of collection.json (what the root keeps of it)


def collect(base: Path, job: Path, nodes: int, group_size: int, timeout: float, stats: Path, transfer: str,
            analysis: str) -> float:
    """One ``megatrace collect`` per emulated node under mpiexec; each process's peak RSS and CPU into ``stats``."""
    stats.mkdir(parents=True, exist_ok=True)
    wrapper = (f'export MEGATRACE_NODE_NAME=$(printf node%05d "$PMI_RANK"); exec {TIME} -f "%M %U %S" '
               f'-o {stats}/proc-"$PMI_RANK" "$@"')
    argv = [sys.executable, "-m", "megatrace.cli", "collect", "--ring-dir", f"{base}/%n", "--job-dir", str(job),
            "--job-id", "77", "--no-system", "--trigger", "end", "--analysis", analysis, "--no-report", "--group-size",
            str(group_size), "--timeout", str(timeout), "--transfer", transfer]
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


def measure(base: Path, work: Path, nodes: int, group_size: int, timeout: float, transfer: str) -> Row:
    shutil.rmtree(work, ignore_errors=True)
    job = work / "job"
    job.mkdir(parents=True)
    wall = collect(base, job, nodes, group_size, timeout, work / "stats", transfer,
                   "quick" if transfer == "auto" else "none")
    bundle = job / "megatrace-77"
    doc = json.loads((bundle / "collection.json").read_text())
    missing = doc["nodes"]["missing"]
    if missing:
        raise SystemExit(f"{nodes} nodes ({transfer}): nodes missing from the collection: {missing}")
    local = sorted(json.loads(p.read_text())["transfer"]["cpu_seconds"] for p in (bundle / "nodes").glob("*.json"))
    copy = parallel_copy(base, work / "copy", nodes)
    procs = {r: read_proc(work / "stats", r) for r in range(nodes)}
    leaders = [r for r in range(group_size, nodes, group_size)]
    members = sorted((p for r, p in procs.items() if r % group_size), key=lambda p: p.cpu_s) or [procs[0]]
    raw = sum(p.stat().st_size for p in base.glob("node*/rank-*") if int(p.parent.name[4:]) < nodes)
    moved = doc["transfer"]
    index = sum(p.stat().st_size for p in (bundle / "nodes").glob("*.json"))
    index += (bundle / "collection.json").stat().st_size
    row = Row(nodes, transfer, wall, copy, procs[0], procs[leaders[0]] if leaders else None,
              members[len(members) // 2], raw, moved["bytes_through_root"], moved["largest_message"],
              moved["files_written_by_nodes"], local[len(local) // 2], group_size,
              float(doc["analysis"].get("seconds", 0.0)), doc["ranks"]["world_size"], index // nodes)
    shutil.rmtree(work, ignore_errors=True)
    return row


# -- the model --------------------------------------------------------------------------------------------------

def _slope(x: list[float], y: list[float]) -> float:
    """The slope of a line through the points (fixed costs are the intercept); one point: the ratio."""
    if len(x) > 1 and np.ptp(x) > 0:
        return max(float(np.polyfit(x, y, 1)[0]), 0.0)
    return float(y[-1] / max(x[-1], 1.0))


def model(rows: list[Row], link_gbps: float, fs_gbps: float) -> dict[str, float]:
    """The collection of ``TARGET_NODES`` nodes one way (``rows`` of that way; sizes: the last row's).

    Every node snapshots its rings at once (a member's CPU seconds). Shared filesystem: the nodes write their
    rings together at ``fs_gbps``, as the parallel copy does, and the root handles one header per node.
    Streamed: the root receives every node's bytes through its link and decodes and writes them. The rings are
    in place once the last byte is written; the parallel copy is the same bytes at ``fs_gbps``.
    """
    row = rows[-1]
    n = TARGET_NODES
    raw_node = row.raw_bytes / row.nodes
    copy_s = n * raw_node / (fs_gbps * 1e9 / 8)
    root_extra = [max(r.root.cpu_s - r.member.cpu_s - r.analysis_s, 0.0) for r in rows]  # (the verdict: apart)
    # The root keeps of each node its facts and its entries in collection.json: as Python objects, taken as
    # three times their JSON (an RSS slope over a few MiB of growth is mostly noise).
    rss_per_node = INDEX_OBJECT_FACTOR * row.index_bytes / MIB
    out = {"member_s": row.member.cpu_s, "copy_s": copy_s, "node_local_s": row.node_local_s,
           "largest_message_mib": row.largest_message / MIB,
           "leader_rss_mib": max((r.leader.rss_mib for r in rows if r.leader), default=row.member.rss_mib),
           "root_rss_mib": row.root.rss_mib + rss_per_node * (n - row.nodes)}
    if row.transfer == "stream":
        per_node = row.through_root / row.nodes
        through = n * per_node
        per_byte = _slope([r.through_root for r in rows], root_extra)
        receive_s = through / (link_gbps * 1e9 / 8) + through * per_byte
        out |= {"through_root_gib": through / (1 << 30), "root_s": receive_s, "root_mb_s": 1e-6 / max(per_byte, 1e-12),
                "collection_s": row.member.cpu_s + receive_s, "rings_s": row.member.cpu_s + receive_s}
    else:
        per_node_s = _slope([r.nodes for r in rows], root_extra)
        through = n * row.through_root / row.nodes
        root_s = n * per_node_s + through / (link_gbps * 1e9 / 8)
        # the rings are in place when a node has read, digested and written its own: its local work (measured
        # here, its write to this host's disk included, so counted twice beside the copy's: conservative) and
        # its share of the filesystem's bandwidth
        ranks = n * row.ranks // row.nodes
        verdict_s = row.analysis_s + _slope([r.ranks for r in rows], [r.analysis_s for r in rows]) * (ranks - row.ranks)
        out |= {"through_root_gib": through / (1 << 30), "root_s": root_s, "root_per_node_ms": per_node_s * 1e3,
                "verdict_s": verdict_s, "collection_s": row.member.cpu_s + copy_s + root_s,
                "rings_s": row.node_local_s + copy_s}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--records", type=int, default=65536, help="ring slots per rank (the tracer's default)")
    p.add_argument("--group-size", type=int, default=8,
                   help="nodes per leader (the collector's default is 32; 8 here gives the runs leaders to measure)")
    p.add_argument("--timeout", type=float, default=300.0, help="the collector's --timeout")
    p.add_argument("--transfer", nargs="+", choices=["auto", "stream"], default=["auto", "stream"])
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
            for transfer in args.transfer:
                print(f"  {nodes} nodes, --transfer {transfer}: collecting", file=sys.stderr)
                rows.append(measure(base, root / "work", nodes, args.group_size, args.timeout, transfer))
    finally:
        if not args.keep and args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    print_tables(rows, args)
    return 0


def print_tables(rows: list[Row], args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(f"\nmachine: {os.cpu_count()} CPUs, load {load[0]:.1f}; {args.ranks_per_node} ranks per node, rings of "
          f"{fmt.file_size(args.records) / MIB:.1f} MiB, groups of {args.group_size} nodes\n")
    head = (f"{'nodes':>5} {'transfer':>8} {'raw MiB':>8} {'wall s':>7} {'cp s':>6} {'wall/cp':>7} "
            f"{'root MiB':>8} {'root cpu s':>10} {'leader MiB':>10} {'member cpu s':>12} {'via root MiB':>12} "
            f"{'largest msg MiB':>15} {'by nodes':>8} {'verdict s':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        leader = f"{r.leader.rss_mib:>10.0f}" if r.leader else f"{'-':>10}"
        print(f"{r.nodes:>5} {r.transfer:>8} {r.raw_bytes / MIB:>8.0f} {r.wall_s:>7.1f} {r.copy_s:>6.2f} "
              f"{r.wall_s / r.copy_s:>7.1f} {r.root.rss_mib:>8.0f} {r.root.cpu_s:>10.1f} {leader} "
              f"{r.member.cpu_s:>12.2f} {r.through_root / MIB:>12.1f} {r.largest_message / MIB:>15.2f} "
              f"{r.written_by_nodes:>8} {r.analysis_s:>9.2f}")
    for transfer in args.transfer:
        m = model([r for r in rows if r.transfer == transfer], args.root_link_gbps, args.fs_gbps)
        if transfer == "stream":
            how = (f"{m['through_root_gib']:.0f} GiB through the root's {args.root_link_gbps:g} Gb/s link and its "
                   f"decoding at {m['root_mb_s']:.0f} MB/s ({m['root_s']:.0f} s)")
        else:
            how = (f"the nodes write their own rings at {args.fs_gbps:g} Gb/s together ({m['copy_s']:.1f} s) after "
                   f"{m['node_local_s']:.2f} CPU s of their own reading and digests; the root takes one header per "
                   f"node at {m['root_per_node_ms']:.1f} ms each, {m['through_root_gib'] * 1024:.0f} MiB in all "
                   f"({m['root_s']:.1f} s); its quick pass on the rings in the bundle, by the measured runs' "
                   f"seconds per rank, {m['verdict_s']:.1f} s")
        print(f"\nmodel at {TARGET_NODES:,} nodes x {args.ranks_per_node} ranks, --transfer {transfer}: after each "
              f"node's own {m['member_s']:.1f} s, {how}; the parallel copy at {args.fs_gbps:g} Gb/s takes "
              f"{m['copy_s']:.1f} s\n")
        checks = [("root peak memory", m["root_rss_mib"], TARGET_RSS_MIB, "MiB"),
                  ("leader peak memory", m["leader_rss_mib"], TARGET_RSS_MIB, "MiB"),
                  ("largest MPI message", m["largest_message_mib"], TARGET_MESSAGE_MIB, "MiB"),
                  ("trigger to findings.json", m["collection_s"] + m.get("verdict_s", 0.0), TARGET_VERDICT_S, "s"),
                  ("full rings in the job directory", m["rings_s"], 1.2 * m["copy_s"], "s")]
        for what, got, limit, unit in checks:
            print(f"  {what:<45} {got:>9.1f} {unit:<3} target <= {limit:.1f} {unit}: "
                  f"{'OK' if got <= limit else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
