"""What every command shares: the one context settings dict and the one base of user-facing errors.

Imports only click and :mod:`megatrace.errors`: ``megatrace --help`` and ``megatrace-check --help`` load this and
nothing heavy.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import IO, Any

import click

from megatrace.errors import MegatraceError

CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

_NO_TEARDOWN: list[bool] = []  # set by a command whose work is written and closed (see skip_teardown)


def skip_teardown() -> None:
    """Say that this command has written and closed everything: the ``megatrace`` process then leaves without
    tearing the interpreter down (freeing a large analysis object by object: 50 ms at 4,096 ranks, a twentieth of a
    quick analysis). Only the process entry (:func:`megatrace.cli.entry`: the console script, ``python -m
    megatrace.cli``) acts on it; a program that calls ``main(...)`` itself (a test, the collector) goes on."""
    _NO_TEARDOWN.append(True)


# What numpy's BLAS reads at load for the size of its thread pool (OpenBLAS, MKL, an OpenMP build).
_BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")


def import_numpy_for_analysis() -> None:
    """Import numpy without a BLAS thread pool, unless the user sized one: the analysis does no linear algebra, and
    OpenBLAS otherwise starts a thread per core that spins for a while after the import (at 4,096 ranks 0.1 s of a
    second core during a 1 s quick analysis, the core the heap's prefault thread works on). The environment is as it
    was afterwards: nothing the command starts inherits the setting."""
    if "numpy" in sys.modules:
        return
    unset = [name for name in _BLAS_THREADS if name not in os.environ]
    for name in unset:
        os.environ[name] = "1"
    try:
        importlib.import_module("numpy")  # (the BLAS is loaded now, with one thread)
    finally:
        for name in unset:
            os.environ.pop(name, None)


def leave_if_done(exc: SystemExit) -> None:
    """At the process entry, the command's exit ``exc``: when the command called :func:`skip_teardown`, flush the
    output and ``os._exit`` with its status (atexit handlers and the interpreter's teardown skipped); else return
    (the caller re-raises)."""
    if not _NO_TEARDOWN:
        return
    code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 1  # (output lost: say so by the exit status, as the interpreter would)
    os._exit(code)


class CommandError(MegatraceError, click.ClickException):
    """A user-facing error: printed as one 'Error:' line, exit status 1.

    Every error a command shows its user derives from this class; library code raises its own domain
    errors (``LayoutError``, ``TraceLoadError``, ...: all :class:`megatrace.errors.MegatraceError`, as this class
    is) and the command converts them.
    """


class PrefixedError(CommandError):
    """A user-facing error said as '<prog>: message' instead of 'Error: message', with its own exit status.

    For the commands a Slurm prolog or epilog runs, whose log lines name the program (``megatrace-check: ...``).
    """

    def __init__(self, prog: str, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.prog = prog
        self.exit_code = exit_code

    def show(self, file: IO[Any] | None = None) -> None:
        line = f"{self.prog}: {self.format_message()}"
        if file is None:
            click.echo(line, err=True, color=self.show_color)
        else:
            click.echo(line, file=file, color=self.show_color)
