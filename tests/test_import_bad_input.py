"""Broken, truncated, hostile and mixed inputs of every importer: one clear error line naming the file, the entry
or line and the field; never a traceback, a hang, or a silently wrong trace (issue 7).

One real demo run (TP2 x PP2, healthy, 2 steps, with the Flight Recorder hook), checked in
(tests/data/scenarios/healthy-fr-tp2pp2, tests/helpers/scenarios.py regenerates it), gives real Flight
Recorder dumps; its rings are written as Megatrace NCCL-patch logs and NCCL Inspector lines by the writers of
tests/helpers/nccl_logs.py and tests/helpers/inspector_logs.py. Each test mutates a copy of those real files and runs
``megatrace analyze`` on it: in-process (click's CliRunner) or, where the input could hang the process, as a
subprocess under a timeout.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers.inspector_logs import write_inspector
from helpers.nccl_logs import write_nccl_logs
from helpers.scenarios import unpack

from megatrace.cli import main
from megatrace.load import load_trace
from megatrace.load.importers import flight_recorder
from megatrace.load.traceset import TraceLoadError, TraceSet

BOUND_S = 30.0  # every bad input is refused (or read) within this, on a loaded machine


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A healthy demo run: rings, and every rank's Flight Recorder dump in run/fr/."""
    out = unpack("healthy-fr-tp2pp2", tmp_path_factory.mktemp("bad") / "run")
    assert sorted(p.name for p in (out / "fr").iterdir()) == [f"fr_rank_{r}" for r in range(4)]
    return out


@pytest.fixture(scope="module")
def trace(run: Path) -> TraceSet:
    return load_trace(run)


# --- helpers -------------------------------------------------------------------------------------------------

def analyze_cli(path: Path, *extra: str) -> tuple[int, str]:
    """``megatrace analyze PATH`` in-process: (exit code, output); an escaped exception fails the test."""
    start = time.monotonic()
    result = CliRunner().invoke(main, ["analyze", str(path), "--no-report", "--json", str(path / "f.json"), *extra])
    assert time.monotonic() - start < BOUND_S, f"{path}: took {time.monotonic() - start:.1f} s"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        raise AssertionError("an exception escaped megatrace analyze:\n" +
                             "".join(traceback.format_exception(result.exception)))
    return result.exit_code, result.output


def analyze_process(path: Path, timeout: float = BOUND_S) -> tuple[int, str]:
    """``megatrace analyze PATH`` as a subprocess that must end within ``timeout`` (inputs that could hang it)."""
    run = subprocess.run([sys.executable, "-c", "from megatrace.cli import main; main()", "analyze", str(path),
                          "--no-report", "--json", str(path / "f.json")], capture_output=True, text=True,
                         timeout=timeout)
    return run.returncode, run.stdout + run.stderr


def safe_loads_in_child(blob: bytes, tmp: Path, timeout: float = 10.0) -> str:
    """The error :func:`safe_loads` raises on ``blob``, in a child process that must end within ``timeout`` (a
    payload that hangs the reader must not hang the test run)."""
    payload = tmp / "x.pkl"
    payload.write_bytes(blob)
    code = ("import sys; from megatrace.load.importers.safe_pickle import safe_load_file\n"
            "try:\n    safe_load_file(sys.argv[1])\nexcept ValueError as exc:\n    print(exc)")
    run = subprocess.run([sys.executable, "-c", code, str(payload)], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr
    return run.stdout


def refused(path: Path, *patterns: str, process: bool = False) -> str:
    """Bad input: exit code 1, one ``Error: ...`` line naming the file (and what ``patterns`` say), no traceback."""
    code, out = analyze_process(path) if process else analyze_cli(path)
    assert "Traceback" not in out, out
    assert code == 1, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), out
    for pattern in patterns:
        assert re.search(pattern, out), f"{pattern!r} not in {out!r}"
    return out


def accepted(path: Path) -> dict:
    """Good (or merely odd) input: exit code 0; returns findings.json."""
    code, out = analyze_cli(path)
    assert code == 0 and "Traceback" not in out, out
    return json.loads((path / "f.json").read_text())


def fr_dumps(run: Path, dest: Path) -> Path:
    """A copy of the run's dumps (and layout) in ``dest``."""
    dest.mkdir(parents=True)
    for p in (run / "fr").iterdir():
        shutil.copy(p, dest / p.name)
    shutil.copy(run / "layout.yaml", dest / "layout.yaml")
    return dest


def mutate_dump(path: Path, change) -> None:  # noqa: ANN001 - change(dump) edits the dump in place
    dump = pickle.loads(path.read_bytes())  # our own run's dump: trusted
    change(dump)
    path.write_bytes(pickle.dumps(dump))


