"""Command-line entry points: ``megatrace`` (a click group) and ``megatrace-check``.

Each command body is a few lines that call into the package; heavy imports
(torch, numpy) happen inside the bodies so ``--help`` stays fast on login nodes.
"""

from __future__ import annotations

import os
import sys

import click

from megatrace import __version__

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class MegatraceError(click.ClickException):
    """A user-facing error: printed as one 'Error:' line, exit status 1."""


@click.group(context_settings=CONTEXT_SETTINGS, epilog="""\b
Examples:
  megatrace demo --ranks 8 --tp 2 --pp 2 --dp 2 --steps 20 --fault hang:rank=5,step=3
  megatrace run -- python train.py --lr 3e-4
""")
@click.version_option(__version__, prog_name="megatrace")
def main() -> None:
    """MegaTrace finds the rank, node, GPU, group or link that hangs or slows a distributed training job.

    The pipeline: trace every collective and point-to-point call into per-rank ring
    files, collect them from every node, analyze them, and write a post-mortem report.
    """


@main.command(context_settings={**CONTEXT_SETTINGS, "ignore_unknown_options": True},
              epilog="""\b
Examples:
  megatrace run -- python train.py
  megatrace run --dir /tmp/traces -- torchrun --nproc-per-node 8 train.py
""")
@click.option("--dir", "trace_dir", type=click.Path(file_okay=False), envvar="MEGATRACE_DIR",
              show_envvar=True, help="Directory for the ring files "
              "[default: /dev/shm/megatrace/<job>.<step>/, node-local].")
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
        raise MegatraceError(f"cannot run {command[0]!r}: {exc.strerror}") from None


@click.command("megatrace-check", context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, prog_name="megatrace-check")
def check_main() -> None:
    """Preflight health checks of GPUs, nodes and the network before a job runs.

    The probes (pynvml GPU checks, node consistency, network bandwidth matrix) are
    not part of this release yet; this command exits with status 2 so that no
    prolog mistakes it for a passing check.
    """
    click.echo("megatrace-check: no preflight probes in this release; nothing was checked", err=True)
    sys.exit(2)


if __name__ == "__main__":  # pragma: no cover
    main()
