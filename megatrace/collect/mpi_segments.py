"""MPICH's start-up segments in /dev/shm: a stale one of this job step cleared before MPI starts, ours unlinked once
attached.

MPICH (4 and later: the mpich wheel the collector runs on) gives each node of an MPI job a start-up segment named
after the PMI job name, which under Slurm's pmi2 is ``JOBID.STEPID``: ``/dev/shm/mpich_shm_<FNV-1a 32 of that
name, hex>_<node index>`` (``mpich_vci_...`` beside it). The first local task creates it with ``O_EXCL``; a task
that finds the name taken attaches as a follower, waiting for a creator that will never come or reading what an
earlier process left there. So a segment left by an earlier incarnation of the same job step (a collector killed at
the job's time limit, the job then requeued under the same id; a lab whose job ids started again) makes MPI's
start-up fail ("Shared memory error") or hang. MPICH removes its segments in ``MPI_Finalize`` only, which a
collector facing a dead peer skips (it cannot return): each such collection left a few MiB of memory in /dev/shm
on every node.

A stale segment is cleared only where Slurm says this step runs one task per node (the collector's own ``srun``
line): then no other task of the step can be attaching to this node's segment, so one found before ``MPI_Init`` is
stale. Ours is unlinked under any launcher (srun, or ``mpiexec`` with several tasks a node): ``MPI_Init`` returns
only after every local task has attached (MPICH's start-up barrier), and nothing attaches by name later. A name is
removed only when it is a regular file of this user (another user's file is left, and named); anything else is left
as it is.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping

from megatrace.files import open_dir

SHM_DIR = "/dev/shm"
SEGMENT_RE = re.compile(r"mpich_(?:shm|vci)_[0-9a-f]+_\d+")
_ONE_PER_NODE_RE = re.compile(r"1(\(x\d+\))?(,1(\(x\d+\))?)*")


def fnv1a_32(data: bytes) -> int:
    """The 32-bit FNV-1a hash (MPICH's ``HASH_FNV`` of the PMI job name)."""
    h = 0x811C9DC5
    for byte in data:
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def segment_names(job_id: str, step_id: str, node_index: int) -> tuple[str, str]:
    """The names MPICH gives node ``node_index``'s start-up segments in job step ``job_id.step_id``."""
    world = fnv1a_32(f"{job_id}.{step_id}".encode())
    return f"mpich_shm_{world:x}_{node_index}", f"mpich_vci_{world:x}_{node_index}"


def one_task_per_node(env: Mapping[str, str]) -> bool:
    """Slurm says this step runs one task on each of its nodes (``SLURM_STEP_TASKS_PER_NODE``: "1", "1(x4)")."""
    return bool(_ONE_PER_NODE_RE.fullmatch(env.get("SLURM_STEP_TASKS_PER_NODE", "")))


def clear_stale(env: Mapping[str, str] = os.environ, shm_dir: str = SHM_DIR) -> list[str]:
    """Before ``MPI_Init``: remove this node's start-up segments of this job step, left by an earlier incarnation.
    Returns what was done, one line each (nothing outside a one-task-per-node Slurm step)."""
    job, step, task = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", ""), env.get("SLURM_PROCID", "")
    if not (job.isdigit() and step.isdigit() and task.isdigit() and one_task_per_node(env)):
        return []
    # One task per node: task r is on the step's r-th node, MPICH's node index r.
    return _remove(shm_dir, segment_names(job, step, int(task)), "stale, from an earlier run of job step "
                   f"{job}.{step}: MPI's start-up would attach to it")


def unlink_attached(shm_dir: str = SHM_DIR, maps: str = "/proc/self/maps") -> list[str]:
    """After ``MPI_Init``: unlink the start-up segments this process has mapped (they stay mapped while it runs), so
    that none is left behind whether or not ``MPI_Finalize`` runs."""
    prefix = shm_dir.rstrip("/") + "/"
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            mapped = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and prefix in line}
    except OSError:
        return []
    names = sorted({p[len(prefix):] for p in mapped if p.startswith(prefix) and SEGMENT_RE.fullmatch(p[len(prefix):])})
    return _remove(shm_dir, names, "attached by this collector: unlinked so that none is left behind")


def _remove(shm_dir: str, names: tuple[str, ...] | list[str], why: str) -> list[str]:
    """Unlink each of ``names`` in ``shm_dir`` that is a regular file of this user; lines saying what was done."""
    done: list[str] = []
    try:
        dfd = open_dir(shm_dir)  # (no link of another user followed on the way)
    except OSError:  # (UnsafePathError included)
        return done
    try:
        for name in names:
            try:
                st = os.lstat(name, dir_fd=dfd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                done.append(f"{shm_dir}/{name}: not looked at ({exc.strerror})")
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                done.append(f"{shm_dir}/{name}: left alone (not a regular file of uid {os.geteuid()}: "
                            f"uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); MPI's start-up may fail on it")
                continue
            try:
                os.unlink(name, dir_fd=dfd)
                done.append(f"{shm_dir}/{name}: removed ({why})")
            except FileNotFoundError:
                continue
            except OSError as exc:
                done.append(f"{shm_dir}/{name}: not removed ({exc.strerror})")
    finally:
        os.close(dfd)
    return done
