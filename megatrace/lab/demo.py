"""``megatrace lab demo``: the demo job under ``sbatch --megatrace`` on the lab, then its report.

A batch script runs ``srun -N4 -n8 --overcommit python -m megatrace.demo`` (the
demo worker takes rank and world from SLURM_PROCID / SLURM_NTASKS) with an
injected fault. With a hang, the node agents the prolog started see every node
stall for ``hang-timeout`` (30 s), confirm it together, collect every node's
rings with the mpi4py collector beside the hung step, write the report into
``<job dir>/step-0/`` and cancel the job (``on-hang=cancel``), minutes before
gloo's own timeout would have ended it. A job that ends by itself gets its report
from the epilog (``megatrace job-end``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megatrace.lab import LabError
from megatrace.names import job_dir_name, step_dir_name

Log = Callable[[str], None]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}


@dataclass(frozen=True)
class LabDemo:
    nodes: int = 4
    ranks: int = 8
    tp: int = 2
    pp: int = 2
    steps: int = 20
    fault: str = "hang:rank=5,step=3"
    hang_timeout_s: int = 30  # the agents' --megatrace=hang-timeout
    on_hang: str = "cancel"
    comm_timeout_s: int = 900  # gloo's timeout: the agents must be the ones to catch the hang
    time_limit_min: int = 15
    timeout_s: float = 600.0


def batch_script(demo: LabDemo) -> str:
    dp = demo.ranks // (demo.tp * demo.pp)
    fault = f"--fault {demo.fault} " if demo.fault else ""
    return f"""#!/bin/bash
# The MegaTrace demo job under Slurm (written by `megatrace lab demo`).
# Rank and world come from SLURM_PROCID / SLURM_NTASKS; every virtual node is this host.
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)) OMP_NUM_THREADS=1
out="${{MEGATRACE_OUT_DIR:-$SLURM_SUBMIT_DIR/megatrace-$SLURM_JOB_ID}}/step-0"
srun -N{demo.nodes} -n{demo.ranks} --overcommit --kill-on-bad-exit=1 \\
    {sys.executable} -m megatrace.demo --tp {demo.tp} --pp {demo.pp} --dp {dp} --steps {demo.steps} \\
    {fault}--comm-timeout {demo.comm_timeout_s} -o "$out"
echo "megatrace demo: srun exited with status $?; traces in $out"
"""


def _job_state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    return fields.get("JobState", "UNKNOWN")


def wait_for_job(job: str, timeout: float, log: Log) -> str:
    until = time.monotonic() + timeout
    last = ""
    while time.monotonic() < until:
        state = _job_state(job)
        if state != last:
            log(f"lab demo: job {job} {state}")
            last = state
        if state in TERMINAL:
            return state
        time.sleep(1.0)
    subprocess.run(["scancel", job], capture_output=True)
    raise LabError(f"job {job} did not finish within {timeout:g} s; cancelled")


def run(demo: LabDemo, workdir: Path, log: Log) -> Path:
    """Submit, wait, analyze; return the trace directory (findings.json, report.html inside)."""
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / "megatrace-demo.sbatch"
    script.write_text(batch_script(demo))
    option = f"--megatrace=hang-timeout={demo.hang_timeout_s},on-hang={demo.on_hang}"
    proc = subprocess.run(["sbatch", "--parsable", option, f"-N{demo.nodes}", f"-n{demo.ranks}", "--overcommit",
                           f"--time={demo.time_limit_min}", "-J", "megatrace-demo", "-o", "megatrace-demo-%j.out",
                           str(script)], cwd=workdir, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LabError(f"sbatch failed: {proc.stderr.strip()}")
    job = proc.stdout.strip().split(";")[0]
    log(f"lab demo: sbatch {option} -N{demo.nodes} -n{demo.ranks} --overcommit {script.name}: job {job} "
        f"(fault {demo.fault})")
    state = wait_for_job(job, demo.timeout_s, log)
    trace_dir = workdir / job_dir_name(job) / step_dir_name(0)
    rings = list((trace_dir / "rings").glob("rank-*.ring"))
    if not rings:
        raise LabError(f"job {job} ended {state} without rings in {trace_dir / 'rings'}; "
                       f"see {workdir / f'megatrace-demo-{job}.out'}")
    log(f"lab demo: job {job} {state}; {len(rings)} rings in {trace_dir / 'rings'}")
    collection = trace_dir / "collection.json"
    if collection.exists():
        trigger = json.loads(collection.read_text()).get("trigger", {}).get("reason")
        log(f"lab demo: the node agents collected the job while it ran (trigger: {trigger}); what on-hang did "
            f"is in {workdir / f'megatrace-demo-{job}.out'}")
    if (trace_dir / "findings.json").exists() and (trace_dir / "report.html").exists():
        summary = trace_dir / "summary.txt"
        if summary.exists():
            print(summary.read_text().rstrip())
        else:
            print(f"VERDICT {json.loads((trace_dir / 'findings.json').read_text()).get('verdict')}")
        return trace_dir / "report.html"
    log(f"lab demo: no report in {trace_dir} yet: analysing here")
    megatrace = shutil.which("megatrace", path=str(Path(sys.executable).parent)) or "megatrace"
    analysis = subprocess.run([megatrace, "analyze", str(trace_dir)])
    if analysis.returncode not in (0, 3):
        raise LabError(f"megatrace analyze {trace_dir} failed (exit {analysis.returncode})")
    findings = trace_dir / "findings.json"
    if (trace_dir / "report.html").exists():
        return trace_dir / "report.html"
    report = subprocess.run([megatrace, "report", str(findings)], capture_output=True, text=True)
    if report.returncode == 0 and (trace_dir / "report.html").exists():
        return trace_dir / "report.html"
    return findings
