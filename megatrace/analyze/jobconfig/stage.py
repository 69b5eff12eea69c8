"""The job configuration as the analysis's first stage: it runs after loading and before the clock alignment,
because it can give the trace the layout every later stage uses.

:func:`job_stage` builds the :class:`JobConfig`, fills in the trace's layout when none was given, and writes
``job.yaml``; it never fails the analysis (a problem becomes a :class:`LoadProblem`).
:func:`apply_layout_spec` gives the trace the layout of the command line's sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from megatrace.analyze.jobconfig.build import build_job_config
from megatrace.analyze.jobconfig.checks import job_layout
from megatrace.analyze.jobconfig.jobfile import write_job_yaml
from megatrace.analyze.jobconfig.model import JobConfig
from megatrace.config import Layout, LayoutError
from megatrace.load.side_files import fit_layout
from megatrace.load.traceset import LoadProblem, TraceSet


class LayoutSizes(Protocol):
    """Sizes given on the command line (:class:`megatrace.analyze.engine.LayoutSpec`)."""

    def resolve(self, world_size: int) -> Layout: ...


@dataclass(frozen=True)
class GivenLayout:
    """Where the layout the trace already has came from, as ``job.yaml`` names its source."""

    where: str  # "--tp/--pp/--dp", "--layout FILE", "the given layout" or the trace's layout.yaml
    full: bool  # a whole layout (microbatches and schedule too), not only sizes


def job_stage(trace: TraceSet, given: GivenLayout | None, out_dir: Path) -> JobConfig | None:
    """Build the job configuration, give the trace its layout when it has none, and write ``out_dir/job.yaml``."""
    explicit = None if trace.layout is None or given is None else (trace.layout, given.where, given.full)
    try:
        job = build_job_config(trace, explicit)
    except Exception as exc:  # noqa: BLE001 - the job's configuration is context; analysis goes on without it
        trace.problems.append(LoadProblem("warning", "job-config", f"job configuration not built: {exc!r}"))
        return None
    if trace.layout is None:
        # the sources by precedence; when those do not fit, what the trace itself shows
        inferred = job_layout(job) or job_layout(job, ("environment", "groups"))
        if inferred is not None:
            trace.layout = fit_layout(inferred, trace.world_size, f"job configuration ({job.sizes_label()})",
                                      trace.problems)
    target = out_dir / "job.yaml"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_job_yaml(job, target)
    except OSError as exc:
        trace.problems.append(LoadProblem("warning", "job-config", f"cannot write {target}: {exc.strerror}",
                                          paths=(str(target),)))
    return job


def apply_layout_spec(trace: TraceSet, spec: LayoutSizes) -> None:
    """Give the trace the layout of the command line's sizes; a problem, and no layout, when they do not fit."""
    try:
        trace.layout = fit_layout(spec.resolve(trace.world_size), trace.world_size, "--tp/--pp/--dp",
                                  trace.problems)
    except LayoutError as exc:
        trace.layout = None
        trace.problems.append(LoadProblem("error", "layout", f"{exc}; analysing without a layout"))
