"""``megatrace lab``: the click group (imports only click; the work is imported inside each command)."""

from __future__ import annotations

import click

from megatrace.cli.settings import CONTEXT_SETTINGS, CommandError

LAB_DIR_OPTION = click.option("--lab-dir", type=click.Path(file_okay=False), envvar="MEGATRACE_LAB_DIR",
                              show_envvar=True, default="/var/lib/megatrace-lab", show_default=True,
                              help="Where the lab keeps its config, state, pids and logs.")


def _paths(lab_dir: str):
    from megatrace.lab.paths import LabPaths

    return LabPaths.default(lab_dir)


def _fail(exc: Exception) -> CommandError:
    return CommandError(str(exc))


@click.group(context_settings=CONTEXT_SETTINGS, epilog="""\b
Examples:
  sudo megatrace lab up --nodes 4
  sudo megatrace lab up --slurm-source slurm-26.05.3.tar.gz     # a current release, built once
  megatrace lab status
  sbatch --megatrace -N4 -n8 --overcommit job.sh
  sudo megatrace lab demo
  sudo megatrace lab down
""")
def lab() -> None:
    """Run a local Slurm cluster (munge, slurmctld, N slurmd on this host) with the MegaTrace plugin.

    `up` installs what is missing (apt: slurm, munge, libslurm-dev; pip: mpich, mpi4py),
    writes /etc/slurm/slurm.conf (never over a configuration the lab did not write),
    builds and installs the SPANK plugin, prolog and epilog, and starts the daemons.
    It runs Debian's Slurm, or another release: --slurm PREFIX (installed there) or
    --slurm-source TARBALL (built once, kept); the lab's commands then use that release.
    `down` stops only the daemons `up` started, by their recorded pids.
    """


@lab.command(context_settings=CONTEXT_SETTINGS)
@click.option("--nodes", type=click.IntRange(1, 64), default=4, show_default=True, help="Virtual nodes (n1..nN).")
@click.option("--skip-install", is_flag=True, help="Do not install packages, plugin or scripts.")
@click.option("--health-interval", type=click.IntRange(0), default=300, show_default=True,
              help="Seconds between slurmd's runs of the MegaTrace HealthCheckProgram (0: never).")
@click.option("--slurm", "slurm_prefix", type=click.Path(file_okay=False, exists=True), metavar="PREFIX",
              help="Run the Slurm installed under PREFIX (a source build, configured with --enable-multiple-slurmd) "
                   "[default: the one the lab runs, else Debian's packages].")
@click.option("--slurm-source", type=click.Path(dir_okay=False, exists=True), metavar="TARBALL",
              help="Build the Slurm of this source tarball (slurm-X.Y.Z.tar.gz) into /opt/megatrace-slurm and run "
                   "it; a build of the same tarball and options is reused.")
@LAB_DIR_OPTION
def up(nodes: int, skip_install: bool, health_interval: int, slurm_prefix: str | None, slurm_source: str | None,
       lab_dir: str) -> None:
    """Bring the lab up (idempotent: starts only what is not running)."""
    from megatrace.lab import LabError, control, slurm_install
    from megatrace.lab.slurmconf import LabSpec

    if slurm_prefix and slurm_source:
        raise click.UsageError("give --slurm PREFIX or --slurm-source TARBALL, not both")
    log = lambda m: click.echo(m, err=True)  # noqa: E731
    try:
        slurm = (slurm_install.from_prefix(slurm_prefix) if slurm_prefix else
                 slurm_install.build_from_source(slurm_source, log) if slurm_source else None)
        st = control.up(LabSpec(nodes=nodes, health_interval=health_interval), _paths(lab_dir), log=log,
                        skip_install=skip_install, slurm=slurm)
    except LabError as exc:
        raise _fail(exc) from None
    on = f" on Slurm {st['slurm']['version']} ({st['slurm']['prefix'] or 'the system'})"
    click.echo(f"lab up{on}: {len(st['nodes'])} nodes ({', '.join(f'{n} {s}' for n, s in st['nodes'].items())})")


@lab.command(context_settings=CONTEXT_SETTINGS)
@LAB_DIR_OPTION
def down(lab_dir: str) -> None:
    """Stop the daemons `up` started (and only those)."""
    from megatrace.lab import LabError, control

    try:
        stopped = control.down(_paths(lab_dir), log=lambda m: click.echo(m, err=True))
    except LabError as exc:
        raise _fail(exc) from None
    click.echo("lab down: " + (", ".join(stopped) if stopped else "nothing was running"))


@lab.command(context_settings=CONTEXT_SETTINGS)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@LAB_DIR_OPTION
def status(as_json: bool, lab_dir: str) -> None:
    """Show the lab's daemons and nodes; exit 1 when the lab is not (fully) up."""
    import json

    from megatrace.lab import control

    st = control.status(_paths(lab_dir))
    if as_json:
        click.echo(json.dumps(st, indent=2))
    else:
        slurm = st["slurm"]
        click.echo(f"lab {'up' if st['up'] else 'down'} ({st['root']}); Slurm {slurm['version'] or '?'} "
                   f"({slurm['prefix'] or 'the system'})")
        for d in st["daemons"]:
            click.echo(f"  {d['name']:<12} pid {d['pid']:<8} {'running' if d['running'] else 'gone'}")
        for node, state in st["nodes"].items():
            click.echo(f"  {node:<12} {state}")
    if not st["up"]:
        raise click.exceptions.Exit(1)


@lab.command("demo", context_settings=CONTEXT_SETTINGS)
@click.option("--nodes", type=click.IntRange(1, 64), default=4, show_default=True, help="Virtual nodes.")
@click.option("--ranks", type=click.IntRange(4), default=8, show_default=True, help="Ranks (tp=2, pp=2).")
@click.option("--fault", default="hang:rank=5,step=3", show_default=True, help="Injected fault (see `megatrace demo`).")
@click.option("-C", "--workdir", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Submit from here: the job directory is WORKDIR/megatrace-<jobid>.")
@LAB_DIR_OPTION
def demo_cmd(nodes: int, ranks: int, fault: str, workdir: str, lab_dir: str) -> None:
    """Bring the lab up, run the demo job with `sbatch --megatrace`, analyze it, print the report's path."""
    from pathlib import Path

    from megatrace.lab import LabError, control
    from megatrace.lab import demo as lab_demo
    from megatrace.lab.slurmconf import LabSpec

    log = lambda m: click.echo(m, err=True)  # noqa: E731
    try:
        control.up(LabSpec(nodes=nodes), _paths(lab_dir), log=log)
        report = lab_demo.run(lab_demo.LabDemo(nodes=nodes, ranks=ranks, fault=fault), Path(workdir).resolve(), log)
    except LabError as exc:
        raise _fail(exc) from None
    click.echo(f"lab demo: the report: {report}")
