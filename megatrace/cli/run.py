"""``megatrace run`` (trace any command) and ``megatrace demo`` (a built-in training job, traced).

Imports only click and the light option tables at load time; the launcher (and torch, in the ranks) in the bodies.
"""

from __future__ import annotations

import os

import click

from megatrace.cli.settings import CONTEXT_SETTINGS, CommandError
from megatrace.config import ORDERS
from megatrace.demo.engines import DEFAULT_ENGINE, ENGINES


_ENGINES_HELP = "\b\nEngines (--engine; the sizes each one takes in brackets):\n" + "".join(
    f"  {e.name:<9} {e.summary} [{' '.join(e.sizes)}]\n" for e in ENGINES.values()) + "\n"


@click.command(context_settings={**CONTEXT_SETTINGS, "ignore_unknown_options": True},
               epilog="""\b
Examples:
  megatrace run -- python train.py
  megatrace run --dir /tmp/traces -- torchrun --nproc-per-node 8 train.py
""")
@click.option("--dir", "trace_dir", type=click.Path(file_okay=False), envvar="MEGATRACE_DIR",
              show_envvar=True, help="Directory for the ring files "
              "[default: /dev/shm/megatrace-<uid>/<job>.<step>/, node-local].")
@click.option("--ring-records", type=click.IntRange(16, 1 << 26), envvar="MEGATRACE_RING_RECORDS",
              show_envvar=True, default=65536, show_default=True,
              help="Records kept per rank (64 bytes each); older records are overwritten.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(trace_dir: str | None, ring_records: int, command: tuple[str, ...]) -> None:
    """Trace every torch.distributed call of COMMAND, with no change to it.

    Sets MEGATRACE_ENABLE=1 for COMMAND and every process it starts; each rank then
    writes its ring file when it calls init_process_group.
    """
    from megatrace.trace.launch import tracing_environment

    env = tracing_environment(os.environ, trace_dir=trace_dir, ring_records=ring_records)
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as exc:
        raise CommandError(f"cannot run {command[0]!r}: {exc.strerror}") from None


@click.command(context_settings=CONTEXT_SETTINGS, epilog=_ENGINES_HELP + """\b
Fault specs (steps count from 0; slowlink: 3d and pipeline only):
  hang:rank=R,step=S[,phase=forward|backward|optimizer]   rank stops before its next collective
  commhang:rank=R,step=S                                   rank enters a collective, never returns
  slow:rank=R,factor=F[,from_step=S]                       rank computes F times slower
  crash:rank=R,step=S                                      rank exits with status 1
  slowlink:ranks=A-B,delay_ms=D                            p2p between adjacent stages A, B is late
\b
Examples:
  megatrace demo
  megatrace demo --ranks 8 --tp 2 --pp 2 --steps 20 --fault hang:rank=5,step=3 -o /tmp/demo
  megatrace demo --ranks 4 --tp 1 --pp 2 --fault slowlink:ranks=0-2,delay_ms=50
  megatrace demo --engine ddp --ranks 4 --fault commhang:rank=2,step=5
  megatrace demo --engine tp --ranks 4 --tp 2 --fault slow:rank=1,factor=3
  megatrace demo --engine pipeline --ranks 4 --microbatches 8 --fault hang:rank=2,step=3,phase=backward
  megatrace demo --engine pipeline --pp 2 --dp 2 --fault slow:rank=1,factor=2
""")
@click.option("--engine", type=click.Choice(list(ENGINES)), default=DEFAULT_ENGINE, show_default=True,
              help="The parallel API that trains the model (see below).")
@click.option("--ranks", type=click.IntRange(1), default=None,
              help="World size [default: 8 for 3d, else 4; or the product of the sizes given].")
@click.option("--tp", type=click.IntRange(1), default=None, help="Tensor-parallel size (3d, tp) [default: 2].")
@click.option("--pp", type=click.IntRange(1), default=None,
              help="Pipeline-parallel size (3d [default: 2]; pipeline: ranks / dp).")
@click.option("--dp", type=click.IntRange(1), default=None, help="Data-parallel size [default: ranks/(tp*pp)].")
@click.option("--order", type=click.Choice(ORDERS),
              default="tp-dp-pp", show_default=True,
              help="Rank order of the 3d engine, fastest-varying dimension first (Megatron-LM's default).")
@click.option("--steps", type=click.IntRange(1), default=20, show_default=True, help="Training steps.")
@click.option("--microbatches", type=click.IntRange(1), default=None,
              help="Microbatches per step of the 1F1B schedule (3d, pipeline) [default: 4].")
@click.option("--fault", "faults", multiple=True, metavar="SPEC", help="Inject a fault (repeatable; see below).")
@click.option("-o", "--out", type=click.Path(file_okay=False), default=None,
              help="Output directory [default: ./megatrace-demo-<timestamp>].")
@click.option("--no-trace", is_flag=True, help="Run without the tracer (benchmarks).")
@click.option("--markers", is_flag=True, help="Record step and phase markers (megatrace.step/phase).")
@click.option("--compute-ms", type=click.FloatRange(0), default=2.0, show_default=True,
              help="Compute padding per forward (backward: twice this).")
@click.option("--dp-mode", type=click.Choice(["allreduce", "reduce-scatter"]), default="allreduce",
              show_default=True, help="Gradient averaging over the DP group (3d).")
@click.option("--stall-timeout", type=click.FloatRange(0.5), default=10.0, show_default=True,
              help="Kill every rank after this many seconds without progress.")
@click.option("--deadline", type=click.FloatRange(1), default=None,
              help="Kill every rank after this many seconds [default: 60 + 2 per step].")
def demo(engine: str, ranks: int | None, tp: int | None, pp: int | None, dp: int | None, order: str, steps: int,
         microbatches: int | None, faults: tuple[str, ...], out: str | None, no_trace: bool, markers: bool,
         compute_ms: float, dp_mode: str, stall_timeout: float, deadline: float | None) -> None:
    """Run a built-in parallel training job on this host, optionally with injected faults.

    A real training loop on torch gloo (CPU), one process per rank, traced like any
    other job: the hand-written 3D job, or PyTorch's own DDP, FSDP2, DTensor tensor
    parallelism or pipelining (--engine). A hung run is killed after --stall-timeout
    seconds without progress. Exits 0 when the run succeeds or a fault was injected.
    """
    from pathlib import Path

    from megatrace.config import LayoutError
    from megatrace.demo.faults import FaultError
    from megatrace.demo.launcher import DemoOptions, build_layout, default_out_dir, run_local, summary_lines

    opts = DemoOptions(engine=engine, ranks=ranks, tp=tp, pp=pp, dp=dp, order=order, steps=steps,
                       microbatches=microbatches, faults=faults, out=Path(out) if out else default_out_dir(),
                       trace=not no_trace, markers=markers, compute_ms=compute_ms, dp_mode=dp_mode,
                       stall_s=stall_timeout, deadline_s=deadline)
    try:
        layout = build_layout(opts)
    except (LayoutError, FaultError) as exc:
        raise CommandError(str(exc)) from None
    click.echo(f"demo: {engine} engine, {layout.world_size} ranks (TP{layout.tp} x PP{layout.pp} x DP{layout.dp}), "
               f"{steps} steps -> {opts.out}", err=True)
    result = run_local(opts, log=lambda msg: click.echo(msg, err=True))
    click.echo("\n".join(summary_lines(result)))
    if not result.ok and not faults:
        raise CommandError(f"the demo failed without an injected fault: see {result.out / 'logs'}")
