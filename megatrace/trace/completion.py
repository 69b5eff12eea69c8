"""Completion tracking for operations whose end the caller does not wait for.

A CPU (gloo) async op reports completion through its future's callback. A
device op (NCCL) is complete when a device event or the work says so; nothing
calls us then, so one daemon thread polls the outstanding probes. The caller
never blocks: it only appends to a deque.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from megatrace.trace import ring_format as fmt
from megatrace.trace.warnings import warn_once

Handle = tuple[int, int]
Probe = Callable[[], bool]  # True once the operation has completed; may raise if it failed


class CompletionPoller:
    """Polls ``probe()`` for each outstanding operation and records its completion."""

    def __init__(self, complete: Callable[[Handle, int], None], interval_s: float = 0.0005,
                 on_done: Callable[[object], None] | None = None) -> None:
        self._complete = complete
        self._interval = interval_s
        self._on_done = on_done  # e.g. return a device event to its pool
        self._incoming: collections.deque[tuple[Handle, Probe, object]] = collections.deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, handle: Handle, probe: Probe, token: object = None) -> None:
        """Track one operation; ``token`` is handed to ``on_done`` when it completes."""
        self._incoming.append((handle, probe, token))
        if self._thread is None:
            self._start()
        self._wake.set()

    def _start(self) -> None:
        thread = threading.Thread(target=self._run, name="megatrace-completion", daemon=True)
        self._thread = thread
        thread.start()

    def pending(self) -> int:
        return len(self._incoming)

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop polling; waits briefly so no probe runs while the process tears its groups down."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        pending: list[tuple[Handle, Probe, object]] = []
        while not self._stopped:
            while self._incoming:
                pending.append(self._incoming.popleft())
            if not pending:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            still: list[tuple[Handle, Probe, object]] = []
            for item in pending:
                handle, probe, token = item
                try:
                    done, state = probe(), fmt.State.COMPLETED
                except Exception:  # noqa: BLE001 - the operation itself failed
                    done, state = True, fmt.State.FAILED
                if not done:
                    still.append(item)
                    continue
                try:
                    self._complete(handle, state)
                    if self._on_done is not None:
                        self._on_done(token)
                except Exception as exc:  # noqa: BLE001 - never let the thread die
                    warn_once("poller", f"completion tracking failed: {exc!r}")
            pending = still
            self._wake.wait(self._interval)
            self._wake.clear()
