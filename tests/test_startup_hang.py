"""A job stuck before communication started: real ranks in init_process_group, watched and analysed.

Each rank is a real process running an unmodified script (``dist.init_process_group("gloo")`` with env://)
under the tracer's autoload, as the SPANK plugin runs it; the rendezvous never completes because one rank
never calls init_process_group, or because MASTER_ADDR does not resolve. The agent's scan, the collector's
node facts and the analysis must each say so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.outside import wait_for

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.collect.agent import pid_alive, scan
from megatrace.collect.detect import STALLED, SUSPECT, node_state
from megatrace.load.traceset import TraceLoadError
from megatrace.trace.init_marker import parse_marker

pytest.importorskip("torch")

SCRIPT = """
import datetime, os, time
import torch.distributed as dist
if os.environ["RANK"] == os.environ.get("BLOCK_RANK"):
    time.sleep(3600)  # stuck in its own start-up: never reaches init_process_group
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
print("initialised", flush=True)
"""


class Ranks:
    """``world`` processes of SCRIPT, traced (MEGATRACE_ENABLE=1), each in a session of its own."""

    def __init__(self, tmp: Path, world: int, addr: str = "127.0.0.1", block: int | None = None) -> None:
        self.dir = tmp / "rings"
        script = tmp / "train.py"
        script.write_text(SCRIPT)
        port = 20000 + os.getpid() % 20000
        self.procs = []
        for rank in range(world):
            env = dict(os.environ, MEGATRACE_ENABLE="1", MEGATRACE_DIR=str(self.dir), MEGATRACE_JOB_ID="4711",
                       MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                       BLOCK_RANK=str(block), PYTHONWARNINGS="ignore")
            self.procs.append(subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def wait_markers(self, n: int, timeout: float = 120) -> None:
        if wait_for(lambda: self.dir.is_dir() and len(list(self.dir.glob("rank-*.init"))) >= n, timeout, step=0.2):
            return
        raise AssertionError(f"{n} start markers were not written in {timeout} s: {list(self.dir.glob('*'))}")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def started(tmp_path: Path):
    made: list[Ranks] = []
    yield lambda *a, **k: made.append(Ranks(tmp_path, *a, **k)) or made[-1]
    for r in made:
        r.stop()


def _collect(ranks: Ranks, tmp: Path) -> Path:
    out = tmp / "bundle"
    proc = subprocess.run([sys.executable, "-m", "megatrace.cli", "collect", "--local", "--ring-dir", str(ranks.dir),
                           "--job-id", "4711", "--job-dir", str(tmp), "--node", "n1", "--trigger", "hang",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


def test_a_rank_that_never_reaches_init_process_group_is_named(tmp_path: Path, started) -> None:
    ranks = started(3, block=2)
    ranks.wait_markers(2)
    verdicts, _ = scan(str(ranks.dir), time.monotonic_ns() + 5_000_000_000, 2.0, pid_alive, job_id="4711",
                       uid=os.geteuid())
    assert sorted(v.rank for v in verdicts) == [0, 1] and all(v.state == STALLED for v in verdicts), verdicts
    assert "in init_process_group" in verdicts[0].reason and node_state(verdicts) == SUSPECT
    bundle = _collect(ranks, tmp_path)
    result = analyze(bundle)
    top = result.findings[0]
    assert top.kind == Kind.STARTUP_HANG and top.severity == Severity.CRITICAL, top.verdict
    assert top.subject.rank == 2 and "rank 2 never reached init_process_group" in top.verdict, top.verdict
    text = " ".join(map(str, top.evidence))
    assert "accepts connections" in text and "still runs" in text, text
    assert f"rank 2: its process on n1 (pid {ranks.procs[2].pid}) still runs" in text, text  # found by its step
    assert "(py-spy, innermost first): <module> (train.py:5)" in text, text  # where it is stuck: its sleep
    assert not [f for f in result.findings if f.kind == Kind.HEALTHY]


def test_a_rendezvous_address_that_does_not_resolve_is_the_cause(tmp_path: Path, started) -> None:
    ranks = started(2, addr="no-such-host.invalid")
    ranks.wait_markers(2)
    top = analyze(_collect(ranks, tmp_path)).findings[0]
    assert top.kind == Kind.STARTUP_HANG, top.verdict
    assert "the rendezvous address no-such-host.invalid does not resolve on 1 node (n1" in top.verdict, top.verdict
    assert top.subject.ranks == (0, 1)


def test_a_ring_supersedes_the_marker(tmp_path: Path, started) -> None:
    ranks = started(2)
    for p in ranks.procs:
        assert p.wait(timeout=180) == 0
    assert sorted(p.name for p in ranks.dir.glob("rank-*.init")) == ["rank-00000.init", "rank-00001.init"]
    verdicts, _ = scan(str(ranks.dir), time.monotonic_ns(), 2.0, pid_alive, job_id="4711", uid=os.geteuid())
    assert sorted(v.rank for v in verdicts) == [0, 1] and all("init_process_group" not in v.reason for v in verdicts)
    assert not [f for f in analyze(ranks.dir).findings if f.kind == Kind.STARTUP_HANG]


def test_markers_are_input_like_any_other(tmp_path: Path) -> None:
    good = {"kind": "init", "job_id": "1", "rank": 3, "world_size": 4, "pid": 99, "host": "n1", "master_addr": "a",
            "master_port": 29500, "rendezvous": "env", "t_wall_ns": 1, "t_mono_ns": 1}
    assert parse_marker(json.dumps(good).encode()).endpoint == "a:29500"
    for bad in ({**good, "rank": -1}, {**good, "pid": "99"}, {**good, "master_port": 70000}, {**good, "kind": "x"},
                {**good, "world_size": 1 << 40}, [good]):
        assert parse_marker(json.dumps(bad).encode()) is None, bad
    assert parse_marker(b"{" * 100_000) is None and parse_marker(b"\xff\xfe") is None
    rings = tmp_path / "rings"
    rings.mkdir(mode=0o700)
    (rings / "rank-00003.init").write_text(json.dumps({**good, "rank": 2}))  # another rank's number inside
    with pytest.raises(TraceLoadError, match=r"none of its 1 start markers \(rank-NNNNN.init\) is readable"):
        analyze(tmp_path)


def test_no_marker_through_a_link_someone_planted(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.mkdir()
    (tmp_path / "rings").symlink_to(target)
    env = dict(os.environ, MEGATRACE_DIR=str(tmp_path / "rings"), RANK="0", WORLD_SIZE="1")
    code = ("from megatrace.trace.init_marker import write_marker\n"
            "write_marker((), {})\nprint('went on')\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "went on", proc.stderr
    assert not list(target.iterdir())


def test_a_restarted_rank_keeps_its_earlier_marker(tmp_path: Path) -> None:
    env = dict(os.environ, MEGATRACE_DIR=str(tmp_path / "rings"), RANK="5", WORLD_SIZE="8", MASTER_ADDR="n1",
               MASTER_PORT="29500")
    code = "from megatrace.trace.init_marker import write_marker\nwrite_marker((), {})\n"
    for _ in range(2):
        assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0
    names = sorted(p.name for p in (tmp_path / "rings").iterdir())
    assert names == ["rank-00005.init", "rank-00005.init.1"], names
    mk = parse_marker((tmp_path / "rings" / "rank-00005.init").read_bytes())
    assert (mk.rank, mk.world_size, mk.endpoint, mk.rendezvous) == (5, 8, "n1:29500", "env")
    assert (tmp_path / "rings").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "rings" / "rank-00005.init").stat().st_mode & 0o777 == 0o600
