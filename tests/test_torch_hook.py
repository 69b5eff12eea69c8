"""The torch.distributed tracer, on real gloo process groups in separate processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.outside import wait_for
from helpers.torch_ranks import finish, free_port, groups, launch, records

from megatrace.trace.ring_format import Flag, Op, State
from megatrace.trace.ring_reader import RingFormatError, read_meta, read_ring

torch = pytest.importorskip("torch")


def test_every_traced_call_leaves_one_record_with_its_fields(tmp_path: Path) -> None:
    finish(launch("every_op", tmp_path, NCCL_DEBUG="WARN", NCCL_IB_AUTH_TOKEN="hunter2"))
    entries, _ = read_meta(tmp_path / "rings" / "rank-00000.meta.jsonl")
    (env,) = [e["vars"] for e in entries if e["kind"] == "env"]
    assert env["NCCL_DEBUG"] == "WARN" and env["RANK"] == "0" and "NCCL_IB_AUTH_TOKEN" not in env
    for rank in (0, 1):
        outcome = json.loads((tmp_path / f"outcome-{rank}.json").read_text())
        recs = [r for r in records(tmp_path, rank) if r["op"] != Op.BARRIER]
        by_op: dict[int, list[dict]] = {}
        for r in recs:
            by_op.setdefault(r["op"], []).append(r)
        expected_ops = {"all_reduce": Op.ALL_REDUCE, "all_gather": Op.ALL_GATHER,
                        "reduce_scatter_tensor": Op.REDUCE_SCATTER, "broadcast": Op.BROADCAST,
                        "reduce": Op.REDUCE, "all_to_all_single": Op.ALL_TO_ALL, "gather": Op.GATHER,
                        "scatter": Op.SCATTER}
        for name, op in expected_ops.items():
            assert op in by_op, f"rank {rank}: no record for {name} ({outcome.get(name)})"
            state = by_op[op][0]["state"]
            assert state == (State.COMPLETED if outcome[name] == "ok" else State.FAILED), (name, outcome[name])
        all_reduces = by_op[Op.ALL_REDUCE]
        assert [r["flags"] & Flag.ASYNC for r in all_reduces] == [0, Flag.ASYNC]
        assert all_reduces[0]["nbytes"] == 16 and all_reduces[0]["dtype"] == 1  # 4 x float32
        gathers = by_op[Op.ALL_GATHER]
        assert len(gathers) == 2 and gathers[1]["flags"] & Flag.TENSOR_API  # into_tensor, recorded once
        roots = {op: by_op[op][0]["peer"] for op in (Op.BROADCAST, Op.REDUCE, Op.GATHER, Op.SCATTER)}
        assert roots == {Op.BROADCAST: 1, Op.REDUCE: 1, Op.GATHER: 0, Op.SCATTER: 1}
        world_gid = all_reduces[0]["group_id"]
        collectives = [r for r in recs if r["group_id"] == world_gid and not Op(r["op"]).is_p2p]
        assert [r["group_seq"] for r in collectives] == list(range(1, len(collectives) + 1))
        p2p = by_op[Op.SEND] if rank == 0 else by_op[Op.RECV]
        assert all(r["peer"] == 1 - rank and r["state"] == State.COMPLETED for r in p2p)
        assert [r["group_seq"] for r in p2p] == list(range(1, len(p2p) + 1))  # per-peer sequence
        assert any(r["flags"] & Flag.BATCHED for r in p2p)
        assert all(r["t_complete"] >= r["t_enqueue"] > 0 for r in recs if r["state"] == State.COMPLETED)
    def timeless(meta: dict[int, dict]) -> dict[int, dict]:
        return {gid: {k: v for k, v in e.items() if k != "t_mono_ns"} for gid, e in meta.items()}

    g0 = timeless(groups(tmp_path, 0))
    assert g0 == timeless(groups(tmp_path, 1))  # the same ids, names and members on every rank
    assert {e["desc"] for e in g0.values()} >= {"default_pg", "pair"}


def test_reader_sees_the_wedged_call_as_entered_while_it_blocks(tmp_path: Path) -> None:
    procs = launch("wedged_peer", tmp_path)
    ring = tmp_path / "rings" / "rank-00000.ring"

    def entered() -> bool:
        try:
            recs = read_ring(ring).to_dicts()
        except (OSError, RingFormatError):  # a ring not there yet, or being created, reads as no ring yet
            return False
        return len(recs) >= 2 and recs[-1]["state"] == State.ENQUEUED

    seen_entered = wait_for(entered, timeout=60, step=0.05)
    time.sleep(0.3)  # a duration, not a wait: blocked a while longer, the record must hold it (checked below)
    assert read_ring(ring).to_dicts()[-1]["state"] == State.ENQUEUED  # still blocked: rank 1 is late
    (tmp_path / "go").touch()
    finish(procs)
    last = records(tmp_path, 0)[-1]
    assert seen_entered and last["state"] == State.COMPLETED and last["flags"] & Flag.ASYNC
    assert last["t_complete"] - last["t_enqueue"] > 300e6  # the wait is inside the record


def test_full_ring_wraps_counts_what_it_dropped_and_warns_once(tmp_path: Path) -> None:
    errs = finish(launch("many_ops", tmp_path, MEGATRACE_RING_RECORDS="16", SCENARIO_OPS="100"))
    snap = read_ring(tmp_path / "rings" / "rank-00000.ring")
    assert len(snap.records) == 16 and snap.dropped == 100 - 16 and not snap.problems
    assert snap.to_dicts()[-1]["group_seq"] == 100
    assert errs[0].count("is full after 16 records") == 1


def test_unwritable_trace_directory_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    errs = finish(launch("many_ops", tmp_path, MEGATRACE_DIR=str(blocker / "rings"), SCENARIO_OPS="20"))
    for err in errs:
        warnings = [line for line in err.splitlines() if "megatrace" in line]
        assert len(warnings) == 1 and "tracing is off" in warnings[0] and str(blocker) in warnings[0]


def test_groups_from_subgroups_and_device_mesh_and_markers_are_recorded(tmp_path: Path) -> None:
    finish(launch("groups_and_markers", tmp_path, world=4))
    for rank in range(4):
        recs = records(tmp_path, rank)
        meta = groups(tmp_path, rank)
        used = {r["group_id"] for r in recs if r["op"] == Op.ALL_REDUCE}
        assert used <= meta.keys() and len(used) == 3
        member_sets = sorted(sorted(meta[g]["ranks"]) for g in used)
        assert all(rank in ranks and len(ranks) == 2 for ranks in member_sets)
        steps = [r["group_seq"] for r in recs if r["op"] == Op.MARK_STEP]
        phases = [(r["dtype"], r["peer"]) for r in recs if r["op"] == Op.MARK_PHASE]
        assert steps == [0, 1, 2] and phases == [(1, 0), (3, -1)] * 3


def test_poller_records_completion_of_async_works_without_blocking(tmp_path: Path) -> None:
    finish(launch("async_poll", tmp_path))
    polled = [r for r in records(tmp_path, 0) if r["group_id"] == 4242]
    assert len(polled) == 5 and all(r["state"] == State.COMPLETED for r in polled)
    assert all(r["t_complete"] > r["t_enqueue"] for r in polled)


def test_missing_torch_op_gives_one_warning_and_the_rest_is_traced(tmp_path: Path) -> None:
    code = """
import sys, types, torch
from torch.distributed import distributed_c10d as real
from megatrace.trace import torch_hook
clone = types.ModuleType("clone")
clone.__dict__.update({k: v for k, v in vars(real).items() if k != "all_to_all"})
assert torch_hook.install(clone)
assert getattr(clone.all_reduce, "_megatrace", False) and not hasattr(clone, "all_to_all")
"""
    env = dict(os.environ, MEGATRACE_ENABLE="0", PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "megatrace" in line]
    assert len(lines) == 1 and "torch.distributed.all_to_all" in lines[0]


def test_megatrace_run_traces_an_unchanged_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:%d')\n"
                      "dist.all_reduce(torch.ones(3))\n" % free_port())
    megatrace = Path(sys.executable).with_name("megatrace")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRACE")}
    result = subprocess.run([str(megatrace), "run", "--dir", str(tmp_path / "rings"), "--",
                             sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    recs = records(tmp_path, 0)
    assert [(r["op"], r["nbytes"], r["state"]) for r in recs] == [(Op.ALL_REDUCE, 12, State.COMPLETED)]
