"""MPICH's start-up segments around the collector's ``MPI_Init`` (``megatrace/collect/mpi_segments.py``).

The naming is checked against the real MPICH under the real Slurm lab (``srun --mpi=pmi2``, one task per virtual
node): the names computed from the step's environment are the very files MPICH maps. The lab tests then plant what
a collector killed at a time limit leaves (a segment of the same job step) and run the collector the way the agents
do: without the clearing, MPI's start-up fails on it (shown on the unfixed code when this was written: "Shared
memory error", "Out of memory" in MPIDI_POSIX_comm_bootstrap); with it the collection completes and no segment of
the step is left in /dev/shm. The file checks (whose files are removed, which are left and named) run without
Slurm, on a directory standing for /dev/shm.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers.slurm_lab import PYTHON, clean_env, submit

from megatrace.collect.mpi_segments import (clear_stale, fnv1a_32, one_task_per_node, segment_names,
                                            unlink_attached)
from megatrace.collect.slurm import collect_command

STEP_ENV = {"SLURM_JOB_ID": "206", "SLURM_STEP_ID": "1", "SLURM_PROCID": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x4)"}


def test_the_hash_is_fnv1a_32_and_names_follow_mpichs_pattern() -> None:
    assert [fnv1a_32(s) for s in (b"", b"a", b"foobar")] == [0x811C9DC5, 0xE40C292C, 0xBF9CF968]  # FNV's vectors
    assert segment_names("169", "1", 0) == ("mpich_shm_d60e6660_0", "mpich_vci_d60e6660_0")


@pytest.mark.parametrize("tasks, one", [("1", True), ("1(x4)", True), ("1(x2),1", True), ("2", False),
                                        ("1(x2),2", False), ("", False), ("1(x4", False)])
def test_only_a_step_of_one_task_per_node_counts(tasks: str, one: bool) -> None:
    assert one_task_per_node({"SLURM_STEP_TASKS_PER_NODE": tasks}) is one


def test_a_stale_segment_of_this_step_and_node_is_removed_and_nothing_else(tmp_path: Path) -> None:
    mine, vci = segment_names("206", "1", 2)
    other_node, _ = segment_names("206", "1", 1)  # (another node's: on one host, its collector is starting now)
    other_step, _ = segment_names("206", "0", 2)
    for name in (mine, vci, other_node, other_step, "unrelated"):
        (tmp_path / name).write_bytes(b"\xff" * 64)
    notes = clear_stale(STEP_ENV, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other_node, other_step, "unrelated"])
    assert len(notes) == 2 and all("removed (stale, from an earlier run of job step 206.1" in n for n in notes)


@pytest.mark.parametrize("drop, tasks", [("SLURM_JOB_ID", "1(x4)"), ("SLURM_STEP_ID", "1(x4)"),
                                         ("SLURM_PROCID", "1(x4)"), ("", "2(x4)")])
def test_outside_a_one_task_per_node_slurm_step_nothing_is_touched(tmp_path: Path, drop: str, tasks: str) -> None:
    mine, _ = segment_names("206", "1", 2)
    (tmp_path / mine).write_bytes(b"x")
    env = {k: v for k, v in STEP_ENV.items() if k != drop} | {"SLURM_STEP_TASKS_PER_NODE": tasks}
    assert clear_stale(env, str(tmp_path)) == [] and (tmp_path / mine).exists()


def test_a_link_or_a_directory_under_the_name_is_left_and_named(tmp_path: Path) -> None:
    mine, vci = segment_names("206", "1", 2)
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / mine)
    (tmp_path / vci).mkdir()
    notes = clear_stale(STEP_ENV, str(tmp_path))
    assert (tmp_path / mine).is_symlink() and (tmp_path / vci).is_dir() and target.read_bytes() == b"keep"
    assert len(notes) == 2 and all("left alone (not a regular file of uid" in n for n in notes), notes


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root (CI runs as root)")
def test_another_users_file_under_the_name_is_left_and_named(tmp_path: Path) -> None:
    mine, _ = segment_names("206", "1", 2)
    (tmp_path / mine).write_bytes(b"planted")
    os.chown(tmp_path / mine, 65534, 65534)
    notes = clear_stale(STEP_ENV, str(tmp_path))
    assert (tmp_path / mine).read_bytes() == b"planted"
    assert len(notes) == 1 and notes[0].startswith(f"{tmp_path}/{mine}: left alone (not a regular file of uid 0: "
                                                   "uid 65534, mode -") and "may fail on it" in notes[0], notes


def test_after_init_the_segments_this_process_maps_are_unlinked(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("mpich_shm_d60e6660_2", "mpich_vci_d60e6660_2", "torch_1234", "mpich_shm_1_0"):
        (shm / name).write_bytes(b"x")
    maps = tmp_path / "maps"  # /proc/self/maps' format: the last column is the mapped path
    maps.write_text(
        f"7f00-7f10 rw-s 00000000 00:1a 11 {shm}/mpich_shm_d60e6660_2\n"
        f"7f10-7f20 rw-s 00000000 00:1a 12 {shm}/mpich_vci_d60e6660_2\n"
        f"7f20-7f30 rw-s 00000000 00:1a 13 {shm}/torch_1234\n"
        f"7f30-7f40 rw-s 00000000 00:1a 14 {shm}/mpich_shm_1_0 (deleted)\n"
        "7f40-7f50 r-xp 00000000 08:01 15 /usr/lib/libc.so.6\n"
        "7f50-7f60 rw-p 00000000 00:00 0 \n")
    notes = unlink_attached(str(shm), str(maps))
    assert sorted(p.name for p in shm.iterdir()) == ["mpich_shm_1_0", "torch_1234"]
    assert len(notes) == 2 and all("attached by this collector" in n for n in notes)
    (shm / "mpich_shm_d60e6660_2").write_bytes(b"x")
    assert unlink_attached(str(shm), str(tmp_path / "no-maps")) == []


# --- on the real MPICH under the real Slurm lab ---

PROBE = r"""
import json, os, sys
from megatrace.collect.mpi_segments import segment_names
env = os.environ
expected = segment_names(env["SLURM_JOB_ID"], env["SLURM_STEP_ID"], int(env["SLURM_PROCID"]))
from mpi4py import MPI  # MPI_Init: MPICH creates or attaches this node's start-up segment
with open("/proc/self/maps") as f:
    mapped = sorted({l.split()[-1].rsplit("/", 1)[-1] for l in f if "/dev/shm/mpich_" in l})
