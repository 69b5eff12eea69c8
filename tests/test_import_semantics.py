"""What the importers infer beyond the lines they read, checked on real demo runs and hand-built traces.

* NCCL-patch logs whose windows differ: a rank whose later dumps are missing is unobserved after its
  log, not hung; a real hang is still named.
* Pipelines longer than two stages (TP2 x PP4) and with data parallelism (TP2 x PP2 x DP2): the hung
  middle-stage rank comes first, from Flight Recorder dumps and from NCCL-patch logs with and without
  groupHash (whose send/recv name no peer: it is inferred from the call sequences of adjacent stages).
* The hang analysis names the oldest of many queued calls as the one a rank waits in.
* Flight Recorder dumps whose rings dropped older entries: only the common window is judged.

The demo runs (gloo, real processes, every rank's Flight Recorder dump beside its ring) are checked in
(tests/data/scenarios/, tests/helpers/scenarios.py regenerates them), so these tests need no torch; the live
capture of both formats is run by tests/test_import_flight_recorder_live.py and the demo's own tests.
``fault.json`` (ground truth) is read by these tests only. The logs are written from each run's rings by the
tests' writer of the patch's format.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.analysis_factory import TraceBuilder
from helpers.nccl_logs import write_nccl_logs  # the tests' writer of the NCCL patch's line format
from helpers.scenarios import unpack

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Finding, Kind, Severity, Subject, order_findings
from megatrace.load import load_trace
from megatrace.load.importers.safe_pickle import safe_loads
from megatrace.trace.ring_format import Flag, Op, State

HANG_KINDS = (Kind.COMPUTE_HANG, Kind.COMM_HANG, Kind.CRASHED_PROCESS, Kind.EXITED_EARLY, Kind.DEADLOCK,
              Kind.NO_TRACE, Kind.COLLECTIVE_MISMATCH, Kind.PARTIAL_STOP)


# -- fast: hand-built traces and plain findings -----------------------------------------------------------------

def test_a_rank_with_many_queued_calls_waits_in_the_oldest(tmp_path: Path) -> None:
    """More calls queued behind the stuck one than the hang analysis reads from a rank's end (64)."""
    b = TraceBuilder(world=2, capacity=4096)
    tp = b.group("tp", [0, 1])
    b.healthy_steps([tp], 20)  # TP all_reduce #1..#20, the last at 191 ms
    for k in range(500):  # rank 1 stops; rank 0 queues #21..#520 (asynchronous), none completes
        b.collective(tp, at=300.0 + k, skip=(1,), stuck=(0,), override={0: {"flags": int(Flag.ASYNC)}})
    b.write(tmp_path)
    top = analyze(tmp_path).findings[0]
    assert top.kind == Kind.COMPUTE_HANG and top.subject.rank == 1, top.verdict
    assert "(first rank 0, in TP all_reduce #21 (group [0, 1]))" in top.verdict, top.verdict
    assert top.data["chain"][0] == "rank 0 waits in TP all_reduce #21 (group [0, 1]) for rank 1"


def test_finding_the_oldest_queued_call_stays_fast_on_16k_ranks() -> None:
    from types import SimpleNamespace

    from megatrace.analyze import hang
    from megatrace.load.traceset import COLUMNS, Records

    ranks, per_rank = 16384, 400
    n = ranks * per_rank
    rec = Records(**{k: np.zeros(n, v) for k, v in COLUMNS.items()})
    rec.op[:], rec.state[:], rec.flags[:] = Op.ALL_REDUCE, State.COMPLETED, int(Flag.ASYNC)
    place = np.arange(n) % per_rank
    rec.flags[place == 10] = 0  # each rank's last synchronous call that completed ...
    rec.state[place >= 100 + np.arange(n) // per_rank % 7] = State.ENQUEUED  # ... then ~300 calls never complete
    trace = SimpleNamespace(records=rec, starts=np.arange(ranks + 1, dtype=np.int64) * per_rank)
    t0 = time.perf_counter()
    tails = hang._tails(trace)
    took = time.perf_counter() - t0
    head = tails.rows[:, 0]
    assert tails.valid[:, 0].all() and (head % per_rank == 100 + np.arange(ranks) % 7).all()
    assert took < 5.0, f"{took:.1f} s"


def _root(rank: int, stop_ns: int, impact: int = 2) -> Finding:
    return Finding(f"compute-hang:rank-{rank}", Severity.CRITICAL, Kind.COMPUTE_HANG, Subject(rank=rank),
                   f"rank {rank} stopped", confidence=0.9, impact=impact, data={"stop_ns": stop_ns})


def test_equal_hang_roots_are_ordered_by_who_stopped_first() -> None:
    later, first = _root(3, stop_ns=2_000), _root(5, stop_ns=1_000)
    partial = Finding("partial-stop", Severity.WARNING, Kind.PARTIAL_STOP, Subject(ranks=(0,)), "", impact=1)
    assert [f.id for f in order_findings([later, partial, first])] == [first.id, later.id, partial.id]
    wider = _root(3, stop_ns=2_000, impact=5)  # the rank more ranks wait on still comes first
    assert order_findings([first, wider])[0] is wider


# -- real demo runs (checked in) --------------------------------------------------------------------------------

HANGS = {"tp2pp4-rank5": "hang-rank5-fr-tp2pp4", "tp2pp4-rank2": "hang-rank2-fr-tp2pp4",
         "tp2pp2dp2-rank6": "hang-rank6-fr-tp2pp2dp2"}  # each a scenario: a middle-stage rank hangs at step 2 of 4


@pytest.fixture(scope="module")
def hang_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int]]:
    """Each layout once, a middle-stage rank hanging at step 2 (rings and Flight Recorder dumps)."""
    runs = {}
    for name, scenario in HANGS.items():
        out = unpack(scenario, tmp_path_factory.mktemp("semantics") / name)
        (truth,) = json.loads((out / "fault.json").read_text())["faults"]
        steps = (out / "metrics" / f"rank-{truth['rank']:05d}.jsonl").read_text().count("\n")
        assert steps == 2, f"{scenario}: the demo stopped at step {steps}, not at the injected hang (regenerate it)"
        runs[name] = (out, truth["rank"])
    return runs


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """TP2 x PP2, rank 2 computes twice as slowly; a healthy run otherwise (rings and Flight Recorder dumps)."""
    out = unpack("slow-rank2-fr-tp2pp2", tmp_path_factory.mktemp("semantics") / "slow")
    (truth,) = json.loads((out / "fault.json").read_text())["faults"]
    return out, truth["rank"]


