"""``megatrace analyze``, ``megatrace export`` and ``megatrace report``: a trace in, findings, a trace file or the
HTML report out.

Imports only click at load time; the analysis (numpy, networkx), the importers and the renderer (jinja2) are
imported in the bodies.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from megatrace.cli.settings import CONTEXT_SETTINGS, CommandError, import_numpy_for_analysis, skip_teardown
from megatrace.names import SEVERITIES, job_dir_name

if TYPE_CHECKING:
    from megatrace.analyze.engine import AnalysisResult

# = megatrace.load.importers.FORMATS (not imported: the importers load numpy)
TRACE_FORMATS = ("auto", "rings", "flight-recorder", "nccl-log", "inspector", "kineto", "nccl-ras", "job-log")


@click.command(context_settings=CONTEXT_SETTINGS, epilog="""\b
Examples:
  megatrace analyze megatrace-demo-hang/
  megatrace analyze traces/ --tp 8 --pp 4 --json out/findings.json
  megatrace analyze traces/ --fail-on error || echo "job needs attention"
  megatrace analyze traces/ --quick        # a hung job: who is stuck, in seconds
  megatrace analyze fr-dumps/ -o /tmp/job-1234   # everything it writes goes there
  megatrace analyze slurm-1234.out         # a job never traced: its output log's NCCL watchdog lines
  megatrace analyze --job 1234             # the same, its output files found through Slurm
  megatrace analyze megatrace-1234/step-0 --with-log slurm-1234.out   # rings, and the log for ranks without one

\b
Output: findings.json, report.html, trace.json and job.yaml go to --out: by default TRACE_DIR
for MegaTrace rings, and a new TRACE_DIR-megatrace beside it for the other formats (files
another tool wrote are never written into).

\b
Exit status:
  0  analysis done, nothing at or above --fail-on (or no --fail-on)
  1  the directory is not a readable trace, or a layout file is invalid
  2  bad command-line usage
  3  a finding at or above --fail-on severity
