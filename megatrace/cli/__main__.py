"""``python -m megatrace.cli``: the ``megatrace`` command (the collector, agent and epilog start it this way)."""

from megatrace.cli import entry

entry()
