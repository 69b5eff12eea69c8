"""NCCL Inspector output written from real demo runs (one rank computes twice as slowly), imported and analysed.

:func:`helpers.inspector_logs.write_inspector` writes each rank's completed collectives in the plugin's JSON
format (header, metadata, coll_perf; ``event_trace_ts`` when verbose), one file per process named
``<host>-pid<pid>.log`` as the plugin names them. ``fault.json`` (ground truth) is read by these tests only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # real multi-process torch runs

from click.testing import CliRunner  # noqa: E402

from megatrace.analyze.engine import analyze  # noqa: E402
from megatrace.analyze.findings import Kind  # noqa: E402
from megatrace.analyze.straggler_stats import RankStats  # noqa: E402
from megatrace.analyze.stragglers import _explain_neighbours  # noqa: E402
from megatrace.cli import main  # noqa: E402
from megatrace.demo.launcher import DemoOptions, run_local  # noqa: E402
from megatrace.load import load_trace  # noqa: E402
from megatrace.load.importers import detect_format  # noqa: E402
from megatrace.load.traceset import TraceLoadError, TraceSet  # noqa: E402
from megatrace.trace.ring_format import State  # noqa: E402
from helpers.inspector_logs import COLL, write_inspector  # noqa: E402


def run_demo(out: Path, tp: int, pp: int, dp: int, faults: tuple[str, ...]) -> tuple[TraceSet, int | None]:
    """A real demo run (6 steps) and its slow rank from the ground truth (None: healthy)."""
    run_local(DemoOptions(tp=tp, pp=pp, dp=dp, steps=6, faults=faults, out=out, stall_s=10.0), log=lambda msg: None)
    truth = json.loads((out / "fault.json").read_text())["faults"] if faults else []
    return load_trace(out), (truth[0]["rank"] if truth else None)


def inspector_of(trace: TraceSet, out: Path) -> Path:
    """Inspector lines of ``trace`` beside the demo's layout (what a user passes along with the logs)."""
    write_inspector(trace, out)
    (out / "layout.yaml").write_text((trace.path / "layout.yaml").read_text())
    return out


def stragglers(path: Path) -> list[int]:
    return [f.subject.rank for f in analyze(path).findings if f.kind == Kind.STRAGGLER]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[TraceSet, int]:
    """TP2·PP2·DP1: no data-parallel sync, so no step can be told apart from collectives alone."""
    return run_demo(tmp_path_factory.mktemp("inspector") / "slow", 2, 2, 1, ("slow:rank=1,factor=2",))


def test_inspector_lines_become_the_same_collectives(demo: tuple[TraceSet, int], tmp_path: Path) -> None:
    trace, _ = demo
    written = write_inspector(trace, tmp_path / "insp")
    (tmp_path / "insp" / "layout.yaml").write_text((trace.path / "layout.yaml").read_text())
    assert detect_format(tmp_path / "insp") == "inspector"
    got = load_trace(tmp_path / "insp")
    assert got.source_format == got.job_id == "inspector" and list(got.ranks) == [0, 1, 2, 3]  # global ranks
    for rank, n in written.items():
        assert got.info(rank).n_records == n and got.info(rank).host == trace.info(rank).host
    kinds = {(g.desc, g.ranks) for g in got.groups.values()}
    assert {("tp", (0, 1)), ("tp", (2, 3)), ("default_pg", (0, 1, 2, 3))} <= kinds
    assert (got.records.state == State.COMPLETED).all()
    # the timing evidence survives, to the microsecond: each call's arrival and completion
    rec = trace.records
    for rank in trace.ranks.tolist():
        info, rows = trace.info(rank), trace.rows(rank)
        keep = np.isin(rec.op[rows], list(COLL)) & (rec.state[rows] == State.COMPLETED)
        wall = (info.anchor_wall_ns + rec.t_enqueue[rows][keep] - info.anchor_mono_ns) // 1000 * 1000
        assert sorted(got.records.t_enqueue[got.rows(rank)].tolist()) == sorted(wall.tolist())


def test_the_slow_rank_is_named_without_steps(demo: tuple[TraceSet, int], tmp_path: Path) -> None:
    trace, slow = demo
    insp = inspector_of(trace, tmp_path / "insp")
    result = CliRunner().invoke(main, ["analyze", str(insp), "--format", "inspector", "--no-report"])
    assert result.exit_code == 0, result.output
    verdict = result.output.splitlines()[0]
    assert verdict.startswith(f"VERDICT [warning] rank {slow} ") and "slower than the ranks doing the same work" in verdict
    assert "no step could be told apart" in result.output
    assert stragglers(insp) == [slow]


