"""The end of a traced job: the report for every step that no collection covered.

The epilog runs ``megatrace job-end`` on every node, as the job's user, after it copied
the node's rings into ``<job-dir>/step-<s>/rings/``. Each node marks itself done in
``<state-dir>/epilog/<node>``; the job's first node (the leader, the batch host in
Slurm's node order) waits for the others' marks (at most ``wait_s``: a node whose
epilog never runs must not stop the report), then analyses each step directory that
holds rings but no ``findings.json`` (a collection during the job, of a hang or before
the time limit, already wrote its own). How each task ended (the SPANK plugin records
slurmstepd's exit statuses; the epilog hands them to ``<state-dir>/exits/<node>``)
becomes the step's ``procs.json``, so that a crashed rank is told from those Slurm
killed after it. ``megatrace analyze`` writes findings.json and report.html beside
the rings.

Nothing here fails the epilog: problems are logged, and the exit status is 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from megatrace.collect import safefs
from megatrace.names import safe_name

WAIT_S = 30.0
ANALYZE_TIMEOUT_S = 300.0
OUTPUT_REPORT_DIR = "job-output"  # the report of a job's output when no rank left a ring
STEP_DIR_RE = re.compile(r"step-([0-9]+|batch|interactive)")


@dataclass
class JobEnd:
    """What one node's ``job-end`` did."""

    node: str
    leader: str
    waited_s: float = 0.0
    missing_nodes: list[str] = field(default_factory=list)
    analysed: dict[str, str] = field(default_factory=dict)  # step directory -> verdict line or problem
    skipped: dict[str, str] = field(default_factory=dict)  # step directory -> why


def steps_to_analyse(job_dir: Path) -> tuple[list[Path], dict[str, str]]:
    """Step directories with rings and without findings.json, and why the others are skipped."""
    todo, skipped = [], {}
    try:
        entries = sorted(job_dir.iterdir())
    except OSError as exc:
        return [], {str(job_dir): f"cannot list: {exc.strerror or exc}"}
    for d in entries:
        if not STEP_DIR_RE.fullmatch(d.name) or d.is_symlink() or not d.is_dir():
            continue
        rings = d / "rings"
        if rings.is_symlink() or not any(rings.glob("rank-*.ring")):
            skipped[d.name] = "no rings"
        elif (d / "findings.json").exists():
            skipped[d.name] = "already analysed by a collection during the job"
        else:
            todo.append(d)
    return todo, skipped


def finish_job(job_dir: str, state_dir: str, node: str, nodes: list[str] | None, wait_s: float = WAIT_S,
               analyze_timeout_s: float = ANALYZE_TIMEOUT_S, log: Callable[[str], None] = lambda m: None,
               job_id: str | None = None, output_files: list[str] | None = None) -> JobEnd:
    """Mark ``node`` done; on the leader, wait for the others and analyse what no collection covered.

    The job's output files (``output_files``, else those Slurm names for ``job_id``) are handed to each analysis,
    which reads them for the ranks without a ring; when no step has rings at all, they are analysed on their own,
    into ``<job_dir>/job-output/``."""
    nodes = [n for n in (nodes or []) if n] or [node]
    result = JobEnd(node=node, leader=nodes[0])
    marks = Path(state_dir) / "epilog"
    with safefs.OutDir(state_dir) as state, state.subdir("epilog") as epilog:
        epilog.write(safe_name(node), f"{time.time_ns()}\n".encode(), replace=True)
    if node != result.leader:
        return result
    t0 = time.monotonic()
    while True:
        result.missing_nodes = [n for n in nodes if not (marks / safe_name(n)).exists()]
        if not result.missing_nodes or time.monotonic() - t0 >= wait_s:
            break
        time.sleep(0.5)
    result.waited_s = round(time.monotonic() - t0, 1)
    if result.missing_nodes:
        log(f"job-end: no epilog mark from {', '.join(result.missing_nodes)} after {wait_s:g} s; "
            "analysing what arrived")
    todo, result.skipped = steps_to_analyse(Path(job_dir))
    outputs = [Path(f) for f in output_files] if output_files is not None else _job_outputs(job_id, log)
    exits = read_task_exits(Path(state_dir) / "exits")
    for step in todo:
        step_exits = exits.get(step.name.removeprefix("step-"))
        if step_exits and not (step / "procs.json").exists():
            try:
                (step / "procs.json").write_text(json.dumps(procs_document(step_exits), indent=1) + "\n")
            except OSError as exc:
                log(f"job-end: {step.name}: cannot write procs.json: {exc.strerror or exc}")
        result.analysed[step.name] = _analyse(step, analyze_timeout_s, outputs)
        log(f"job-end: {step.name}: {result.analysed[step.name]}")
    if outputs and not todo and not any(why != "no rings" for why in result.skipped.values()):
        out = Path(job_dir) / OUTPUT_REPORT_DIR  # no rank left a ring: what the job printed is all there is
        result.analysed[OUTPUT_REPORT_DIR] = _analyse(outputs[0], analyze_timeout_s, outputs[1:], out)
        log(f"job-end: no rings; the job's output: {result.analysed[OUTPUT_REPORT_DIR]}")
    return result


