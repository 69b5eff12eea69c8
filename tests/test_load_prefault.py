"""Pages of new columns faulted in on another core: contents never change, whatever the loader writes meanwhile."""

from __future__ import annotations

import numpy as np

from megatrace.load.prefault import populate_in_background


def test_populating_changes_no_value_written_before_or_during_it() -> None:
    cols = [np.empty(3 << 20, np.int64), np.empty(5 << 20, np.int32), np.zeros(10, np.int8)]
    cols[0][:1000] = np.arange(1000)  # written before
    thread = populate_in_background(cols)
    cols[1][:] = 7  # written while the thread runs
    assert thread is not None  # (two arrays of 1 MiB or more; the small one is skipped)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert np.array_equal(cols[0][:1000], np.arange(1000)) and (cols[1] == 7).all() and not cols[2].any()


def test_nothing_to_do_for_small_arrays() -> None:
    assert populate_in_background([np.zeros(100), np.zeros(1000, np.int8)]) is None


def test_a_kept_heap_is_warmed_ahead_and_an_ordinary_one_left_alone() -> None:
    """``warm_heap`` faults in heap the process keeps (the commands' tuned heap); in a library caller's process it
    does nothing (a freed block there goes back to the system)."""
    import subprocess
    import sys

    child = r"""
import sys, time
from megatrace.analyze import heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
if sys.argv[1] == "kept":
    heap.keep_freed_memory()
before = rss()
heap.warm_heap(300 << 20)
for _ in range(300):
    if rss() - before > 250:
        break
    time.sleep(0.01)
print(rss() - before)
"""
    grown = {how: int(subprocess.run([sys.executable, "-c", child, how], capture_output=True, text=True,
                                     check=True).stdout) for how in ("kept", "plain")}
    assert grown["kept"] > 250 and grown["plain"] < 50, grown