def nested(depth: int, leaf: object = "1") -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def with_deep_list(dump: dict, depth: int) -> bytes:
    """``dump`` pickled with the string "DEEP" (wherever it was put) replaced by lists nested ``depth`` deep: a
    nesting too deep for pickle.dumps to write (or repr to print), as a hostile dump would hold."""
    blob = pickle.dumps(dump, protocol=2)
    marker = b"X\x04\x00\x00\x00DEEP"  # BINUNICODE "DEEP"
    assert blob.count(marker) == 1
    return blob.replace(marker, b"]" * depth + b"a" * (depth - 1))  # EMPTY_LIST ×depth, then APPEND each in the last


# --- 1. the restricted unpickler: no hang on memo cycles or shared references ------------------------------------

def test_a_self_referencing_pickle_is_refused_at_once(run: Path, tmp_path: Path) -> None:
    tiny: list = []
    tiny.append(tiny)
    blob = pickle.dumps({"entries": tiny}, protocol=2)
    assert len(blob) < 40  # the audit's 27-byte payload
    assert re.search(r"x.pkl: refused: a list at \['entries'\].* contains itself", safe_loads_in_child(blob, tmp_path))
    # in a real dump, through the CLI, which must not hang
    dumps = fr_dumps(run, tmp_path / "cycle")
    loop: list = [1]
    loop.append(loop)
    mutate_dump(dumps / "fr_rank_1", lambda d: d["entries"][2].__setitem__("frames", loop))
    refused(dumps, r"fr_rank_1: refused: a list at \['entries'\]\[2\]\['frames'\].* contains itself \(a cycle",
            process=True)


def test_shared_references_nested_deep_are_refused_and_shallower_ones_read_fast(run: Path, tmp_path: Path) -> None:
    laugh: list = []
    for _ in range(60):  # 2**60 paths through 61 lists, in a few hundred bytes
        laugh = [laugh, laugh]
    blob = pickle.dumps({"entries": [], "pg_config": laugh}, protocol=2)
    assert len(blob) < 600
    assert re.search(r"x.pkl: refused: containers nested more than 32 deep at \['pg_config'\]",
                     safe_loads_in_child(blob, tmp_path))
    dumps = fr_dumps(run, tmp_path / "deep")
    mutate_dump(dumps / "fr_rank_2", lambda d: d["entries"][0].__setitem__("frames", laugh))
    refused(dumps, r"fr_rank_2: refused: containers nested more than 32 deep at \['entries'\]\[0\]\['frames'\]",
            process=True)
    # shared but acyclic, and shallow enough: 2**27 paths, 28 lists: read at once, the dump analysed as usual
    shared: list = []
    for _ in range(27):
        shared = [shared, shared]
    ok = fr_dumps(run, tmp_path / "shared")
    mutate_dump(ok / "fr_rank_2", lambda d: d["entries"][0].__setitem__("frames", shared))
    code, out = analyze_process(ok)
    assert code == 0 and "VERDICT" in out, out


