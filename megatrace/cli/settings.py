"""What every command shares: the one context settings dict and the one base of user-facing errors.

Imports only click and :mod:`megatrace.errors`: ``megatrace --help`` and ``megatrace-check --help`` load this and
nothing heavy.
"""

from __future__ import annotations

from typing import IO, Any

import click

from megatrace.errors import MegatraceError

CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


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
