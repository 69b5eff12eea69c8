"""Megatrace NCCL-patch logs written from a real demo run, imported and analysed.

The demo run (TP2 x PP2 on gloo, rank 2 hangs at step 2) is checked in (tests/data/scenarios/hang-rank2-tp2pp2,
tests/helpers/scenarios.py regenerates it); its rings are turned into
``rank_<R>.log`` files by :func:`helpers.nccl_logs.write_nccl_logs`, a small writer of the patch's exact
line format: element counts, process-local stream pointers, per-communicator opCounts (a batch of
send/recv shares one), a one-rank communicator that logs opCount 0, overlapping dumps of a ring of
lines, with or without ``groupHash``. ``fault.json`` (ground truth) is read by these tests only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers.nccl_logs import write_nccl_logs
from helpers.scenarios import unpack

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.cli import main
from megatrace.load import load_trace
from megatrace.load.traceset import TraceLoadError, TraceSet
from megatrace.trace.ring_format import State


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[TraceSet, int]:
    out = unpack("hang-rank2-tp2pp2", tmp_path_factory.mktemp("nccl") / "hang")
    (fault,) = json.loads((out / "fault.json").read_text())["faults"]
    steps = (out / "metrics" / f"rank-{fault['rank']:05d}.jsonl").read_text().count("\n")
    assert steps == 2, f"the scenario stopped at step {steps}, not at the injected hang (regenerate it)"
    return load_trace(out), fault["rank"]


@pytest.mark.parametrize("group_hash", [True, False], ids=["groupHash", "no-groupHash"])
def test_the_hung_rank_is_named_from_nccl_logs(demo: tuple[TraceSet, int], tmp_path: Path, group_hash: bool) -> None:
    trace, culprit = demo
    written = write_nccl_logs(trace, tmp_path / "logs", group_hash=group_hash)
    text = (tmp_path / "logs" / "rank_0.log").read_text()
    assert text.count("\n") > len(written[0]) and ("groupHash" in text) == group_hash  # overlapping dumps
    got = load_trace(tmp_path / "logs")
    assert got.source_format == got.job_id == "nccl-log"
    for rank, calls in written.items():
        assert got.info(rank).n_records == len(calls)  # every call once, whatever the overlap
    # the communicators: both TP groups and the PP groups, found with or without groupHash
    kinds = {(g.desc, g.ranks) for g in got.groups.values() if len(g.ranks) > 1}
    assert {("tp", (0, 1)), ("tp", (2, 3)), ("pp", (0, 2)), ("pp", (1, 3))} <= kinds
    result = analyze(tmp_path / "logs")
    assert got.completion_times == "arrivals"  # enqueue times only: each call completes at its last arrival
    assert "critical_path" in result.results["skipped_stages"]  # (transfer times are unknown)
    assert "stragglers" not in result.results["skipped_stages"]
    # the hung rank computed at full speed: no straggler (on an overloaded machine another rank may really be
    # slowed by the scheduler, and be named: that is no mistake of the analysis)
    assert culprit not in [f.subject.rank for f in result.findings if f.kind == Kind.STRAGGLER]
    top = result.findings[0]
    assert top.kind == Kind.COMPUTE_HANG, top.verdict
    assert top.subject.rank == culprit, top.verdict
    assert top.severity in (Severity.CRITICAL, Severity.WARNING)


@pytest.mark.parametrize("old_format", [False, True], ids=["save_count-lines", "older-lines"])
def test_more_streams_than_groups_are_matched_by_their_calls(demo: tuple[TraceSet, int], tmp_path: Path,
                                                           old_format: bool) -> None:
    """Each group's calls on two streams (Megatron makes groups of the same members twice), without groupHash, in
    both line formats: the streams are matched by their calls, no communicator is merged into the world (where
    the calls of different ones would pair up and look like a mismatch), and the culprit is named."""
    trace, culprit = demo
    write_nccl_logs(trace, tmp_path / "logs", group_hash=False, old_format=old_format, split=True)
    got = load_trace(tmp_path / "logs")
    assert not [g for g in got.groups.values() if len(g.ranks) == len(got.ranks) and g.desc != "pp"], \
        [g.label for g in got.groups.values()]
    assert any(p.code == "nccl-log-streams" for p in got.problems)
    result = analyze(tmp_path / "logs")
    assert not [f for f in result.findings if f.kind == Kind.COLLECTIVE_MISMATCH], \
        [f.verdict for f in result.findings if f.kind == Kind.COLLECTIVE_MISMATCH]
    top = result.findings[0]
    assert top.kind == Kind.COMPUTE_HANG and top.subject.rank == culprit, top.verdict


def test_completions_are_inferred_from_arrivals(demo: tuple[TraceSet, int], tmp_path: Path) -> None:
    trace, culprit = demo
    write_nccl_logs(trace, tmp_path / "logs", group_hash=True)
    got = load_trace(tmp_path / "logs")
    rec = got.records
    done = rec.state == State.COMPLETED
    assert done.mean() > 0.9  # all but the calls stuck at the end
    assert (rec.t_complete[done] >= rec.t_enqueue[done]).all()
    stuck = np.flatnonzero(~done)
    assert set(rec.rank[stuck].tolist()) <= {0, 1, 3} and culprit not in rec.rank[stuck].tolist()


def test_a_wrapped_ring_with_sparse_dumps_still_names_the_culprit(demo: tuple[TraceSet, int], tmp_path: Path) -> None:
    trace, culprit = demo
    written = write_nccl_logs(trace, tmp_path / "logs", group_hash=False, ring=25, dump_every=40)
    got = load_trace(tmp_path / "logs")
    assert any(got.info(r).n_records < len(c) for r, c in written.items())  # lines lost between dumps
    top = analyze(tmp_path / "logs").findings[0]
    assert top.kind == Kind.COMPUTE_HANG and top.subject.rank == culprit, top.verdict


def test_the_cli_reads_nccl_logs(demo: tuple[TraceSet, int], tmp_path: Path) -> None:
    trace, culprit = demo
    write_nccl_logs(trace, tmp_path / "logs", group_hash=True)
    result = CliRunner().invoke(main, ["analyze", str(tmp_path / "logs"), "--format", "nccl-log", "--no-report"])
    assert result.exit_code == 0, result.output
    assert f"rank {culprit} " in result.output.splitlines()[0], result.output


def test_broken_truncated_and_mixed_logs_name_the_file_and_line(demo: tuple[TraceSet, int], tmp_path: Path) -> None:
    trace, _ = demo
    write_nccl_logs(trace, tmp_path / "logs", group_hash=True)
    log = tmp_path / "logs" / "rank_1.log"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[:5] + ["[save_count 1] [17555901.2539] [Rank 1] Fun AllReduce Data twelve"]
                             + lines[5:]) + "\n")
    with pytest.raises(TraceLoadError, match=r"rank_1.log, line 6: not a Megatrace NCCL log line"):
        load_trace(tmp_path / "logs")
    log.write_text("\n".join(lines[:5] + [lines[5].replace("[Rank 1]", "[Rank 3]")] + lines[6:]) + "\n")
    with pytest.raises(TraceLoadError, match=r"rank_1.log, line 6: \[Rank 3\] in the file of rank 1"):
        load_trace(tmp_path / "logs")
    log.write_text("\n".join(lines[:5] + [lines[5].split(" groupHash")[0]] + lines[6:]) + "\n")
    with pytest.raises(TraceLoadError, match=r"rank_1.log: some lines carry a groupHash and some do not"):
        load_trace(tmp_path / "logs")
    log.write_text("\n".join(lines) + "\n" + lines[-1][:30])  # the patch was killed mid-line
    got = load_trace(tmp_path / "logs")
    torn = [p for p in got.problems if p.code == "nccl-log-torn"]
    assert torn and f"rank_1.log, line {len(lines) + 1}: last line cut off" in torn[0].message
    log3 = tmp_path / "logs" / "rank_3.log"  # one rank's file from an older build, without groupHash
    log3.write_text("".join(line.split(" groupHash")[0] + "\n" for line in log3.read_text().splitlines()))
    with pytest.raises(TraceLoadError, match=r"rank_3.log: no groupHash, while .*rank_0.log has them"):
        load_trace(tmp_path / "logs")
