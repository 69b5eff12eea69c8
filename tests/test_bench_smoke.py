"""A small run of every benchmark in bench/ (CI runs this, not the whole `make bench`).

Each script must run to its tables on a tiny scale; the numbers themselves are not asserted here
(speed targets live in the benchmarks, where the baseline is measured in the same run).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
pytestmark = pytest.mark.slow


def bench(script: str, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_tracer_overhead_prints_its_ratios() -> None:
    out = bench("tracer_overhead.py", "--calls", "200", "--rounds", "3", "--skip-demo")
    assert "gloo all_reduce" in out and "ratio" in out and "not measured" not in out
    for path in ("CPU call from C++", "CPU torch.distributed call", "device (NCCL) call"):
        assert path in out, out


def test_analysis_scale_prints_times_memory_and_the_report() -> None:
    out = bench("analysis_scale.py", "--ranks", "64", "--tp", "2", "--pp", "4", "--records", "300", "--repeat", "1")
    assert "quick/full" in out and "same culprit" in out and "report.html MB" in out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["64"] and "yes" in line)
    assert "yes" in row  # full and quick name the same culprit


def test_accuracy_prints_the_matrix_and_the_targets() -> None:
    out = bench("accuracy.py", "--scenarios", "5", "--tp", "2", "--pp", "2", "--dp", "2", "--steps", "8")
    assert "named first:" in out and "false positives:" in out and "healthy" in out


def test_import_accuracy_prints_each_format_against_the_rings() -> None:
    out = bench("import_accuracy.py", "--runs", "1", "--seed", "1")
    assert "ratio to rings" in out and all(f in out for f in ("flight-recorder", "inspector", "nccl-log"))


def test_simulate_speed_prints_the_ratio_to_the_plain_writer() -> None:
    out = bench("simulate_speed.py", "--ranks", "64", "--tp", "2", "--pp", "4", "--records", "300")
    assert "64" in out and "ratio" in out.lower()


def test_collection_on_the_lab_gathers_every_node(lab) -> None:
    out = bench("collection_lab.py", "--repeat", "1", timeout=400)
    assert "srun --overlap collector" in out and "baseline: copy the node-local rings" in out, out


def test_collection_scale_measures_both_transfers_and_states_its_model() -> None:
    out = bench("collection_scale.py", "--nodes", "2", "3", "--ranks-per-node", "2", "--records", "1024",
                "--group-size", "2")
    rows = [line.split() for line in out.splitlines() if line.split()[1:2] in (["auto"], ["stream"])]
    assert [(r[0], r[1]) for r in rows] == [("2", "auto"), ("2", "stream"), ("3", "auto"), ("3", "stream")], out
    by_nodes = {(r[0], r[1]): int(r[12]) for r in rows}  # files the nodes wrote themselves
    assert by_nodes[("3", "auto")] == 12 and by_nodes[("3", "stream")] == 0, out
    assert out.count("largest MPI message") == 2 and "--transfer auto" in out and "--transfer stream" in out