def _job_outputs(job_id: str | None, log: Callable[[str], None]) -> list[Path]:
    """The job's output files as Slurm names them (none without a job id, or when Slurm cannot say)."""
    if not job_id:
        return []
    from megatrace.collect.slurm import JobLookupError, job_output

    try:
        return job_output(job_id).files
    except JobLookupError as exc:
        log(f"job-end: the job's output is not read: {exc}")
        return []


@dataclass(frozen=True)
class TaskExit:
    """How one task ended, as slurmstepd told the SPANK plugin (``exits-<job>.<node>`` lines)."""

    rank: int
    pid: int
    status: int  # the wait status
    wall_ns: int
    node: str

    @property
    def exit_code(self) -> int | None:
        return os.WEXITSTATUS(self.status) if os.WIFEXITED(self.status) else None

    @property
    def signal(self) -> str | None:
        if not os.WIFSIGNALED(self.status):
            return None
        try:
            return signal.Signals(os.WTERMSIG(self.status)).name
        except ValueError:
            return f"signal {os.WTERMSIG(self.status)}"


EXIT_LINE_RE = re.compile(r"step=(\S+) rank=(\d+) pid=(-?\d+) status=(-?\d+) wall_ns=(\d+)")
STOP_SIGNALS = ("SIGTERM", "SIGKILL", "SIGINT", "SIGHUP")  # what Slurm sends when it ends a step or job


def read_task_exits(directory: Path) -> dict[str, list[TaskExit]]:
    """Every node's task exits (``<directory>/<node>``), by step name; malformed lines are skipped."""
    out: dict[str, list[TaskExit]] = {}
    try:
        files = sorted(p for p in directory.iterdir() if p.is_file() and not p.is_symlink())
    except OSError:
        return out
    for path in files:
        try:
            text = path.read_text(errors="replace")[:4_000_000]
        except OSError:
            continue
        for line in text.splitlines():
            m = EXIT_LINE_RE.fullmatch(line.strip())
            if m:
                out.setdefault(m.group(1), []).append(TaskExit(int(m.group(2)), int(m.group(3)), int(m.group(4)),
                                                               int(m.group(5)), path.name))
    return out


def procs_document(exits: list[TaskExit]) -> dict[str, Any]:
    """procs.json (the analysis's process facts) from one step's task exits.

    The first task to end on its own (a non-zero status, or a signal Slurm does not send to stop a
    step, such as SIGSEGV) is the one that failed; tasks stopped by SIGTERM/SIGKILL after it, or in a
    step where no task failed on its own (a cancel, the time limit), were killed by Slurm."""
    first = min((e for e in exits if (e.exit_code or 0) != 0 or (e.signal and e.signal not in STOP_SIGNALS)),
                key=lambda e: e.wall_ns, default=None)
    ranks = {}
    for e in sorted(exits, key=lambda e: e.rank):
        killed = e is not first and e.signal in STOP_SIGNALS and (first is None or e.wall_ns >= first.wall_ns)
        ranks[str(e.rank)] = {"pid": e.pid, "exit_code": e.exit_code, "signal": e.signal,
                              "killed_by_launcher": killed, "node": e.node, "ended_wall_ns": e.wall_ns}
    message = "task exit statuses from slurmstepd (the MegaTrace SPANK plugin)"
    if first is not None:
        how = f"exited with status {first.exit_code}" if first.exit_code else f"was killed by {first.signal}"
        message += f"; rank {first.rank} on {first.node} {how} first"
    return {"outcome": "failed" if first is not None else None, "message": message, "ranks": ranks,
            "collected_by": "megatrace job-end"}


def _analyse(step: Path, timeout_s: float, logs: list[Path] = (), out: Path | None = None) -> str:
    """``megatrace analyze STEP --with-log ...`` in a child process; its verdict line, or what went wrong."""
    cmd = [sys.executable, "-m", "megatrace.cli", "analyze", str(step)]
    cmd += [a for f in logs for a in ("--with-log", str(f))]
    cmd += ["-o", str(out)] if out is not None else []
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"analysis did not finish within {timeout_s:g} s; run: megatrace analyze {step}"
    except OSError as exc:
        return f"cannot run the analysis: {exc}"
    verdict = next((line for line in proc.stdout.splitlines() if line.startswith("VERDICT")), "")
    if proc.returncode not in (0, 3) or not verdict:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"analysis failed (exit {proc.returncode}): {tail[:300]}"
    report = (out or step) / "report.html"
    return verdict + (f"; report: {report}" if report.exists() else "")
