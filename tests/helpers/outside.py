"""Test helpers for faults done to a process from outside, and for waiting on what they cause."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


class Throttle:
    """Stop a process 50 ms of every 100 ms from outside (a thermally throttled or oversubscribed host)."""

    def __init__(self, pid: int, stop_s: float = 0.05, run_s: float = 0.05) -> None:
        self.pid, self.stop_s, self.run_s = pid, stop_s, run_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Throttle":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(self.run_s)
        except ProcessLookupError:
            pass

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def wait_for(what: Callable[[], T], timeout: float, step: float = 0.5, awaited: str | None = None) -> T:
    """Poll ``what`` every ``step`` seconds until it returns something true or ``timeout`` seconds pass; its last
    value. The tests wait with this, never with a fixed sleep: a condition polled returns as soon as it holds, and
    a loaded machine only makes it take longer. Cheap conditions poll every 50 ms (``step=0.05``); the default
    suits costly ones (an analysis, ``scontrol``).

    ``awaited``: what is waited for, in words; then a timeout fails the test, saying what and for how long.
    Without it the caller judges the false value returned (``assert wait_for(...), detail``).
    """
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        value = what()
        if value:
            return value
        time.sleep(step)
    value = what()
    if not value and awaited is not None:
        raise AssertionError(f"waited {timeout:g} s for {awaited}, in vain (last seen: {value!r})")
    return value
