"""Tracer overhead, traced vs untraced in the same run.

    python bench/tracer_overhead.py [--calls 2000] [--rounds 15] [--demo-steps 20] [--skip-demo]

Prints three tables:
1. the tracer's own cost per call, on each path a call takes (precise; no communication noise):
   - a CPU call issued from C++ (DDP's gradient buckets, functional collectives: the ``ddp`` and
     ``tp`` engines): the c10d dispatcher hook alone, on torch's own fake backend (it returns at
     once), ``ProcessGroup.allreduce`` with the hook installed vs without;
   - a CPU call of the ``torch.distributed`` functions (FSDP, pipelining, the ``3d`` demo, scripts):
     the Python wrapper stepping aside plus the hook, ``dist.all_reduce`` on the fake backend vs the
     original function without the hook;
   - a device (NCCL) call where the c10d hook is not built (with it, device calls take the hook's CUDA
     kernels): the Python wrapper around a no-op with all_reduce's signature vs the no-op itself;
2. small gloo all-reduces between two real processes, traced (hook and wrapper) vs the original
   torch function without the hook, in blocks whose order rotates each round, with an A/A control
   (the untraced block again) that shows what the machine's noise alone makes of the comparison;
3. the demo job's median step wall time and CPU time, traced vs untraced (runs in
   ABBA order), and how much the untraced runs alone differ (the noise floor).
Targets (issue "Foundation"): at most 2 µs added per call, at most 1 % on the
demo step time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TARGET_US_PER_CALL = 2.0
TARGET_STEP_RATIO = 1.01


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_cost(calls: int, rounds: int) -> tuple[float, float, bool]:
    """Median ns per call of the traced wrapper around a no-op vs the no-op, over interleaved rounds."""
    import torch

    from megatrace.trace import torch_hook
    from megatrace.trace.ring_writer import RingIdentity, RingWriter

    def noop(tensor, op=None, group=None, async_op=False):  # all_reduce's signature
        return None

    tracer = torch_hook.Tracer()
    with tempfile.TemporaryDirectory() as tmp:
        tracer.torch = torch
        tracer.writer = RingWriter(tmp, RingIdentity(rank=0, world_size=1), capacity=1 << 16)
        native = tracer.writer.native
        gt = torch_hook.GroupTrace(1, (0,))
        tracer.groups[None] = gt
        traced = torch_hook._make_wrapper("all_reduce", noop, torch_hook.OP_SPECS["all_reduce"], tracer,
                                          torch_hook._dtype_codes(torch))
        t = torch.ones(16)
        base, wrapped = [], []
        for _ in range(rounds):
            for fn, out in ((noop, base), (traced, wrapped)):
                start = time.perf_counter_ns()
                for _ in range(calls):
                    fn(t)
                out.append((time.perf_counter_ns() - start) / calls)
        tracer.writer.close()
    return statistics.median(base), statistics.median(wrapped), native


def _hook_paths_worker(calls: int, rounds: int, out: str) -> None:
    """In a process of its own (the hook is process-wide): the two CPU paths on torch's fake backend."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatrace.trace import dispatch_hook, torch_hook

    torch.set_num_threads(1)
    torch_hook.install()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    tracer = torch_hook.TRACER
    if not tracer.cpu_native:
        Path(out).write_text(json.dumps({"error": "the c10d hook is not attached (see the tracer's warning)"}))
        return
    rows, _ = dispatch_hook.spec_rows(torch)
    pg, t, tl = dist.group.WORLD, torch.ones(16), [torch.ones(16)]
    api, original = dist.all_reduce, dist.all_reduce.__wrapped__
    results: dict[str, list[float]] = {k: [] for k in ("cpp_base", "cpp_hook", "api_base", "api_hook")}
    installed = True
    for i in range(rounds):
        for hooked in ((False, True) if i % 2 == 0 else (True, False)):
            if hooked != installed:
                tracer.hook.install(rows) if hooked else tracer.hook.uninstall()
                installed = hooked
            for name, fn, arg in (("cpp", pg.allreduce, tl), ("api", api if hooked else original, t)):
                start = time.perf_counter_ns()
                for _ in range(calls):
                    fn(arg)
                results[f"{name}_{'hook' if hooked else 'base'}"].append((time.perf_counter_ns() - start) / calls)
    Path(out).write_text(json.dumps(results))


