"""The demo job end to end: real gloo ranks, traced, with each injected fault leaving its signature.

Multi-process runs are marked ``slow``; one healthy 8-rank run is shared by several
tests, and the fault runs use 4 ranks and few steps where the fault allows it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from megatrace.cli import main
from megatrace.config import load_layout
from megatrace.schedule import expected_collectives_per_step
from megatrace.trace.ring_format import Op, State

torch = pytest.importorskip("torch")

from megatrace.demo.launcher import DemoOptions, DemoResult, run_local  # noqa: E402
from megatrace.trace.ring_reader import read_meta, read_ring  # noqa: E402

TP_DP_PP_8 = dict(tp=2, pp=2, dp=2)
TP_PP_4 = dict(tp=2, pp=2, dp=1)
ENTERED, COMPLETED, FAILED = int(State.ENQUEUED), int(State.COMPLETED), int(State.FAILED)


@dataclass
class Ring:
    rank: int
    records: np.ndarray  # communication records only (no markers), sorted by seq
    markers: np.ndarray
    desc: dict[int, str]  # group id -> "tp" / "pp" / "dp" / "default_pg"
    closed_cleanly: bool

    def of(self, kind: str, op: Op | None = None, state: int | None = None) -> np.ndarray:
        sel = np.array([self.desc.get(int(g)) == kind for g in self.records["group_id"]], dtype=bool)
        if op is not None:
            sel &= self.records["op"] == int(op)
        if state is not None:
            sel &= self.records["state"] == state
        return self.records[sel]

    def counts(self) -> Counter:
        return Counter((self.desc[int(r["group_id"])], Op(int(r["op"])).label) for r in self.records
                       if self.desc[int(r["group_id"])] in ("tp", "pp", "dp"))


def rings(out: Path) -> dict[int, Ring]:
    result = {}
    for path in sorted((out / "rings").glob("rank-*.ring")):
        snap = read_ring(path)
        meta, _ = read_meta(path.with_name(path.name.replace(".ring", ".meta.jsonl")))
        desc = {m["gid"]: m["desc"] for m in meta if m.get("kind") == "group"}
        is_marker = snap.records["op"] >= int(Op.MARK_STEP)
        result[snap.header.rank] = Ring(snap.header.rank, snap.records[~is_marker], snap.records[is_marker], desc,
                                        snap.header.closed_cleanly)
    return result


def demo(out: Path, **kwargs: object) -> DemoResult:
    opts = dict(steps=6, stall_s=3.0, deadline_s=90.0, crash_grace_s=3.0)
    opts.update(kwargs)
    return run_local(DemoOptions(out=out, **opts), log=print)  # type: ignore[arg-type]


def per_step(layout_out: Path, rank: int, key: tuple[str, str], **kwargs: str) -> int:
    return expected_collectives_per_step(load_layout(layout_out / "layout.yaml"), rank, **kwargs).get(key, 0)


# -- healthy run -------------------------------------------------------------------------------------

HEALTHY_STEPS = 20


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> DemoResult:
    return demo(tmp_path_factory.mktemp("healthy"), steps=HEALTHY_STEPS, **TP_DP_PP_8)


@pytest.mark.slow
def test_healthy_run_finishes_and_records_everything(healthy: DemoResult) -> None:
    assert healthy.ok, healthy.message
    out = healthy.out
    assert all(p.exit_code == 0 and not p.killed_by_launcher for p in healthy.procs)
    procs = json.loads((out / "procs.json").read_text())
    assert procs["outcome"] == "ok" and set(procs["ranks"]) == {str(r) for r in range(8)}
    layout = load_layout(out / "layout.yaml")
    assert (layout.world_size, layout.tp, layout.pp, layout.dp, layout.microbatches) == (8, 2, 2, 2, 4)
    assert set(layout.ranks) == set(range(8))
    assert json.loads((out / "fault.json").read_text()) == {"faults": []}
    for rank in range(8):
        lines = (out / "metrics" / f"rank-{rank:05d}.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == list(range(HEALTHY_STEPS))
        assert ("loss" in lines[0]) == (layout.coords(rank).pp == 1)


@pytest.mark.slow
def test_healthy_loss_goes_down(healthy: DemoResult) -> None:
    losses = healthy.losses
    assert len(losses) == HEALTHY_STEPS
    assert losses[-1] < 0.5 * losses[0], losses
    assert np.mean(losses[-5:]) < np.mean(losses[:5]), losses


@pytest.mark.slow
def test_healthy_rings_hold_every_collective(healthy: DemoResult) -> None:
    layout = load_layout(healthy.out / "layout.yaml")
    by_rank = rings(healthy.out)
    assert sorted(by_rank) == list(range(8))
    for rank, ring in by_rank.items():
        expected = {k: HEALTHY_STEPS * v for k, v in expected_collectives_per_step(layout, rank, 2).items()}
        assert dict(ring.counts()) == expected, f"rank {rank}"
        assert (ring.records["state"] == COMPLETED).all()
        assert ring.closed_cleanly
        for kind in ("tp", "pp", "dp"):  # the meta files name the demo's groups as the layout has them
            gids = {g for g, d in ring.desc.items() if d == kind}
            assert len(gids) == 1
        tp_gid = next(g for g, d in ring.desc.items() if d == "tp")
        assert tp_gid == next(g for g, d in by_rank[layout.group_of("tp", rank)[0]].desc.items() if d == "tp")


# -- faults ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_hang_stops_the_rank_before_its_collective(tmp_path: Path) -> None:
    result = demo(tmp_path, faults=("hang:rank=5,step=3",), **TP_DP_PP_8)
    assert result.outcome == "stalled"
    assert "no progress for 3 s" in result.message and "killed 8 ranks" in result.message
    procs = json.loads((tmp_path / "procs.json").read_text())
    assert procs["outcome"] == "stalled" and all(p["killed_by_launcher"] for p in procs["ranks"].values())
    r = rings(tmp_path)
    tp_per_step = per_step(tmp_path, 5, ("tp", "all_reduce"))
    # Rank 5 is on the last stage: step 3 begins with the receive of microbatch 0, before any TP all_reduce.
    assert len(r[5].of("tp", Op.ALL_REDUCE, COMPLETED)) == 3 * tp_per_step
    assert not (r[5].records["state"] == ENTERED).any(), "rank 5 stopped before its call, it never entered it"
    peer_tp = r[4].of("tp", Op.ALL_REDUCE)
    assert peer_tp[-1]["state"] == ENTERED and peer_tp[-1]["group_seq"] == 3 * tp_per_step + 1
    assert (peer_tp[:-1]["state"] == COMPLETED).all()
    assert "injected hang on rank 5 at step 3" in (tmp_path / "logs" / "rank-00005.log").read_text()


@pytest.mark.slow
def test_commhang_leaves_the_rank_inside_the_collective(tmp_path: Path) -> None:
    result = demo(tmp_path, faults=("commhang:rank=3,step=2",), **TP_PP_4)
    assert result.outcome == "stalled"
    r = rings(tmp_path)
    stuck = r[3].records[r[3].records["state"] == ENTERED]
    assert len(stuck) == 1 and r[3].desc[int(stuck[0]["group_id"])] == "tp"
    assert stuck[0]["op"] == Op.ALL_REDUCE
    assert stuck[0]["group_seq"] == 2 * per_step(tmp_path, 3, ("tp", "all_reduce")) + 1
    peer = r[2].records[(r[2].records["group_id"] == stuck[0]["group_id"])
                        & (r[2].records["group_seq"] == stuck[0]["group_seq"])]
    assert len(peer) == 1 and peer[0]["state"] == ENTERED


@pytest.mark.slow
def test_crash_exits_the_rank_and_fails_its_peers(tmp_path: Path) -> None:
    result = demo(tmp_path, faults=("crash:rank=1,step=2",), **TP_PP_4)
    assert result.outcome == "failed"
    procs = json.loads((tmp_path / "procs.json").read_text())["ranks"]
    assert procs["1"]["exit_code"] == 1 and not procs["1"]["killed_by_launcher"]
    assert "injected crash on rank 1 at step 2" in (tmp_path / "logs" / "rank-00001.log").read_text()
    r = rings(tmp_path)
    assert not (r[1].records["state"] == ENTERED).any() and not r[1].closed_cleanly
    assert len(r[1].of("tp", Op.ALL_REDUCE, COMPLETED)) == 2 * per_step(tmp_path, 1, ("tp", "all_reduce"))
    peer_last = r[0].of("tp", Op.ALL_REDUCE)[-1]  # rank 0 waits for rank 1 in their first TP all_reduce of step 2
    assert peer_last["state"] in (ENTERED, FAILED)
    assert peer_last["group_seq"] == 2 * per_step(tmp_path, 0, ("tp", "all_reduce")) + 1


def _idle_ms(records: np.ndarray, since_ns: int) -> float:
    """Time outside any communication call after ``since_ns``: the rank's compute."""
    rec = records[(records["t_enqueue"] >= since_ns) & (records["state"] == COMPLETED)]
    spans = sorted(zip(rec["t_enqueue"].tolist(), rec["t_complete"].tolist()))
    covered, end = 0, spans[0][0]
    for lo, hi in spans:
        if hi > end:
            covered += hi - max(lo, end)
            end = hi
    return (end - spans[0][0] - covered) / 1e6


