"""NCCL interposer overhead: the same NCCL calls with and without libmegatrace_nccl.so, in one run.

    python bench/nccl_interposer.py [--calls 200000] [--rounds 7] [--ranks 1]

Builds the interposer, the NCCL test double (tests/nccl_double, over the mpich wheel's MPI) and
its driver, then times ``ncclAllReduce`` of 2 floats on the world communicator, median ns per
call inside the driver, in three configurations whose runs alternate round by round:

* untraced: no LD_PRELOAD (the baseline);
* preloaded, off: LD_PRELOAD set, MEGATRACE_ENABLE=0 (what a job pays that loads it untraced);
* traced: LD_PRELOAD and MEGATRACE_ENABLE=1 (one record per call, completed on return).

With one rank the double's all-reduce is a local copy (~0.1 µs), so the difference is the
interposer's own cost: a table lookup, two atomic increments, two clock reads and the record.
Target (issue 9): at most 300 ns added per call (median).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from nccl_double.harness import BuildUnavailable, build_all, run_job

TARGET_NS = 300.0


def one_run(build, directory: Path, calls: int, ranks: int, preload: bool, enable: bool) -> float:
    env = {"MEGATRACE_ENABLE": "1" if enable else "0"}
    job = run_job(build, directory, ["--bench", str(calls)], ranks=ranks, trace=preload, env=env,
                  deadline_s=300, stdout=True)
    if job.returncode != 0:
        raise SystemExit(f"driver failed: {job.stderr}")
    return float(job.stdout.split()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200_000, help="calls per run [200000]")
    p.add_argument("--rounds", type=int, default=7, help="runs per configuration, interleaved [7]")
    p.add_argument("--ranks", type=int, default=1, help="MPI ranks (1 isolates the interposer) [1]")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="mt-nccl-bench-") as tmp:
        try:
            build = build_all(Path(tmp) / "build")
        except BuildUnavailable as exc:
            print(f"skipped: {exc}")
            return 0
        configs = {"untraced": (False, False), "preloaded, off": (True, False), "traced": (True, True)}
        samples: dict[str, list[float]] = {name: [] for name in configs}
        for r in range(args.rounds):
            for name, (preload, enable) in configs.items():
                run_dir = Path(tmp) / f"{name.replace(', ', '-')}-{r}"
                samples[name].append(one_run(build, run_dir, args.calls, args.ranks, preload, enable))
    med = {name: statistics.median(v) for name, v in samples.items()}
    base = med["untraced"]
    print("MegaTrace NCCL interposer overhead (median ns per ncclAllReduce, 2 floats; baseline in this run)\n")
    print(f"{args.ranks} rank(s), {args.calls} calls per run, {args.rounds} interleaved runs per configuration\n")
    print(f"{'configuration':18} {'ns/call':>10} {'added':>10} {'ratio':>7}  target")
    for name, value in med.items():
        added = value - base
        target = "" if name == "untraced" else (f"<= {TARGET_NS:.0f} ns added: "
                                               f"{'ok' if added <= TARGET_NS else 'MISSED'}")
        print(f"{name:18} {value:10.1f} {added:10.1f} {value / base:7.2f}  {target}")
    print("\nper-run medians:", {k: [round(x) for x in v] for k, v in samples.items()})
    return 0 if med["traced"] - base <= TARGET_NS else 1


if __name__ == "__main__":
    sys.exit(main())
