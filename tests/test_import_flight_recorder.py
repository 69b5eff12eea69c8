"""PyTorch Flight Recorder dumps from real torch gloo runs: imported, analysed.

Real runs, checked in so that these tests need no torch: demo runs (TP2 x PP2; their opt-in hook
MEGATRACE_DEMO_FR_DUMP writes every rank's ``_dump_fr_trace()`` each second) with a hang, with a slow rank, and
healthy (tests/data/scenarios/, tests/helpers/scenarios.py regenerates them), and a three-rank script whose rank 0
calls one all_reduce with the wrong dtype (tests/data/flight_recorder/dtype-mismatch, tests/helpers/torch_runs.py).
``fault.json`` (ground truth) is read by these tests only. tests/test_import_flight_recorder_live.py runs the demo
and the script live, and compares with torch's own analyzer, torchfrtrace.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.nccl_logs import write_nccl_logs  # the NCCL-patch log writer
from helpers.scenarios import unpack as unpack_scenario
from helpers.torch_runs import unpack as unpack_run

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.analyze.straggler_stats import RankStats
from megatrace.analyze.stragglers import _explain_neighbours
from megatrace.cli import main
from megatrace.load import load_trace
from megatrace.load.importers import detect_format
from megatrace.load.importers.flight_recorder import find_dumps, read_dump
from megatrace.load.importers.safe_pickle import UnsafePickleError, safe_loads
from megatrace.load.traceset import TraceLoadError
from megatrace.trace.ring_format import Op, State


@pytest.fixture(scope="module")
def hang_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo, rank 1 hangs at step 2; rings and Flight Recorder dumps (out/fr/fr_rank_<R>)."""
    out = unpack_scenario("hang-rank1-fr-tp2pp2", tmp_path_factory.mktemp("fr") / "hang")
    steps = (out / "metrics" / "rank-00001.jsonl").read_text().count("\n")
    assert steps == 2, f"the scenario stopped at step {steps}, not at the injected hang (regenerate it)"
    return out


