"""One-line, once-only warnings from the tracer: it must never crash or flood the job's stderr."""

from __future__ import annotations

import os
import sys

_seen: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Print ``megatrace: <message>`` to stderr the first time ``key`` is seen in this process."""
    if key in _seen:
        return
    _seen.add(key)
    try:
        sys.stderr.write(f"megatrace[{os.getpid()}]: warning: {message}\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a closed stderr must not break training
        pass
