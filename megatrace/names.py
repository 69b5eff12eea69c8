"""One home for every naming rule MegaTrace's parts must agree on.

Standard library only, and nothing from ``megatrace``: any stage may import it. The C plugin
(spank_plugin/remote.c), the C tracer (megatrace/trace/nccl/tracer.c) and the Slurm scripts (slurm/) cannot
import Python; tests/test_names.py reads their copies out of the source text and compares them with these.
"""

from __future__ import annotations

import os
import re
import socket

# --- Job directories -------------------------------------------------------------------------------------
JOB_DIR_PREFIX = "megatrace-"  # <submit dir>/megatrace-<job id>; <FALLBACK_DIR>/<uid>/megatrace-<job id>
ATTEMPT_PREFIX = ".r"  # a requeued job (same id) has one directory per attempt: <dir>.r<restarts>


def job_dir_name(job_id: str | int) -> str:
    """The job directory's name when ``dir=`` does not give one: ``megatrace-<job id>``."""
    return f"{JOB_DIR_PREFIX}{job_id}"


def attempt_suffix(restarts: str | int | None) -> str:
    """``.r<N>`` for a requeued job's attempt N (``SLURM_RESTART_COUNT`` > 0); "" for the first attempt or a
    value that is not a count."""
    text = str(restarts) if restarts is not None else ""
    return f"{ATTEMPT_PREFIX}{text}" if text.isdigit() and int(text) > 0 else ""


# --- Ring directories ------------------------------------------------------------------------------------
NODE_DIR_PREFIX = "job-"  # <LOCAL_DIR>/job-<job id>.<node>, made by root (prolog or plugin) for the job's user
STEP_DIR_PREFIX = "step-"  # <node dir>/step-<step>: one per step; MEGATRACE_DIR of the step's ranks
USER_BASE_PREFIX = "megatrace-"  # outside Slurm: /dev/shm/megatrace-<uid>, one base per user


def node_dir_name(job_id: str | int, node: str) -> str:
    """The node-local directory of a job's rings on ``node``: ``job-<job id>.<node>``."""
    return f"{NODE_DIR_PREFIX}{job_id}.{node}"


def step_dir_name(step: str | int) -> str:
    """A step's directory in the node directory (and in the job directory): ``step-<step>``."""
    return f"{STEP_DIR_PREFIX}{step}"


def user_base_name(uid: int) -> str:
    """The per-user base of rings outside Slurm (without ``MEGATRACE_DIR``): ``megatrace-<uid>``."""
    return f"{USER_BASE_PREFIX}{uid}"


def ring_dir_name(job: str, step: str) -> str:
    """The ring directory's name in the per-user base: ``<job>.<step>`` (``<job>`` without a step), made safe."""
    return safe_name(f"{job}.{step}" if step else job, limit=None, fallback="job", strip_dots=True,
                     ascii_only=False)


# --- Safe names ------------------------------------------------------------------------------------------
SAFE_CHARS = "A-Za-z0-9._-"  # a bracket expression's body: what a name in a path may hold (C, shell alike)
_UNSAFE = re.compile(f"[^{SAFE_CHARS}]")


def safe_name(text: str, *, limit: int | None = 128, fallback: str = "_", strip_dots: bool = False,
              ascii_only: bool = True) -> str:
    """``text`` as one path component: every character but letters, digits, ``.``, ``_`` and ``-`` becomes
    ``_``; at most ``limit`` characters; ``fallback`` when nothing is left.

    The defaults are the collectors' (node names, job ids in file names). The Python tracer's ring directory
    (:func:`ring_dir_name`) also strips leading and trailing dots, has no limit, falls back to ``job`` and keeps
    non-ASCII letters and digits (``ascii_only`` False), as trace/settings.py always did; the C tracer's
    ``safe_component`` (tracer.c) replaces those, as ``ascii_only`` True would.
    """
    if ascii_only:
        cleaned = _UNSAFE.sub("_", text)
    else:
        cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in text)
    if limit is not None:
        cleaned = cleaned[:limit]
    if strip_dots:
        cleaned = cleaned.strip(".")
    return cleaned or fallback


# --- Node names ------------------------------------------------------------------------------------------
NODE_NAME_ENV = ("MEGATRACE_NODE_NAME", "SLURMD_NODENAME")  # in this order; then the host name


def node_name(given: str | None = None) -> str:
    """This node's name: ``given``, else ``MEGATRACE_NODE_NAME``, ``SLURMD_NODENAME``, or the host name."""
    if given:
        return given
    for key in NODE_NAME_ENV:
        if value := os.environ.get(key):
            return value
    return socket.gethostname()


# --- Operations ------------------------------------------------------------------------------------------
def unknown_op_name(code: int) -> str:
    """The name of an operation code no ``Op`` knows: ``op<code>`` (``op7``)."""
    return f"op{code}"


# --- Severities and triggers -----------------------------------------------------------------------------
SEVERITIES = ("critical", "error", "warning", "info")  # the most severe first
TRIGGERS = ("hang", "end", "timelimit", "failure", "manual")  # why a collection ran
