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


def wait_for(what: Callable[[], T], timeout: float, step: float = 0.5) -> T:
    """Poll ``what`` until it returns something true or ``timeout`` seconds pass; its last value."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        value = what()
        if value:
            return value
        time.sleep(step)
    return what()