def _logs(run: Path, out: Path, group_hash: bool) -> Path:
    write_nccl_logs(load_trace(run), out, group_hash=group_hash)
    return out


def _drop_last_dumps(log: Path, n: int) -> None:
    """Remove the last ``n`` dumps (save_counts) of one rank's log: a file that lost its later dumps."""
    lines = log.read_text().splitlines()
    save = [int(re.match(r"\[save_count (\d+)\]", line).group(1)) for line in lines]
    last = sorted(set(save))[-1 - n]
    log.write_text("\n".join(line for line, s in zip(lines, save) if s <= last) + "\n")


def _hangs(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.kind in HANG_KINDS and f.severity.at_least(Severity.WARNING)]


@pytest.mark.parametrize("group_hash", [True, False], ids=["groupHash", "no-groupHash"])
@pytest.mark.parametrize("victim,lost", [(3, 2), (0, 1)], ids=["rank3-2dumps", "rank0-1dump"])
def test_a_log_that_lost_its_last_dumps_is_no_hang(slow_run: tuple[Path, int], tmp_path: Path, group_hash: bool,
                                                   victim: int, lost: int) -> None:
    run, slow = slow_run
    logs = _logs(run, tmp_path / "logs", group_hash)
    _drop_last_dumps(logs / f"rank_{victim}.log", lost)
    trace = load_trace(logs)
    assert [i.rank for i in trace.rank_info if i.ended_early] == [victim]
    (note,) = [p for p in trace.problems if p.code == "nccl-log-window"]
    assert note.severity == "warning" and note.ranks == (victim,), note
    result = analyze(logs)
    assert not _hangs(result.findings), [f.verdict for f in _hangs(result.findings)]
    assert {f.subject.rank for f in result.findings if f.kind == Kind.STRAGGLER} <= {slow}
    assert any(f.kind == Kind.TRACE_PROBLEM and "end before the job did" in f.verdict for f in result.findings)


def test_a_log_that_lost_a_dump_in_the_middle_is_no_hang(slow_run: tuple[Path, int], tmp_path: Path) -> None:
    run, slow = slow_run
    written = write_nccl_logs(load_trace(run), tmp_path / "logs", group_hash=False, ring=25)  # dumps do not overlap
    log = tmp_path / "logs" / "rank_1.log"
    log.write_text("".join(line for line in log.read_text().splitlines(keepends=True)
                           if not line.startswith("[save_count 3]")))
    trace = load_trace(tmp_path / "logs")
    assert trace.info(1).n_records < len(written[1]) - 10  # calls lost between dumps 2 and 4
    (note,) = [p for p in trace.problems if p.code == "nccl-log-gaps"]
    assert note.ranks == (1,) and "[3]" in note.message
    result = analyze(tmp_path / "logs")
    assert not _hangs(result.findings), [f.verdict for f in _hangs(result.findings)]
    assert {f.subject.rank for f in result.findings if f.kind == Kind.STRAGGLER} <= {slow}


def test_a_real_hang_is_still_named_when_logs_end_at_different_times(hang_runs: dict, tmp_path: Path) -> None:
    run, culprit = hang_runs["tp2pp4-rank5"]
    complete = _logs(run, tmp_path / "complete", True)
    assert not any(i.ended_early for i in load_trace(complete).rank_info)  # the ranks that stopped did stop
    logs = _logs(run, tmp_path / "logs", True)
    _drop_last_dumps(logs / "rank_0.log", 1)  # a rank of the other pipeline lost its last dump
    top = analyze(logs).findings[0]
    assert top.kind == Kind.COMPUTE_HANG and top.severity == Severity.CRITICAL, top.verdict
    assert top.subject.rank == culprit, top.verdict


