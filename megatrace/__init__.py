"""MegaTrace: diagnostics for distributed GPU training on Slurm.

The package is a pipeline, one sub-package per stage:
``trace`` (capture into per-rank ring files) → ``collect`` (gather rings from
every node) → ``analyze`` (find the hung or slow rank, group or link) →
``report`` (the post-mortem HTML). ``demo`` is a built-in 3D-parallel job with
fault injection; ``check`` holds the preflight health probes.

Importing this package is cheap: it never imports torch. The optional marker
API below records iteration and phase boundaries when a traced job wants them;
analysis never depends on markers.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "step", "phase"]


def step(number: int | None = None) -> None:
    """Mark the start of a training iteration (no-op unless the tracer is active)."""
    from megatrace.trace import markers

    markers.step(number)


def phase(name: str, microbatch: int | None = None) -> None:
    """Mark the start of a phase: ``forward``, ``backward``, ``optimizer``, ``data`` or ``eval``."""
    from megatrace.trace import markers

    markers.phase(name, microbatch)