print(json.dumps({"rank": MPI.COMM_WORLD.Get_rank(), "expected": list(expected), "mapped": mapped}), flush=True)
"""


def test_the_names_are_the_segments_mpich_maps_under_srun_pmi2(lab) -> None:
    proc = subprocess.run(["srun", "-N4", "--ntasks-per-node=1", "--mpi=pmi2", "--time=2", PYTHON, "-c", PROBE],
                          capture_output=True, text=True, timeout=180, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r["rank"])
    assert len(rows) == 4, proc.stdout
    for row in rows:
        assert row["mapped"] and set(row["mapped"]) <= set(row["expected"]), row


def _step_segments(job: str) -> list[str]:
    """This job's start-up segments in /dev/shm (steps 0-63)."""
    names = {n for step in range(64) for node in range(4) for n in segment_names(job, str(step), node)}
    return sorted(n for n in os.listdir("/dev/shm") if n in names)


def test_the_collector_starts_past_a_stale_segment_of_its_step_and_leaves_none(lab, tmp_path: Path) -> None:
    """What a collector killed at the time limit leaves, found by the next run of the same job step (a requeued
    job keeps its id; the lab's ids start again): the collection completes, and nothing of the job is left."""
    tmp_path.chmod(0o755)
    job = submit("sleep 300\n", tmp_path, "-N4", "-n4", "--time=5")
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True
                             ).stdout.strip() != "RUNNING":
            assert time.monotonic() < deadline, f"job {job} did not start"
            time.sleep(0.5)
        planted = [segment_names(job, "0", node)[0] for node in range(4)]  # its first step: the collector's
        for name in planted:
            Path("/dev/shm", name).write_bytes(b"\xff" * (1 << 20))
        def collect(out: str) -> subprocess.CompletedProcess:
            cmd = collect_command(job, str(tmp_path), "manual", 4, ring_dir=str(tmp_path / "none"), timeout_s=30.0,
                                  extra=["--out", str(tmp_path / out), "--analysis", "none", "--no-report",
                                         "--no-stacks"])
            return subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=clean_env())

        proc = collect("bundle")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert sum("removed (stale, from an earlier run of job step" in line
                   for line in proc.stderr.splitlines()) == 4, proc.stderr
        assert (tmp_path / "bundle").is_dir()
        again = collect("bundle-2")  # (step 1: nothing stale; its own segments unlinked once attached)
        assert again.returncode == 0, again.stderr[-2000:]
        assert _step_segments(job) == []  # (MPICH removes its segments only in MPI_Finalize)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        for name in _step_segments(job):
            Path("/dev/shm", name).unlink(missing_ok=True)
