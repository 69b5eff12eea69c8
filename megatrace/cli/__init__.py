"""Command-line entry points: ``megatrace`` (a click group) and ``megatrace-check``.

One module per concern: :mod:`.settings` (the context settings and :class:`CommandError`, the base of every
error a command shows), :mod:`.sections` (the sections of ``megatrace --help``), :mod:`.run` (run, demo),
:mod:`.analyze` (analyze, export, report), :mod:`.simulate`, :mod:`.collect` (collect, agent, job-end),
:mod:`.fleet` (health, nodes), :mod:`.lab` and :mod:`.check` (``megatrace-check``).

Each command body is a few lines that call into the package; heavy imports (torch, numpy, networkx) happen
inside the bodies so ``--help`` stays fast on login nodes.
"""

from __future__ import annotations

import click

from megatrace import __version__
from megatrace.cli import analyze, collect, fleet, lab, run, simulate
from megatrace.cli.analyze import TRACE_FORMATS
from megatrace.cli.check import check_main
from megatrace.cli.sections import SectionedGroup
from megatrace.cli.settings import CONTEXT_SETTINGS, CommandError, leave_if_done


@click.group(cls=SectionedGroup, context_settings=CONTEXT_SETTINGS, epilog="""\b
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


# The submodules keep their names here (megatrace.cli.analyze is the module); the commands are added by object.
for _command in (run.run, run.demo, analyze.analyze, analyze.export, analyze.report, simulate.simulate,
                 collect.collect, collect.agent, collect.job_end, fleet.health, fleet.nodes, lab.lab):
    main.add_command(_command)


def entry() -> None:
    """The ``megatrace`` process (its console script, ``python -m megatrace.cli``): :func:`main`, leaving without
    the interpreter's teardown when the command asked for it (:func:`~megatrace.cli.settings.skip_teardown`)."""
    try:
        main()
    except SystemExit as exc:
        leave_if_done(exc)
        raise


__all__ = ["CONTEXT_SETTINGS", "TRACE_FORMATS", "CommandError", "check_main", "entry", "main"]
