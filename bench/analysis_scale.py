"""Analysis time and peak memory at scale, full mode against quick (hang-only) mode, with the targets.

    python bench/analysis_scale.py [--ranks 1024 4096 16384] [--tp 8] [--pp 8] [--records 2000]
                                   [--repeat 3] [-o DIR] [--keep]

For every scale it writes a synthetic hung trace (``bench/synth_trace.py``: TP x PP x DP, about
``--records`` records per rank, one rank stopped in the last step), then runs ``analyze(DIR)`` and
``analyze(DIR, mode="hang")`` each in a fresh Python process (peak RSS is that process's), ``--repeat``
times each, and prints one table: the best time of each mode, their ratio, the peak RSS, whether both
name the same culprit, then the full analysis's report (render time, report.html and trace.json sizes),
and the targets (hang localisation within 1 s at 4,096 ranks and within 10 s at 16,384 ranks, peak memory
under 4 GiB; the full analysis within 3 s at 4,096 ranks and within 12 s and 2 GiB at 16,384) marked OK or
MISSED. Each child process is tuned as ``megatrace analyze`` is (``analyze/heap.py``: freed memory kept, no
cyclic garbage collection).
At 4,096 and 16,384 ranks the last table times the commands as a user types them, whole processes
(``bench/analyze_command.py``; ``--no-command`` leaves it out). The machine's load is printed too: on a
shared machine, times vary from run to run.

Disk: about 135 KB per rank (16,384 ranks: 2.2 GB). Traces are removed afterwards unless ``--keep``;
with ``-o DIR`` a trace already there with the same parameters is reused.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import analyze_command  # noqa: E402
from synth_trace import generate  # noqa: E402

TARGET_S = {4096: 1.0, 16384: 10.0}  # hang localisation (quick mode), seconds
TARGET_FULL = {4096: (3.0, None), 16384: (12.0, 2048)}  # full analysis in one process: seconds, peak MiB
TARGET_RSS_MIB = 4096  # peak memory, both modes
TARGET_REPORT_MB = 5.0  # report.html at 16,384 ranks

CHILD = r"""
import json, resource, sys, time
from megatrace.analyze.engine import analyze
from megatrace.analyze.heap import tuned_for_analysis
with tuned_for_analysis():  # as `megatrace analyze` runs it
    c, t = time.process_time(), time.perf_counter()
    r = analyze(sys.argv[1], mode=sys.argv[2])
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    top = r.findings[0]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = {}
    if sys.argv[2] == "full":  # the report of the full analysis: render time and size (HTML + trace.json)
        import os, tempfile
        from megatrace.report.render import write_report
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            html, trace = write_report(r.document(), os.path.join(tmp, "report.html"))
            report = {"report_s": time.perf_counter() - t, "report_bytes": os.path.getsize(html),
                      "trace_bytes": os.path.getsize(trace) if trace else 0,
                      "report_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print(json.dumps({"time": wall, "cpu": cpu, "timings": r.timings, "rss_mib": rss, "verdict": top.verdict, "kind": top.kind.value,
                      "culprit": [top.subject.rank, list(top.subject.ranks)], "records": len(r.trace.records), **report}))
