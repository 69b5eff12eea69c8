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
