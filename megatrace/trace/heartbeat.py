"""The tracer's heartbeat: the ring header says, ten times a second, that this process still runs.

A rank that is stopped (SIGSTOP, a debugger), killed, or wedged holding the Python interpreter lock
stops beating; a rank that waits inside a collective, or computes, keeps beating. Readers compare
the beats of all ranks (``docs/trace-format.md``, ``heartbeat_ns``). One daemon thread, asleep
between beats: it never touches the training thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from megatrace.trace import ring_format as fmt
from megatrace.trace.warnings import warn_once


class Heartbeat:
    """Calls ``beat()`` now and every ``interval_s`` until :meth:`stop`."""

    def __init__(self, beat: Callable[[], None], interval_s: float = fmt.HEARTBEAT_INTERVAL_NS / 1e9) -> None:
        self._beat = beat
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatrace-heartbeat", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except Exception as exc:  # noqa: BLE001 - never let tracing disturb the process
                warn_once("heartbeat", f"heartbeat stopped: {exc!r}")
                return

    def stop(self) -> None:
        self._stop.set()
