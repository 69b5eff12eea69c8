"""PyTorch profiler (Kineto) traces of a real gloo job, imported and analysed.

The job (tests/programs/kineto_gloo_job.py) runs 3 ranks under ``torch.profiler`` and exports one chrome
trace per rank (rank 0's gzipped). In the slow run, rank 1 is throttled from outside (SIGSTOP/SIGCONT,
:class:`helpers.outside.Throttle`); the healthy run is left alone.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from megatrace.analyze.engine import analyze  # noqa: E402
from megatrace.analyze.findings import Kind  # noqa: E402
from megatrace.cli import main  # noqa: E402
from megatrace.load import load_trace  # noqa: E402
from megatrace.load.importers import detect_format  # noqa: E402
from megatrace.load.importers.kineto import OPS, _key, load_kineto, read_document  # noqa: E402
from megatrace.load.traceset import TraceLoadError  # noqa: E402
from megatrace.trace.ring_format import Op, State  # noqa: E402
from helpers.outside import Throttle  # noqa: E402

JOB = Path(__file__).with_name("programs") / "kineto_gloo_job.py"
WORLD, SLOW = 3, 1
HANG_KINDS = {Kind.COMPUTE_HANG, Kind.COMM_HANG, Kind.CRASHED_PROCESS, Kind.EXITED_EARLY, Kind.DEADLOCK,
              Kind.POSSIBLE_HANG, Kind.STALL, Kind.PARTIAL_STOP, Kind.STARTUP_HANG, Kind.NO_TRACE}


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_job(out: Path, iterations: int, slow: int | None = None) -> Path:
    """The job's traces in ``out``; ``slow``: the rank throttled from outside while it runs."""
    out.mkdir(parents=True)
    port = _port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(JOB), str(r), str(WORLD), str(out), port, str(iterations)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in range(WORLD)]
    try:
        if slow is None:
            codes = [p.wait(timeout=90) for p in procs]
        else:
            with Throttle(procs[slow].pid):
                codes = [p.wait(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * WORLD, [p.stderr.read().decode()[-2000:] for p in procs]
    # what a user passes along: the parallel layout (3-way data parallel), from which steps are told apart
    (out / "layout.yaml").write_text(f"world_size: {WORLD}\ntp: 1\npp: 1\ndp: {WORLD}\n")
    return out


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kineto")
    return {"slow": run_job(root / "slow", 30, slow=SLOW), "healthy": run_job(root / "healthy", 20)}


def _events(path: Path) -> list[dict]:
    data = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    return json.loads(data)["traceEvents"]


def test_every_profiled_call_is_imported(runs: dict[str, Path]) -> None:
    out = runs["slow"]
    assert detect_format(out) == "kineto"
    trace = load_trace(out)
    assert trace.source_format == trace.job_id == "kineto" and trace.world_size == WORLD
    assert list(trace.ranks) == [0, 1, 2]
    for rank in range(WORLD):
        path = next(out.glob(f"trace-rank{rank}.json*"))
        counted: dict[int, int] = {}
        for e in _events(path):  # what the profiler recorded: one c10d:: op per call
            if e.get("cat") == "cpu_op" and e["name"].startswith("c10d::") and _key(e["name"]) in OPS:
                counted[OPS[_key(e["name"])]] = counted.get(OPS[_key(e["name"])], 0) + 1
        rows = trace.rows(rank)
        got: dict[int, int] = {}
        for op in trace.records.op[rows].tolist():
            got[op] = got.get(op, 0) + 1
        assert got == counted and counted[Op.ALL_REDUCE] == 30, (rank, got, counted)
    rec = trace.records
    assert (rec.state == State.COMPLETED).all() and (rec.t_complete >= rec.t_enqueue).all()
    ar = rec.op == Op.ALL_REDUCE
    assert (rec.nbytes[ar] == 4096 * 4).all()  # nelems from Input Dims x float from the gloo execution
    sends = rec.op == Op.SEND
    assert set(rec.peer[sends].tolist()) == {1} and set(rec.peer[rec.op == Op.RECV].tolist()) == {0}
    # ranks of one host share the clock: the first all-reduce ends at about the same time on every rank (a
    # wrong time base would put them seconds or hours apart; a rank descheduled on a busy host, some 100 ms)
    ends = [rec.t_complete[trace.rows(r)][ar[trace.rows(r)]][0] for r in range(WORLD)]
    assert max(ends) - min(ends) < 500_000_000
    assert not [p for p in trace.problems if p.severity != "info"], trace.problems


def test_the_throttled_rank_is_the_straggler(runs: dict[str, Path]) -> None:
    result = analyze(runs["slow"])
    stragglers = [f.subject.rank for f in result.findings if f.kind == Kind.STRAGGLER]
    # named first (on a busy 2-core host another rank may, really, be somewhat slow as well)
    assert stragglers[:1] == [SLOW], [f.verdict for f in result.findings[:4]]
    assert not [f for f in result.findings if f.kind in HANG_KINDS]
    # the critical path runs through the throttled rank's compute, then the data-parallel all-reduce that waits
    # for it. The throttle stops the rank 50 ms of every 100 ms and a step lasts about 40 ms, so a step can fall
    # wholly in a running half and be on time: the throttled rank's share of the critical path's time, over
    # all steps, is what must dominate (a share of steps depended on the phase: 11 of 15 on a busy host).
    paths = result.results["critical_path"].steady
    per_rank: dict[int, int] = {}
    for p in paths:
        for rank, ns in p.by_rank.items():
            per_rank[rank] = per_rank.get(rank, 0) + ns
    total = sum(per_rank.values())
    assert max(per_rank, key=per_rank.get) == SLOW and per_rank[SLOW] >= 0.6 * total, per_rank
    assert all(p.by_category.get("dp-sync", 0) > 0 for p in paths), [p.by_category for p in paths[:4]]
    cli = CliRunner().invoke(main, ["analyze", str(runs["slow"]), "--format", "kineto", "--no-report"])
    assert cli.exit_code == 0 and f"rank {SLOW}" in cli.output.splitlines()[0], cli.output


def test_a_healthy_run_has_no_hang_and_no_straggler(runs: dict[str, Path]) -> None:
    result = analyze(runs["healthy"])
    kinds = {f.kind for f in result.findings}
    assert not kinds & HANG_KINDS, [f.verdict for f in result.findings[:4]]  # (performance is the host's to judge)
    # nobody is slow: the rank whose compute is on the critical path changes from step to step
    paths = result.results["critical_path"].paths
    assert len({r for p in paths for r, ns in p.by_rank.items() if ns > 0}) > 1, [p.by_rank for p in paths]


def _copy(runs: dict[str, Path], dest: Path) -> Path:
    dest.mkdir()
    for p in runs["healthy"].iterdir():
        if p.is_file():
            (dest / p.name).write_bytes(p.read_bytes())
    return dest


def _fails(directory: Path, pattern: str) -> None:
    """A clear one-line error from the CLI (no traceback), matching ``pattern``."""
    with pytest.raises(TraceLoadError, match=pattern):
        load_kineto(directory)
    cli = CliRunner().invoke(main, ["analyze", str(directory), "--format", "kineto", "--no-report"])
    assert cli.exit_code != 0 and "Traceback" not in cli.output and not isinstance(cli.exception, (KeyError,
                                                                                                     TypeError))


def test_bad_input_names_file_event_and_field(runs: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(runs, tmp_path / "bad")
    f = d / "trace-rank1.json"
    good = f.read_bytes()
    f.write_bytes(good[: len(good) // 2])  # truncated
    _fails(d, r"trace-rank1.json: line \d+, column \d+: not JSON")
    doc = json.loads(good)
    i = next(k for k, e in enumerate(doc["traceEvents"]) if e.get("name") == "c10d::allreduce_")
    for field, value, pattern in (("ts", "12", r"field ts: expected a time in µs"),
                                  ("dur", -1.0, r"field dur: expected a duration"),
                                  ("args", [1], r"field args: expected an object")):
        bad = json.loads(good)
        bad["traceEvents"][i][field] = value
        f.write_text(json.dumps(bad))
        _fails(d, rf"trace-rank1.json, traceEvents\[{i}\]: {pattern}")
    bad = json.loads(good)
    bad["traceEvents"][i]["args"]["Input Dims"] = [["x"]]
    f.write_text(json.dumps(bad))
    _fails(d, rf"traceEvents\[{i}\]: field args.Input Dims\[0\]\[0\]\[0\]: expected a dimension .*, got 'x'")
    bad = json.loads(good)
    bad["distributedInfo"]["rank"] = "1"
    f.write_text(json.dumps(bad))
    _fails(d, r"trace-rank1.json: field distributedInfo.rank: expected a rank")
    bad["distributedInfo"]["rank"] = 0
    f.write_text(json.dumps(bad))
    _fails(d, r"rank 0 also comes from")


def test_nested_bomb_and_huge_files_are_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(runs, tmp_path / "bomb")
    (d / "trace-rank1.json").write_text('{"schemaVersion": 1, "traceEvents": ' + "[" * 200_000 + "]" * 200_000 + "}")
    _fails(d, r"trace-rank1.json: not a Kineto trace \(JSON nested too deeply")
    big = tmp_path / "big.json"
    big.write_bytes(b'{"traceEvents": []' + b" " * 2000 + b"}")
    with pytest.raises(TraceLoadError, match=r"big.json: 2019 bytes, over the 1000-byte limit"):
        read_document(big, limit=1000)
    gz = tmp_path / "big.json.gz"
    gz.write_bytes(gzip.compress(b'{"traceEvents": []' + b" " * 5000 + b"}"))
    with pytest.raises(TraceLoadError, match=r"big.json.gz: over 1000 bytes once decompressed"):
        read_document(gz, limit=1000)


def test_load_is_linear_on_a_large_trace(runs: dict[str, Path], tmp_path: Path) -> None:
    """A synthetic 3-rank trace with 20,000 calls per rank loads in seconds."""
    d = _copy(runs, tmp_path / "large")
    for f in d.glob("trace-rank*.json*"):
        doc = read_document(f)
        calls = [e for e in doc["traceEvents"] if e.get("cat") in ("cpu_op", "user_annotation")
                 and (e["name"].startswith("c10d::allreduce") or e["name"] == "gloo:all_reduce")]
        span = 1e6
        more = [dict(e, ts=e["ts"] + k * span) for k in range(1, 500) for e in calls]
        doc["traceEvents"] += more
        f.unlink()
        (d / "trace-rank{}.json".format(doc["distributedInfo"]["rank"])).write_text(json.dumps(doc))
    t0 = time.perf_counter()
    trace = load_kineto(d)
    took = time.perf_counter() - t0
    assert trace.info(0).n_records > 10_000 and took < 20, took