"""


def run_mode(trace: Path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(trace), mode], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def best_of(trace: Path, mode: str, repeat: int) -> dict:
    runs = [run_mode(trace, mode) for _ in range(repeat)]
    best = min(runs, key=lambda r: r["time"])
    best["times"] = [r["time"] for r in runs]
    best["rss_mib"] = max(r["rss_mib"] for r in runs)
    return best


def prepare(root: Path, ranks: int, tp: int, pp: int, records: int, hang: int) -> Path:
    trace = root / f"ranks-{ranks}"
    params = {"ranks": ranks, "tp": tp, "pp": pp, "records": records, "hang": hang}
    stamp = trace / "bench-params.json"
    if stamp.exists() and json.loads(stamp.read_text()) == params:
        print(f"  reusing {trace}", file=sys.stderr)
        return trace
    if trace.exists():
        shutil.rmtree(trace)
    t = time.perf_counter()
    generate(trace, ranks, tp, pp, records, 4, hang)
    stamp.write_text(json.dumps(params))
    print(f"  generated {ranks} ranks in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return trace


def mark(ok: bool) -> str:
    return "OK" if ok else "MISSED"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--records", type=int, default=2000, help="records per rank (about)")
    p.add_argument("--repeat", type=int, default=3, help="runs per mode and scale; the best time counts")
    p.add_argument("--full-repeat", type=int, default=1, help="runs of the (slow) full mode per scale")
    p.add_argument("-o", "--out", type=Path, default=None, help="where the traces go (reused when present)")
    p.add_argument("--keep", action="store_true", help="keep the generated traces")
    p.add_argument("--no-command", action="store_true",
                   help="skip the last table: `megatrace analyze` as typed, at 4,096 and 16,384 ranks")
    args = p.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="megatrace-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    commands: list[analyze_command.CommandRow] = []
    try:
        for ranks in args.ranks:
            hang = 1234 % ranks
            print(f"{ranks} ranks (TP{args.tp} PP{args.pp}, ~{args.records} records per rank, rank {hang} hangs)",
                  file=sys.stderr)
            trace = prepare(root, ranks, args.tp, args.pp, args.records, hang)
            full = best_of(trace, "full", args.full_repeat)
            quick = best_of(trace, "hang", args.repeat)
            rows.append((ranks, full, quick))
            print(f"  full {full['time']:.2f} s, quick {min(quick['times']):.2f} s "
                  f"({', '.join(f'{t:.2f}' for t in quick['times'])})", file=sys.stderr)
            if not args.no_command and ranks in analyze_command.TARGET_VERDICT_S:
                if not commands:
                    print(f"  bytecode of {analyze_command.compile_package()} written where missing or stale "
                          "(as an install does)", file=sys.stderr)
                simulated = analyze_command.simulated(root, ranks)
                for kind, where in (("bench", trace), ("simulate", simulated)):
                    commands.append(analyze_command.measure(ranks, kind, where, root / f"out-{kind}-{ranks}",
                                                            args.repeat))
                if not args.keep and args.out is None:
                    shutil.rmtree(simulated)
            if not args.keep and args.out is None:
                shutil.rmtree(trace)
    finally:
        if not args.keep and args.out is None:
            shutil.rmtree(root, ignore_errors=True)

    load = os.getloadavg()
    print(f"\nmachine: {os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
          f"times: best of {args.full_repeat} (full) and {args.repeat} (quick) fresh processes\n")
    head = (f"{'ranks':>6} {'records':>11} {'full s':>7} {'quick s':>8} {'quick cpu s':>11} {'quick/full':>10} "
            f"{'full MiB':>9} {'quick MiB':>9} {'same culprit':>12}  targets")
    print(head)
    print("-" * len(head))
    missed = 0
    for ranks, full, quick in rows:
        targets = []
        if ranks in TARGET_S:
            ok = quick["time"] <= TARGET_S[ranks]
            missed += not ok
            targets.append(f"quick <= {TARGET_S[ranks]:g} s {mark(ok)}")
        ok = max(full["rss_mib"], quick["rss_mib"]) < TARGET_RSS_MIB
        missed += not ok
        targets.append(f"memory < 4 GiB {mark(ok)}")
        if ranks in TARGET_FULL:
            limit_s, limit_mib = TARGET_FULL[ranks]
            ok = full["time"] <= limit_s
            missed += not ok
            targets.append(f"full <= {limit_s:g} s {mark(ok)}")
            if limit_mib is not None:
                ok = full["rss_mib"] <= limit_mib
                missed += not ok
                targets.append(f"full <= {limit_mib / 1024:g} GiB {mark(ok)}")
        same = (full["kind"], full["culprit"]) == (quick["kind"], quick["culprit"])
        missed += not same
        print(f"{ranks:>6} {full['records']:>11,} {full['time']:>7.2f} {quick['time']:>8.2f} {quick['cpu']:>11.2f} "
              f"{quick['time'] / full['time']:>10.3f} {full['rss_mib']:>9.0f} {quick['rss_mib']:>9.0f} "
              f"{'yes' if same else 'NO':>12}  {'; '.join(targets)}")
    print()
    for ranks, full, quick in rows:
        stages = ", ".join(f"{k} {v:.2f}" for k, v in quick["timings"].items() if k != "total")
        print(f"{ranks:>6} quick stages (s): {stages}")
    for ranks, full, _ in rows:
        stages = ", ".join(f"{k} {v:.2f}" for k, v in full["timings"].items() if k != "total")
        print(f"{ranks:>6} full stages (s): {stages}")
    print(f"\n{'ranks':>6} {'report s':>9} {'report.html MB':>15} {'trace.json MB':>14} {'peak MiB':>9}  target "
          "(peak: the full analysis and its report in one process)")
    for ranks, full, _ in rows:
        mb = full.get("report_bytes", 0) / 1e6
        ok = ranks != 16384 or mb <= TARGET_REPORT_MB
        missed += not ok
        print(f"{ranks:>6} {full.get('report_s', 0):>9.2f} {mb:>15.2f} {full.get('trace_bytes', 0) / 1e6:>14.2f} "
              f"{full.get('report_rss_mib', 0):>9.0f}  "
              + (f"<= {TARGET_REPORT_MB:g} MB at 16,384 ranks {mark(ok)}" if ranks == 16384 else ""))
    if commands:
        missed += analyze_command.print_table(commands, analyze_command.import_floor_s(args.repeat))
    print(f"\nverdict ({rows[-1][0]} ranks, quick): {rows[-1][2]['verdict']}" if rows else "")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