""")
@click.argument("trace_dir", type=click.Path(path_type=str), required=False)
@click.option("--job", "job_id", metavar="JOBID",
              help="A Slurm job: its output files (StdOut, StdErr) are found through scontrol, or sacct once the job "
                   "has left the queue, and read as its log; with TRACE_DIR, as --with-log.")
@click.option("--with-log", "job_logs", multiple=True, metavar="FILE",
              type=click.Path(dir_okay=False, exists=True, path_type=str),
              help="The job's output file (repeatable): for the ranks that have no ring, what it says of how they "
                   "stopped (an exception, Slurm's task exit, the NCCL watchdog's position) is merged in.")
@click.option("--layout", "layout_file", type=click.Path(dir_okay=False, exists=True),
              help="Parallel layout YAML [default: DIR/layout.yaml when present].")
@click.option("--tp", type=click.IntRange(1), help="Tensor-parallel size (instead of --layout).")
@click.option("--pp", type=click.IntRange(1), help="Pipeline-parallel size (instead of --layout).")
@click.option("--dp", type=click.IntRange(1), help="Data-parallel size [default: world / (tp*pp)].")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Directory for findings.json, report.html, trace.json and job.yaml [default: TRACE_DIR for "
                   "rings, TRACE_DIR-megatrace beside it for imported formats].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Where to write the findings [default: OUT/findings.json].")
@click.option("--fail-on", type=click.Choice(SEVERITIES), default=None,
              help="Exit with status 3 when a finding of this severity or worse exists.")
@click.option("--quick", is_flag=True,
              help="Hang localisation only: read just the newest records of each rank (further back only "
                   "where needed) and skip the analyses that need whole iterations (critical path, "
                   "stragglers). Seconds at 16,384 ranks; names the same culprit of a hang.")
@click.option("--no-report", is_flag=True,
              help="Do not write report.html and trace.json beside the findings (see: megatrace report).")
@click.option("--format", "trace_format", default="auto", show_default=True,
              type=click.Choice(TRACE_FORMATS),
              help="Input format: MegaTrace rings, PyTorch Flight Recorder dumps, Megatrace NCCL-patch logs "
                   "(rank_<R>.log), NCCL Inspector JSON lines, PyTorch profiler (Kineto) traces, an NCCL RAS report "
                   "(ncclras output) or a job's output log (PyTorch's NCCL watchdog lines; TRACE_DIR may then be "
                   "the file); auto detects it (docs/importers.md).")
def analyze(trace_dir: str | None, job_id: str | None, job_logs: tuple[str, ...], layout_file: str | None,
            tp: int | None, pp: int | None, dp: int | None, out_dir: str | None, json_path: str | None,
            fail_on: str | None, quick: bool, no_report: bool, trace_format: str) -> None:
    """Analyze a trace directory: name the rank, group or link that hung or failed the job.

    TRACE_DIR holds the ring files (in TRACE_DIR/rings/ or directly), and optionally
    layout.yaml and procs.json; or another tool's trace (--format), or it is a job's
    output log (slurm-<id>.out), read for the NCCL watchdog's positions and how ranks
    ended (--job finds it through Slurm). The verdict is printed first; every finding goes
    to findings.json (schema: docs/findings-schema.md). With --quick, a slow job is not
    diagnosed (stragglers and the critical path need whole iterations). From 256 ranks of
    rings, a hung job's verdict from the quick pass comes first, on stderr and in
    findings.json, while the full analysis runs; the full one then rewrites both.
    """
    import_numpy_for_analysis()
    from megatrace.analyze.engine import LayoutSpec, analyze as run_analysis, output_dir
    from megatrace.analyze.findings import Severity
    from megatrace.analyze.heap import tuned_for_analysis
    from megatrace.load import TraceLoadError
    from megatrace.analyze.summary import render_summary
    from megatrace.config import LayoutError

    if layout_file and (tp or pp or dp):
        raise click.UsageError("give either --layout or --tp/--pp/--dp, not both")
    layout = layout_file or (LayoutSpec(tp, pp, dp) if (tp or pp or dp) else None)
    if trace_dir is None and job_id is None:
        raise click.UsageError("give TRACE_DIR (a trace directory or a job's output file), or --job JOBID")
    logs = list(job_logs)
    if job_id is not None:
        found = _job_output_files(job_id, trace_dir is not None)
        if trace_dir is None:
            trace_dir, found = str(found[0]), found[1:]
        logs += [str(p) for p in found if str(p) not in logs]
    command = _analyze_command(trace_dir, layout_file, tp, pp, dp, quick, logs) + (
        f" --format {trace_format}" if trace_format != "auto" else "")  # for the report

    click.get_current_context().with_resource(tuned_for_analysis())  # until the command ends

    def run(mode: str) -> tuple[AnalysisResult, Path, str]:
        try:
            result = run_analysis(trace_dir, layout=layout, mode=mode, format=trace_format, out_dir=out_dir,
                                  job_logs=logs)
        except (TraceLoadError, LayoutError) as exc:
            raise CommandError(str(exc)) from None
        result.results["command"] = command
        out = Path(out_dir) if out_dir is not None else output_dir(result.trace)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CommandError(f"cannot create the output directory {out}: {exc.strerror}; give one with "
                               f"-o/--out DIR") from None
        return result, out, json_path or str(out / "findings.json")

    if not quick and _many_rings(trace_dir, trace_format):
        _say_hang_first(*run("hang"))
    result, out, target = run("hang" if quick else "full")
    if quick:
        skipped = result.results.get("skipped_stages") or []
        source = (f"the newest {result.trace.tail} records of each rank" if result.trace.tail is not None
                  else "every record (imported traces are read whole)")
        click.echo(f"quick analysis: hang localisation from {source}"
                   + (f"; not run: {', '.join(skipped)}" if skipped else ""), err=True)
    click.echo(render_summary(result, out_dir=out))
    try:
        click.echo(f"findings: {result.write_json(target)}", err=True)
    except OSError as exc:
        raise CommandError(f"cannot write {target}: {exc.strerror}") from None
    if not no_report:
        click.echo(f"report: {_write_report(target)[0]}", err=True)
    skip_teardown()  # (everything is written and closed: the process need not free the analysis object by object)
    if fail_on and result.at_least(Severity.parse(fail_on)):
        raise click.exceptions.Exit(3)


# From this many ranks, a full analysis takes long enough (seconds at 4,096) that a hung job's verdict from the
# quick pass comes first; below it, the full analysis is about as quick.
VERDICT_FIRST_RANKS = 256


def _many_rings(trace_dir: str, trace_format: str) -> bool:
    """Whether TRACE_DIR holds rings of at least :data:`VERDICT_FIRST_RANKS` ranks (imported formats are read
    whole even by the quick pass: it would gain nothing)."""
    from megatrace.load.discovery import trace_files

    if trace_format not in ("auto", "rings") or not os.path.isdir(trace_dir):
        return False
    try:
        return len(trace_files(Path(trace_dir)).rings) >= VERDICT_FIRST_RANKS
    except OSError:
        return False  # (the full analysis says what is wrong with the directory)


def _say_hang_first(result: AnalysisResult, out: Path, target: str) -> None:
    """A hang the quick pass found: its verdict on stderr and its findings.json at once, before the full analysis
    rewrites both; a quick pass that finds no hang says nothing (the full analysis may find a straggler)."""
    from megatrace.analyze.findings import Severity
    from megatrace.analyze.summary import render_verdict

    top = result.verdict
    if top is None or top.severity != Severity.CRITICAL:
        return
    click.echo(f"hang verdict from the quick pass, {result.timings.get('total', 0.0):.1f} s; the full analysis "
               "follows:\n" + render_verdict(result), err=True)
    try:  # (written after the verdict is shown: 0.1 to 0.2 s at thousands of ranks)
        click.echo(f"the quick pass's findings: {result.write_json(target)}\n", err=True)
    except OSError:
        click.echo("", err=True)  # (the full analysis reports a findings file it cannot write)


def _job_output_files(job_id: str, given_dir: bool) -> list[Path]:
    """The output files of Slurm job ``job_id`` (``--job``), said on stderr; a traced job's rings are pointed at."""
    from megatrace.collect.slurm import JobLookupError, job_output

    try:
        found = job_output(job_id)
    except JobLookupError as exc:
        raise CommandError(str(exc)) from None
    click.echo(f"job {job_id}: its output: {', '.join(map(str, found.files))} (from {found.source})"
               + "".join(f"; not read: {u}" for u in found.unreadable), err=True)
    rings = Path(found.work_dir or "/nonexistent") / job_dir_name(job_id)
    if not given_dir and any(rings.glob("step-*/rings/rank-*.ring")):
        click.echo(f"job {job_id} was traced: its rings are in {rings} (megatrace analyze {rings}/step-N --job "
                   f"{job_id} reads both)", err=True)
    return found.files