@pytest.fixture(scope="module")
def mismatch_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three real gloo ranks; rank 0 (torchfrtrace's reference rank) calls all_reduce #4 with the wrong dtype."""
    return unpack_run("flight_recorder/dtype-mismatch", tmp_path_factory.mktemp("fr") / "mismatch")


def test_real_dumps_have_the_fields_the_importer_reads(hang_run: Path) -> None:
    dumps = find_dumps(hang_run / "fr")
    assert [p.name for p in dumps] == [f"fr_rank_{r}" for r in range(4)]
    dump = read_dump(dumps[0])
    assert {"version", "pg_config", "pg_status", "entries", "comm_lib_version"} <= set(dump)
    entry = dump["entries"][-1]
    assert {"record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "op_id", "profiling_name",
            "time_created_ns", "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "state",
            "time_discovered_started_ns", "time_discovered_completed_ns", "retired", "timeout_ms",
            "is_p2p"} <= set(entry)  # (no "frames": the demo's hook dumps without stack traces)
    assert entry["profiling_name"] == "gloo:all_reduce" and entry["process_group"][1] == "tp"


def test_the_demo_hang_is_named_from_flight_recorder_dumps_alone(hang_run: Path) -> None:
    (fault,) = json.loads((hang_run / "fault.json").read_text())["faults"]
    assert detect_format(hang_run) == "rings"  # the rings win when both are there ...
    trace = load_trace(hang_run, format="flight-recorder")  # ... so force the dumps
    assert trace.source_format == trace.job_id == "flight-recorder" and list(trace.ranks) == [0, 1, 2, 3]
    tp = {g.ranks for g in trace.groups.values() if g.desc == "tp"}
    assert tp == {(0, 1), (2, 3)}
    rec = trace.records
    rows = trace.rows(0)
    assert set(rec.op[rows].tolist()) == {Op.ALL_REDUCE}  # gloo records collectives only
    assert rec.state[rows][-1] == State.ENQUEUED  # rank 0 waits in its last all_reduce: not retired
    assert trace.completion_times == "arrivals"  # gloo: retired entries carry no completion time
    result = analyze(hang_run, format="flight-recorder")
    top = result.findings[0]
    assert top.kind == Kind.COMPUTE_HANG and top.severity == Severity.CRITICAL, top.verdict
    assert top.subject.rank == fault["rank"], top.verdict


@pytest.mark.parametrize("scenario,slow", [("slow-rank2-fr-tp2pp2", True), ("healthy-fr-tp2pp2-6steps", False)],
                         ids=["slow", "healthy"])
def test_a_slow_rank_is_named_from_dumps_and_logs_without_completion_times(tmp_path: Path, scenario: str,
                                                                           slow: bool) -> None:
    """Gloo dumps give arrivals only: compute between calls is measured from each instance's last arrival."""
    out = unpack_scenario(scenario, tmp_path / "run")
    faults = json.loads((out / "fault.json").read_text())["faults"]
    assert bool(faults) == slow, faults
    result = analyze(out, format="flight-recorder")
    assert "critical_path" in result.results["skipped_stages"] and "stragglers" not in result.results["skipped_stages"]
    named = [f.subject.rank for f in result.findings if f.kind == Kind.STRAGGLER]
    # the same run's calls as NCCL-patch logs (enqueue times only, no groupHash): the same verdict
    write_nccl_logs(load_trace(out), tmp_path / "logs", group_hash=False)
    from_logs = [f.subject.rank for f in analyze(tmp_path / "logs").findings if f.kind == Kind.STRAGGLER]
    if faults:
        (fault,) = faults
        assert named == [fault["rank"]] and result.findings[0].kind == Kind.STRAGGLER, result.findings[0].verdict
        assert from_logs == [fault["rank"]]
        top = result.findings[0]  # without completion times, the slowdown quoted is a lower bound, and says so
        assert " at least " in top.verdict and any("lower bound" in str(e) for e in top.evidence), top.verdict
        ring = [f for f in analyze(out).findings if f.kind == Kind.STRAGGLER]
        assert ring and " at least " not in ring[0].verdict, ring
        # An arrival-only import does not show how long a receive waited (a send's completion is inferred from
        # its receiver), so the pipeline-replica rule applies to it though it has p2p records; not to the rings.
        for path, applies in ((tmp_path / "logs", True), (out, False)):
            stats = {r: RankStats(r, (r,), 0, 0, 0, 0, 0, 0, intervals=40, straggler=r in (0, 2),
                                  interval_ratio={0: 1.2, 2: 1.7}.get(r, 1.0)) for r in range(4)}
            kept, why = _explain_neighbours(load_trace(path), stats, [2, 0], [])
            assert (kept, why) == (([2], {0: 2}) if applies else ([2, 0], {})), path
    else:
        assert named == [] and from_logs == []


def test_the_cli_detects_dumps_in_a_subdirectory(hang_run: Path, tmp_path: Path) -> None:
    only = tmp_path / "dumps"
    (only / "fr").mkdir(parents=True)
    for p in find_dumps(hang_run / "fr"):
        (only / "fr" / p.name).write_bytes(p.read_bytes())
    (only / "layout.yaml").write_text((hang_run / "layout.yaml").read_text())
    result = CliRunner().invoke(main, ["analyze", str(only), "--no-report", "--json", str(tmp_path / "f.json")])
    assert result.exit_code == 0, result.output
    verdict = result.output.splitlines()[0]
    assert verdict.startswith("VERDICT") and "rank 1 " in verdict, result.output
    doc = json.loads((tmp_path / "f.json").read_text())
    assert doc["findings"][0]["subject"]["rank"] == 1


def test_the_rank_with_the_wrong_dtype_is_the_odd_one_out(mismatch_run: Path) -> None:
    """Where torchfrtrace blames the good ranks (it takes its reference rank, 0, for right: see the live tests)."""
    result = analyze(mismatch_run)
    top = result.findings[0]
    assert top.kind == Kind.COLLECTIVE_MISMATCH, top.verdict
    assert top.subject.ranks == (0,), top.verdict  # MegaTrace: rank 0 is the odd one out
    assert "rank 0 is the odd one out" in top.verdict and "int32 on ranks [0]" in top.verdict


def test_json_dumps_give_the_same_trace_as_pickles(mismatch_run: Path) -> None:
    assert read_dump(mismatch_run / "fr_rank_0")["entries"][3]["frames"]  # dumped with stack traces
    from_pickle = load_trace(mismatch_run, format="flight-recorder")
    from_json = load_trace(mismatch_run / "json", format="flight-recorder")
    for name in ("rank", "group_seq", "op", "dtype", "nbytes", "t_enqueue", "state"):
        assert getattr(from_json.records, name).tolist() == getattr(from_pickle.records, name).tolist(), name


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204 - what an attacker's pickle does
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_pickle_is_refused_without_running_it(mismatch_run: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    real = pickle.loads((mismatch_run / "fr_rank_1").read_bytes())
    real["entries"][0]["frames"] = [_Evil(marker)]  # a real dump with one poisoned value
    blob = pickle.dumps(real)
    assert marker.exists() is False
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        with pytest.raises(UnsafePickleError, match=r"evil.pkl: refused to unpickle: opcode (STACK_GLOBAL|GLOBAL)"):
            safe_loads(pickle.dumps(real, protocol=protocol), "evil.pkl")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "fr_rank_0").write_bytes(blob)
    with pytest.raises(TraceLoadError, match=r"fr_rank_0: refused to unpickle"):
        load_trace(bad)
    assert not marker.exists()
    for payload in (pickle.dumps(Path("/etc")), pickle.dumps({"a": {1, 2}, "b": range(3)})):
        with pytest.raises(UnsafePickleError):
            safe_loads(payload)
    assert safe_loads(pickle.dumps({"a": [1, 2.5, None, (True, "x")], "b": {3}})) == \
        {"a": [1, 2.5, None, (True, "x")], "b": {3}}


def test_truncated_damaged_and_mixed_inputs_name_the_file(mismatch_run: Path, tmp_path: Path) -> None:
    real = (mismatch_run / "fr_rank_2").read_bytes()
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "fr_rank_2").write_bytes(real[: len(real) // 2])
    with pytest.raises(TraceLoadError, match=r"cut/fr_rank_2: not a readable pickle \(truncated or damaged\)"):
        load_trace(cut)
    field = tmp_path / "field"
    field.mkdir()
    dump = pickle.loads(real)
    del dump["entries"][3]["profiling_name"]
    (field / "fr_rank_2").write_bytes(pickle.dumps(dump))
    with pytest.raises(TraceLoadError, match=r"field/fr_rank_2: entry 3: missing profiling_name"):
        load_trace(field)
    broken = tmp_path / "broken"
    broken.mkdir()
    text = (mismatch_run / "json" / "fr_rank_0.json").read_text()
    (broken / "fr_rank_0.json").write_text(text[: len(text) // 3])
    with pytest.raises(TraceLoadError, match=r"broken/fr_rank_0.json, line \d+: not a Flight Recorder dump"):
        load_trace(broken, format="flight-recorder")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "fr_rank_0").write_bytes(real)
    (mixed / "rank_1.log").write_text("[save_count 1] [1755590104.253968145] [Rank 1] Fun AllReduce Data 4 "
                                      "stream 0x55919d27b4b0 opCount 0\n")
    with pytest.raises(TraceLoadError, match=r"more than one trace format.*flight-recorder.*nccl-log.*--format"):
        load_trace(mixed)


def test_export_writes_a_perfetto_trace_of_imported_dumps(mismatch_run: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "trace.json"
    result = runner.invoke(main, ["export", str(mismatch_run), "--perfetto", "-o", str(out)])
    assert result.exit_code == 0, result.output
    events = json.loads(out.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["args"]["rank"] for e in slices} == {0, 1, 2} and len(slices) == 18  # 6 all_reduces x 3 ranks
    assert runner.invoke(main, ["export", str(mismatch_run)]).exit_code == 2  # no export format chosen
    missing = runner.invoke(main, ["export", str(tmp_path / "nothing"), "--perfetto"])
    assert missing.exit_code == 1 and missing.output.startswith("Error:")


def test_the_cli_offers_every_importer() -> None:
    from megatrace.load.importers import FORMATS
    from megatrace.cli import TRACE_FORMATS

    assert TRACE_FORMATS == FORMATS
