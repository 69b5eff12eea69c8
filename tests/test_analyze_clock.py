"""Clock alignment: header anchors, then per-host corrections from collective completion times."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.analysis_factory import MS, WALL_BASE, TraceBuilder

from megatrace.analyze.clock import align_clocks
from megatrace.analyze.match import index_records, match
from megatrace.load import load_trace


def two_hosts(skew_ms: dict[str, float], steps: int = 20) -> TraceBuilder:
    hosts = {r: f"h{r // 4}" for r in range(8)}
    b = TraceBuilder(world=8, hosts=hosts, skew_ms=skew_ms)
    tp = [b.group("tp", [r, r + 1]) for r in range(0, 8, 2)]
    dp = [b.group("dp", [r, r + 4]) for r in range(4)]  # every DP group spans both hosts
    b.healthy_steps(tp + dp, steps=steps)
    return b


def aligned(tmp_path: Path, b: TraceBuilder):
    b.write(tmp_path)
    trace = load_trace(tmp_path)
    ix = index_records(trace)
    return trace, ix, align_clocks(trace, ix)


@pytest.mark.parametrize("skew", [7.0, -3.5, 250.0])
def test_an_injected_host_skew_of_several_ms_is_recovered(tmp_path: Path, skew: float) -> None:
    trace, ix, clock = aligned(tmp_path, two_hosts({"h1": skew}))
    assert clock.method == "anchors+collectives"
    assert clock.correction_ns["h0"] == 0  # the host of rank 0 is the reference
    assert abs(clock.correction_ns["h1"] + skew * MS) < 0.05 * MS
    # After alignment, DP members (one per host) complete together again.
    m = match(trace, ix, clock.t_enqueue, clock.t_complete)
    assert np.all(m.collectives.arrival_lag < 0.05 * MS)
    # Aligned times are wall-clock ns on host h0's clock.
    first = int(clock.t_enqueue[trace.rows(0)][0])
    assert abs(first - (WALL_BASE + 1 * MS)) < MS


def test_without_skew_no_correction_is_made(tmp_path: Path) -> None:
    _, _, clock = aligned(tmp_path, two_hosts({}))
    assert all(abs(c) < 0.01 * MS for c in clock.correction_ns.values())
    assert clock.residual_ns < 0.01 * MS


def test_a_single_host_uses_its_anchors_only(tmp_path: Path) -> None:
    b = TraceBuilder(world=2)
    g = b.group("tp", [0, 1])
    b.healthy_steps([g], steps=3)
    _, _, clock = aligned(tmp_path, b)
    assert clock.method == "anchors" and clock.correction_ns == {"node0": 0}


def test_hosts_without_shared_collectives_keep_their_anchors(tmp_path: Path) -> None:
    b = TraceBuilder(world=4, hosts={0: "a", 1: "a", 2: "b", 3: "b"}, skew_ms={"b": 5.0})
    groups = [b.group("tp", [0, 1]), b.group("tp", [2, 3])]  # no group spans the hosts
    b.healthy_steps(groups, steps=3)
    _, _, clock = aligned(tmp_path, b)
    assert clock.method == "anchors" and clock.notes
    assert clock.correction_ns == {"a": 0, "b": 0}
