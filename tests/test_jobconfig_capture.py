"""The tracer's capture at init: the trainer's argv, its config files and library versions, on real gloo ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatrace.analyze.engine import analyze
from megatrace.analyze.jobconfig import load_job_yaml
from megatrace.trace.ring_reader import read_meta

pytest.importorskip("torch")

SCENARIOS = Path(__file__).with_name("torch_scenarios.py")
ARGS = ["--tensor-model-parallel-size", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--deepspeed_config", "ds.json", "--job.config_file", "missing.toml"]


def test_the_tracer_records_argv_config_files_and_versions_and_the_job_goes_on(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
                                                  "zero_optimization": {"stage": 2}}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), MEGATRACE_ENABLE="1", MEGATRACE_DIR=str(tmp_path / "rings"),
                   MEGATRACE_JOB_ID="capture", SCENARIO_OUT=str(tmp_path), SCENARIO_OPS="3", OMP_NUM_THREADS="1",
                   NCCL_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
        procs.append(subprocess.Popen([sys.executable, str(SCENARIOS), "many_ops", *ARGS], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    entries, problems = read_meta(tmp_path / "rings" / "rank-00001.meta.jsonl")
    assert not problems
    process = next(e for e in entries if e["kind"] == "process")
    assert process["torch"] and process["argv"][-len(ARGS):] == ARGS
    inputs = next(e for e in entries if e["kind"] == "job_inputs")
    assert inputs["argv"][-len(ARGS):] == ARGS and inputs["cwd"] == str(tmp_path)
    ds, toml = inputs["files"]
    assert ds["path"] == "ds.json" and json.loads(ds["text"])["zero_optimization"]["stage"] == 2
    assert toml == {"path": "missing.toml", "error": "No such file or directory"}

    result = analyze(tmp_path)
    doc = load_job_yaml(tmp_path / "job.yaml")
    assert doc["parallel"]["tp"] == {"value": 2, "source": "arguments: Megatron-LM --tensor-model-parallel-size"}
    assert doc["parallel"]["dp"]["value"] == 1  # 2 ranks / TP 2
    assert doc["features"]["zero_stage"]["value"] == 2
    assert doc["environment"]["nccl"] == {"NCCL_SOCKET_IFNAME": "lo"}
    assert doc["environment"]["versions"]["torch"] == process["torch"]
    codes = {i["code"] for i in doc["issues"]}
    assert "unparseable-config" in codes  # missing.toml: named, not fatal
    assert "batch" in codes  # global 8 != micro 1 x accumulation 4 x DP 1
    assert result.verdict is not None


def test_library_versions_read_nccl_and_driver_formats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatrace.trace import environment

    assert environment._nccl_version((2, 21, 5)) == "2.21.5"
    assert environment._nccl_version(21805) == "2.18.5"  # torch < 1.13 returned an int
    assert environment._nccl_version(2708) == "2.7.8"
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
                    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    monkeypatch.setattr(environment, "NVIDIA_DRIVER_FILE", str(proc))
    assert environment._driver_version() == "550.54.15"
    proc.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  560.35.03  Release Build\n")
    assert environment._driver_version() == "560.35.03"
    monkeypatch.setattr(environment, "NVIDIA_DRIVER_FILE", str(tmp_path / "absent"))
    import torch

    got = environment.library_versions(torch)
    assert got["torch"] == torch.__version__ and "driver" not in got