@pytest.mark.slow
def test_slow_rank_computes_longer_between_collectives(tmp_path: Path) -> None:
    result = demo(tmp_path, faults=("slow:rank=1,factor=2,from_step=2",), markers=True, **TP_PP_4)
    assert result.ok, result.message
    r = rings(tmp_path)
    steps = r[1].markers[r[1].markers["op"] == Op.MARK_STEP]
    assert steps["group_seq"].tolist() == list(range(6))
    since = {rank: int(ring.markers[(ring.markers["op"] == Op.MARK_STEP)
                                    & (ring.markers["group_seq"] == 2)][0]["t_enqueue"]) for rank, ring in r.items()}
    idle = {rank: _idle_ms(ring.records, since[rank]) for rank, ring in r.items()}
    assert idle[1] > 1.5 * idle[0], idle  # its TP peer runs the same blocks at normal speed
    compute = {rank: [json.loads(line)["compute_s"] for line in
                      (tmp_path / "metrics" / f"rank-{rank:05d}.jsonl").read_text().splitlines()]
               for rank in (0, 1)}
    assert np.mean(compute[1][2:]) > 1.5 * np.mean(compute[0][2:]), compute


@pytest.mark.slow
def test_slowlink_delays_arrivals_on_that_link_only(tmp_path: Path) -> None:
    delay_ms = 40.0
    result = demo(tmp_path, faults=(f"slowlink:ranks=0-2,delay_ms={delay_ms:g}",), dp_mode="reduce-scatter",
                  tp=1, pp=2, dp=2)
    assert result.ok, result.message
    layout = load_layout(tmp_path / "layout.yaml")
    r = rings(tmp_path)
    for rank, ring in r.items():
        expected = {k: 6 * v for k, v in expected_collectives_per_step(layout, rank, 2, "reduce-scatter").items()}
        assert dict(ring.counts()) == expected, f"rank {rank}"
        recv = ring.of("pp", Op.RECV, COMPLETED)
        waited_ms = np.median((recv["t_complete"] - recv["t_enqueue"]) / 1e6)
        if rank in (0, 2):
            assert waited_ms > delay_ms, (rank, waited_ms)
        else:
            assert waited_ms < delay_ms / 2, (rank, waited_ms)


