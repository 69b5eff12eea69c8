"""``megatrace-check``: the command (imports only click at load time; the checks import in the body)."""

from __future__ import annotations

import sys

import click

from megatrace import __version__

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.command("megatrace-check", context_settings=CONTEXT_SETTINGS, epilog="""\b
Examples:
  megatrace-check                                  # this node: GPUs and host
  srun --ntasks-per-node=1 --mpi=pmi2 megatrace-check --level full --json check.json
  megatrace-check --only gpu.ecc --only gpu.clocks --expect-gpus 8
  megatrace-check --prom-textfile /var/lib/node_exporter/megatrace.prom

\b
Exit status (exact; a prolog drains the node on 4):
  0  every check passed (or had nothing to check)
  3  warnings only
  4  at least one failure, or a check hung past --timeout
  2  bad usage
  1  the checks could not run
\b
Probes: gpu.{nvml,count,driver,xid,temperature,clocks,ecc,remap,retired,power,pcie,pcie_gen,memory,
mig,persistence,nvlink,dcgm}, node.{injected,tracer,shm,job_dir,ring_dir,ib,cpus,mem_bytes,kernel,
versions,gpu_driver,ib_rate,clock}, net.{allreduce,node,link,matrix,pair}.
Drills: a root-owned /etc/megatrace/fail-preflight-NODE fails node.injected with its text;
slow-net-NODE (milliseconds) slows that node in the network test. MEGATRACE_SITE_DIR moves the folder.
Under srun/mpiexec the first task of each node checks the node; each task checks the GPUs it is
bound to (CUDA_VISIBLE_DEVICES), or the first task all of them; every task joins the all-reduce
(NCCL where every task has a GPU, else MPI); --level full adds the node x node bandwidth matrix
over MPI; task 0 prints one table.
""")
@click.version_option(__version__, prog_name="megatrace-check")
@click.option("--level", type=click.Choice(["quick", "full"]), default="quick", show_default=True,
              help="quick: GPU and node checks, a small all-reduce; full: also the node x node matrix.")
@click.option("--only", "only", multiple=True, metavar="NAME",
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
@click.option("--timeout", "timeout_s", type=click.FloatRange(1), default=120.0, show_default=True,
              help="Seconds before a hung check counts as a failure and the command exits 4.")
@click.option("--node", default=None, help="The node's name in the results [default: SLURMD_NODENAME or hostname].")
@click.option("--net-backend", type=click.Choice(["auto", "mpi", "torch"]), default="auto", show_default=True,
              help="The all-reduce's path. auto: NCCL through torch.distributed where every task has a GPU, else "
                   "MPI; torch: torch.distributed (NCCL on GPUs, gloo without); mpi: MPI only.")
@click.option("--thresholds", "thresholds_path", type=click.Path(dir_okay=False), envvar="MEGATRACE_THRESHOLDS",
              default=None, help="The site's limits (YAML; see configs/thresholds.yaml) [env MEGATRACE_THRESHOLDS].")
@click.option("--calibrate", "calibrate_path", type=click.Path(dir_okay=False), default=None,
              help="On a healthy allocation: write thresholds with the network floor set from what was measured.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the verdict line.")
def check_main(level: str, only: tuple[str, ...], expect_gpus: int | None, job_dir: str | None, ring_dir: str | None,
               json_path: str | None, prom_textfile: str | None, timeout_s: float, node: str | None,
               net_backend: str, thresholds_path: str | None, calibrate_path: str | None, quiet: bool) -> None:
    """Preflight health checks of GPUs, nodes and the network before a job runs.

    GPUs through NVML (count against the allocation, XID-prone states: ECC, row
    remapping, clock slowdown, temperature, power cap, PCIe width, stray processes),
    the node (free space, InfiniBand ports, and against the other nodes: CPUs,
    memory, versions, clock), and the network (all-reduce bus bandwidth; with
    --level full the node x node bandwidth matrix: a slow row is a bad node, a
    slow cell a bad link). Every probe is bounded in time.
    """
    from megatrace.check.output import prom_textfile as write_prom, table, write_json
    from megatrace.check.runner import CheckOptions, Watchdog, node_name, run
    from megatrace.check.thresholds import ThresholdsError, calibrated, load_thresholds, save_thresholds

    try:
        limits = load_thresholds(thresholds_path)
    except ThresholdsError as exc:
        raise click.ClickException(str(exc)) from None
    opts = CheckOptions(level=level, only=only, expect_gpus=expect_gpus, job_dir=job_dir, ring_dir=ring_dir,
                        timeout_s=timeout_s, node=node, net_backend=net_backend, thresholds=limits)
    try:
        with Watchdog(timeout_s, node_name(node)):
            report = run(opts)
    except Exception as exc:  # noqa: BLE001  (the checks could not run: say so, exit 1, never a traceback)
        click.echo(f"megatrace-check: the checks could not run: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1)
    if report.verdict_code is not None:  # not task 0 under MPI: task 0 prints for the allocation
        sys.exit(report.exit_code)
    text = table(report)
    click.echo(text.splitlines()[-1] if quiet else text)
    try:
        if json_path:
            write_json(report, json_path)
        if prom_textfile:
            write_prom(report, prom_textfile)
        if calibrate_path:
            busbw = report.value_of("net.allreduce")
            if busbw is None:
                click.echo("megatrace-check: --calibrate needs the all-reduce: run under srun/mpiexec", err=True)
                sys.exit(1)
            save_thresholds(calibrated(limits, busbw), calibrate_path,
                            f"calibrated on {len(report.nodes)} nodes, all-reduce bus bandwidth {busbw:.2f} GB/s")
            click.echo(f"thresholds written to {calibrate_path}")
    except OSError as exc:
        click.echo(f"megatrace-check: cannot write {exc.filename}: {exc.strerror}", err=True)
        sys.exit(1)
    sys.exit(report.exit_code)
