"""The analysis facade: ``analyze(trace_dir) -> AnalysisResult``, one call per analyzer.

Pipeline: load → job configuration (:mod:`megatrace.analyze.jobconfig.stage`: it
may give the trace its layout, so it runs first) → index (matching keys) → clock
alignment → match → hang wait-for graph → findings. Further analyzers (critical
path, stragglers, the rules engine) plug in as :data:`STAGES`: each is a function of the
:class:`AnalysisContext` that returns findings and may leave results in
``context.results`` for the stages after it (the rules engine runs last and
sees every finding so far).

Modes: ``mode="full"`` (the default) loads every record and runs every stage.
``mode="hang"`` (``megatrace analyze --quick``) loads only each rank's newest
:data:`~megatrace.load.QUICK_TAIL` records (deeper for the few ranks
whose tail is too short, see :func:`~megatrace.analyze.tails.widen_tails`) and
runs only the stages named in :data:`HANG_MODE_STAGES`: hang localisation in
seconds at 16,384 ranks, without the analyzers that need whole iterations.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrace.analyze import explain
from megatrace.analyze.clock import ClockAlignment, align_clocks
from megatrace.analyze.context import AnalysisContext, Stage
from megatrace.analyze.findings import Finding, Kind, Severity, findings_document, order_findings, write_findings_json
from megatrace.analyze.hang import TAIL, HangAnalysis, analyze_hangs
from megatrace.analyze.heap import warm_heap
from megatrace.analyze.index import index_records
from megatrace.analyze.jobconfig import config_findings, job_facts
from megatrace.analyze.jobconfig.stage import GivenLayout, apply_layout_spec, job_stage
from megatrace.analyze.match import MatchResult, match
from megatrace.analyze.tails import widen_tails
from megatrace.config import Layout, LayoutError
from megatrace.load import QUICK_TAIL, load_trace
from megatrace.load.traceset import TraceSet


@dataclass(frozen=True)
class LayoutSpec:
    """TP/PP/DP sizes from the command line; a missing one is derived from the trace's world size."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None

    def resolve(self, world_size: int) -> Layout:
        """tp and pp default to 1; dp (or pp, when only dp is given) is what the world size leaves."""
        tp = self.tp or 1
        if self.dp is not None and self.pp is not None:
            pp, dp = self.pp, self.dp
        else:
            rest = tp * (self.pp or 1 if self.dp is None else self.dp)
            if world_size % rest:
                raise LayoutError(f"--tp/--pp/--dp sizes (product {rest}) do not divide the trace's world size "
                                  f"{world_size}")
            pp, dp = (self.pp or 1, world_size // rest) if self.dp is None else (world_size // rest, self.dp)
        return Layout(world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp).validate("--tp/--pp/--dp")




def _hang_stage(ctx: AnalysisContext) -> list[Finding]:
    hang = analyze_hangs(ctx.trace, ctx.clock, ctx.match)
    ctx.results["hang"] = hang
    found = explain.hang_findings(ctx.trace, ctx.match, hang)
    if hang.stall is not None:
        found.append(explain.stall_finding(ctx.trace, hang))
    elif not hang.roots and not any(f.kind == Kind.CRASHED_PROCESS and f.severity == Severity.CRITICAL
                                    for f in found):  # ("no hang" beside the crash that ended the job: a contradiction)
        found.append(explain.healthy_finding(ctx.trace, ctx.match, hang))
    return found


def _mismatch_stage(ctx: AnalysisContext) -> list[Finding]:
    return explain.mismatch_findings(ctx.trace, ctx.match)


def _rules_stage(ctx: AnalysisContext) -> list[Finding]:
    from megatrace.analyze.rules import rules_stage  # imported late: rules read this module's context

    return rules_stage(ctx)


# Extension point: (name, stage) pairs, run in order; the rules engine stays last so its
# conditions see every earlier finding.
def _critical_path_stage(ctx: AnalysisContext) -> list[Finding]:
    from megatrace.analyze.critical_path import critical_path_stage

    return critical_path_stage(ctx)


def _straggler_stage(ctx: AnalysisContext) -> list[Finding]:
    from megatrace.analyze.stragglers import straggler_stage  # reuses the critical-path graphs

    return straggler_stage(ctx)


STAGES: list[tuple[str, Stage]] = [("hang", _hang_stage), ("mismatch", _mismatch_stage),
                                   ("critical_path", _critical_path_stage), ("stragglers", _straggler_stage),
                                   ("rules", _rules_stage)]

MODES = ("full", "hang")
WARM_BYTES_PER_RECORD = 24  # heap faulted in ahead for a full analysis (it grows by some 22 bytes a record after the
#                             load): 24 peaked at 1,991-1,995 MiB at 16,384 ranks, 16 at 1,946-2,006 and faulted
#                             the rest in during the stages (match 0.6 s instead of 0.43), 32 at 2,214-2,228
# The stages that hold on each rank's tail alone (mode "hang"): a stage that needs whole iterations
# (critical path, stragglers) is left out of that mode by not being named here.
HANG_MODE_STAGES = frozenset({"hang", "mismatch", "rules"})


@dataclass
class AnalysisResult:
    """Everything one analysis produced; ``findings`` are ordered, the first is the verdict."""

    trace: TraceSet
    clock: ClockAlignment
    match: MatchResult
    findings: list[Finding]
    results: dict[str, Any]
    timings: dict[str, float]

    @property
    def hang(self) -> HangAnalysis | None:
        return self.results.get("hang")

    @property
    def verdict(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def trace_summary(self) -> dict[str, Any]:
        t = self.trace
        return {"path": str(t.path), "job_id": t.job_id, "world_size": t.world_size, "ranks_loaded": len(t.ranks),
                "missing_ranks": list(t.missing_ranks), "hosts": t.hosts, "records": len(t.records),
                "groups": len(t.groups), "layout": None if t.layout is None else
                {k: getattr(t.layout, k) for k in ("tp", "pp", "dp", "microbatches", "schedule", "order")},
                "problems": [str(p) for p in t.problems], **self._job_summary()}

    def _job_summary(self) -> dict[str, Any]:
        job = self.results.get("job")
        return {} if job is None else {"job": job_facts(job)}

    def analysis_summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"clock": self.clock.summary(), "matching": self.match.summary(),
                               "timings_s": {k: round(v, 4) for k, v in self.timings.items()}}
        if self.results.get("mode", "full") != "full":
            t = self.trace
            out["mode"] = {"name": self.results["mode"], "tail_records": t.tail,
                           "ranks_read_deeper": sum(1 for i in t.rank_info if i.n_records > (t.tail or 0)),
                           "skipped_stages": list(self.results.get("skipped_stages", ()))}
        if self.hang is not None:
            out["hang"] = self.hang.summary()
        from megatrace.analyze.report_data import report_data  # what the HTML report draws (timeline, graph)

        out["report"] = report_data(self.trace, self.clock, self.results)
        return out

    def document(self) -> dict[str, Any]:
        return findings_document(self.findings, self.trace_summary(), self.analysis_summary())

    def write_json(self, path: str | Path) -> Path:
        return write_findings_json(path, self.document())

    def at_least(self, severity: Severity) -> list[Finding]:
        return [f for f in self.findings if f.severity.at_least(severity)]


def output_dir(trace: TraceSet) -> Path:
    """Where an analysis writes by default: beside ring files, in the trace directory; for an imported format
    (files nobody here wrote, maybe read-only), a new directory beside it, ``<name>-megatrace``."""
    path = Path(trace.path)
    return path if not trace.imported else path.resolve().parent / f"{path.resolve().name}-megatrace"


def _given_layout(trace: TraceSet, layout: object) -> GivenLayout | None:
    """Where the layout the loaded trace has came from (``layout``: :func:`analyze`'s argument)."""
    if trace.layout is None:
        return None
    if isinstance(layout, LayoutSpec):
        return GivenLayout("--tp/--pp/--dp", full=False)
    where = (f"--layout {layout}" if isinstance(layout, (str, Path)) else "the given layout"
             if isinstance(layout, Layout) else str(trace.path / "layout.yaml"))
    return GivenLayout(where, full=True)


def _stages_to_run(ctx: AnalysisContext, stages: list[tuple[str, Stage]] | None,
                   quick: bool) -> list[tuple[str, Stage]]:
    """The stages this analysis runs, in order: all of ``stages`` (default :data:`STAGES`), or only those of
    :data:`HANG_MODE_STAGES` (and the stragglers for a log of arrivals) in hang mode or when the trace's
    completion times are guessed; ``ctx.results["skipped_stages"]`` names the others."""
    trace = ctx.trace
    run = stages if stages is not None else STAGES
    keep = None
    if quick or trace.completion_times in ("inferred", "order"):  # (guessed completions would invent stragglers)
        keep = HANG_MODE_STAGES
    elif trace.completion_times == "arrivals":  # compute between calls is known, transfer times are not
        keep = HANG_MODE_STAGES | {"stragglers"}
    if keep is not None:
        ctx.results["skipped_stages"] = [name for name, _ in run if name not in keep]
        run = [(name, stage) for name, stage in run if name in keep]
    return run


def analyze(trace_dir: str | Path, layout: Layout | LayoutSpec | str | Path | None = None,
            stages: list[tuple[str, Stage]] | None = None, mode: str = "full",
            format: str = "auto",  # noqa: A002 - load_trace's format (docs/importers.md)
            out_dir: str | Path | None = None, job_logs: Sequence[str | Path] = ()) -> AnalysisResult:
    """Analyse a trace directory and return ordered findings (the first one is the verdict).

    ``layout``: a :class:`Layout`, a :class:`LayoutSpec` (sizes from the command line), a path to a
    layout YAML, or None to use ``layout.yaml`` in the trace directory when present.
    ``mode``: ``"full"`` (everything) or ``"hang"`` (tails only; of ``stages``, default :data:`STAGES`,
    only those in :data:`HANG_MODE_STAGES` run; ``results["skipped_stages"]`` names the others).
    ``out_dir``: where ``job.yaml`` goes (default :func:`output_dir`: never inside an imported format's files).
    ``job_logs``: the job's output files, read for the ranks that have no ring (:func:`merge_job_logs`).
    Raises :class:`megatrace.load.TraceLoadError` when the directory is not a trace and
    :class:`megatrace.config.LayoutError` when a given layout file is unreadable.
    """
    from megatrace.config import load_layout

    if mode not in MODES:
        raise ValueError(f"unknown analysis mode {mode!r} (one of {', '.join(MODES)})")
    quick = mode == "hang"
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    spec = layout if isinstance(layout, LayoutSpec) else None
    given = load_layout(layout) if isinstance(layout, (str, Path)) else layout if isinstance(layout, Layout) else None
    trace = load_trace(trace_dir, layout=given, tail=QUICK_TAIL if quick else None, format=format, job_logs=job_logs)
    if spec is not None:
        apply_layout_spec(trace, spec)
    timings["load"] = time.perf_counter() - t0
    if not quick:  # (the full analysis grows after the load: most of that faulted in ahead)
        warm_heap(len(trace.records) * WARM_BYTES_PER_RECORD)
    t = time.perf_counter()
    job = job_stage(trace, _given_layout(trace, layout), Path(out_dir) if out_dir is not None else output_dir(trace))
    timings["job"] = time.perf_counter() - t
    t = time.perf_counter()
    index = index_records(trace)
    timings["index"] = time.perf_counter() - t
    if quick:
        t = time.perf_counter()
        trace, index = widen_tails(trace, index, TAIL)
        timings["widen"] = time.perf_counter() - t
    t = time.perf_counter()
    clock = align_clocks(trace, index, in_place=True)
    timings["clock"] = time.perf_counter() - t
    t = time.perf_counter()
    matched = match(trace, index, clock.t_enqueue, clock.t_complete)
    timings["match"] = time.perf_counter() - t
    ctx = AnalysisContext(trace, clock, matched)
    ctx.results["mode"] = mode
    if job is not None:
        ctx.results["job"] = job
        ctx.findings.extend(config_findings(job))
    for name, stage in _stages_to_run(ctx, stages, quick):
        t = time.perf_counter()
        ctx.findings.extend(stage(ctx))
        timings[name] = time.perf_counter() - t
    if trace.init_markers:  # ranks stuck in init_process_group: before any record, so before any other verdict
        from megatrace.analyze.startup import startup_findings

        started = startup_findings(trace)
        if started and not len(trace.ranks):  # (nothing was recorded: "no hang" would be the empty trace's)
            ctx.findings = [f for f in ctx.findings if f.kind not in (Kind.HEALTHY, Kind.POSSIBLE_HANG)]
        ctx.findings.extend(started)
    findings = order_findings(explain.trace_findings(trace, clock) + ctx.findings)
    timings["total"] = time.perf_counter() - t0
    return AnalysisResult(trace, clock, matched, findings, ctx.results, timings)
