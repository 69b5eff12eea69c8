"""One node's snapshot: its own rings (also in a directory shared by virtual nodes) and its processes."""

from __future__ import annotations

import os
from pathlib import Path

from megatrace.collect.node import foreign_files, process_facts, snapshot_node
from megatrace.trace.ring_writer import RingIdentity, RingWriter


def test_in_a_directory_shared_by_virtual_nodes_each_node_takes_only_its_own_rings(tmp_path: Path) -> None:
    writers = [RingWriter(tmp_path, RingIdentity(rank=r, world_size=4, job_id="9", host=f"n{r // 2 + 1}"),
                          capacity=16, use_native=False) for r in range(4)]
    for w in writers:
        w.complete(w.begin(1, 1, 1, 4))
    snap = snapshot_node(str(tmp_path), "n2", stacks=False, system=False)
    assert sorted(snap.files) == ["rank-00002.meta.jsonl", "rank-00002.ring", "rank-00003.meta.jsonl",
                                  "rank-00003.ring"]
    assert [r["rank"] for r in snap.facts["rings"]] == [2, 3] and snap.facts["other_nodes_rings"] == 2
    # this live process is the writer of every ring: alive, with its state from /proc
    assert snap.facts["procs"][str(os.getpid())]["alive"] is True
    # a node name that no ring carries (hosts named otherwise): every ring is kept
    assert len(snapshot_node(str(tmp_path), "gpu17", stacks=False, system=False).files) == 8


def test_foreign_rings_are_told_by_the_host_in_their_header() -> None:
    hosts = {"rank-00000.ring": "a", "rank-00001.ring": "b", "rank-00001.ring.1": "b"}
    assert foreign_files(hosts, "a") == {"rank-00001"}
    assert foreign_files(hosts, "zzz") == set()


def test_a_pid_that_started_after_its_ring_is_not_the_writer() -> None:
    me = process_facts(os.getpid(), ring_anchor_mono_ns=None)
    assert me["alive"] and me["state"] in "RS"
    assert process_facts(os.getpid(), ring_anchor_mono_ns=0)["alive"] is False  # a ring older than this process
    assert process_facts(2 ** 22 + 12345)["alive"] is False


def test_gathers_and_local_runs_never_share_a_bundle_directory(tmp_path: Path) -> None:
    from megatrace.collect.bundle import GATHER_MARK, LOCAL_MARK, bundle_path

    assert bundle_path(tmp_path, "5").name == "megatrace-5"
    (tmp_path / "megatrace-5").mkdir()
    (tmp_path / "megatrace-5" / LOCAL_MARK).touch()  # epilogs are filling it
    assert bundle_path(tmp_path, "5").name == "megatrace-5.1"
    assert bundle_path(tmp_path, "5", local=True).name == "megatrace-5"
    (tmp_path / "megatrace-5.1").mkdir()
    (tmp_path / "megatrace-5.1" / GATHER_MARK).touch()  # a gather is writing it
    (tmp_path / "megatrace-5.1" / "collection.json").touch()
    assert bundle_path(tmp_path, "5").name == "megatrace-5.2"
    assert bundle_path(tmp_path, "5", fresh=True).name == "megatrace-5.2"
    (tmp_path / "megatrace-5.2").symlink_to(tmp_path)
    assert bundle_path(tmp_path, "5").name == "megatrace-5.3"


def test_a_pid_in_a_ring_header_is_looked_into_only_when_it_runs_as_the_rings_owner(tmp_path: Path) -> None:
    """Issue 20, item 8: the root-run collector followed a pid from a header into /proc and py-spy of any process."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("playing another user needs root")
    w = RingWriter(tmp_path, RingIdentity(rank=0, world_size=1, job_id="9", host="n1", pid=os.getpid()),
                   capacity=16, use_native=False)
    w.complete(w.begin(1, 1, 1, 4))
    for p in (tmp_path, *tmp_path.iterdir()):
        os.chown(p, 4242, 4242)  # a user's ring naming root's process (this one)
    facts = snapshot_node(str(tmp_path), "n1", stacks=False, system=False).facts
    me = facts["procs"][str(os.getpid())]
    assert me["alive"] is False and "cmdline" not in me and "not looked into" in me["note"], me
    assert facts["ring_dir_uid"] == 4242


PY_SPY_DUMP = """Process 4242: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4250 (idle): "pt_tcpstore"
    run (threading.py:975)
Thread 4242 (idle): "MainThread"
    sleep_forever (train.py:9)
        Arguments:
            seconds: 3600
    load (train.py:14)
    <module> (train.py:20)
"""


def test_the_main_threads_innermost_frames_are_taken_from_a_py_spy_dump() -> None:
    from megatrace.collect.node import main_thread_frames

    assert main_thread_frames(PY_SPY_DUMP) == ["sleep_forever (train.py:9)", "load (train.py:14)",
                                               "<module> (train.py:20)"]
    assert main_thread_frames(PY_SPY_DUMP, limit=1) == ["sleep_forever (train.py:9)"]
    unnamed = "Process 7: python x.py\n\nThread 8 (idle)\n    helper (x.py:1)\nThread 7 (active)\n    main (x.py:5)\n"
    assert main_thread_frames(unnamed) == ["main (x.py:5)"]  # py-spy without thread names: the thread id = the pid
    assert main_thread_frames("py-spy: Permission denied") == []
