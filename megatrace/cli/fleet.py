"""``megatrace health`` (Slurm's HealthCheckProgram) and ``megatrace nodes`` (the health history).

Imports only click at load time; the work happens in the bodies.
"""

from __future__ import annotations

import datetime

import click

from megatrace.cli.settings import CONTEXT_SETTINGS, CommandError


@click.command(context_settings=CONTEXT_SETTINGS, epilog="""\b
Examples:
  megatrace health --node n7 --expect-gpus 8
  megatrace health --no-act --alerts configs/alerts.yaml      # check and alert, never drain

\b
In slurm.conf (slurmd runs it as root on every node):
  HealthCheckProgram=/usr/local/lib/megatrace/healthcheck   # slurm/healthcheck (docs/fleet.md)
  HealthCheckInterval=300
  HealthCheckNodeState=ANY

\b
Exit status: 0 healthy (or warnings), 4 a check failed (the node is drained), 1 could not run.
""")
@click.option("--node", default=None, help="This node's Slurm name [default: SLURMD_NODENAME or hostname].")
@click.option("--expect-gpus", type=click.IntRange(0), default=None, help="GPUs this node must have.")
@click.option("--resume-after", type=click.IntRange(1), default=3, show_default=True,
              help="Return a node MegaTrace drained to service after this many passing checks in a row.")
@click.option("--history", "history_path", type=click.Path(dir_okay=False), envvar="MEGATRACE_HISTORY",
              default=None, help="The history store [default: /var/lib/megatrace/history.db; env MEGATRACE_HISTORY].")
@click.option("--alerts", "alerts_path", type=click.Path(dir_okay=False), envvar="MEGATRACE_ALERTS", default=None,
              help="Alert levels and receivers (YAML; see configs/alerts.yaml) [env MEGATRACE_ALERTS].")
@click.option("--thresholds", "thresholds_path", type=click.Path(dir_okay=False), envvar="MEGATRACE_THRESHOLDS",
              default=None, help="The site's check limits (configs/thresholds.yaml) [env MEGATRACE_THRESHOLDS].")
@click.option("--no-act", is_flag=True, help="Check, record and alert, but never drain or resume.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(1), default=30.0, show_default=True,
              help="Seconds before a hung check counts as a failure.")
def health(node: str | None, expect_gpus: int | None, resume_after: int, history_path: str | None,
           alerts_path: str | None, thresholds_path: str | None, no_act: bool, timeout_s: float) -> None:
    """Check this node, drain it when it fails, return it to service when it heals, alert.

    Meant for Slurm's HealthCheckProgram: quick node and GPU checks (megatrace-check
    --level quick), the result kept in the history store, a failing node drained with
    a reason starting "megatrace:", a node that MegaTrace drained resumed after
    --resume-after passing checks in a row (never one drained by someone else), and
    failures sent as alerts (deduplicated and rate-limited).
    """
    from megatrace.check.runner import CheckOptions, Watchdog
    from megatrace.names import node_name
    from megatrace.check.thresholds import ThresholdsError, load_thresholds
    from megatrace.fleet.alerts import AlertConfigError, load_alert_config
    from megatrace.fleet.health import health_check
    from megatrace.fleet.history import open_history

    name = node_name(node)
    try:
        limits, alert_cfg = load_thresholds(thresholds_path), load_alert_config(alerts_path)
    except (ThresholdsError, AlertConfigError) as exc:
        raise CommandError(str(exc)) from None
    history, problem = open_history(history_path)  # a corrupt or locked store never stops the check
    if problem:
        click.echo(f"megatrace health: {problem}", err=True)
    opts = CheckOptions(level="quick", only=("gpu", "node"), expect_gpus=expect_gpus, timeout_s=timeout_s,
                        node=name, thresholds=limits)
    with Watchdog(timeout_s + 15, name), history:
        out = health_check(name, opts, history, alert_cfg, resume_after, act=not no_act)
    status = out.report.status.value
    line = f"megatrace health {name}: {status}"
    if out.action:
        line += f"; {'drained: ' + (out.reason or '') if out.action == 'drain' else 'returned to service'}"
    if out.alerts and out.alerts.sent:
        line += f"; {len(out.alerts.sent)} alert(s) sent"
    click.echo(line)
    for err in out.errors:
        click.echo(f"megatrace health: {err}", err=True)
    if status == "fail":
        raise click.exceptions.Exit(4)


@click.command(context_settings=CONTEXT_SETTINGS, epilog="""\b
Examples:
  megatrace nodes
  megatrace nodes --history /shared/megatrace/history.db --window 20
""")
@click.option("--history", "history_path", type=click.Path(dir_okay=False), envvar="MEGATRACE_HISTORY",
              default=None, help="The history store [default: /var/lib/megatrace/history.db].")
@click.option("--window", type=click.IntRange(1), default=10, show_default=True, help="Checks per node to count.")
def nodes(history_path: str | None, window: int) -> None:
    """Show each node's recent health checks, the nodes that stand out first.

    A node that failed 3 or more of its last --window checks is marked "!": flaky
    or broken even when it passes right now.
    """
    from pathlib import Path

    from megatrace.fleet.history import History, default_path

    path = Path(history_path) if history_path else default_path()
    if not path.exists():
        raise CommandError(f"no health history at {path} (run `megatrace health` first, or give --history)")
    with History(path) as history:
        rows = history.summary(window)
    if not rows:
        click.echo(f"no checks recorded in {path}")
        return
    click.echo(f"{'':1} {'node':16} {'last':5} {'when (UTC)':19} {'fail':>4} {'warn':>4} {'of':>3}  last problem")
    for s in rows:
        when = datetime.datetime.fromtimestamp(s.last_t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        click.echo(f"{'!' if s.stands_out else ' '} {s.node:16} {s.last_status:5} {when:19} {s.failed:>4} "
                   f"{s.warned:>4} {s.checks:>3}  {s.last_problem or ''}")