def _analyze_command(trace_dir: str, layout_file: str | None, tp: int | None, pp: int | None, dp: int | None,
                     quick: bool, logs: tuple[str, ...] | list[str] = ()) -> str:
    """The command line that reproduces this analysis (paths made absolute)."""
    import shlex

    args = ["megatrace", "analyze", os.path.abspath(trace_dir)]
    args += [a for log in logs for a in ("--with-log", os.path.abspath(log))]
    if layout_file:
        args += ["--layout", os.path.abspath(layout_file)]
    args += [a for k, v in (("--tp", tp), ("--pp", pp), ("--dp", dp)) if v for a in (k, str(v))]
    return shlex.join(args + (["--quick"] if quick else []))


@click.command("export", context_settings=CONTEXT_SETTINGS, epilog="""\b
Examples:
  megatrace export megatrace-demo-hang/ --perfetto -o trace.json
  megatrace export fr-dumps/ --format flight-recorder --perfetto -o /tmp/fr.json
""")
@click.argument("trace_dir", type=click.Path(path_type=str))
@click.option("--perfetto", is_flag=True, help="Write a Chrome / Perfetto trace (JSON trace events; the only "
              "export format so far).")
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=str), default="trace.json",
              show_default=True, help="Where to write it (a name ending in .gz is written gzipped).")
