"""``megatrace job-end`` without Slurm: task exits into process facts, the leader's wait, which steps it analyses.

The lab tests (tests/test_slurm_lab.py) run the same code from the real epilog.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatrace.collect.job_end import finish_job, procs_document, read_task_exits, steps_to_analyse
from megatrace.demo.launcher import DemoOptions, run_local

SIGKILLED = signal.SIGKILL  # a wait status of "killed by SIGKILL" is the signal number itself
EXITED_1 = 1 << 8


def _exits(tmp_path: Path, lines: dict[str, list[str]]) -> Path:
    d = tmp_path / ".agents" / "exits"
    d.mkdir(parents=True)
    for node, rows in lines.items():
        (d / node).write_text("".join(r + "\n" for r in rows))
    return d


def test_the_first_task_to_fail_on_its_own_crashed_and_the_rest_were_killed(tmp_path: Path) -> None:
    d = _exits(tmp_path, {
        "n1": ["step=0 rank=0 pid=10 status=9 wall_ns=2000", "step=0 rank=1 pid=11 status=9 wall_ns=2001"],
        "n2": ["step=0 rank=2 pid=12 status=256 wall_ns=1000", "garbage line", "step=0 rank=3 pid=13 status=9 "
               "wall_ns=2002", "step=1 rank=0 pid=20 status=0 wall_ns=5000"]})
    exits = read_task_exits(d)
    assert sorted(exits) == ["0", "1"] and len(exits["0"]) == 4
    doc = procs_document(exits["0"])
    ranks = doc["ranks"]
    assert ranks["2"]["exit_code"] == 1 and ranks["2"]["killed_by_launcher"] is False
    assert all(ranks[r]["signal"] == "SIGKILL" and ranks[r]["killed_by_launcher"] for r in ("0", "1", "3"))
    assert doc["outcome"] == "failed" and "rank 2 on n2 exited with status 1 first" in doc["message"]


def test_a_cancelled_or_timed_out_step_blames_nobody(tmp_path: Path) -> None:
    d = _exits(tmp_path, {"n1": [f"step=0 rank={r} pid={r} status={int(signal.SIGTERM)} wall_ns={r}"
                                 for r in range(4)]})
    doc = procs_document(read_task_exits(d)["0"])
    assert doc["outcome"] is None
    assert all(p["killed_by_launcher"] for p in doc["ranks"].values())


def test_a_segfault_is_a_crash_even_when_it_is_a_signal(tmp_path: Path) -> None:
    d = _exits(tmp_path, {"n1": [f"step=0 rank=0 pid=1 status={int(signal.SIGSEGV)} wall_ns=5",
                                 f"step=0 rank=1 pid=2 status={int(signal.SIGKILL)} wall_ns=6"]})
    ranks = procs_document(read_task_exits(d)["0"])["ranks"]
    assert ranks["0"]["signal"] == "SIGSEGV" and not ranks["0"]["killed_by_launcher"]
    assert ranks["1"]["killed_by_launcher"]


def test_only_steps_with_rings_and_without_findings_are_analysed(tmp_path: Path) -> None:
    for name, files in (("step-0", ["rings/rank-00000.ring", "findings.json"]), ("step-1", ["rings/rank-00000.ring"]),
                        ("step-2", ["layout.yaml"]), ("other", ["rings/rank-00000.ring"])):
        for f in files:
            (tmp_path / name / f).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / f).write_text("x")
    todo, skipped = steps_to_analyse(tmp_path)
    assert [p.name for p in todo] == ["step-1"]
    assert skipped == {"step-0": "already analysed by a collection during the job", "step-2": "no rings"}


def test_a_follower_only_marks_itself_done(tmp_path: Path) -> None:
    done = finish_job(str(tmp_path), str(tmp_path / ".agents"), "n2", ["n1", "n2"], wait_s=0)
    assert done.leader == "n1" and not done.analysed
    assert (tmp_path / ".agents" / "epilog" / "n2").exists()


def test_the_leader_waits_for_the_others_then_names_the_crashed_rank(tmp_path: Path) -> None:
    """A real demo run with a crash, its launcher's process facts removed: job-end rebuilds them from the task
    exits (as the plugin records them) and the report names the crash."""
    step = tmp_path / "step-0"
    result = run_local(DemoOptions(tp=2, pp=2, dp=1, steps=6, out=step, faults=("crash:rank=2,step=3",),
                                   stall_s=4.0))
    launcher = json.loads((step / "procs.json").read_text())["ranks"]
    (step / "procs.json").unlink()
    rings = step / "rings"
    assert result.outcome != "ok" and list(rings.glob("rank-*.ring"))
    now = time.time_ns()
    rows = [f"step=0 rank={r} pid={p['pid']} status={EXITED_1 if r == '2' else int(signal.SIGKILL)} "
            f"wall_ns={now + (0 if r == '2' else 1000 + int(r))}" for r, p in launcher.items()]
    _exits(tmp_path, {"n1": rows})
    # n2 marks itself done a moment after the leader starts waiting (its sleep is a duration: the leader must
    # wait for it, at least a second).
    marker = subprocess.Popen([sys.executable, "-c", "import time, pathlib; time.sleep(1.5); "
                               f"pathlib.Path({str(tmp_path / '.agents' / 'epilog' / 'n2')!r}).write_text('x')"])
    done = finish_job(str(tmp_path), str(tmp_path / ".agents"), "n1", ["n1", "n2"], wait_s=20)
    marker.wait()
    assert done.missing_nodes == [] and 1.0 <= done.waited_s < 20
    assert "step-0" in done.analysed and "rank 2" in done.analysed["step-0"], done.analysed
    top = json.loads((step / "findings.json").read_text())["findings"][0]
    assert top["kind"] == "crashed-process" and top["subject"]["rank"] == 2, top
    assert (step / "report.html").exists()
    assert os.path.exists(step / "procs.json")
