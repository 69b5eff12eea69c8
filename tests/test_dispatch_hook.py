"""The c10d dispatcher hook: every collective a real PyTorch program makes, once, on real gloo groups.

The reference count is torch's own: the Flight Recorder's in-process dump on each rank (it records
collectives at the backend, whatever called them, but no point-to-point calls on gloo).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from helpers.torch_ranks import finish, groups, launch, records

from megatrace.trace.ring_format import Flag, Op, State

torch = pytest.importorskip("torch")

FR_NAMES = {Op.ALL_REDUCE: "all_reduce", Op.ALL_GATHER: "all_gather", Op.BROADCAST: "broadcast",
            Op.REDUCE: "reduce", Op.BARRIER: "barrier", Op.REDUCE_SCATTER: "reduce_scatter",
            Op.ALL_TO_ALL: "all_to_all", Op.GATHER: "gather", Op.SCATTER: "scatter"}


def _ring_counts(tmp_path: Path, rank: int) -> tuple[Counter, list[dict]]:
    names = {gid: g["name"] for gid, g in groups(tmp_path, rank).items()}
    recs = records(tmp_path, rank)
    collectives = Counter(f"{names[r['group_id']]} {FR_NAMES[Op(r['op'])]}" for r in recs
                          if not Op(r["op"]).is_p2p)
    return collectives, recs


@pytest.mark.parametrize("completion", ["future", "poll"])
def test_ddp_functional_and_python_calls_are_each_recorded_once(tmp_path: Path, completion: str) -> None:
    """``poll``: every work is completed by the hook's poller thread, as device (NCCL) works are on a GPU
    (the CPU twin of tests/test_gpu_nccl.py's DDP test: same kernel, same completion code)."""
    world = 3
    env = {"MEGATRACE_DISPATCH_HOOK": "poll"} if completion == "poll" else {}
    finish(launch("cpp_callers", tmp_path, world=world, TORCH_FR_BUFFER_SIZE="2000", **env))
    for rank in range(world):
        reference = Counter(json.loads((tmp_path / f"fr-{rank}.json").read_text()))
        collectives, recs = _ring_counts(tmp_path, rank)
        assert collectives == reference, f"rank {rank}: ring {collectives} vs Flight Recorder {reference}"
        # DDP's reducer issues one all-reduce per backward (3), the script two more, funcol one.
        assert reference["0 all_reduce"] == 5
        assert all(r["state"] == State.COMPLETED for r in recs), [r for r in recs if r["state"] != State.COMPLETED]
        world_seqs = [r["group_seq"] for r in recs if not Op(r["op"]).is_p2p and r["group_id"] == recs[0]["group_id"]]
        assert world_seqs == list(range(1, len(world_seqs) + 1))
        # p2p (the Flight Recorder does not see them on gloo): the batch's pair, and 0 -> 1 once more.
        sends = [(r["peer"], r["nbytes"], bool(r["flags"] & Flag.BATCHED)) for r in recs if r["op"] == Op.SEND]
        recvs = [(r["peer"], r["nbytes"], bool(r["flags"] & Flag.BATCHED)) for r in recs if r["op"] == Op.RECV]
        expect_sends = [((rank + 1) % world, 12, True)] + ([(1, 20, False)] if rank == 0 else [])
        expect_recvs = [((rank - 1) % world, 12, True)] + ([(0, 20, False)] if rank == 1 else [])
        assert sends == expect_sends and recvs == expect_recvs


def test_the_process_meta_says_which_paths_were_recorded(tmp_path: Path) -> None:
    finish(launch("cpp_callers", tmp_path, world=2))
    entries = [e for e in (tmp_path / "rings" / "rank-00000.meta.jsonl").read_text().splitlines() if '"process"' in e]
    capture = json.loads(entries[0])["capture"]
    assert "allreduce_" in capture["dispatcher_cpu"] and "send" in capture["dispatcher_cpu"]
    # c10d registers its CUDA kernels in every torch build: the hook sits in front of them too.
    assert "allreduce_" in capture["dispatcher_device"] and "send" in capture["dispatcher_device"]


def test_without_the_hook_the_tracer_says_what_it_cannot_see(tmp_path: Path) -> None:
    errs = finish(launch("cpp_callers", tmp_path, world=2, MEGATRACE_DISPATCH_HOOK="0",
                         TORCH_FR_BUFFER_SIZE="2000"))
    assert errs[0].count("DDP's gradient all-reduces") == 1
    collectives, _ = _ring_counts(tmp_path, 0)
    reference = Counter(json.loads((tmp_path / "fr-0.json").read_text()))
    # The script's own calls are there; DDP's three all-reduces and funcol's are not.
    assert collectives["0 reduce"] == reference["0 reduce"] == 1
    assert collectives["0 all_reduce"] == 1 < reference["0 all_reduce"]


def test_a_hook_built_for_another_torch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatrace.trace import dispatch_hook

    module = dispatch_hook.load(torch)
    monkeypatch.setattr(module, "TORCH_VERSION", "1.0.0")
    with pytest.raises(dispatch_hook.HookUnavailable, match="built for torch 1.0.0.*rebuild"):
        dispatch_hook.load(torch)


def test_every_operator_spec_matches_this_torch_and_a_renamed_argument_is_skipped() -> None:
    from megatrace.trace import dispatch_hook

    rows, skipped = dispatch_hook.spec_rows(torch)
    assert not skipped and {r[0] for r in rows} == set(dispatch_hook.HOOK_SPECS)
    renamed = {"broadcast_": dispatch_hook.HookSpec(Op.BROADCAST, "tensors", "root")}  # real name: root_rank
    assert dispatch_hook.spec_rows(torch, renamed) == ([], ["broadcast_"])
    unknown = {"no_such_op_": dispatch_hook.HookSpec(Op.ALL_REDUCE, "tensors")}
    assert dispatch_hook.spec_rows(torch, unknown) == ([], ["no_such_op_"])


def test_a_call_that_raises_is_made_once_and_recorded_once_as_failed(tmp_path: Path) -> None:
    """The Python wrapper steps aside for the hook; a collective that raises must not be called again."""
    errs = finish(launch("peer_gone", tmp_path, world=2, MEGATRACE_RING_RECORDS="64"))
    assert (tmp_path / "raised.txt").read_text() == "3"
    assert "tracer error" not in errs[0], errs[0][-2000:]
    after_barrier = [r for r in records(tmp_path, 0) if r["op"] == Op.ALL_REDUCE]
    assert len(after_barrier) == 3 and all(r["state"] == State.FAILED for r in after_barrier)
