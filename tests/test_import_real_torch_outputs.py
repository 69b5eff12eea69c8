"""What a real PyTorch NCCL job printed and dumped when its watchdog timed a collective out.

Recorded on an H200 (torch 2.11.0+cu130, NCCL 2.28.9) by tests/test_gpu_nccl.py's watchdog test with
MEGATRACE_GPU_KEEP set, file paths rewritten: the job's output (the watchdog's own lines, including
2.11's "failure detected by watchdog at work sequence id: 4 PG status: last enqueued work: 4, last
completed work: 3") and the Flight Recorder dump (format 2.10). One rank; its fourth all-reduce was
enqueued behind two minutes of GPU work and timed out after 10 s. The importers, written from the
format strings of the PyTorch sources, must read the real thing on a machine without a GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data" / "real"


@pytest.mark.parametrize("name, fmt", [("torch-2.11-nccl-watchdog-timeout.log", "job-log"),
                                       ("torch-2.11-flight-recorder", "flight-recorder")])
def test_the_timed_out_all_reduce_is_named(tmp_path: Path, name: str, fmt: str) -> None:
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "megatrace.cli", "analyze", str(DATA / name), "-o", str(out),
                          "--no-report"], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in run.stderr, run.stderr
    doc = json.loads((out / "findings.json").read_text())
    assert doc["trace"]["job_id"] == fmt and doc["trace"]["ranks_loaded"] == 1, doc["trace"]
    first = doc["findings"][0]
    assert (first["severity"], first["kind"]) == ("critical", "comm-hang"), first
    assert first["subject"]["group"]["ranks"] == [0], first["subject"]
    assert "all_reduce #4" in first["verdict"], first["verdict"]
    problems = [f for f in doc["findings"] if f["kind"] == "trace-problem" and f["severity"] != "info"]
    assert not problems, problems
