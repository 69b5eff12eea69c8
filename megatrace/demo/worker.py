"""One rank of the demo job: ``python -m megatrace.demo [--engine ENGINE] --steps 20 -o DIR``.

Rank and world come from RANK/WORLD_SIZE/LOCAL_RANK or, under srun, from the
SLURM_* variables (see :mod:`megatrace.demo.env`). The engine (:mod:`megatrace.demo.engines`)
decides the layout and the training loop; :mod:`megatrace.demo.runtime` does the rest. Output
under ``DIR``: ``metrics/rank-NNNNN.jsonl`` (one line per step) and ``logs/rank-NNNNN.heartbeat``
(rewritten at every phase, watched by the launcher).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatrace.config import ORDERS, SCHEDULES, Layout, LayoutError, save_layout
from megatrace.demo.engines import DEFAULT_ENGINE, ENGINES, check_engine_fault, engine_layout
from megatrace.demo.env import DistEnv, EnvError, resolve_env
from megatrace.demo.faults import FaultError, FaultSpec, parse_fault, validate_faults, write_fault_json
from megatrace.demo.inject import COLLECTIVE_OPS, P2P_OPS
from megatrace.demo.rendezvous import DEFAULT_TIMEOUT_S as DEFAULT_RENDEZVOUS_S
from megatrace.demo.rendezvous import RendezvousError
from megatrace.demo.runtime import Markers, Session
from megatrace.schedule import DP_MODES

DEFAULT_LAYERS_PER_STAGE = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatrace.demo", description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=ENGINES, default=DEFAULT_ENGINE,
                   help="the parallel API that trains the model (see megatrace.demo.engines)")
    p.add_argument("--tp", type=int, default=None, help="default: the engine's (3d and tp: 2)")
    p.add_argument("--pp", type=int, default=None, help="default: the engine's (3d: 2, pipeline: world size / dp)")
    p.add_argument("--dp", type=int, default=None, help="default: world size / (tp * pp)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=None, help="3d and pipeline only; default 4")
    p.add_argument("--layers-per-stage", type=int, default=DEFAULT_LAYERS_PER_STAGE,
                   help="blocks per pipeline stage (the whole model where there is no pipeline)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--order", choices=ORDERS, default="tp-dp-pp")
    p.add_argument("--dp-mode", choices=DP_MODES, default="allreduce")
    p.add_argument("--compute-ms", type=float, default=2.0)
    p.add_argument("--fault", action="append", default=[], metavar="SPEC", help="see megatrace.demo.faults")
    p.add_argument("--markers", action="store_true", help="call megatrace.step() / megatrace.phase()")
    p.add_argument("--comm-timeout", type=float, default=1800.0, help="gloo timeout in seconds")
    p.add_argument("--rendezvous-timeout", type=float, default=DEFAULT_RENDEZVOUS_S, metavar="SECONDS",
                   help="give up reaching MASTER_ADDR:MASTER_PORT after this long (a name that does not resolve: "
                        f"at once) [default: {DEFAULT_RENDEZVOUS_S:g}]")
    p.add_argument("-o", "--out", default=None, help="output directory [default: megatrace-demo-<job id>]")
    return p.parse_args(argv)


def configure(args: argparse.Namespace) -> tuple[DistEnv, Layout, list[FaultSpec], Path]:
    """Rank, layout, faults and output directory; raises EnvError, LayoutError or FaultError."""
    env = resolve_env(os.environ)
    layout = engine_layout(args.engine, env.world_size, tp=args.tp, pp=args.pp, dp=args.dp,
                           microbatches=args.microbatches, layers_per_stage=args.layers_per_stage,
                           order=args.order, schedule=args.schedule)
    faults = [parse_fault(s) for s in args.fault]
    for fault in faults:
        check_engine_fault(args.engine, fault)
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
    engine = ENGINES[args.engine]
    session = Session(env, layout, faults, out, Markers(args.markers), args.comm_timeout,
                      COLLECTIVE_OPS + P2P_OPS if engine.point_to_point else COLLECTIVE_OPS,
                      rendezvous_timeout_s=args.rendezvous_timeout)
    try:
        return engine.trainer()(session, args)
    except RendezvousError as exc:
        print(f"megatrace demo: error: {exc}", file=sys.stderr)
        return 3
