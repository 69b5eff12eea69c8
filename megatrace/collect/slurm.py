"""Slurm glue for the collector and the agent: node lists, the collector's srun line, on-hang actions.

The functions here are what the prolog, the epilog and the lab call:

* :func:`collect_command` builds the ``srun --overlap`` command that runs one
  collector task per node of a running (possibly hung) job, :func:`run_collect` runs it;
* :func:`agent_command` builds the ``srun --overlap`` command that starts one agent per node;
* :func:`expand_hostlist` expands ``SLURM_JOB_NODELIST`` (``n[1-4],gpu[01-03,07]``)
  without calling ``scontrol``;
* :func:`hang_action` cancels or requeues the job after a confirmed hang (``--on-hang``), saying why;
* :func:`job_fields` and :func:`end_time` read the job's record (the agent's time-limit watch);
* :func:`job_output` finds a job's output files (``megatrace analyze --job``, the end-of-job report).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from megatrace.errors import MegatraceError

ON_HANG = ("report", "cancel", "requeue")
SCONTROL_TIMEOUT_S = 30.0
EXCLUDE_WAIT_S = 60.0  # how long a requeued job may take to be pending again (its epilogs run first)


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


# Fields that `scontrol show job` prints alone on their line (or last on the first line, JobName): their values
# may hold blanks (a StdOut path with spaces) and are taken whole, never split into words.
WHOLE_LINE_FIELDS = ("Command", "WorkDir", "AdminComment", "Comment", "StdErr", "StdIn", "StdOut", "Power")


def job_fields(job_id: str, scontrol: str = "scontrol") -> dict[str, str]:
    """``scontrol show job JOB`` as a dict (empty when it cannot be read): see :func:`parse_job_record`."""
    try:
        out = subprocess.run([scontrol, "show", "job", job_id], capture_output=True, text=True,
                             timeout=SCONTROL_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_job_record(out)


def parse_job_record(text: str) -> dict[str, str]:
    """The fields of one job in ``scontrol show job`` (multi-line) output, never split at a blank inside a value.

    JobName (last on the first line) and the fields of :data:`WHOLE_LINE_FIELDS` are taken to the end of
    their line; the other lines hold blank-free ``Key=Value`` words. The first value of a key wins, so a
    job name cannot stand in for a field printed after it.
    """
    fields: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines()):
        line = raw.strip()
        if number == 0 and " JobName=" in line:
            head, _, name = line.partition(" JobName=")
            fields.update(item.split("=", 1) for item in head.split() if "=" in item)
            fields["JobName"] = name
            continue
        key, eq, value = line.partition("=")
        if eq and key in WHOLE_LINE_FIELDS:
            fields.setdefault(key, value)
            continue
        for item in line.split():
            if "=" in item:
                k, v = item.split("=", 1)
                fields.setdefault(k, v)
    return fields


def end_time(fields: Mapping[str, str]) -> float | None:
    """The job's planned end (``EndTime``, local time) as a Unix time; None when unlimited or unknown."""
    value = fields.get("EndTime", "")
    if fields.get("TimeLimit") in (None, "UNLIMITED", "Partition_Limit") or not value or value == "Unknown":
        return None
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def say_in_job_output(fields: Mapping[str, str], text: str) -> bool:
    """Append a line to the job's standard output file (run as the job's user); True when written.

    Opened with O_APPEND and without following a link; a device or a missing file is left alone."""
    path = fields.get("StdOut", "")
    if not path.startswith("/"):
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        os.write(fd, (text.rstrip("\n") + "\n").encode(errors="replace"))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def hang_action(action: str, job_id: str | None, env: Mapping[str, str] | None = None, reason: str = "",
                exclude_node: str | None = None) -> str:
    """Carry out ``--on-hang`` after the report is written; returns what was done, in words.

    ``reason`` (one line) goes into the job's output file and its Comment (``scontrol show job``, and
    ``sacct --format=Comment`` where accounting stores comments) before ``scancel``/``requeue``.
    ``exclude_node``: for a requeue, the culprit's node, added to the job's excluded nodes first so
    that the job does not land on it again.
    """
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
    done = []
    if reason:
        line = " ".join(f"megatrace: {reason}; {'cancelling' if action == 'cancel' else 'requeueing'} "
                        f"the job (on-hang={action})".split())[:480]
        if say_in_job_output(job_fields(job_id), line):
            done.append("said why in the job's output")
        if _scontrol_update(job_id, f"Comment={_clip(line, 250)}") is None:
            done.append("set the job's comment")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "; ".join([*done, f"{' '.join(cmd)} did not return within {SCONTROL_TIMEOUT_S:.0f} s"])
    if proc.returncode:
        return "; ".join([*done, f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[:300]}"])
    done.append(f"{' '.join(cmd)}: done")
    if action == "requeue" and exclude_node and re.fullmatch(r"[A-Za-z0-9._-]+", exclude_node):
        done.append(_exclude(job_id, exclude_node))
    return "; ".join(done)


def _exclude(job_id: str, node: str, wait_s: float = EXCLUDE_WAIT_S) -> str:
    """Add ``node`` to a requeued job's excluded nodes; Slurm accepts that only once the job is pending
    again (after its epilogs), so try until then."""
    until = time.monotonic() + wait_s
    problem: str | None = "not tried"
    while time.monotonic() < until:
        excluded = [n for n in expand_hostlist(job_fields(job_id).get("ExcNodeList", "") or "") if n != "(null)"]
        problem = _scontrol_update(job_id, "ExcNodeList=" + ",".join(dict.fromkeys([*excluded, node])))
        if problem is None:
            return f"excluded node {node} from the requeued job"
        time.sleep(1.0)
    return f"could not exclude node {node}: {problem}"


def _clip(text: str, limit: int) -> str:
    """``text`` cut at the last word boundary within ``limit`` characters, marked with an ellipsis."""
    if len(text) <= limit:
        return text
    cut = text[:limit - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(" ;,") + "…"


def _scontrol_update(job_id: str, setting: str) -> str | None:
    """``scontrol update JobId=JOB SETTING``; None on success, else the error in words."""
    try:
        proc = subprocess.run(["scontrol", "update", f"JobId={job_id}", setting], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit {proc.returncode}")[:200]


# -- a job's output files (megatrace analyze --job, job-end) ------------------------------------------

JOB_ID_RE = re.compile(r"[0-9]{1,12}(?:_[0-9]{1,9})?")
FILE_PATTERN = re.compile(r"%(\d{0,2})([AaJjNnstux%])")  # sbatch's filename patterns (man sbatch)
SACCT_FIELDS = ("JobIDRaw", "JobName", "User", "WorkDir", "NodeList", "StdOut", "StdErr")  # StdOut: Slurm 23.02+


class JobLookupError(MegatraceError):
    """Slurm does not know the job, or names no output file of it; the message says what was asked and why."""


@dataclass
class JobOutput:
    """Where a Slurm job's output went: the files that exist, and those Slurm named that cannot be read."""

    job_id: str
    files: list[Path]
    source: str  # "scontrol", "sacct", or "sacct (default name)"
    work_dir: str = ""
    unreadable: list[str] = field(default_factory=list)  # "PATH: why"


def job_output(job_id: str, scontrol: str = "scontrol", sacct: str = "sacct") -> JobOutput:
    """The output files (StdOut, StdErr) of job ``job_id``: from ``scontrol show job`` while Slurm holds the job,
    else from ``sacct`` (which names them from Slurm 23.02; before, the sbatch default ``slurm-<id>.out`` in
    its working directory). Patterns (``%j``, ``%x``, ...) are expanded. Raises :class:`JobLookupError`."""
    if not JOB_ID_RE.fullmatch(job_id):
        raise JobLookupError(f"--job {job_id!r}: not a Slurm job id (digits, or ARRAYID_TASK for an array task)")
    fields = job_fields(job_id, scontrol)
    source = "scontrol"
    if not fields.get("JobId"):
        fields, source = _sacct_fields(job_id, sacct)
    names = [fields.get("StdOut", ""), fields.get("StdErr", "")]
    if not any(names):
        array = fields.get("ArrayTaskId") not in (None, "", "N/A")
        names = ["slurm-%A_%a.out" if array else "slurm-%j.out"]
        source += " (default name)"
    work = fields.get("WorkDir", "")
    files: list[Path] = []
    unreadable: list[str] = []
    for name in dict.fromkeys(n for n in names if n and n != "/dev/null"):
        path = Path(expand_file_pattern(name, fields))
        if not path.is_absolute():
            path = Path(work or ".") / path
        try:
            st = os.stat(path)
        except OSError as exc:
            unreadable.append(f"{path}: {exc.strerror}")
            continue
        if not stat.S_ISREG(st.st_mode):
            unreadable.append(f"{path}: not a regular file")
        elif not os.access(path, os.R_OK):
            unreadable.append(f"{path}: not readable by this user")
        else:
            files.append(path)
    if not files:
        raise JobLookupError(f"job {job_id}: no output file to read ({source}): "
                             + ("; ".join(unreadable) or "Slurm names none")
                             + " (give the file: megatrace analyze FILE)")
    return JobOutput(job_id, files, source, work, unreadable)


def _sacct_fields(job_id: str, sacct: str) -> tuple[dict[str, str], str]:
    """The job's fields from the accounting database (only those :func:`expand_file_pattern` and :func:`job_output`
    use); the fields a release lacks (StdOut, StdErr before 23.02) are left out."""
    errors = []
    for names in (SACCT_FIELDS, SACCT_FIELDS[:5]):
        try:
            proc = subprocess.run([sacct, "-j", job_id, "-X", "-n", "-P", "-o", ",".join(names)], capture_output=True,
                                  text=True, timeout=SCONTROL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise JobLookupError(f"job {job_id}: scontrol does not know it and sacct cannot run: {exc}") from None
        line = next((ln for ln in proc.stdout.splitlines() if ln.strip()), "")
        if proc.returncode == 0 and line:
            values = line.split("|", len(names) - 1)
            fields = dict(zip(names, values))
            fields["JobId"] = fields.pop("JobIDRaw", job_id)
            fields["UserId"] = fields.pop("User", "")
            if "_" in job_id:
                fields["ArrayJobId"], fields["ArrayTaskId"] = job_id.split("_", 1)
            return fields, "sacct"
        errors.append(_clip(proc.stderr.strip() or "no such job", 200))
    raise JobLookupError(f"job {job_id}: Slurm does not know it (scontrol: not held any more; sacct: {errors[-1]})")


def expand_file_pattern(name: str, fields: Mapping[str, str]) -> str:
    """An sbatch ``--output`` name with its patterns replaced from the job's fields (``%j`` job id, ``%A``/``%a``
    array job/task, ``%x`` name, ``%u`` user, ``%N`` first node, ``%%``; ``%5j`` pads to five digits)."""
    if "%" not in name:
        return name
    job = fields.get("JobId", "")
    array_job = fields.get("ArrayJobId") or job
    task = fields.get("ArrayTaskId") if fields.get("ArrayTaskId") not in (None, "N/A") else "4294967294"
    nodes = fields.get("BatchHost") or fields.get("NodeList") or ""
    try:
        first = expand_hostlist(nodes)[0] if nodes and nodes != "(null)" else ""
    except (ValueError, IndexError):
        first = ""
    values = {"A": array_job, "a": task, "J": job, "j": job, "N": first, "n": "0", "s": "batch", "t": "0",
              "u": fields.get("UserId", "").split("(", 1)[0], "x": fields.get("JobName", "")}

    def one(m: re.Match[str]) -> str:
        if m.group(2) == "%":
            return "%"
        value = values[m.group(2)]
        return value.zfill(int(m.group(1))) if m.group(1) and value.isdigit() else value

    return FILE_PATTERN.sub(one, name)