@pytest.mark.parametrize("source", ["flight-recorder", "log-groupHash", "log-no-groupHash"])
@pytest.mark.parametrize("name", list(HANGS))
def test_the_hung_middle_stage_rank_comes_first(hang_runs: dict, tmp_path: Path, name: str, source: str) -> None:
    run, culprit = hang_runs[name]
    if source == "flight-recorder":
        result = analyze(run, format="flight-recorder")
    else:
        result = analyze(_logs(run, tmp_path / "logs", source == "log-groupHash"))
    top = result.findings[0]
    assert top.kind == Kind.COMPUTE_HANG and top.severity == Severity.CRITICAL, top.verdict
    assert top.subject.rank == culprit, top.verdict
    if source != "flight-recorder":  # the logs show the whole wait-for graph: every other rank waits for it
        assert len(top.data["waiters"]) == 7, top.verdict


@pytest.mark.parametrize("group_hash", [True, False], ids=["groupHash", "no-groupHash"])
def test_pipeline_peers_are_inferred_on_a_four_stage_communicator(hang_runs: dict, tmp_path: Path,
                                                                  group_hash: bool) -> None:
    run, _ = hang_runs["tp2pp4-rank5"]
    rings = load_trace(run)
    got = load_trace(_logs(run, tmp_path / "logs", group_hash))
    pp = [g for g in got.groups.values() if g.desc == "pp"]
    assert pp and all(len(g.ranks) == 4 for g in pp)  # one communicator per pipeline: the log names no peer
    total = right = 0
    for rank in rings.ranks.tolist():
        p2p = [np.isin(t.records.op[t.rows(rank)], (Op.SEND, Op.RECV)) for t in (rings, got)]
        truth, inferred = rings.records.peer[rings.rows(rank)][p2p[0]], got.records.peer[got.rows(rank)][p2p[1]]
        assert len(truth) == len(inferred)
        total, right = total + len(truth), right + int((truth == inferred).sum())
    assert total > 100 and right >= 0.9 * total, f"{right} of {total} peers right"
    rec = got.records
    done = np.isin(rec.op, (Op.SEND, Op.RECV)) & (rec.state == State.COMPLETED)
    pending = np.isin(rec.op, (Op.SEND, Op.RECV)) & (rec.state != State.COMPLETED)
    assert done.sum() > 100 and pending.any()  # the calls stuck at the hang are not taken for completed ones


def _trim(run: Path, out: Path, rank: int, share: float) -> Path:
    """The run's dumps, rank ``rank`` keeping only its newest entries (a ring that wrapped); record ids kept."""
    (out / "fr").mkdir(parents=True)
    for path in sorted((run / "fr").iterdir()):
        dump = safe_loads(path.read_bytes(), str(path))
        if path.name.endswith(f"_{rank}"):
            entries = sorted(dump["entries"], key=lambda e: e["record_id"])
            dump["entries"] = entries[int(len(entries) * share):]
        (out / "fr" / path.name).write_bytes(pickle.dumps(dump))
    shutil.copy(run / "layout.yaml", out / "layout.yaml")
    return out


@pytest.mark.parametrize("rank,share", [(3, 0.5), (2, 0.5), (3, 0.7), (2, 0.7)])
def test_flight_recorder_windows_that_start_apart_name_no_wrong_rank(slow_run: tuple[Path, int], tmp_path: Path,
                                                                     rank: int, share: float) -> None:
    run, slow = slow_run
    trimmed = _trim(run, tmp_path / "trimmed", rank, share)
    trace = load_trace(trimmed, format="flight-recorder")
    assert trace.info(rank).dropped > 0 and all(trace.info(r).dropped == 0 for r in (0, 1, 2, 3) if r != rank)
    assert any(p.code == "fr-windows" for p in trace.problems)
    named = [f.subject.rank for f in analyze(trimmed, format="flight-recorder").findings if f.kind == Kind.STRAGGLER]
    assert set(named) <= {slow}, named
    if share == 0.5:  # half of the trace is still compared: the slow rank is named
        assert named == [slow], named


def test_a_save_count_far_ahead_is_a_short_note_not_a_huge_range() -> None:
    """A damaged save_count (0, then 10**15) must not make the gap note enumerate 10**15 numbers."""
    import time

    from megatrace.load.importers.nccl_log import _note_dump_gaps

    problems: list = []
    t = time.monotonic()
    _note_dump_gaps({1: {0: [0, 0], 1: [0, 0], 10**15: [0, 0]}, 2: {0: [0, 0], 2: [0, 0]}}, problems)
    assert time.monotonic() - t < 1.0
    (note,) = problems
    assert note.ranks == (1, 2) and "rank 1: [2, 3," in note.message and "999999999999986 more]" in note.message