# -- validation before any process starts ----------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--fault", "hang:rank=9,step=3"], "--fault hang:rank=9,step=3: rank 9 is outside the world of 8 ranks"),
    (["--fault", "hang:rank=1"], "missing step"),
    (["--fault", "slowlink:ranks=0-1,delay_ms=5"], "not adjacent stages"),
    (["--ranks", "6"], "--ranks"),
    (["--ranks", "8", "--dp", "3"], "--ranks"),
    (["--engine", "ddp", "--tp", "2"], "the ddp engine has no --tp"),
    (["--engine", "fsdp", "--microbatches", "4"], "--microbatches does not apply"),
    (["--engine", "tp", "--ranks", "3"], "3 ranks (--ranks) are not divisible by tp*pp = 2*1 = 2"),
    (["--engine", "pipeline", "--ranks", "8"], "Schedule1F1B needs at least as many microbatches as stages"),
    (["--engine", "pipeline", "--ranks", "6", "--pp", "4"], "6 ranks (--ranks) are not divisible by tp*pp = 1*4 = 4"),
    (["--engine", "ddp", "--fault", "slowlink:ranks=0-1,delay_ms=5"], "the ddp engine cannot inject slowlink"),
    (["--engine", "tp", "--dp-mode", "reduce-scatter"], "only the 3d engine has a --dp-mode"),
    (["--engine", "ddp", "--fault", "hang:rank=4,step=1"], "rank 4 is outside the world of 4 ranks"),
    (["--engine", "mpi"], "'mpi' is not one of"),
])
def test_cli_rejects_bad_input_before_starting(tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["demo", "-o", str(out), *args])
    assert res.exit_code != 0
    assert message in res.output
    assert "Traceback" not in res.output
    assert not out.exists()
