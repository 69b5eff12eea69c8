"""Fault specs of the demo, its rendezvous environment, and the fault injector's Python-level logic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatrace.config import Layout
from megatrace.demo.env import EnvError, first_host, resolve_env
from megatrace.demo.faults import (CommHangFault, CrashFault, FaultError, HangFault, SlowFault, SlowLinkFault,
                                   fault_to_dict, format_fault, parse_fault, validate_faults, write_fault_json)
from megatrace.demo.inject import FaultInjector

LAYOUT = Layout(world_size=8, tp=2, pp=2, dp=2)


@pytest.mark.parametrize("spec, fault", [
    ("hang:rank=5,step=3", HangFault(5, 3)),
    ("hang:rank=5,step=3,phase=backward", HangFault(5, 3, "backward")),
    ("commhang:rank=1,step=0", CommHangFault(1, 0)),
    ("slow:rank=2,factor=1.5", SlowFault(2, 1.5)),
    (" slow:rank=2, factor=2, from_step=4 ", SlowFault(2, 2.0, 4)),
    ("crash:rank=3,step=4", CrashFault(3, 4)),
    ("slowlink:ranks=1-5,delay_ms=50", SlowLinkFault((1, 5), 50.0)),
])
def test_parse_and_format_round_trip(spec: str, fault: object) -> None:
    assert parse_fault(spec) == fault
    assert parse_fault(format_fault(fault)) == fault


@pytest.mark.parametrize("spec, message", [
    ("freeze:rank=1,step=2", "unknown fault kind 'freeze'"),
    ("hang", "missing rank, step"),
    ("hang:rank=1", "missing step"),
    ("hang:rank=x,step=2", "rank must be an integer, got 'x'"),
    ("hang:rank=1,step=-2", "step must not be negative"),
    ("hang:rank=1,step=2,phase=loss", "phase must be one of forward, backward, optimizer"),
    ("hang:rank=1,step=2,factor=2", "unknown key 'factor' for hang"),
    ("hang:rank=1,rank=2,step=2", "key 'rank' given twice"),
    ("hang:rank=1,step", "expected key=value, got 'step'"),
    ("slow:rank=1,factor=fast", "factor must be a number"),
    ("slow:rank=1,factor=0", "factor must be a positive number"),
    ("slowlink:ranks=1,delay_ms=5", "ranks must look like A-B"),
    ("slowlink:ranks=1-5,delay_ms=nan", "delay_ms must be a positive number"),
])
def test_parse_errors_name_the_field(spec: str, message: str) -> None:
    with pytest.raises(FaultError, match=message) as info:
        parse_fault(spec)
    assert str(info.value).startswith(f"--fault {spec}:")


@pytest.mark.parametrize("spec, message", [
    ("hang:rank=9,step=3", "rank 9 is outside the world of 8 ranks"),
    ("crash:rank=1,step=20", "step 20 is not below --steps 20"),
    ("slow:rank=1,factor=2,from_step=25", "from_step 25 is not below"),
    ("slow:rank=1,factor=0.5", "factor must be at least 1"),
    ("slowlink:ranks=1-9,delay_ms=5", "rank 9 is outside"),
    ("slowlink:ranks=0-1,delay_ms=5", "not adjacent stages"),  # TP neighbours
    ("slowlink:ranks=0-6,delay_ms=5", "not adjacent stages"),  # next stage, other DP replica
    ("slowlink:ranks=4-4,delay_ms=5", "two different ranks"),
])
def test_validate_against_layout(spec: str, message: str) -> None:
    with pytest.raises(FaultError, match=message):
        validate_faults([parse_fault(spec)], LAYOUT, steps=20)


def test_valid_faults_and_ground_truth_file(tmp_path: Path) -> None:
    faults = [parse_fault(s) for s in ("hang:rank=5,step=3", "slowlink:ranks=0-4,delay_ms=20")]
    validate_faults(faults, LAYOUT, steps=20)
    write_fault_json(tmp_path / "fault.json", faults)
    data = json.loads((tmp_path / "fault.json").read_text())
    assert data["faults"][0] == {"kind": "hang", "rank": 5, "step": 3, "phase": "forward",
                                 "spec": "hang:rank=5,step=3,phase=forward"}
    assert data["faults"][1] == fault_to_dict(faults[1]) and data["faults"][1]["ranks"] == [0, 4]


def test_injector_selects_its_rank_and_tracks_slowdown() -> None:
    faults = [SlowFault(2, 2.0, from_step=3), SlowFault(2, 1.5), HangFault(5, 1), SlowLinkFault((2, 6), 5.0)]
    injector = FaultInjector(faults, rank=2, layout=LAYOUT)
    assert injector.faults == [faults[0], faults[1], faults[3]]
    injector.start_step(0)
    assert injector.slowdown() == 1.5
    injector.start_step(3)
    assert injector.slowdown() == 3.0


def test_hang_arms_at_its_phase_and_stays_armed() -> None:
    injector = FaultInjector([HangFault(1, 2, "backward")], rank=1, layout=LAYOUT)
    injector.start_step(2)
    injector.set_phase("forward")
    injector.before_comm()  # not yet: returns
    injector.set_phase("backward")
    assert injector._hang_armed is not None
    injector.set_phase("forward")  # 1F1B goes back to a forward: still armed
    assert injector._hang_armed is not None


def test_first_host() -> None:
    assert first_host("n[1-4]") == "n1"
    assert first_host("n1,n2") == "n1"
    assert first_host("gpu[07,09-12],cpu1") == "gpu07"
    assert first_host("rack1-[3-5]-ib") == "rack1-3-ib"
    assert first_host("solo") == "solo"


def test_resolve_env() -> None:
    env = resolve_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 8, 1, "127.0.0.1", 29500)
    assert not env.under_slurm
    slurm = resolve_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                         "SLURM_NODELIST": "n[2-4]", "SLURM_JOB_ID": "123457"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.master_addr, slurm.master_port) == \
        (5, 8, 1, "n2", 20000 + 123457 % 20000)
    assert slurm.under_slurm
    explicit = resolve_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "10.0.0.1",
                            "MASTER_PORT": "1234", "SLURM_NODELIST": "n1"})
    assert (explicit.master_addr, explicit.master_port) == ("10.0.0.1", 1234)
    for bad, message in (({}, "no RANK"), ({"RANK": "0"}, "WORLD_SIZE"), ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
                         ({"RANK": "4", "WORLD_SIZE": "2"}, "outside")):
        with pytest.raises(EnvError, match=message):
            resolve_env(bad)
