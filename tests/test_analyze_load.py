"""Loading a trace directory: columns over all ranks, groups, layout, node facts, and bad input as problems."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from analysis_factory import TraceBuilder

from megatrace.analyze.load import TraceLoadError, load_trace
from megatrace.config import Layout


def four_ranks() -> tuple[TraceBuilder, list]:
    b = TraceBuilder(world=4, hosts={0: "h0", 1: "h0", 2: "h1", 3: "h1"})
    groups = [b.group("tp", [0, 1]), b.group("tp", [2, 3]), b.group("dp", [0, 2]), b.group("dp", [1, 3])]
    b.healthy_steps(groups, steps=3)
    return b, groups


def codes(trace) -> dict[str, str]:
    return {p.code: p.message for p in trace.problems}


def test_a_healthy_trace_loads_as_columns_with_groups_hosts_and_layout(tmp_path: Path) -> None:
    b, groups = four_ranks()
    b.write(tmp_path, closed=True, layout=Layout(world_size=4, tp=2, pp=1, dp=2))
    trace = load_trace(tmp_path)
    assert trace.world_size == 4 and trace.job_id == "job-1" and not trace.problems
    assert trace.ranks.tolist() == [0, 1, 2, 3] and trace.coverage == 1.0
    assert len(trace.records) == 4 * 3 * 2  # each rank: 3 steps x (its tp + its dp collective)
    assert np.all(np.diff(trace.records.rank) >= 0)  # ranks contiguous, ascending
    rows = trace.rows(2)
    assert set(trace.records.rank[rows].tolist()) == {2}
    assert np.all(np.diff(trace.records.seq[rows]) == 1)
    assert trace.records.t_enqueue.dtype == np.int64 and trace.records.group_id.dtype == np.uint32
    assert trace.hosts == ["h0", "h1"] and trace.host_of(3) == "h1" and trace.local_rank_of(3) == 3
    assert trace.groups[groups[1].gid].ranks == (2, 3) and trace.groups[groups[1].gid].label == "tp group [2, 3]"
    assert trace.layout is not None and trace.layout.dp == 2
    assert all(i.closed_cleanly for i in trace.rank_info)


def test_a_missing_rank_is_named_and_the_rest_is_loaded(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path, skip_ranks=(2,))
    trace = load_trace(tmp_path)
    assert trace.missing_ranks == (2,) and trace.ranks.tolist() == [0, 1, 3]
    assert "no readable ring for 1 of 4 ranks: [2]" in codes(trace)["missing-ranks"]
    assert trace.coverage == 0.75


def test_files_of_another_job_are_ignored_and_named(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path, job_ids={3: "job-2"})
    trace = load_trace(tmp_path)
    msg = codes(trace)["mixed-jobs"]
    assert trace.job_id == "job-1" and "job-2" in msg and "rank-00003.ring" in msg
    assert trace.missing_ranks == (3,)


def test_a_duplicated_rank_keeps_one_file_and_names_the_other(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path)
    rings = tmp_path / "rings"
    shutil.copy(rings / "rank-00001.ring", rings / "rank-00007.ring")
    trace = load_trace(tmp_path)
    assert "rank 1 appears in 2 ring files" in codes(trace)["duplicate-rank"]
    assert trace.ranks.tolist() == [0, 1, 2, 3]


def test_an_empty_ring_is_reported_and_kept(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path, empty_ranks=(1,))
    trace = load_trace(tmp_path)
    assert "ranks [1]" in codes(trace)["empty-ring"]
    assert trace.has(1) and trace.rows(1) == slice(trace.rows(1).start, trace.rows(1).start)


@pytest.mark.parametrize("make", ["missing", "file", "empty", "unreadable"])
def test_a_directory_that_is_not_a_trace_raises_a_clear_error(tmp_path: Path, make: str) -> None:
    target = tmp_path / "x"
    if make == "file":
        target.write_text("hello")
    elif make == "empty":
        target.mkdir()
        (target / "notes.txt").write_text("not a trace")
    elif make == "unreadable":
        (target / "rings").mkdir(parents=True)
        (target / "rings" / "rank-00000.ring").write_bytes(b"garbage" * 1000)
    with pytest.raises(TraceLoadError) as err:
        load_trace(target)
    assert str(target) in str(err.value)


def test_a_layout_that_does_not_fit_the_world_is_dropped_with_a_problem(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path, layout=Layout(world_size=8, tp=2, pp=2, dp=2))
    trace = load_trace(tmp_path)
    assert trace.layout is None
    assert "does not fit the trace's 4 ranks" in codes(trace)["layout"]


def test_group_members_that_disagree_across_ranks_are_reported(tmp_path: Path) -> None:
    b, groups = four_ranks()
    b.write(tmp_path)
    meta = tmp_path / "rings" / "rank-00001.meta.jsonl"
    meta.write_text(meta.read_text().replace('"ranks":[0,1]', '"ranks":[0,1,2]'))
    trace = load_trace(tmp_path)
    assert "the members of 1 group disagree across ranks" in codes(trace)["group-disagreement"]
    assert trace.groups[groups[0].gid].ranks == (0, 1)  # a tie: the lowest reporting rank wins


def test_groups_without_meta_are_inferred_from_their_users(tmp_path: Path) -> None:
    b, groups = four_ranks()
    b.write(tmp_path, no_meta=(0, 1, 2, 3))
    trace = load_trace(tmp_path)
    assert "unknown-groups" in codes(trace) and "missing-meta" in codes(trace)
    assert trace.groups[groups[2].gid].ranks == (0, 2) and trace.groups[groups[2].gid].inferred


def test_process_facts_are_read_from_procs_json(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path, procs={1: {"exit_code": 1}, 2: {"exit_code": None, "signal": "SIGTERM",
                                                      "killed_by_launcher": True}}, outcome="failed")
    facts = load_trace(tmp_path).facts
    assert facts.outcome == "failed"
    assert facts.procs[1].crashed and not facts.procs[2].crashed and not facts.procs[0].crashed
    assert facts.procs[1].describe() == "exited with status 1"


def test_rings_directly_in_the_directory_are_found(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path)
    trace = load_trace(tmp_path / "rings")
    assert trace.ranks.tolist() == [0, 1, 2, 3]
