"""Tracer settings, read from the environment of the traced process (set by the SPANK plugin or ``megatrace run``)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from megatrace import names
from megatrace.trace import ring_format as fmt
from megatrace.trace.warnings import warn_once

ENABLE = "MEGATRACE_ENABLE"
DIR = "MEGATRACE_DIR"
JOB_ID = "MEGATRACE_JOB_ID"
STEP_ID = "MEGATRACE_STEP_ID"
RING_RECORDS = "MEGATRACE_RING_RECORDS"


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(ENABLE, "0").strip().lower() not in ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class TracerSettings:
    """Where and how a rank writes its ring."""

    directory: Path
    job_id: str
    step_id: str
    ring_records: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "TracerSettings":
        job = env.get(JOB_ID) or env.get("SLURM_JOB_ID") or "local"
        step = env.get(STEP_ID) or env.get("SLURM_STEP_ID") or ""
        records = fmt.DEFAULT_CAPACITY
        raw = env.get(RING_RECORDS)
        if raw:
            try:
                records = int(raw)
                if not fmt.MIN_CAPACITY <= records <= fmt.MAX_CAPACITY:
                    raise ValueError
            except ValueError:
                records = fmt.DEFAULT_CAPACITY
                warn_once("ring-records", f"{RING_RECORDS}={raw!r} is not an integer in "
                                          f"[{fmt.MIN_CAPACITY}, {fmt.MAX_CAPACITY}]; using {records}")
            else:
                # A power of two: adler32 then always tells a slot's old lap from its new one
                # in a torn live read (see docs/trace-format.md, "Capacity").
                rounded = 1 << (records - 1).bit_length()
                if rounded != records:
                    warn_once("ring-records", f"{RING_RECORDS}={records} rounded up to {rounded}, "
                                              "a power of two")
                    records = rounded
        directory = env.get(DIR)
        if not directory:
            directory = str(default_base() / names.ring_dir_name(job, step))
        return cls(Path(directory), job, step, records)


def default_base(uid: int | None = None) -> Path:
    """Where rings go without ``MEGATRACE_DIR`` (outside Slurm): ``/dev/shm/megatrace-<uid>``, one base per user.

    Per user, so that the first user on a node owns nothing the others need: each creates and owns
    their own base (mode 0700). ``/tmp`` (``$TMPDIR``) where there is no ``/dev/shm``. Under Slurm the
    plugin sets ``MEGATRACE_DIR`` to the node directory root made for the job.
    """
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / names.user_base_name(os.geteuid() if uid is None else uid)
