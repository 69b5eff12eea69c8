"""What MPI processes leave behind in /dev/shm (tests run one at a time: a name that appears is the test's)."""

from __future__ import annotations

from pathlib import Path


def mpich_segments() -> set[str]:
    """MPICH's start-up segments in /dev/shm now (``collect/mpi_segments.py``)."""
    return {p.name for p in Path("/dev/shm").glob("mpich_*")}


def remove_left_by(before: set[str]) -> list[str]:
    """Remove the MPICH segments that appeared since ``before`` and no live process maps: what a job of MPI ranks
    killed from outside (no ``MPI_Finalize``) left, as a site's epilog would clear it. Returns the names removed."""
    new = mpich_segments() - before
    if not new:
        return []
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")  # (once per process, whatever the number of names)
        except OSError:
            continue  # (a process that ended meanwhile)
        mapped.update(name for name in new if name in text)
    gone = sorted(new - mapped)
    for name in gone:
        Path("/dev/shm", name).unlink(missing_ok=True)
    return gone
