"""``megatrace simulate``: the command (imports only click at load time; the simulation, and numpy, in the body)."""

from __future__ import annotations

import click

from megatrace.cli.settings import CONTEXT_SETTINGS, CommandError


@click.command(context_settings=CONTEXT_SETTINGS, epilog="""\b
Examples:
  megatrace simulate --ranks 64 --tp 2 --pp 4 --fault hang:rank=13,step=5 -o sim-hang
  megatrace simulate --ranks 16384 --tp 8 --pp 16 --records 2000 --fault slow:rank=900,factor=1.2 -o big
  megatrace analyze sim-hang

\b
Faults (as the demo's; steps count from 0):
  hang:rank=R,step=S[,phase=forward|backward|optimizer]   rank R stops before its next call
  commhang:rank=R,step=S                                  R's first collective of step S never completes
  slow:rank=R,factor=F[,from_step=S]                      R computes F times slower
  crash:rank=R,step=S                                     R exits at the start of step S
  slowlink:ranks=A-B,delay_ms=D                           p2p between adjacent stages A and B is D ms slower
""")
@click.option("--ranks", type=click.IntRange(1), default=None, help="World size [default: tp*pp*dp].")
@click.option("--tp", type=click.IntRange(1), default=8, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", type=click.IntRange(1), default=4, show_default=True, help="Pipeline-parallel size.")
@click.option("--dp", type=click.IntRange(1), default=None, help="Data-parallel size [default: ranks/(tp*pp)].")
@click.option("--microbatches", type=click.IntRange(1), default=4, show_default=True,
              help="Microbatches per step (1F1B schedule).")
@click.option("--steps", type=click.IntRange(2), default=None,
              help="Training steps [default: enough for --records records per rank].")
@click.option("--records", type=click.IntRange(16), default=500, show_default=True,
              help="About this many records per rank (ignored with --steps).")
@click.option("--fault", "faults", multiple=True, metavar="SPEC", help="Inject a fault (repeatable; see below).")
@click.option("--jitter", type=click.FloatRange(0, 0.9), default=0.1, show_default=True,
              help="Each rank arrives up to this share of its compute early, at random.")
@click.option("--skew-ms", type=click.FloatRange(0), default=2.0, show_default=True,
              help="Each host's wall clock is off by up to this many ms.")
@click.option("--gpus-per-node", type=click.IntRange(1), default=8, show_default=True, help="Ranks per host.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the jitter and clock errors.")
@click.option("-o", "--out", type=click.Path(file_okay=False), required=True, help="Output directory.")
def simulate(ranks: int | None, tp: int, pp: int, dp: int | None, microbatches: int, steps: int | None, records: int,
             faults: tuple[str, ...], jitter: float, skew_ms: float, gpus_per_node: int, seed: int, out: str) -> None:
    """Write a synthetic trace of the demo's training job, at any scale, with injected faults.

    The ring files are in the real format, as the tracer would have left them, with
    layout.yaml, procs.json and the ground truth in fault.json (never read by the
    analysis). Times come from an event simulation of the 1F1B pipelines coupled at
    the DP sync; one simulated replica stands for every healthy one, so 16,384 ranks
    take seconds to simulate and about a minute to write.
    """
    from pathlib import Path

    from megatrace.config import Layout, LayoutError
    from megatrace.demo.faults import FaultError
    from megatrace.simulate import SimOptions, simulate_job, steps_for_records

    if dp is None:
        world = ranks if ranks is not None else tp * pp
        if world % (tp * pp):
            raise click.BadParameter(f"{world} ranks are not divisible by tp*pp = {tp * pp}", param_hint="--ranks")
        dp = world // (tp * pp)
    elif ranks is not None and ranks != tp * pp * dp:
        raise click.BadParameter(f"{ranks} != tp*pp*dp = {tp}*{pp}*{dp}", param_hint="--ranks")
    try:
        layout = Layout(world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp, microbatches=microbatches).validate()
        n_steps = steps or steps_for_records(layout, records, microbatches, 2)
        result = simulate_job(SimOptions(tp=tp, pp=pp, dp=dp, out=Path(out), steps=n_steps,
                                         microbatches=microbatches, faults=faults, jitter=jitter, skew_ms=skew_ms,
                                         gpus_per_node=gpus_per_node, seed=seed),
                              progress=lambda msg: click.echo(f"simulate: {msg}", err=True))
    except (LayoutError, FaultError) as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"cannot write {out}: {exc.strerror or exc}") from None
    click.echo(f"{result.layout.world_size:,} ranks (TP{tp} x PP{pp} x DP{dp}), {n_steps} steps, "
               f"{result.records:,} records -> {result.out}")
