"""The analysing process keeps the memory it frees: a large array made again is not faulted in again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, resource, sys
import numpy as np
from megatrace.analyze.heap import keep_freed_memory

kept = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
for _ in range(3):  # an analysis's pattern: a big array made, filled, dropped, made again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.empty(64 << 20, np.uint8)
    a[:] = 1
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del a
print(json.dumps({"kept": kept, "faults": faults}))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_an_array_made_again_is_not_faulted_in_again() -> None:
    plain, kept = _faults("plain"), _faults("keep")
    assert kept["kept"] is True
    # By default each 64 MiB array is a fresh mapping, faulted in again every time (huge pages, where the kernel
    # gives them, make fewer faults of each, not fewer arrays faulted in).
    assert plain["faults"][0] > 10 and min(plain["faults"][1:]) > plain["faults"][0] / 2
    # Kept: the first array is faulted in once; the next ones reuse its pages.
    assert kept["faults"][0] > 10 and max(kept["faults"][1:]) < kept["faults"][0] / 20