def test_a_healthy_run_names_no_straggler(tmp_path: Path) -> None:
    trace, _ = run_demo(tmp_path / "healthy", 2, 2, 1, ())
    assert stragglers(inspector_of(trace, tmp_path / "insp")) == []


def test_the_straggler_is_told_from_its_waiting_pipeline_neighbour(tmp_path: Path) -> None:
    """Rank 5 (stage 1, replica 0) is slow; ranks 0 and 1, its stage-0 neighbours, wait in receives the
    Inspector never records, and may look slow too."""
    trace, slow = run_demo(tmp_path / "slow5", 2, 2, 2, ("slow:rank=5,factor=3",))
    insp = inspector_of(trace, tmp_path / "insp")
    result = analyze(insp)
    assert stragglers(insp) == [slow]
    explained = result.results["stragglers"].explained
    assert set(explained) <= {0, 1} and set(explained.values()) <= {slow}, explained
    for q in explained:
        assert any(f"rank {q} of its pipeline replica is slower too" in str(e) for e in result.findings[0].evidence)
    # The rule itself, on this trace's layout: of two flagged ranks of one replica the one further above its
    # peers call by call stays, whichever stage it is in; a flagged rank of the other replica is not touched.
    imported = load_trace(insp)
    for weaker, stronger in ((1, 5), (5, 1)):
        stats = {r: RankStats(r, (r,), 0, 0, 0, 0, 0, 0, intervals=40, straggler=r in (1, 5, 6),
                              interval_ratio={weaker: 1.2, stronger: 1.7, 6: 1.1}.get(r, 1.0)) for r in range(8)}
        notes: list[str] = []
        kept, why = _explain_neighbours(imported, stats, [stronger, weaker, 6], notes)
        assert kept == [stronger, 6] and why == {weaker: stronger} and not stats[weaker].straggler, (kept, why)


def test_without_the_verbose_trace_times_come_from_the_dump(demo: tuple[TraceSet, int], tmp_path: Path) -> None:
    trace, _ = demo
    write_inspector(trace, tmp_path / "plain", verbose=False)
    write_inspector(trace, tmp_path / "verbose")
    plain, verbose = load_trace(tmp_path / "plain"), load_trace(tmp_path / "verbose")
    assert plain.records.group_seq.tolist() == verbose.records.group_seq.tolist()
    assert (plain.completion_times, verbose.completion_times) == ("inferred", "observed")
    d = plain.records.t_complete - verbose.records.t_complete
    assert (d == 400_000).all()  # completion at the dump, 400 µs after the kernel stopped


def test_ranks_from_file_names_and_bad_input_name_file_and_line(demo: tuple[TraceSet, int], tmp_path: Path) -> None:
    trace, _ = demo
    out = tmp_path / "named"
    write_inspector(trace, out, name=lambda rank, info: f"inspector-rank{rank}.log")
    for f in out.iterdir():  # drop the world communicator (the final barrier): ranks must come from the names
        f.write_text("".join(line + "\n" for line in f.read_text().splitlines() if '"n_ranks": 4' not in line))
    assert list(load_trace(out).ranks) == [0, 1, 2, 3]
    (out / "inspector-rank3.log").rename(out / "inspector-last.log")
    with pytest.raises(TraceLoadError, match=r"inspector-last.log: cannot tell this process's global rank"):
        load_trace(out)
    (out / "inspector-last.log").rename(out / "inspector-rank3.log")
    f = out / "inspector-rank2.log"
    lines = f.read_text().splitlines()
    f.write_text("\n".join(lines[:3] + [lines[3][:40]] + lines[4:]) + "\n")
    with pytest.raises(TraceLoadError, match=r"inspector-rank2.log, line 4: not a JSON object"):
        load_trace(out)
    f.write_text("\n".join(lines[:3] + [lines[3].replace('"coll_sn"', '"coll_seq"')] + lines[4:]) + "\n")
    with pytest.raises(TraceLoadError, match=r"inspector-rank2.log, line 4: not an NCCL Inspector record"):
        load_trace(out)
