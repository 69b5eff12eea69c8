"""The one base of every error MegaTrace raises for its user to read.

Each stage raises its own domain errors (``TraceLoadError``, ``LayoutError``, ``RingFormatError``, ``LabError``,
...), all subclasses of :class:`MegatraceError`, each keeping the built-in base its callers catch (``ValueError``,
``OSError``, ...). The commands show them as one line (:class:`megatrace.cli.settings.CommandError`), never a
traceback.
"""

from __future__ import annotations


class MegatraceError(Exception):
    """An error whose message is for the user: it names the file, rank or field at fault."""
