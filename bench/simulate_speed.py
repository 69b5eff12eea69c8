"""How fast `megatrace simulate` writes traces, against the plain synthetic writer in the same run.

    python bench/simulate_speed.py [--ranks 1024 4096 16384] [--tp 8] [--pp 16] [--records 2000]

For each scale: the event simulation of the demo's job with a hang (megatrace.simulate, jitter and
clock skew on) and bench/synth_trace.py's generator (no schedule model: fixed times, the baseline)
each write about ``--records`` records per rank into a fresh directory; the table gives both times,
their ratio, records per second and the issue's target (16,384 ranks x 2,000 records well under a
minute). Traces are deleted afterwards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synth_trace import generate  # noqa: E402

from megatrace.config import Layout  # noqa: E402
from megatrace.simulate import SimOptions, simulate_job, steps_for_records  # noqa: E402

TARGET_S = {16384: 60.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=16)
    p.add_argument("--records", type=int, default=2000)
    args = p.parse_args(argv)
    rows = []
    root = Path(tempfile.mkdtemp(prefix="megatrace-simbench-"))
    try:
        for ranks in args.ranks:
            dp = ranks // (args.tp * args.pp)
            layout = Layout(world_size=ranks, tp=args.tp, pp=args.pp, dp=dp, microbatches=4, layers_per_stage=2)
            steps = steps_for_records(layout, args.records, 4, 2)
            t = time.perf_counter()
            res = simulate_job(SimOptions(tp=args.tp, pp=args.pp, dp=dp, out=root / "sim", steps=steps,
                                          faults=(f"hang:rank={ranks // 2 + 3},step={steps - 2}",)))
            t_sim = time.perf_counter() - t
            shutil.rmtree(root / "sim")
            t = time.perf_counter()
            generate(root / "synth", ranks, args.tp, args.pp, args.records, 4, ranks // 2 + 3)
            t_base = time.perf_counter() - t
            shutil.rmtree(root / "synth")
            rows.append((ranks, res.records, t_sim, res.simulate_s, t_base))
            print(f"  {ranks} ranks: simulate {t_sim:.1f} s, baseline {t_base:.1f} s", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()
    print(f"\nmachine: {os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}\n")
    head = f"{'ranks':>6} {'records':>11} {'simulate s':>10} {'(events s)':>10} {'baseline s':>10} {'ratio':>6} " \
           f"{'records/s':>10}  target"
    print(head)
    print("-" * len(head))
    missed = 0
    for ranks, n, t_sim, t_events, t_base in rows:
        target = ""
        if ranks in TARGET_S:
            ok = t_sim < TARGET_S[ranks]
            missed += not ok
            target = f"< {TARGET_S[ranks]:g} s {'OK' if ok else 'MISSED'}"
        print(f"{ranks:>6} {n:>11,} {t_sim:>10.1f} {t_events:>10.1f} {t_base:>10.1f} {t_sim / t_base:>6.2f} "
              f"{n / t_sim:>10,.0f}  {target}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