def hook_paths_cost(calls: int, rounds: int) -> dict[str, float] | str:
    """Median ns per call of both CPU paths, untraced and traced; or why it could not be measured."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ, MEGATRACE_ENABLE="0", MEGATRACE_DIR=os.path.join(tmp, "rings"), OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, __file__, "--hook-worker", "--calls", str(calls), "--rounds",
                               str(rounds), "--out", out], env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            return f"the fake-backend worker failed: {proc.stderr.strip()[-500:]}"
        res = json.loads(Path(out).read_text())
    if "error" in res:
        return res["error"]
    return {k: statistics.median(v) for k, v in res.items()}


def _allreduce_worker(rank: int, calls: int, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatrace.trace import torch_hook

    from megatrace.trace import dispatch_hook

    torch.set_num_threads(1)
    torch_hook.install()
    dist.init_process_group("gloo")
    hook = torch_hook.TRACER.hook if torch_hook.TRACER.cpu_native else None
    rows, _ = dispatch_hook.spec_rows(torch)
    traced = dist.all_reduce
    original = traced.__wrapped__
    t = torch.ones(16)
    for _ in range(200):  # warm up connections and the ring's pages
        traced(t)
        original(t)
    # Three blocks per round, their order rotated (each kind first, second and last equally often): the
    # traced block, the untraced one, and the untraced one again, an A/A control that shows what this
    # machine's noise alone makes of the same comparison.
    kinds = ("untraced", "traced", "again")
    results: dict[str, list[float]] = {k: [] for k in kinds}
    installed = True
    for i in range(rounds):
        order = kinds[i % 3:] + kinds[:i % 3]
        for name in (order if (i // 3) % 2 == 0 else order[::-1]):
            if hook is not None and (name == "traced") != installed:
                hook.install(rows) if name == "traced" else hook.uninstall()
                installed = name == "traced"
            fn = traced if name == "traced" else original
            original(t)  # line both ranks up before timing
            start = time.perf_counter_ns()
            for _ in range(calls):
                fn(t)
            results[name].append((time.perf_counter_ns() - start) / calls)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


@dataclass
class PairCost:
    """ns per 16-float gloo all_reduce: medians of the blocks, and per round the traced block minus the
    untraced one (``added``) and the untraced one again minus the untraced one (``control``)."""

    untraced: float
    traced: float
    added: list[float]
    control: list[float]


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[-1]


def allreduce_cost(calls: int, rounds: int) -> PairCost:
    """16-float gloo all_reduces between two processes: traced, untraced, and untraced again (A/A)."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), MEGATRACE_ENABLE="0", MEGATRACE_DIR=os.path.join(tmp, "rings"),
                       OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(rank), "--calls",
                                           str(calls), "--rounds", str(rounds), "--out", out], env=env))
        codes = [p.wait(timeout=600) for p in procs]
        if any(codes):
            raise SystemExit(f"all_reduce workers failed with exit codes {codes}")
        res = json.loads(Path(out).read_text())
    base = res["untraced"]
    return PairCost(statistics.median(base), statistics.median(res["traced"]),
                    [t - b for t, b in zip(res["traced"], base)], [a - b for a, b in zip(res["again"], base)])