def test_a_dump_above_the_size_limit_is_refused_unread(run: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    dumps = fr_dumps(run, tmp_path / "big")
    monkeypatch.setattr(flight_recorder, "MAX_BYTES", 1000)
    with pytest.raises(TraceLoadError, match=r"fr_rank_0: \d+ bytes: too large for a Flight Recorder dump"):
        load_trace(dumps)


# --- 2. wrong types and out-of-range values: FILE: entry N / line N: field X ----------------------------------

def _entry(k: int, field: str, value: object):  # noqa: ANN202
    return lambda d: d["entries"][k].__setitem__(field, value)


FR_CASES = {
    "time-overflow": (_entry(5, "time_created_ns", 2**70), r"entry 5 \(record \d+\): field time_created_ns: "
                                                           r"expected .*, got 1180591620717411303424"),
    "time-negative": (_entry(5, "time_created_ns", -5), r"entry 5 \(record \d+\): field time_created_ns: .*got -5"),
    "time-bool": (_entry(5, "time_created_ns", True), r"entry 5 \(record \d+\): field time_created_ns: .*got True"),
    "seq-overflow": (_entry(3, "collective_seq_id", 2**63), r"entry 3 \(record \d+\): field collective_seq_id: "
                                                            r"expected .*got 9223372036854775808"),
    "sizes-overflow": (_entry(4, "input_sizes", [[2**40, 2**40]]), r"entry 4 \(record \d+\): field input_sizes: "
                                                                   r"expected tensors of fewer than 2\*\*63 bytes"),
    "sizes-text": (_entry(4, "input_sizes", "abc"), r"entry 4 \(record \d+\): field input_sizes: expected a list"),
    "completed-overflow": (_entry(2, "time_discovered_completed_ns", 2**64),
                           r"entry 2 \(record \d+\): field time_discovered_completed_ns: expected .*got "
                           r"18446744073709551616"),
    "dtype-list": (_entry(1, "input_dtypes", [["Float"]]), r"entry 1 \(record \d+\): field input_dtypes\[0\]: "
                                                          r"expected a string, got \['Float'\]"),
    "record-id-text": (_entry(6, "record_id", "x"), r"entry 6: field record_id: expected .*got 'x'"),
    "record-id-repeated": (lambda d: d["entries"].append(dict(d["entries"][-1])), r"entry \d+: field record_id: expected a record id of its own, got \d+"),
    "state-list": (_entry(2, "state", ["completed"]), r"entry 2 \(record \d+\): field state: expected a string"),
    "pg-config-ranks": (lambda d: d["pg_config"].__setitem__("1", {"ranks": "[0, 'x']"}),
                        r"pg_config\['1'\]: field ranks: expected a list of ranks"),
}


@pytest.mark.parametrize("case", list(FR_CASES))
def test_flight_recorder_fields_are_checked(run: Path, tmp_path: Path, case: str) -> None:
    change, pattern = FR_CASES[case]
    dumps = fr_dumps(run, tmp_path / case)
    mutate_dump(dumps / "fr_rank_1", change)
    refused(dumps, r"fr_rank_1: " + pattern)


def test_a_deeply_nested_process_group_is_refused(run: Path, tmp_path: Path) -> None:
    dumps = fr_dumps(run, tmp_path / "deep")
    dump = pickle.loads((dumps / "fr_rank_1").read_bytes())
    dump["entries"][2]["process_group"] = "DEEP"
    (dumps / "fr_rank_1").write_bytes(with_deep_list(dump, 20_000))
    refused(dumps, r"fr_rank_1: refused: containers nested more than 32 deep at \['entries'\]\[2\]\['process_group'\]")


def test_a_missing_profiling_name_in_the_last_dump_names_it(run: Path, tmp_path: Path) -> None:
    dumps = fr_dumps(run, tmp_path / "last")
    mutate_dump(dumps / "fr_rank_3", _entry(0, "profiling_name", None))
    refused(dumps, r"fr_rank_3: entry 0 \(record \d+\): field profiling_name: expected a string, got None")


def test_json_dumps_are_checked_the_same_way(run: Path, tmp_path: Path) -> None:
    dumps = tmp_path / "json"
    dumps.mkdir()
    for r in range(4):
        (dumps / f"fr_rank_{r}.json").write_text(json.dumps(pickle.loads((run / "fr" / f"fr_rank_{r}").read_bytes())))
    path = dumps / "fr_rank_2.json"
    good = json.loads(path.read_text())
    bad = json.loads(path.read_text())
    bad["entries"][3]["process_group"] = [nested(200), "tp"]  # deep, but not too deep for the JSON reader
    path.write_text(json.dumps(bad))
    refused(dumps, r"fr_rank_2.json: entry 3 \(record \d+\): field process_group: expected \(name, description\)")
    first = '"process_group": ' + json.dumps(good["entries"][0]["process_group"])
    assert first in json.dumps(good)
    path.write_text(json.dumps(good).replace(first, '"process_group": ' + "[" * 100_000 + "]" * 100_000, 1))
    refused(dumps, r"fr_rank_2.json: not a Flight Recorder dump \(JSON nested too deeply to read\)")
    bad = json.loads(json.dumps(good))
    bad["entries"][0]["time_created_ns"] = 1.5e18
    path.write_text(json.dumps(bad))
    refused(dumps, r"fr_rank_2.json: entry 0 \(record \d+\): field time_created_ns: expected .*got 1.5e\+18")


def test_the_gloo_note_looks_at_every_dump_not_only_the_last(run: Path, tmp_path: Path) -> None:
    """(It read the entries of whichever dump the loading loop had read last.)"""
    dumps = fr_dumps(run, tmp_path / "gloo")

    def not_gloo(dump: dict) -> None:
        for e in dump["entries"]:
            e["profiling_name"] = e["profiling_name"].replace("gloo:", "nccl:")

    mutate_dump(dumps / "fr_rank_3", not_gloo)
    notes = accepted(dumps)["trace"]["problems"]
    assert any("pg_config is empty" in n and "gloo records no point-to-point calls" in n for n in notes), notes


def _line(path: Path, no: int, change) -> None:  # noqa: ANN001 - change(line) -> the new line
    lines = path.read_text().splitlines()
    lines[no - 1] = change(lines[no - 1])
    path.write_text("\n".join(lines) + "\n")


NCCL_CASES = {
    "data-overflow": (lambda s: re.sub(r"Data \d+", "Data 99999999999999999999999", s),
                      r"field Data: expected .*got 99999999999999999999999"),
    "data-thousands-of-digits": (lambda s: re.sub(r"Data \d+", "Data " + "9" * 5000, s),
                                 r"field Data: expected .*got 9{40}…"),
    "opcount-overflow": (lambda s: re.sub(r"opCount \d+", "opCount 99999999999999999", s),
                         r"field opCount: expected .*got 99999999999999999"),
    "seconds-overflow": (lambda s: re.sub(r"\[\d+\.", "[99999999999999.", s, count=1),
                         r"field time: expected .*got 99999999999999"),
    "rank-overflow": (lambda s: s.replace("[Rank 1]", "[Rank 99999999999]"),
                      r"field Rank: expected a rank below \d+, got 99999999999"),
    "save-count-thousands-of-digits": (lambda s: re.sub(r"save_count \d+", "save_count " + "7" * 5000, s),
                                       r"field save_count: expected .*got 7{40}…"),
}


@pytest.mark.parametrize("case", list(NCCL_CASES))
def test_nccl_log_numbers_are_checked(trace: TraceSet, tmp_path: Path, case: str) -> None:
    change, pattern = NCCL_CASES[case]
    logs = tmp_path / "logs"
    write_nccl_logs(trace, logs, group_hash=True)
    _line(logs / "rank_1.log", 11, change)
    refused(logs, r"rank_1.log, line 11: " + pattern)


def _record(path: Path, no: int, change) -> None:  # noqa: ANN001 - change(record) edits the JSON object
    def edit(line: str) -> str:
        obj = json.loads(line)
        change(obj)
        return json.dumps(obj)

    _line(path, no, edit)


def _set(*keys: str, value: object):  # noqa: ANN202
    def change(obj: dict) -> None:
        for k in keys[:-1]:
            obj = obj[k]
        obj[keys[-1]] = value
    return change


INSPECTOR_CASES = {
    "metadata-list": (_set("metadata", value=[1]), r"field metadata: expected an object"),
    "trace-list": (_set("coll_perf", "event_trace_ts", value=[1]), r"field coll_perf.event_trace_ts: expected an "
                                                                   r"object"),
    "kernel-events-int": (_set("coll_perf", "event_trace_ts", "kernel_events", value=5),
                          r"field coll_perf.event_trace_ts.kernel_events: expected a list.*got 5"),
    "pid-text": (_set("metadata", "pid", value="abc"), r"field metadata.pid: expected a process id, got 'abc'"),
    "size-overflow": (_set("coll_perf", "coll_msg_size_bytes", value=2**70),
                      r"field coll_perf.coll_msg_size_bytes: expected .*got 1180591620717411303424"),
    "start-overflow": (_set("coll_perf", "event_trace_ts", "coll_start_ts", value=1e30),
                       r"field coll_perf.event_trace_ts.coll_start_ts: expected .*got 1e\+30"),
    "exec-infinite": (_set("coll_perf", "coll_exec_time_us", value=float("inf")),
                      r"field coll_perf.coll_exec_time_us: expected .*finite.*got inf"),
    "sn-text": (_set("coll_perf", "coll_sn", value="12"), r"field coll_perf.coll_sn: expected .*got '12'"),
    "sn-fraction": (_set("coll_perf", "coll_sn", value=12.7), r"field coll_perf.coll_sn: expected .*got 12.7"),
    "rank-outside": (_set("header", "rank", value=99), r"field header.rank: expected a rank in the communicator of "
                                                       r"\d+ .*got 99"),
    "ranks-zero": (_set("header", "n_ranks", value=0), r"field header.n_ranks: expected .*got 0"),
}


@pytest.mark.parametrize("case", list(INSPECTOR_CASES))
def test_inspector_fields_are_checked(trace: TraceSet, tmp_path: Path, case: str) -> None:
    change, pattern = INSPECTOR_CASES[case]
    out = tmp_path / "insp"
    write_inspector(trace, out, name=lambda rank, info: f"inspector-rank{rank}.log")
    _record(out / "inspector-rank2.log", 5, change)
    refused(out, r"inspector-rank2.log, line 5: " + pattern)


def test_inspector_nan_without_the_verbose_trace_and_bad_bytes_name_the_line(trace: TraceSet, tmp_path: Path) -> None:
    out = tmp_path / "plain"
    write_inspector(trace, out, verbose=False, name=lambda rank, info: f"inspector-rank{rank}.log")
    f = out / "inspector-rank1.log"
    good = f.read_bytes()
    _record(f, 3, _set("coll_perf", "coll_exec_time_us", value=float("nan")))  # json writes NaN
    refused(out, r"inspector-rank1.log, line 3: field coll_perf.coll_exec_time_us: expected .*finite.*got nan")
    lines = good.split(b"\n")
    lines[6] = lines[6].replace(b'"coll_perf"', b'"coll\xff_perf"')
    f.write_bytes(b"\n".join(lines))
    refused(out, r"inspector-rank1.log, line 7: not UTF-8 text \(byte 0xff at column \d+")


# --- 3. a file that belongs to the trace is read or refused, never passed over ---------------------------------

def test_a_rank_log_that_does_not_start_like_one_is_an_error_not_skipped(trace: TraceSet, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    write_nccl_logs(trace, logs, group_hash=True)
    f = logs / "rank_1.log"
    f.write_text("#" * 5000 + "\n" + f.read_text())  # no NCCL line in its first 4 KiB
    refused(logs, r"rank_1.log, line 1: not a Megatrace NCCL log line: '####")


def test_a_rank_log_without_a_rank_number_is_an_error(trace: TraceSet, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    write_nccl_logs(trace, logs, group_hash=True)
    (logs / "rank_3.log").rename(logs / "rank_X.log")
    refused(logs, r"rank_X.log: named like a Megatrace NCCL log, but not rank_<R>.log")


def test_an_empty_rank_log_is_a_warning_naming_it(trace: TraceSet, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    write_nccl_logs(trace, logs, group_hash=True)
    (logs / "rank_2.log").write_text("")
    notes = accepted(logs)["trace"]["problems"]
    assert any("rank_2.log: no calls in it" in n for n in notes), notes


def test_an_empty_or_cut_dump_beside_the_others_is_reported(run: Path, tmp_path: Path) -> None:
    dumps = fr_dumps(run, tmp_path / "fr")
    (dumps / "fr_rank_2").write_bytes(b"")
    notes = accepted(dumps)["trace"]["problems"]
    assert any("fr_rank_2: empty file" in n for n in notes), notes
    text = json.dumps(pickle.loads((run / "fr" / "fr_rank_2").read_bytes()))
    (dumps / "fr_rank_2").write_text(text[:10])  # cut before the keys the dumps are recognised by
    refused(dumps, r"fr_rank_2, line 1: not a Flight Recorder dump")


def test_an_empty_or_cut_inspector_file_beside_the_others_is_reported(trace: TraceSet, tmp_path: Path) -> None:
    out = tmp_path / "insp"
    write_inspector(trace, out)
    (out / "layout.yaml").write_text((trace.path / "layout.yaml").read_text())
    victim = sorted(out.glob("*.log"))[1]
    text = victim.read_text()
    victim.write_text("")
    notes = accepted(out)["trace"]["problems"]
    assert any(f"{victim.name}: empty" in n for n in notes), notes
    victim.write_text(text[:30])  # the first record cut before coll_perf
    refused(out, rf"{victim.name}, line 1: not a JSON object")


def test_plain_rank_logs_beside_flight_recorder_dumps_do_not_change_the_format(run: Path, tmp_path: Path) -> None:
    dumps = fr_dumps(run, tmp_path / "fr")
    (dumps / "rank_0.log").write_text("step 1 loss 2.3\n")  # a training log, not an NCCL-patch log
    assert accepted(dumps)["trace"]["job_id"] == "flight-recorder"


# --- 4. nothing recognised: say what was looked for --------------------------------------------------------------

@pytest.mark.parametrize("content", ["empty", "unrelated"])
def test_a_directory_without_a_trace_lists_every_format_and_format(tmp_path: Path, content: str) -> None:
    where = tmp_path / content
    where.mkdir()
    if content == "unrelated":
        (where / "notes.txt").write_text("nothing to see\n")
        (where / "sub").mkdir()
        (where / "sub" / "rank_0.log").write_text("step 1 loss 2.3\n")
    code, out = analyze_cli(where)
    assert code == 1 and "Traceback" not in out, out
    assert out.startswith(f"Error: {where}: not a trace directory"), out
    for looked_for in ("rank-NNNNN.ring", "Flight Recorder dumps", "rank_<R>.log", "NCCL Inspector", "--format"):
        assert looked_for in out, (looked_for, out)
    assert ("(it is empty)" in out) == (content == "empty"), out
