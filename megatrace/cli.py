"""Command-line entry points: ``megatrace`` (a click group) and ``megatrace-check``.

Each command body is a few lines that call into the package; heavy imports
(torch, numpy) happen inside the bodies so ``--help`` stays fast on login nodes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from megatrace import __version__
from megatrace.config import ORDERS
from megatrace.demo.engines import DEFAULT_ENGINE, ENGINES

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
# = analyze.importers.FORMATS
TRACE_FORMATS = ("auto", "rings", "flight-recorder", "nccl-log", "inspector", "kineto", "nccl-ras", "job-log")


_ENGINES_HELP = "\b\nEngines (--engine; the sizes each one takes in brackets):\n" + "".join(
    f"  {e.name:<9} {e.summary} [{' '.join(e.sizes)}]\n" for e in ENGINES.values()) + "\n"


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
        raise MegatraceError(f"cannot run {command[0]!r}: {exc.strerror}") from None


@main.command(context_settings=CONTEXT_SETTINGS, epilog=_ENGINES_HELP + """\b
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
        raise MegatraceError(str(exc)) from None
    click.echo(f"demo: {engine} engine, {layout.world_size} ranks (TP{layout.tp} x PP{layout.pp} x DP{layout.dp}), "
               f"{steps} steps -> {opts.out}", err=True)
    result = run_local(opts, log=lambda msg: click.echo(msg, err=True))
    click.echo("\n".join(summary_lines(result)))
    if not result.ok and not faults:
        raise MegatraceError(f"the demo failed without an injected fault: see {result.out / 'logs'}")


@main.command(context_settings=CONTEXT_SETTINGS, epilog="""\b
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
@click.option("--fail-on", type=click.Choice(["critical", "error", "warning", "info"]), default=None,
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
    diagnosed (stragglers and the critical path need whole iterations).
    """
    from megatrace.analyze.engine import LayoutSpec, analyze as run_analysis, output_dir
    from megatrace.analyze.findings import Severity
    from megatrace.analyze.load import TraceLoadError
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
    try:
        result = run_analysis(trace_dir, layout=layout, mode="hang" if quick else "full", format=trace_format,
                              out_dir=out_dir, job_logs=logs)
    except (TraceLoadError, LayoutError) as exc:
        raise MegatraceError(str(exc)) from None
    out = Path(out_dir) if out_dir is not None else output_dir(result.trace)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MegatraceError(f"cannot create the output directory {out}: {exc.strerror}; give one with "
                             f"-o/--out DIR") from None
    if quick:
        skipped = result.results.get("skipped_stages") or []
        source = (f"the newest {result.trace.tail} records of each rank" if result.trace.tail is not None
                  else "every record (imported traces are read whole)")
        click.echo(f"quick analysis: hang localisation from {source}"
                   + (f"; not run: {', '.join(skipped)}" if skipped else ""), err=True)
    click.echo(render_summary(result, out_dir=out))
    target = json_path or str(out / "findings.json")
    result.results["command"] = _analyze_command(trace_dir, layout_file, tp, pp, dp, quick, logs)  # for the report
    if trace_format != "auto":
        result.results["command"] += f" --format {trace_format}"
    try:
        click.echo(f"findings: {result.write_json(target)}", err=True)
    except OSError as exc:
        raise MegatraceError(f"cannot write {target}: {exc.strerror}") from None
    if not no_report:
        from megatrace.report.command import write_report_files

        click.echo(f"report: {write_report_files(target)[0]}", err=True)
    if fail_on and result.at_least(Severity.parse(fail_on)):
        sys.exit(3)


def _job_output_files(job_id: str, given_dir: bool) -> list[Path]:
    """The output files of Slurm job ``job_id`` (``--job``), said on stderr; a traced job's rings are pointed at."""
    from megatrace.collect.slurm import JobLookupError, job_output

    try:
        found = job_output(job_id)
    except JobLookupError as exc:
        raise MegatraceError(str(exc)) from None
    click.echo(f"job {job_id}: its output: {', '.join(map(str, found.files))} (from {found.source})"
               + "".join(f"; not read: {u}" for u in found.unreadable), err=True)
    rings = Path(found.work_dir or "/nonexistent") / f"megatrace-{job_id}"
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


@main.command("export", context_settings=CONTEXT_SETTINGS, epilog="""\b
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
    from megatrace.analyze.load import TraceLoadError
    from megatrace.config import LayoutError
    from megatrace.report.perfetto import ExportError, export_trace

    if not perfetto:
        raise click.UsageError("choose what to export: --perfetto")
    try:
        stats = export_trace(trace_dir, out, format=trace_format)
    except (TraceLoadError, LayoutError, ExportError) as exc:
        raise MegatraceError(str(exc)) from None
    except OSError as exc:
        raise MegatraceError(f"{trace_dir}: {exc.strerror or exc}") from None
    size = f", {stats.bytes / 1e6:.1f} MB" if stats.bytes else ""
    click.echo(f"trace: {out} ({stats.records} records of {stats.ranks} ranks on {stats.lanes} lanes, "
               f"{stats.incomplete} never completed, {stats.flows} flows{size}; {stats.seconds:.1f} s)", err=True)


# Commands that live with their stage; each module imports only click at load time.
from megatrace.check.command import check_main  # noqa: E402,F401  (the megatrace-check entry point)
from megatrace.collect.cli import agent as _agent, collect as _collect, job_end as _job_end  # noqa: E402
from megatrace.fleet.command import health as _health, nodes as _nodes  # noqa: E402
from megatrace.lab.cli import lab as _lab  # noqa: E402
from megatrace.report.command import report as _report  # noqa: E402
from megatrace.simulate.command import simulate as _simulate  # noqa: E402

for _command in (_report, _simulate, _health, _nodes, _lab, _collect, _agent, _job_end):
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    main()
