"""Flight Recorder dumps written live by today's torch (gloo, several processes), end to end; and torch's own
analyzer, torchfrtrace, on a dtype mismatch. tests/test_import_flight_recorder.py reads checked-in runs of the same
jobs without torch.

Two real runs: the demo with an injected hang (TP2 x PP2, its opt-in hook MEGATRACE_DEMO_FR_DUMP writes every
rank's ``_dump_fr_trace()`` each second), and a three-rank script whose rank 0 calls one all_reduce with the wrong
dtype (:func:`helpers.torch_runs.mismatch_job`). ``fault.json`` (ground truth) is read by these tests only.
"""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # real multi-process torch runs

from helpers.torch_runs import FR_ENV, mismatch_job  # noqa: E402

from megatrace.analyze.engine import analyze  # noqa: E402
from megatrace.analyze.findings import Kind, Severity  # noqa: E402
from megatrace.demo.launcher import DemoOptions, run_local  # noqa: E402
from megatrace.load.importers.flight_recorder import find_dumps, read_dump  # noqa: E402


def test_a_live_demo_hang_is_named_from_its_dumps(tmp_path: Path) -> None:
    """The demo, rank 1 hangs at step 2: today's dumps have the fields the importer reads, and name the hang."""
    out = tmp_path / "hang"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**FR_ENV, "MEGATRACE_DEMO_FR_DUMP": str(out / "fr")}.items():
            mp.setenv(k, v)
        run_local(DemoOptions(tp=2, pp=2, dp=1, steps=4, faults=("hang:rank=1,step=2",), out=out, stall_s=8.0),
                  log=lambda msg: None)
    (fault,) = json.loads((out / "fault.json").read_text())["faults"]
    steps = (out / "metrics" / f"rank-{fault['rank']:05d}.jsonl").read_text().count("\n")
    assert steps == 2, f"the demo stopped at step {steps}, not at the injected hang (machine overloaded?)"
    dumps = find_dumps(out / "fr")
    assert [p.name for p in dumps] == [f"fr_rank_{r}" for r in range(4)]
    dump = read_dump(dumps[0])
    assert {"version", "pg_config", "pg_status", "entries", "comm_lib_version"} <= set(dump)
    entry = dump["entries"][-1]
    assert {"record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "op_id", "profiling_name",
            "time_created_ns", "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "state",
            "time_discovered_started_ns", "time_discovered_completed_ns", "retired", "timeout_ms",
            "is_p2p"} <= set(entry)  # (no "frames": the demo's hook dumps without stack traces)
    assert entry["profiling_name"] == "gloo:all_reduce" and entry["process_group"][1] == "tp"
    top = analyze(out, format="flight-recorder").findings[0]
    assert top.kind == Kind.COMPUTE_HANG and top.severity == Severity.CRITICAL, top.verdict
    assert top.subject.rank == fault["rank"], top.verdict


@pytest.fixture(scope="module")
def mismatch_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three real gloo ranks; rank 0 (torchfrtrace's reference rank) calls all_reduce #4 with the wrong dtype."""
    return mismatch_job(tmp_path_factory.mktemp("fr") / "mismatch")


def _torchfrtrace_culprits(dumps: Path, tmp: Path) -> set[int]:
    """Run torch's own analyzer (torchfrtrace) and collect the ranks it calls culprits.

    gloo leaves ``pg_config`` empty, where NCCL records each group's members; torchfrtrace needs them, so
    the copies it reads get the world group's members filled in as NCCL would record them.
    """
    tmp.mkdir()
    for p in find_dumps(dumps):
        dump = pickle.loads(p.read_bytes())  # our own run's dump: trusted
        dump["pg_config"] = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}
        (tmp / p.name).write_bytes(pickle.dumps(dump))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "COLLECTIVE_DTYPE_MISMATCH" in run.stdout + run.stderr
    return {int(r) for r in re.findall(r"Culprit rank (\d+)", run.stdout + run.stderr)}


def test_torchfrtrace_blames_the_good_ranks_when_its_reference_rank_is_the_bad_one(mismatch_run: Path,
                                                                                    tmp_path: Path) -> None:
    assert read_dump(mismatch_run / "fr_rank_0")["entries"][3]["frames"]  # dumped with stack traces
    blamed = _torchfrtrace_culprits(mismatch_run, tmp_path / "frtrace")
    assert blamed == {1, 2}  # torchfrtrace compares everyone with rank 0 and assumes rank 0 is right
    result = analyze(mismatch_run)
    top = result.findings[0]
    assert top.kind == Kind.COLLECTIVE_MISMATCH, top.verdict
    assert top.subject.ranks == (0,), top.verdict  # MegaTrace: rank 0 is the odd one out
    assert "rank 0 is the odd one out" in top.verdict and "int32 on ranks [0]" in top.verdict
