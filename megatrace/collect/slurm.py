"""Slurm glue for the collector and the agent: node lists, the collector's srun line, on-hang actions.

The functions here are what the prolog, the epilog and the lab call:

* :func:`collect_command` builds the ``srun --overlap`` command that runs one
  collector task per node of a running (possibly hung) job, :func:`run_collect` runs it;
* :func:`agent_command` builds the ``srun --overlap`` command that starts one agent per node;
* :func:`expand_hostlist` expands ``SLURM_JOB_NODELIST`` (``n[1-4],gpu[01-03,07]``)
  without calling ``scontrol``;
* :func:`hang_action` cancels or requeues the job after a confirmed hang (``--on-hang``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping

ON_HANG = ("report", "cancel", "requeue")
SCONTROL_TIMEOUT_S = 30.0


def expand_hostlist(spec: str) -> list[str]:
    """Expand a Slurm host list: ``"n[1-3],gpu[01-02,07],login"`` -> n1 n2 n3 gpu01 gpu02 gpu07 login.

    Several bracket groups in one name (``r[1-2]n[1-2]``) expand as a product. Raises ValueError
    on a malformed list.
    """
    names: list[str] = []
    for part in _split_top(spec.strip()):
        if part:
            names.extend(_expand_one(part))
    return names


def _split_top(spec: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in spec:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {spec!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '[' in host list {spec!r}")
    parts.append(cur)
    return parts


def _expand_one(name: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if not m:
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    out = []
    for rng in m.group(1).split(","):
        lo, sep, hi = rng.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {rng!r} in host list entry {name!r}")
        width = len(lo)
        for i in range(int(lo), int(hi if sep else lo) + 1):
            out.extend(_expand_one(f"{head}{i:0{width}d}{tail}"))
    return out


def job_nodes(env: Mapping[str, str] | None = None) -> list[str] | None:
    """The job's nodes from ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``), or None outside Slurm."""
    env = os.environ if env is None else env
    spec = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not spec:
        return None
    try:
        return expand_hostlist(spec)
    except ValueError:
        return None


def collect_command(job_id: str, job_dir: str, trigger: str = "end", nodes: int | None = None,
                    ring_dir: str | None = None, python: str | None = None, timeout_s: float = 60.0,
                    extra: list[str] | None = None, srun: str = "srun") -> list[str]:
    """The ``srun`` command that runs the collector once on every node of job ``job_id``.

    ``--overlap`` lets it start beside a step that holds all the job's CPUs (a hung training step);
    ``--mpi=pmi2`` is how the mpich wheel's MPI is started by Slurm (pmix fails when several slurmd share
    a host). ``--kill-on-bad-exit=0`` keeps one failing node from killing the others' collectors; the
    collector names it missing. Run it from inside the allocation (batch script, agent) or from outside
    with the job id (``--jobid``). ``ring_dir`` may contain ``%n`` (the node name).
    """
    cmd = [srun, f"--jobid={job_id}", "--overlap", "--mpi=pmi2", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
           "--job-name=megatrace-collect", f"--time={max(1, int(timeout_s * 2 // 60) + 1)}"]
    if nodes:
        cmd += [f"--nodes={nodes}", f"--ntasks={nodes}"]
    cmd += [python or sys.executable, "-m", "megatrace.cli", "collect", "--job-id", job_id, "--job-dir", job_dir,
            "--trigger", trigger, "--timeout", str(timeout_s)]
    if ring_dir:
        cmd += ["--ring-dir", ring_dir]
    return cmd + list(extra or [])


def agent_command(job_id: str, job_dir: str, hang_timeout_s: float = 300.0, on_hang: str = "report",
                  nodes: int | None = None, python: str | None = None, extra: list[str] | None = None,
                  srun: str = "srun") -> list[str]:
    """The ``srun`` command that starts one agent per node of job ``job_id`` (run it in the background)."""
    cmd = [srun, f"--jobid={job_id}", "--overlap", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
           "--job-name=megatrace-agent"]
    if nodes:
        cmd += [f"--nodes={nodes}", f"--ntasks={nodes}"]
    return cmd + [python or sys.executable, "-m", "megatrace.cli", "agent", "--job-id", job_id, "--job-dir",
                  job_dir, "--hang-timeout", str(hang_timeout_s), "--on-hang", on_hang] + list(extra or [])


def run_collect(job_id: str, job_dir: str, trigger: str = "end", nodes: int | None = None,
                timeout_s: float = 60.0, **kwargs: object) -> subprocess.CompletedProcess:
    """Run :func:`collect_command` and wait (at most twice ``timeout_s`` + 60 s); for the epilog and the lab."""
    cmd = collect_command(job_id, job_dir, trigger, nodes, timeout_s=timeout_s, **kwargs)  # type: ignore[arg-type]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=2 * timeout_s + 60)


def hang_action(action: str, job_id: str | None, env: Mapping[str, str] | None = None) -> str:
    """Carry out ``--on-hang`` after the report is written; returns what was done, in words."""
    env = os.environ if env is None else env
    if action == "report":
        return "reported (the job keeps running)"
    if action not in ON_HANG:
        raise ValueError(f"unknown on-hang action {action!r} (one of {', '.join(ON_HANG)})")
    if not job_id or not re.fullmatch(r"\d+([_+]\d+)?", job_id) \
            or not (env.get("SLURM_JOB_ID") or shutil.which("scontrol")):
        return f"not a Slurm job (job id {job_id!r}): '{action}' skipped"
    cmd = ["scancel", job_id] if action == "cancel" else ["scontrol", "requeue", job_id]
    if shutil.which(cmd[0]) is None:
        return f"{cmd[0]} not found: '{action}' skipped"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{' '.join(cmd)} did not return within {SCONTROL_TIMEOUT_S:.0f} s"
    if proc.returncode:
        return f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[:300]}"
    return f"{' '.join(cmd)}: done"
