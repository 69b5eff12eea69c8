"""The NCCL interposer: ``libmegatrace_nccl.so``, loaded with ``LD_PRELOAD``, traces every NCCL call.

It writes the same ring files as the Python tracer (docs/trace-format.md); see
docs/nccl-interposer.md. The install compiles it next to this file (hatch_build.py);
``python -m megatrace.trace.nccl`` prints its path, ``--build`` compiles it by hand.
"""

from __future__ import annotations

from pathlib import Path

from megatrace.errors import MegatraceError
from megatrace.trace.nccl.build import HERE, LIBRARY, compile_interposer

__all__ = ["LIBRARY", "InterposerMissing", "build", "library_path"]


class InterposerMissing(MegatraceError, FileNotFoundError):
    """``libmegatrace_nccl.so`` was not built; the message says how to build it."""


def library_path() -> Path:
    """The installed ``libmegatrace_nccl.so``; raises :class:`InterposerMissing` when it was not built."""
    path = HERE / LIBRARY
    if not path.is_file():
        raise InterposerMissing(f"{path} was not built (no C compiler at install time?); build it with "
                                "'python -m megatrace.trace.nccl --build'")
    return path


def build(target: Path | None = None) -> Path:
    """Compile the interposer to ``target`` (default: beside this file); raises OSError with the compiler's message."""
    target = Path(target) if target is not None else HERE / LIBRARY
    if target.is_dir() or not target.name.endswith(".so"):  # a directory, existing or not
        target = target / LIBRARY
    reason = compile_interposer(target)
    if reason is not None:
        raise OSError(f"cannot build {target}: {reason}")
    return target
