"""The command line's shape: light ``--help``, sectioned command listing, one base for user-facing errors."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import click
from click.testing import CliRunner

import megatrace
from megatrace.cli import CommandError, main
from megatrace.cli.sections import OTHER, SECTIONS

HEAVY = {"numpy", "networkx", "torch"}


def test_help_loads_no_heavy_module() -> None:
    code = ("import sys\n"
            "from click.testing import CliRunner\n"
            "from megatrace.cli import check_main, main\n"
            "assert CliRunner().invoke(main, ['--help']).exit_code == 0\n"
            "assert CliRunner().invoke(check_main, ['--help']).exit_code == 0\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(HEAVY)!r}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def _sections(help_text: str) -> dict[str, list[str]]:
    """Each section title of the group's help -> the commands listed under it."""
    found: dict[str, list[str]] = {}
    current = None
    for line in help_text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            found[current] = []
        elif not line.strip():  # a section ends at a blank line
            current = None
        elif current is not None and line.startswith("  ") and not line.startswith("   "):
            found[current].append(line.split()[0])
    return found


def test_help_lists_every_command_in_exactly_one_section() -> None:
    result = CliRunner().invoke(main, ["--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    sections = _sections(result.output)
    assert [t for t in sections if t in SECTIONS] == ["Tracing and analysis", "Slurm and node", "Development"]
    assert OTHER not in sections, sections.get(OTHER)
    listed = [name for title, names in sections.items() if title in SECTIONS for name in names]
    assert sorted(listed) == sorted(main.commands)  # each one once
    for title, names in SECTIONS.items():
        assert sections[title] == list(names)


def test_the_section_mapping_names_only_commands_that_exist() -> None:
    declared = [name for names in SECTIONS.values() for name in names]
    assert len(declared) == len(set(declared))
    assert set(declared) == set(main.commands)


def _modules():
    yield megatrace
    for info in pkgutil.walk_packages(megatrace.__path__, "megatrace."):
        if info.name.endswith("__main__"):  # running it is what importing it does
            continue
        try:
            yield importlib.import_module(info.name)
        except ImportError:  # an optional dependency (torch, mpi4py, ...) that this host lacks
            continue


def test_every_command_error_derives_from_command_error() -> None:
    classes = {(cls.__module__, cls.__qualname__) for module in _modules()
               for _, cls in inspect.getmembers(module, inspect.isclass)
               if issubclass(cls, click.ClickException) and cls.__module__.startswith("megatrace")}
    assert ("megatrace.cli.settings", "CommandError") in classes
    for module_name, qualname in classes:
        cls = getattr(importlib.import_module(module_name), qualname)
        assert issubclass(cls, CommandError), f"{module_name}.{qualname}"


def test_every_error_class_of_the_package_derives_from_megatrace_error() -> None:
    """One base for every error MegaTrace raises (megatrace.errors), each keeping its built-in base."""
    from megatrace.errors import MegatraceError

    classes = {cls for module in _modules() for _, cls in inspect.getmembers(module, inspect.isclass)
               if issubclass(cls, BaseException) and cls.__module__.startswith("megatrace")}
    assert len(classes) >= 20, sorted(c.__qualname__ for c in classes)
    stray = sorted(f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, MegatraceError))
    assert not stray, stray
