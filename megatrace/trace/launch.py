"""The environment that turns tracing on for a command (``megatrace run``; the SPANK plugin sets the same)."""

from __future__ import annotations

from collections.abc import Mapping

from megatrace.trace import settings


def tracing_environment(env: Mapping[str, str], trace_dir: str | None = None,
                        ring_records: int | None = None) -> dict[str, str]:
    """A copy of ``env`` with the tracer enabled for every Python process started under it."""
    out = dict(env)
    out[settings.ENABLE] = "1"
    if trace_dir:
        out[settings.DIR] = str(trace_dir)
    if ring_records:
        out[settings.RING_RECORDS] = str(ring_records)
    return out
