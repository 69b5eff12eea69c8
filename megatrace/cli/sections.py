"""The sections of ``megatrace --help``: which command is listed under which title, declared here only."""

from __future__ import annotations

import click

# Section title -> the commands listed under it, in the order of the help.
SECTIONS: dict[str, tuple[str, ...]] = {
    "Tracing and analysis": ("run", "demo", "analyze", "export", "report", "simulate"),
    "Slurm and node": ("collect", "agent", "job-end", "health", "nodes"),
    "Development": ("lab",),
}
OTHER = "Other commands"  # a command not in SECTIONS is still listed, under this title


def section_of(name: str) -> str:
    """The title of the section that lists command ``name``."""
    return next((title for title, names in SECTIONS.items() if name in names), OTHER)


class SectionedGroup(click.Group):
    """A click group whose help lists its commands in the sections of :data:`SECTIONS`."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        commands = {name: cmd for name in self.list_commands(ctx)
                    if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden}
        if not commands:
            return
        width = max(map(len, commands))
        limit = formatter.width - 6 - width  # as click's own listing: three times the default spacing
        listed = {**{title: [n for n in names if n in commands] for title, names in SECTIONS.items()},
                  OTHER: [n for n in commands if section_of(n) == OTHER]}
        for title, names in listed.items():
            if names:  # names padded to one width: the summaries line up across the sections
                with formatter.section(title):
                    formatter.write_dl([(n.ljust(width), commands[n].get_short_help_str(limit)) for n in names])
