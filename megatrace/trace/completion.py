"""Completion tracking for operations whose end the caller does not wait for inside the traced call.

Three sources, most precise first (the tracer picks per call, see torch_hook):

* a CPU collective's future calls back when the work ends (exact);
* a gloo point-to-point work has no future: its completion is taken when the
  program's ``wait()`` returns (exact for the usual isend/irecv + wait), and
  :class:`UnwaitedSweeper` catches, twice a second, works nobody waits for;
* a device (NCCL) op ends on the GPU: a daemon thread polls its event or work,
  starting at 0.5 ms and backing off while nothing finishes, so an idle trainer
  is not woken a thousand times a second.

The caller never blocks: registering an op is a deque append (a dict insert for
the sweeper), and it wakes a thread only when that thread is parked with nothing
to poll. Waking a thread on every call hands the GIL back and forth on each op;
on an oversubscribed node that cost the demo 10% of its step time.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from megatrace.trace import ring_format as fmt
from megatrace.trace.warnings import warn_once

Handle = tuple[int, int]
Probe = Callable[[], bool]  # True once the operation has completed; raises if it failed
Finish = Callable[[int], None]  # record the final state


class CompletionPoller:
    """Polls ``probe()`` for each outstanding operation and calls ``finish(state)`` once it is done."""

    def __init__(self, min_interval_s: float = 0.0005, max_interval_s: float = 0.004,
                 name: str = "megatrace-completion") -> None:
        self._min = min_interval_s
        self._max = max_interval_s
        self._name = name
        self._incoming: collections.deque[tuple[Probe, Finish]] = collections.deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._parked = False  # the thread sleeps with nothing to poll: only then does add() wake it
        self._outstanding = 0

    def add(self, probe: Probe, finish: Finish) -> None:
        """Track one operation."""
        self._incoming.append((probe, finish))
        if self._thread is None:
            self._start()
        elif self._parked:
            self._wake.set()

    def _start(self) -> None:
        thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread = thread
        thread.start()

    def pending(self) -> int:
        return len(self._incoming) + self._outstanding

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop polling; waits briefly so no probe runs while the process tears its groups down."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        pending: list[tuple[Probe, Finish]] = []
        interval = self._min
        while not self._stopped:
            if self._incoming:
                interval = self._min
                while self._incoming:
                    pending.append(self._incoming.popleft())
            if not pending:
                self._outstanding = 0
                self._parked = True
                if not self._incoming:  # re-check: an add() may have seen _parked still False
                    self._wake.wait(1.0)
                self._wake.clear()
                self._parked = False
                continue
            still: list[tuple[Probe, Finish]] = []
            for probe, finish in pending:
                try:
                    done, state = probe(), fmt.State.COMPLETED
                except Exception:  # noqa: BLE001 - the operation itself failed
                    done, state = True, fmt.State.FAILED
                if not done:
                    still.append((probe, finish))
                    continue
                try:
                    finish(int(state))
                except Exception as exc:  # noqa: BLE001 - never let the thread die
                    warn_once("poller", f"completion tracking failed: {exc!r}")
            interval = self._min if len(still) < len(pending) else min(interval * 2, self._max)
            pending = still
            self._outstanding = len(pending)
            self._wake.wait(interval)
            self._wake.clear()


class UnwaitedSweeper:
    """Completes the records of works in ``waits`` (work -> handle) that nobody has waited for yet.

    The call path only inserts into ``waits`` and the program's ``wait()`` pops from it, so the
    thread has nothing to do in the usual isend/irecv + wait pattern: it looks twice a second at
    whatever is still there, never woken by a call. ``finish(work, state)`` must pop the entry.
    """

    def __init__(self, waits: dict[Any, Any], probe: Callable[[Any], bool], finish: Callable[[Any, int], None],
                 interval_s: float = 0.5, name: str = "megatrace-sweeper") -> None:
        self._waits = waits
        self._probe = probe
        self._finish = finish
        self._interval = interval_s
        self._name = name
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def sweep(self) -> None:
        """Finish every waiting work that has ended."""
        try:
            works = list(self._waits)
        except RuntimeError:  # the map changed under us: the next sweep sees it
            return
        for work in works:
            try:
                done, state = self._probe(work), fmt.State.COMPLETED
            except Exception:  # noqa: BLE001 - the operation itself failed
                done, state = True, fmt.State.FAILED
            if done:
                try:
                    self._finish(work, int(state))
                except Exception as exc:  # noqa: BLE001 - never let the thread die
                    warn_once("sweeper", f"completion tracking failed: {exc!r}")

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop the thread, then sweep once more from the caller's thread."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self.sweep()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self._interval)
            if not self._stopped:
                self.sweep()
