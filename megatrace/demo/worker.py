"""One rank of the demo job: ``python -m megatrace.demo --tp 2 --pp 2 --dp 2 --steps 20 -o DIR``.

Rank and world come from RANK/WORLD_SIZE/LOCAL_RANK or, under srun, from the
SLURM_* variables (see :mod:`megatrace.demo.env`). Output under ``DIR``:
``metrics/rank-NNNNN.jsonl`` (one line per step) and ``logs/rank-NNNNN.heartbeat``
(rewritten before every forward/backward, watched by the launcher).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import megatrace
from megatrace.config import ORDERS, SCHEDULES, Layout, LayoutError, save_layout
from megatrace.demo.env import DistEnv, EnvError, resolve_env
from megatrace.demo.faults import FaultError, FaultSpec, parse_fault, validate_faults, write_fault_json
from megatrace.schedule import DP_MODES, schedule_for

DEFAULT_LAYERS_PER_STAGE = 2
LR = 0.1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatrace.demo", description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=None, help="default: world size / (tp * pp)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers-per-stage", type=int, default=DEFAULT_LAYERS_PER_STAGE)
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--order", choices=ORDERS, default="tp-dp-pp")
    p.add_argument("--dp-mode", choices=DP_MODES, default="allreduce")
    p.add_argument("--compute-ms", type=float, default=2.0)
    p.add_argument("--fault", action="append", default=[], metavar="SPEC", help="see megatrace.demo.faults")
    p.add_argument("--markers", action="store_true", help="call megatrace.step() / megatrace.phase()")
    p.add_argument("--comm-timeout", type=float, default=1800.0, help="gloo timeout in seconds")
    p.add_argument("-o", "--out", default=None, help="output directory [default: megatrace-demo-<job id>]")
    return p.parse_args(argv)


FR_DUMP_ENV = "MEGATRACE_DEMO_FR_DUMP"  # opt-in: write PyTorch Flight Recorder dumps (needs TORCH_FR_BUFFER_SIZE)
FR_DUMP_PERIOD_S = 1.0


def start_fr_dumps(directory: Path, rank: int) -> None:
    """Write this rank's Flight Recorder dump to ``directory/fr_rank_<R>`` every second and at exit.

    Test data for :mod:`megatrace.analyze.importers.flight_recorder`, named like torch's own dumps
    (prefix + rank, no suffix) so that ``torchfrtrace`` reads them too. gloo's watchdog does not
    dump, so a daemon thread does; a rank that hangs, in Python or inside a gloo call, leaves a dump
    at most a second old. Without stack traces: with them, ``_dump_fr_trace()`` from a second
    thread deadlocks against the main thread recording a collective (torch 2.13, gloo).
    """
    import atexit
    import threading

    import torch

    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"fr_rank_{rank}"

    def dump() -> None:
        tmp = target.with_name(target.name + ".tmp")
        try:
            tmp.write_bytes(torch._C._distributed_c10d._dump_fr_trace(True, False, False))
            os.replace(tmp, target)
        except (OSError, RuntimeError) as exc:  # a dump is a diagnostic: never stop training for it
            print(f"megatrace demo: flight recorder dump failed: {exc}", file=sys.stderr)

    def loop() -> None:
        while True:
            time.sleep(FR_DUMP_PERIOD_S)
            dump()

    threading.Thread(target=loop, name="fr-dump", daemon=True).start()
    atexit.register(dump)


class Markers:
    """megatrace.step()/phase() when asked for and available; silent no-ops otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def _call(self, fn: Callable[[], None]) -> None:
        if self.enabled:
            try:
                fn()
            except ImportError:
                print("megatrace demo: marker API not available; markers off", file=sys.stderr)
                self.enabled = False

    def step(self, n: int) -> None:
        self._call(lambda: megatrace.step(n))

    def phase(self, name: str, microbatch: int | None = None) -> None:
        self._call(lambda: megatrace.phase(name, microbatch=microbatch))