def _step_metric(out: Path, key: str, skip: int) -> list[float]:
    """One metric (``step_time_s``, ``cpu_s``) of every rank's steps after the first ``skip`` warm-up steps."""
    values = []
    for path in sorted((out / "metrics").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry["step"] >= skip:
                values.append(entry[key])
    return values


@dataclass
class DemoTimes:
    """Medians over every rank-step of all runs of one kind, and each run's own median wall time."""

    wall_s: float
    cpu_s: float
    run_walls: list[float]
    calls_per_step: float = 0.0  # traced calls per rank and step (the traced runs' rings)


def demo_step_times(steps: int, repeats: int) -> dict[bool, DemoTimes]:
    """The 8-rank TP2·PP2·DP2 demo, untraced and traced, in ABBA order.

    A run is slower by a few percent just for coming first in a back-to-back pair on a small
    machine, so the order alternates and that bias cancels out."""
    from megatrace.demo.launcher import DemoOptions, run_local

    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    runs: dict[bool, list[float]] = {False: [], True: []}
    calls: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for trace in ((False, True) if i % 2 == 0 else (True, False)):
                out = Path(tmp) / f"run{i}-{'traced' if trace else 'untraced'}"
                done = len(runs[False]) + len(runs[True])
                print(f"  demo run {done + 1}/{2 * repeats} "
                      f"({'traced' if trace else 'untraced'})", file=sys.stderr, flush=True)
                result = run_local(DemoOptions(tp=2, pp=2, dp=2, steps=steps, out=out, trace=trace))
                if not result.ok:
                    raise SystemExit(f"demo run failed: {result.message}")
                if trace:
                    calls.append(_calls_per_step(out, steps))
                times = _step_metric(out, "step_time_s", skip=2)
                wall[trace].extend(times)
                cpu[trace].extend(_step_metric(out, "cpu_s", skip=2))
                runs[trace].append(statistics.median(times))
    return {t: DemoTimes(statistics.median(wall[t]), statistics.median(cpu[t]), runs[t],
                         statistics.median(calls) if t and calls else 0.0) for t in (False, True)}


def _calls_per_step(out: Path, steps: int) -> float:
    """Records each rank wrote per training step (its ring's write counter over the steps)."""
    from megatrace.trace.ring_reader import read_ring

    counters = [read_ring(p).header.write_counter for p in sorted((out / "rings").glob("rank-*.ring"))]
    return statistics.mean(counters) / steps if counters else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--demo-steps", type=int, default=20)
    parser.add_argument("--demo-repeats", type=int, default=4)
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hook-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _allreduce_worker(args.worker, args.calls, args.rounds, args.out)
        return
    if args.hook_worker:
        _hook_paths_worker(args.calls, args.rounds, args.out)
        return

    print("MegaTrace tracer overhead (medians; baseline measured in this run)\n")
    base, traced, native = isolated_cost(args.calls * 10, args.rounds)
    device_us = (traced - base) / 1000
    print(f"ring writer: {'C hot path' if native else 'pure Python (C hot path not built)'}")
    print(f"{'measurement':52} {'untraced':>12} {'traced':>12} {'added':>10} {'ratio':>7}  target")

    def line(label: str, b: float, t: float) -> float:
        added = (t - b) / 1000
        print(f"{label:52} {b / 1000:10.2f}µs {t / 1000:10.2f}µs {added:8.2f}µs {t / b:7.2f}  "
              f"≤{TARGET_US_PER_CALL} µs added {'OK' if added <= TARGET_US_PER_CALL else 'MISSED'}")
        return added

    paths = hook_paths_cost(args.calls * 5, args.rounds)
    per_call_us = device_us
    if isinstance(paths, str):
        print(f"{'CPU calls (c10d hook)':52} not measured: {paths}")
    else:
        line("CPU call from C++ (engines ddp, tp): hook", paths["cpp_base"], paths["cpp_hook"])
        per_call_us = line("CPU torch.distributed call (fsdp, pipeline, 3d): both", paths["api_base"],
                           paths["api_hook"])
    line("device (NCCL) call: Python wrapper, no-op op", base, traced)
    pair = allreduce_cost(args.calls, max(args.rounds, 6))
    lo, added, hi = (x / 1000 for x in _quartiles(pair.added))
    clo, control, chi = (x / 1000 for x in _quartiles(pair.control))
    resolved = hi - lo <= 2 * TARGET_US_PER_CALL  # the blocks agree well enough to see the target at all
    verdict = ("OK" if added <= TARGET_US_PER_CALL else "MISSED") if resolved else "below this machine's resolution"
    print(f"{'gloo all_reduce, 16 floats, 2 ranks (rotated blocks)':52} {pair.untraced / 1000:10.2f}µs "
          f"{pair.traced / 1000:10.2f}µs {added:8.2f}µs {pair.traced / pair.untraced:7.3f}  {verdict}")
    print(f"{'  per round, traced minus untraced: quartiles':52} {lo:10.2f}µs {hi:10.2f}µs")
    print(f"{'  per round, untraced again minus untraced (A/A)':52} {clo:10.2f}µs {chi:10.2f}µs {control:8.2f}µs")
    if not args.skip_demo:
        demo = demo_step_times(args.demo_steps, args.demo_repeats)
        base, traced = demo[False], demo[True]
        for label, b, t in (("demo step wall time, 8 ranks TP2·PP2·DP2", base.wall_s, traced.wall_s),
                            ("demo step CPU time per rank (all threads)", base.cpu_s, traced.cpu_s)):
            ratio = t / b
            print(f"{label:52} {b * 1e3:10.2f}ms {t * 1e3:10.2f}ms {(t - b) * 1e3:8.2f}ms {ratio:7.3f}  "
                  f"≤{TARGET_STEP_RATIO:.2f}× {'OK' if ratio <= TARGET_STEP_RATIO else 'MISSED (see noise note)'}")
        implied = traced.calls_per_step * per_call_us * 1e-6 / base.wall_s  # the isolated per-call cost
        print(f"{'the tracer own work per demo step':52} {'':>12} {traced.calls_per_step * per_call_us:10.2f}µs "
              f"{'':>10} {1 + implied:7.5f}  ≤{TARGET_STEP_RATIO:.2f}× "
              f"{'OK' if 1 + implied <= TARGET_STEP_RATIO else 'MISSED'}  "
              f"({traced.calls_per_step:.1f} calls per rank and step × {per_call_us:.2f} µs)")
        runs = base.run_walls
        spread = (max(runs) - min(runs)) / statistics.median(runs)
        print(f"\nNoise floor: the {len(runs)} untraced demo runs alone differ by {spread:.1%} in median step "
              f"wall time (fastest {min(runs) * 1e3:.1f} ms, slowest {max(runs) * 1e3:.1f} ms).")
    print("\nThe gloo pair: the A/A line compares the untraced call with itself, in the same rotated blocks; "
          "a traced-minus-untraced median inside the A/A quartiles is this machine's noise, not the tracer. "
          "Where the quartiles are wider than the target, the pair cannot resolve it, and the lines above "
          "(the hook and the wrapper timed alone) are the measurement.")
    print("\nNoise note: the first line isolates the tracer, and 'the tracer own work per demo step' multiplies it "
          "by the calls each rank makes per step. The demo lines include the machine's scheduling jitter: 8 "
          "ranks on fewer cores are oversubscribed, gloo spins while it waits (CPU time follows waiting), "
          "and the untraced runs alone differ by the noise floor above, far more than the tracer costs.")

if __name__ == "__main__":
    main()
