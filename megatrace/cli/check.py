"""``megatrace-check``: the command (imports only click at load time; the checks import in the body)."""

from __future__ import annotations

from typing import Any

import click

from megatrace import __version__
from megatrace.check.probes import PROBES, listing, unknown
from megatrace.cli.settings import CONTEXT_SETTINGS, CommandError, PrefixedError

PROG = "megatrace-check"
WATCHDOG_GRACE_S = 5.0  # under MPI, a task other than 0 whose watchdog fired waits this long before it exits


def _known_probes(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """``--only`` names a family or a probe of the registry: a typo must not silently check nothing."""
    bad = unknown(value)
    if bad:
        raise click.BadParameter(f"unknown probe {', '.join(map(repr, bad))}; known: a family "
                                 f"({', '.join(PROBES)}) or one of\n{listing()}")
    return value


@click.command(PROG, context_settings=CONTEXT_SETTINGS, epilog=f"""\b
Examples:
  megatrace-check                                  # this node: GPUs and host
  srun --ntasks-per-node=1 --mpi=pmi2 megatrace-check --level full --json check.json
  megatrace-check --only gpu.ecc --only gpu.clocks --expect-gpus 8
  megatrace-check --prom-textfile /var/lib/node_exporter/megatrace.prom

\b
Exit status (exact; a prolog drains the node on 4):
  0  every check passed (or had nothing to check)
  3  warnings only
  4  at least one failure, or a check hung past --timeout (the probe that hung fails)
  2  bad usage
  1  the checks could not run
\b
Probes (--only takes a family or a probe):
{listing()}
\b
Drills: a root-owned /etc/megatrace/fail-preflight-NODE fails node.injected with its text;
slow-net-NODE (milliseconds) slows that node in the network test. MEGATRACE_SITE_DIR moves the folder.
Under srun/mpiexec the first task of each node checks the node; each task checks the GPUs it is
bound to (CUDA_VISIBLE_DEVICES), or the first task all of them; every task joins the all-reduce
(NCCL where every task has a GPU, else MPI); the first tasks of the nodes measure the node x node
bandwidth and latency matrix over MPI (--level full: longer messages); task 0 prints one table.
A prolog sets MEGATRACE_CHECK_TIMEOUT below its own limit and MEGATRACE_CHECK_REASON_FILE to learn
the drain reason (e.g. "megatrace: GPU1 XID 79 ...").
""")
@click.version_option(__version__, prog_name=PROG)
@click.option("--level", type=click.Choice(["quick", "full"]), default="quick", show_default=True,
              help="quick: GPU and node checks, a small all-reduce and matrix; full: larger messages, and DCGM's "
                   "level-1 diagnostic where dcgmi is installed.")
@click.option("--only", "only", multiple=True, metavar="NAME", callback=_known_probes,
              help="Run only these probes or families (gpu, node, net, gpu.ecc, ...); repeatable.")
@click.option("--expect-gpus", type=click.IntRange(0), default=None,
              help="GPUs this node must have [default: SLURM_GPUS_ON_NODE, else CUDA_VISIBLE_DEVICES].")
@click.option("--job-dir", type=click.Path(file_okay=False), default=None,
              help="Also check free space there (the job directory).")
@click.option("--ring-dir", type=click.Path(file_okay=False), default=None,
              help="Also check free space for the node-local rings there (or its nearest existing parent).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every result (and the bandwidth matrix) as JSON.")
@click.option("--prom-textfile", type=click.Path(dir_okay=False), default=None,
              help="Write node-exporter textfile metrics (one gauge per check).")
@click.option("--reason-file", type=click.Path(dir_okay=False), envvar="MEGATRACE_CHECK_REASON_FILE", default=None,
              help="When a check fails or warns, write the first problem there as a one-line drain reason "
                   "(\"megatrace: GPU1 XID 79 ...\") [env MEGATRACE_CHECK_REASON_FILE].")
@click.option("--timeout", "timeout_s", type=click.FloatRange(1), default=120.0, show_default=True,
              envvar="MEGATRACE_CHECK_TIMEOUT",
              help="Seconds before a hung check counts as a failure and the command exits 4 "
                   "[env MEGATRACE_CHECK_TIMEOUT].")
@click.option("--node", default=None,
              help="The node's name in the results [default: MEGATRACE_NODE_NAME, SLURMD_NODENAME or hostname].")
@click.option("--net-backend", type=click.Choice(["auto", "mpi", "torch"]), default="auto", show_default=True,
              help="The all-reduce's path. auto: NCCL through torch.distributed where every task has a GPU, else "
                   "MPI; torch: torch.distributed (NCCL on GPUs, gloo without); mpi: MPI only.")
@click.option("--thresholds", "thresholds_path", type=click.Path(dir_okay=False), envvar="MEGATRACE_THRESHOLDS",
              default=None, help="The site's limits (YAML; see configs/thresholds.yaml) [env MEGATRACE_THRESHOLDS].")
@click.option("--calibrate", "calibrate_path", type=click.Path(dir_okay=False), default=None,
              help="On a healthy allocation (every check ok): write thresholds with the network floor set from what "
                   "was measured.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the verdict line.")
def check_main(level: str, only: tuple[str, ...], expect_gpus: int | None, job_dir: str | None, ring_dir: str | None,
               json_path: str | None, prom_textfile: str | None, reason_file: str | None, timeout_s: float,
               node: str | None, net_backend: str, thresholds_path: str | None, calibrate_path: str | None,
               quiet: bool) -> None:
    """Preflight health checks of GPUs, nodes and the network before a job runs.

    GPUs through NVML (count against the allocation, XID-prone states: ECC, row
    remapping, clock slowdown, temperature, power cap, PCIe width, stray processes),
    the node (free space, InfiniBand ports, and against the other nodes: CPUs,
    memory, versions, clock), and the network (all-reduce bus bandwidth and the
    node x node bandwidth and latency matrix: a slow row is a bad node, a slow cell
    a bad link). Every probe is bounded in time.
    """
    import time

    from megatrace.check.runner import CheckOptions, Progress, Watchdog, run
    from megatrace.names import node_name
    from megatrace.check.thresholds import ThresholdsError, load_thresholds

    try:
        limits = load_thresholds(thresholds_path)
    except ThresholdsError as exc:
        raise CommandError(str(exc)) from None
    opts = CheckOptions(level=level, only=only, expect_gpus=expect_gpus, job_dir=job_dir, ring_dir=ring_dir,
                        timeout_s=timeout_s, node=node, net_backend=net_backend, thresholds=limits)
    outputs = {"json": json_path, "prom": prom_textfile, "reason": reason_file}
    progress, t0 = Progress(node_name(node)), time.perf_counter()

    def timed_out() -> None:  # the watchdog's thread, while the run hangs: report what is known, then exit 4
        report = progress.timed_out(timeout_s, t0)
        click.echo(f"{PROG}: FAIL {progress.node}: {report.results[-1].message}", err=True)
        if progress.root:
            _emit(report, quiet, outputs)
        else:  # the other tasks' watchdogs fire at about the same time: leave task 0 the time to report first
            time.sleep(WATCHDOG_GRACE_S)

    try:
        with Watchdog(timeout_s, progress.node, timed_out):
            report = run(opts, progress)
    except Exception as exc:  # noqa: BLE001  (the checks could not run: say so, exit 1, never a traceback)
        raise PrefixedError(PROG, f"the checks could not run: {type(exc).__name__}: {exc}") from None
    if report.verdict_code is not None:  # not task 0 under MPI: task 0 prints for the allocation
        raise click.exceptions.Exit(report.exit_code)
    if not _emit(report, quiet, outputs):
        raise click.exceptions.Exit(1)
    if calibrate_path:
        _calibrate(report, limits, calibrate_path)
    raise click.exceptions.Exit(report.exit_code)


def _calibrate(report: Any, limits: Any, path: str) -> None:
    """``--calibrate``: write thresholds whose network floor is what this healthy allocation measured."""
    from megatrace.check.thresholds import calibrated, save_thresholds

    busbw = report.value_of("net.allreduce")
    if busbw is None:
        raise PrefixedError(PROG, "--calibrate needs the all-reduce: run under srun/mpiexec")
    if report.exit_code:
        raise PrefixedError(PROG, f"not calibrating on an allocation whose checks did not all pass "
                                  f"(exit {report.exit_code}): fix or leave out the nodes above, then calibrate again",
                            exit_code=report.exit_code)
    try:
        save_thresholds(calibrated(limits, busbw), path,
                        f"calibrated on {len(report.nodes)} nodes, all-reduce bus bandwidth {busbw:.2f} GB/s")
    except OSError as exc:
        raise PrefixedError(PROG, f"cannot write {exc.filename}: {exc.strerror}") from None
    click.echo(f"thresholds written to {path}")


def _emit(report: Any, quiet: bool, outputs: dict[str, str | None]) -> bool:
    """Print the table and write the outputs asked for; False (after saying why) when one cannot be written."""
    from megatrace.check.output import drain_reason, prom_textfile, table, write_json
    from megatrace.files import write_atomic

    text = table(report)
    click.echo(text.splitlines()[-1] if quiet else text)
    try:
        if outputs["json"]:
            write_json(report, outputs["json"])
        if outputs["prom"]:
            prom_textfile(report, outputs["prom"])
        if outputs["reason"]:
            write_atomic(outputs["reason"], (drain_reason(report) or "") + "\n")
    except OSError as exc:
        click.echo(f"{PROG}: cannot write {exc.filename}: {exc.strerror}", err=True)
        return False
    return True