def configure(args: argparse.Namespace) -> tuple[DistEnv, Layout, list[FaultSpec], Path]:
    """Rank, layout, faults and output directory; raises EnvError, LayoutError or FaultError."""
    env = resolve_env(os.environ)
    dp = args.dp if args.dp is not None else env.world_size // max(args.tp * args.pp, 1)
    layout = Layout(world_size=env.world_size, tp=args.tp, pp=args.pp, dp=dp, microbatches=args.microbatches,
                    schedule=args.schedule, order=args.order, layers_per_stage=args.layers_per_stage).validate()
    faults = [parse_fault(s) for s in args.fault]
    validate_faults(faults, layout, args.steps)
    out = Path(args.out or f"megatrace-demo-{os.environ.get('SLURM_JOB_ID', 'local')}")
    for sub in ("logs", "metrics"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    if env.under_slurm and env.rank == 0 and not (out / "layout.yaml").exists():
        save_layout(layout, out / "layout.yaml")  # no launcher under srun: rank 0 records the ground truth
        write_fault_json(out / "fault.json", faults)
    return env, layout, faults, out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        env, layout, faults, out = configure(args)
    except (EnvError, LayoutError, FaultError) as exc:
        print(f"megatrace demo: error: {exc}", file=sys.stderr)
        return 2
    return train(args, env, layout, faults, out)


def train(args: argparse.Namespace, env: DistEnv, layout: Layout, faults: list[FaultSpec], out: Path) -> int:
    """The training loop of this rank."""
    name = f"rank-{env.rank:05d}"
    heartbeat = out / "logs" / f"{name}.heartbeat"

    import torch
    import torch.distributed as dist

    from megatrace.demo.comm import Comm, create_groups
    from megatrace.demo.inject import FaultInjector
    from megatrace.demo.model import MomentumSGD, build_stage
    from megatrace.demo.pipeline import StageRunner

    torch.set_num_threads(1)
    torch.manual_seed(0)
    os.environ.update(MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port),
                      RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank))
    timeout = timedelta(seconds=args.comm_timeout)
    injector = FaultInjector(faults, env.rank, layout)
    injector.install()  # before the process group, so the tracer's hook goes in front of it
    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size, timeout=timeout)
    if os.environ.get(FR_DUMP_ENV):
        start_fr_dumps(Path(os.environ[FR_DUMP_ENV]), env.rank)
    groups = create_groups(layout, env.rank, timeout)
    comm = Comm(layout, groups, injector.before_comm)
    coords = layout.coords(env.rank)
    model = build_stage(coords.pp, args.layers_per_stage, coords.tp, layout.tp, comm)
    params = list(model.parameters())
    optimizer = MomentumSGD(params, lr=LR)
    markers = Markers(args.markers)

    def on_action(phase: str, microbatch: int) -> None:
        injector.set_phase(phase)
        markers.phase(phase, microbatch=microbatch)
        heartbeat.write_text(f"step={injector.step} phase={phase} microbatch={microbatch}\n")

    pp_ranks = layout.group_of("pp", env.rank)
    runner = StageRunner(model, comm,
                         prev=pp_ranks[coords.pp - 1] if coords.pp > 0 else None,
                         next=pp_ranks[coords.pp + 1] if coords.pp < layout.pp - 1 else None,
                         dp_rank=coords.dp, compute_ms=args.compute_ms, slowdown=injector.slowdown,
                         on_action=on_action)
    actions = schedule_for(layout, coords.pp)
    heartbeat.write_text("ready\n")
    with open(out / "metrics" / f"{name}.jsonl", "w", buffering=1) as metrics:
        for step in range(args.steps):
            start, cpu_start = time.perf_counter(), time.process_time()
            injector.start_step(step)
            markers.step(step)
            stats = runner.run(step, actions)
            injector.set_phase("optimizer")
            markers.phase("optimizer")
            heartbeat.write_text(f"step={step} phase=optimizer\n")
            comm.average_gradients(params, args.dp_mode)
            optimizer.step()
            injector.end_step()
            record = {"step": step, "step_time_s": round(time.perf_counter() - start, 6),
                      "compute_s": round(stats.compute_s, 6),
                      "cpu_s": round(time.process_time() - cpu_start, 6)}  # this process, all its threads
            if stats.loss is not None:
                record["loss"] = stats.loss
            metrics.write(json.dumps(record) + "\n")
    heartbeat.write_text("done\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0
