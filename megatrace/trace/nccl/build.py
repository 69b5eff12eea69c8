"""Compile ``libmegatrace_nccl.so``, the NCCL interposer, with the system C compiler.

Standard library only: ``hatch_build.py`` loads this file by path at install time, and
``python -m megatrace.trace.nccl --build DIR`` runs it by hand. NCCL itself is never needed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIBRARY = "libmegatrace_nccl.so"
SOURCES = ("interpose.c", "tracer.c", "events.c")
FLAGS = ["-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-fvisibility=hidden", "-fno-strict-aliasing"]


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_command(target: Path, source_dir: Path = HERE, cc: str | None = None) -> list[str]:
    """The one compiler command that builds the interposer (also shown in docs/nccl-interposer.md)."""
    return [cc or compiler() or "cc", *FLAGS, *(str(source_dir / s) for s in SOURCES),
            f"-Wl,--version-script={source_dir / 'exports.map'}", "-o", str(target), "-ldl", "-lpthread"]


def compile_interposer(target: Path, source_dir: Path = HERE) -> str | None:
    """Build ``target``; return None on success, else the reason (compiler missing or its stderr)."""
    cc = compiler()
    if not cc:
        return "no C compiler (cc or gcc) on PATH"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    result = subprocess.run(build_command(tmp, source_dir, cc), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        return result.stderr.strip() or f"{cc} exited with {result.returncode}"
    os.replace(tmp, target)  # atomic: a process preloading the old file keeps its copy
    return None
