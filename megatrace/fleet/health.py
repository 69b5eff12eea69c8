"""The periodic health check (Slurm's HealthCheckProgram): check, remember, drain or return to service, alert.

Runs on each node as slurmd's HealthCheckProgram (root), bounded in time. A
failing node is drained with a reason starting ``megatrace:``; a node that
MegaTrace itself drained returns to service (``resume``) after it passed
``resume_after`` consecutive checks. A node drained by anyone else (another
reason) is never touched.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import subprocess
from dataclasses import dataclass, field

from megatrace.check.results import ProbeResult, Status
from megatrace.check.runner import CheckOptions, CheckReport, check_this_node
from megatrace.fleet.alerts import Alert, AlertConfig, Dispatch, dispatch
from megatrace.fleet.history import History

REASON_PREFIX = "megatrace:"
SCONTROL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class NodeState:
    state: str  # e.g. "IDLE", "IDLE+DRAIN", "MIXED+DRAIN", "DOWN"
    reason: str  # "" when none

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.state

    @property
    def ours(self) -> bool:
        return self.reason.startswith(REASON_PREFIX)


@dataclass
class HealthOutcome:
    report: CheckReport
    action: str | None  # "drain", "resume" or None
    reason: str | None = None
    state: NodeState | None = None
    alerts: Dispatch | None = None
    errors: list[str] = field(default_factory=list)


def decide(status: Status, state: NodeState | None, recent: list[str], resume_after: int) -> str | None:
    """What to do with the node: drain it, resume it, or nothing.

    ``recent``: its last check statuses, newest first (this one included).
    """
    if state is None:
        return None
    if status == Status.FAIL:
        return None if state.drained else "drain"
    if state.drained and state.ours and len(recent) >= resume_after \
            and all(s != Status.FAIL.value for s in recent[:resume_after]):
        return "resume"
    return None


def parse_scontrol_node(line: str) -> NodeState:
    """State and Reason from one line of ``scontrol show node NAME -o``."""
    state = re.search(r"\bState=(\S+)", line)
    reason = re.search(r"\bReason=(.*?)(?: \[[^\]]*\])?\s*$", line)
    return NodeState(state.group(1) if state else "UNKNOWN", reason.group(1).strip() if reason else "")


def node_state(node: str) -> NodeState | None:
    """The node as slurmctld sees it; None when scontrol is missing or does not answer."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        done = subprocess.run([scontrol, "show", "node", node, "-o"], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode or not done.stdout.strip():
        return None
    return parse_scontrol_node(done.stdout.strip().splitlines()[0])


def set_node(node: str, action: str, reason: str | None = None) -> str | None:
    """``scontrol update`` the node (drain with ``reason``, or resume); returns an error text or None."""
    argv = [shutil.which("scontrol") or "scontrol", "update", f"nodename={node}"]
    argv += [f"state={'drain' if action == 'drain' else 'resume'}"]
    if action == "drain":
        argv.append(f"reason={reason or REASON_PREFIX + ' failed its health check'}")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol {action} {node}: {exc}"
    return f"scontrol {action} {node}: {done.stderr.strip()}" if done.returncode else None


def drain_reason(results: list[ProbeResult]) -> str:
    worst = next(r for r in sorted(results, key=lambda r: -r.status.rank) if r.status == Status.FAIL)
    return worst.drain_reason()


def _part(r: ProbeResult) -> str:
    """The part of the node a result is about, for the alert's key ("" for the node itself)."""
    s = r.subject
    return f"GPU{s.gpu}" if s.gpu is not None else s.port or (f"link to {s.peer}" if s.peer else "")


def health_check(node: str, opts: CheckOptions, history: History, alert_cfg: AlertConfig,
                 resume_after: int = 3, act: bool = True) -> HealthOutcome:
    """One health check of this node: see the module docstring."""
    results, facts = check_this_node(opts, node)
    report = CheckReport([node], results, {node: facts})
    status = report.status
    worst_result = max(results, key=lambda r: r.status.rank, default=None)
    errors: list[str] = []
    try:  # the store may be locked by another process for longer than its busy timeout: decide anyway
        history.record_check(node, status.value, worst_result.probe if worst_result else None,
                             worst_result.message if worst_result and status != Status.OK else None)
        recent = history.recent_statuses(node, resume_after)
    except sqlite3.Error as exc:
        errors.append(f"history store: {exc}; judged on this check alone")
        recent = [status.value]  # enough to drain, never enough to resume
    state = node_state(node)
    action = decide(status, state, recent, resume_after)
    out = HealthOutcome(report, action, state=state, errors=errors)
    if action == "drain":
        out.reason = drain_reason(results)
    if action and act:
        err = set_node(node, action, out.reason)
        if err:
            out.errors.append(err)
    alerts = [Alert(node, r.probe, r.status.value, r.message, part=_part(r)) for r in results
              if r.status in (Status.FAIL, Status.WARN)]
    try:
        out.alerts = dispatch(alerts, alert_cfg, history)
        out.errors += out.alerts.errors
    except sqlite3.Error as exc:
        out.errors.append(f"history store: {exc}; alerts not sent this time (no deduplication possible)")
    return out
