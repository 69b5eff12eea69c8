"""What MPI processes leave behind in /dev/shm (tests run one at a time: a name that appears is the test's)."""

from __future__ import annotations

from pathlib import Path


def mpich_segments() -> set[str]:
    """MPICH's start-up segments in /dev/shm now (``collect/mpi_segments.py``)."""
    return {p.name for p in Path("/dev/shm").glob("mpich_*")}