@click.option("--format", "trace_format", default="auto", show_default=True,
              type=click.Choice(TRACE_FORMATS),
              help="Input format, as for megatrace analyze (docs/importers.md).")
def export(trace_dir: str, perfetto: bool, out: str, trace_format: str) -> None:
    """Export every record of a trace (any format) to open in ui.perfetto.dev or chrome://tracing.

    One process per rank (named with its host and GPU), one lane per group and kind with more lanes
    where calls overlap, one slice per operation (a call that never completed lasts until the end of
    the trace and says so), flows joining the members of each collective instance in arrival order and
    each send to its recv. Nothing is written into TRACE_DIR.
    """
    import_numpy_for_analysis()
    from megatrace.load import TraceLoadError
    from megatrace.config import LayoutError
    from megatrace.pipeline import export_trace
    from megatrace.report.perfetto import ExportError

    if not perfetto:
        raise click.UsageError("choose what to export: --perfetto")
    try:
        stats = export_trace(trace_dir, out, format=trace_format)
    except (TraceLoadError, LayoutError, ExportError) as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"{trace_dir}: {exc.strerror or exc}") from None
    size = f", {stats.bytes / 1e6:.1f} MB" if stats.bytes else ""
    click.echo(f"trace: {out} ({stats.records} records of {stats.ranks} ranks on {stats.lanes} lanes, "
               f"{stats.incomplete} never completed, {stats.flows} flows{size}; {stats.seconds:.1f} s)", err=True)


@click.command("report", context_settings=CONTEXT_SETTINGS, epilog="""\b
Examples:
  megatrace report megatrace-demo-hang/findings.json
  megatrace report out/findings.json -o /tmp/job-1234.html --no-trace
""")
@click.argument("findings_json", type=click.Path(dir_okay=False, path_type=str))
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Where to write the report [default: report.html beside FINDINGS_JSON].")
@click.option("--trace/--no-trace", default=True, show_default=True,
              help="Also write the incident window as a Chrome/Perfetto trace (trace.json beside the report).")
def report(findings_json: str, out: str | None, trace: bool) -> None:
    """Render the post-mortem HTML report of an analysis from its findings.json.

    FINDINGS_JSON is what `megatrace analyze` wrote. The report is one self-contained HTML
    file (nothing is fetched when it is opened): the verdict first, then the culprits, the
    wait-for chain, the timeline around the incident, the critical path, stragglers and
    slow links, every finding and the job's facts.
    """
    html, trace_path = _write_report(findings_json, out, trace)
    click.echo(f"report: {html}", err=True)
    if trace_path is not None:
        click.echo(f"trace: {trace_path}", err=True)


def _write_report(findings_json: str | Path, out: str | Path | None = None,
                  trace: bool = True) -> tuple[Path, Path | None]:
    """Render ``findings_json`` into ``out`` (default: ``report.html`` beside it) and ``trace.json``;
    a :class:`CommandError` on any problem (unreadable input, unwritable output)."""
    from megatrace.report.render import ReportError, write_report

    try:
        return write_report(findings_json, out, trace=trace)
    except ReportError as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        target = out or Path(findings_json).with_name("report.html")
        raise CommandError(f"cannot write the report {target}: {exc.strerror or exc}") from None
