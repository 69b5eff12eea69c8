"""The analysing process: it keeps the memory it frees (a large array made again is not faulted in again), and
its cyclic garbage collector and numpy's huge pages rest during the analysis only."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

from megatrace.analyze.heap import tuned_for_analysis

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


def test_the_collector_rests_during_the_analysis_only() -> None:
    assert gc.isenabled()
    with tuned_for_analysis():
        assert not gc.isenabled()
    assert gc.isenabled()  # (a command run inside a test's process gives it back)
    with pytest.raises(ValueError), tuned_for_analysis():
        raise ValueError("an analysis that fails")
    assert gc.isenabled()
    gc.disable()
    try:
        with tuned_for_analysis():
            pass
        assert not gc.isenabled()  # (off before: left off)
    finally:
        gc.enable()


def test_numpy_asks_for_no_huge_pages_during_the_analysis_only() -> None:
    """Inside the block numpy's large arrays are not madvised for huge pages (a kept heap holds a 2 MiB page whole
    while its arrays come and go); after it, numpy's setting is back."""
    from numpy._core import multiarray

    before = multiarray._set_madvise_hugepage(True)  # (returns the setting it replaces)
    try:
        with tuned_for_analysis():
            assert multiarray._set_madvise_hugepage(False) is False  # off inside
        assert multiarray._set_madvise_hugepage(True) is True  # on again after
    finally:
        multiarray._set_madvise_hugepage(before)


def test_the_analyze_command_runs_without_the_collector_and_gives_it_back(tmp_path, monkeypatch) -> None:
    """The command (in this process, as click's runner runs it) analyses with the collector at rest."""
    from click.testing import CliRunner

    import megatrace.analyze.engine as engine
    from megatrace.cli import main

    seen: list[bool] = []
    real = engine.analyze

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "analyze", spy)
    trace = tmp_path / "sim"
    runner = CliRunner()
    assert runner.invoke(main, ["simulate", "--ranks", "16", "--tp", "2", "--pp", "2", "--records", "64",
                                "--fault", "hang:rank=3,step=1", "-o", str(trace)]).exit_code == 0
    got = runner.invoke(main, ["analyze", str(trace), "--no-report", "-o", str(tmp_path / "out")])
    assert got.exit_code == 0, got.output
    assert seen == [False] and gc.isenabled()


THREADS_CHILD = r"""
import os, sys
if sys.argv[1] == "command":  # the analyze command, as its process runs it
    from megatrace.cli import main
    main(["analyze", "--quick", sys.argv[2], "--no-report", "-o", sys.argv[3]], standalone_mode=False)
elif sys.argv[1] == "helper":
    from megatrace.cli.settings import import_numpy_for_analysis
    import_numpy_for_analysis()
else:
    import numpy
print(len(os.listdir("/proc/self/task")), os.environ.get("OPENBLAS_NUM_THREADS"))
"""


def _threads(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    import os

    child_env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                                                   "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", THREADS_CHILD, *args], check=True, capture_output=True, text=True,
                         env={**child_env, **(env or {})})
    threads, blas = out.stdout.split()[-2:]
    return int(threads), blas


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task")
def test_the_analysis_starts_no_blas_threads_and_leaves_the_environment_as_it_was(tmp_path) -> None:
    """numpy's OpenBLAS starts a thread per core at import (that spins a while); the analysis has no use for
    them. None is started, the variable that said so is gone again, and one the user set is obeyed."""
    import os

    if len(os.sched_getaffinity(0)) > 1:  # (the control: a plain import starts a pool, one thread per CPU)
        assert _threads("plain")[0] > 1
    assert _threads("helper") == (1, "None")
    assert _threads("helper", env={"OPENBLAS_NUM_THREADS": "2"}) == (2, "2")
    from click.testing import CliRunner

    from megatrace.cli import main

    trace = tmp_path / "sim"
    assert CliRunner().invoke(main, ["simulate", "--ranks", "16", "--tp", "2", "--pp", "2", "--records", "64",
                                     "--fault", "hang:rank=3,step=1", "-o", str(trace)]).exit_code == 0
    assert _threads("command", str(trace), str(tmp_path / "out")) == (1, "None")
