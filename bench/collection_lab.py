"""Collection on the local Slurm lab: seconds and bytes to gather every node's rings of a running job.

    sudo python bench/collection_lab.py [--nodes 4] [--ranks 8] [--repeat 3] [--ring-records 65536]

Needs root and the lab (`megatrace lab up`); prints why and exits 0 otherwise. It submits the demo
job (TP2·PP2·DP2 over 4 virtual nodes, traced with --megatrace) long enough to keep running,
waits until every rank has written records, then runs the collector the way the node agents do
(``srun --overlap --mpi=pmi2``, one task per node, mpi4py gather to rank 0, ``--analysis none``)
``--repeat`` times, and cancels the job. Baseline, measured in the same run: a plain copy of the
same node-local ring files on this host (what the gather must at least move). Every virtual node
is this host, so the network part of a real gather is not measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatrace.collect.slurm import collect_command
from megatrace.lab.demo import LabDemo, batch_script


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _job_state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    return dict(i.split("=", 1) for i in out.split() if "=" in i).get("JobState", "UNKNOWN")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ring-records", type=int, default=65536, help="ring capacity per rank (MEGATRACE_RING_RECORDS)")
    args = p.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("sbatch") is None:
        print("collection on the lab: skipped (needs root and `megatrace lab up`)")
        return 0
    up = subprocess.run([sys.executable, "-m", "megatrace.cli", "lab", "status", "--json"], capture_output=True,
                        text=True)
    if '"up": true' not in up.stdout:
        print("collection on the lab: skipped (the lab is not up: `megatrace lab up`)")
        return 0
    work = Path(tempfile.mkdtemp(prefix="megatrace-collect-bench-"))
    os.chmod(work, 0o755)
    demo = LabDemo(nodes=args.nodes, ranks=args.ranks, steps=100000, fault="")
    script = work / "job.sh"
    script.write_text(batch_script(demo))
    env = {**os.environ, "MEGATRACE_RING_RECORDS": str(args.ring_records)}
    sub = subprocess.run(["sbatch", "--parsable", "--megatrace=hang-timeout=600", f"-N{args.nodes}",
                          f"-n{args.ranks}", "--overcommit", "--time=10", "-o", str(work / "out-%j.txt"), str(script)],
                         cwd=work, capture_output=True, text=True, env=env)
    if sub.returncode:
        print(f"collection on the lab: sbatch failed: {sub.stderr.strip()}")
        return 1
    job = sub.stdout.strip().split(";")[0]
    times: list[float] = []
    copies: list[float] = []
    gathered = 0
    try:
        until = time.monotonic() + 120
        local = Path("/dev/shm/megatrace")
        while time.monotonic() < until:
            rings = list(local.glob(f"job-{job}.*/step-0/rank-*.ring"))
            if len(rings) == args.ranks and _job_state(job) == "RUNNING":
                break
            time.sleep(1)
        else:
            print(f"collection on the lab: job {job} did not start writing rings within 120 s")
            return 1
        time.sleep(10)  # let the rings fill a little
        ring_bytes = sum(p.stat().st_size for p in local.glob(f"job-{job}.*/step-0/rank-*"))
        for i in range(args.repeat):
            with tempfile.TemporaryDirectory() as copy:
                t = time.perf_counter()
                for k, d in enumerate(sorted(local.glob(f"job-{job}.*/step-0"))):
                    shutil.copytree(d, Path(copy) / str(k))
                copies.append(time.perf_counter() - t)
            out = work / f"collect-{i}"
            cmd = collect_command(job, str(work), "manual", args.nodes, ring_dir=f"/dev/shm/megatrace/job-{job}.%n/step-0",
                                  timeout_s=60.0, extra=["--out", str(out), "--analysis", "none", "--no-report",
                                                         "--no-stacks"])
            t = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            times.append(time.perf_counter() - t)
            if proc.returncode:
                print(f"collection on the lab: the collector failed: {proc.stderr.strip()[-500:]}")
                return 1
            gathered = _dir_bytes(out / "rings")
            print(f"  collection {i + 1}/{args.repeat}: {times[-1]:.2f} s", file=sys.stderr)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    med, base = statistics.median(times), statistics.median(copies)
    print(f"Collection on the lab: {args.nodes} virtual nodes (one host), {args.ranks} ranks, job {job}; "
          f"median of {args.repeat}\n")
    print(f"{'measurement':44} {'seconds':>9} {'MB':>8} {'MB/s':>8}")
    print(f"{'baseline: copy the node-local rings':44} {base:>9.3f} {ring_bytes / 1e6:>8.1f} "
          f"{ring_bytes / 1e6 / max(base, 1e-9):>8.0f}")
    print(f"{'srun --overlap collector, mpi4py gather':44} {med:>9.3f} {gathered / 1e6:>8.1f} "
          f"{gathered / 1e6 / max(med, 1e-9):>8.0f}")
    print(f"\nratio collector / copy: {med / max(base, 1e-9):.0f}x; the collector's time is mostly starting "
          "srun, MPI and Python on every node, not moving bytes.")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
