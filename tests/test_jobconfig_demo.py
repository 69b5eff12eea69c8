"""Group inference and layout-free analysis on real demo runs (gloo ranks), in two rank orders.

Five short 8-rank runs, one per distinct group structure (TP4·PP2·DP1 is the same in every order);
the first carries an injected hang. Only this file reads the demos' layout.yaml and fault.json
(the ground truth); analysis runs after layout.yaml is removed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.config import Layout, load_layout
from megatrace.analyze.jobconfig import load_job_yaml
from megatrace.analyze.jobconfig.build import group_uses
from megatrace.analyze.jobconfig.groups import infer_from_groups
from megatrace.load import load_trace

pytest.importorskip("torch")

from megatrace.demo.launcher import DemoOptions, run_local  # noqa: E402

HANG = "hang:rank=5,step=1"
RUNS = {  # name: (tp, pp, dp, order, faults)
    "tp2pp2dp2-megatron-hang": (2, 2, 2, "tp-dp-pp", (HANG,)),
    "tp2pp2dp2-tp-pp-dp": (2, 2, 2, "tp-pp-dp", ()),
    "tp4pp2dp1": (4, 2, 1, "tp-dp-pp", ()),
    "tp1pp4dp2-megatron": (1, 4, 2, "tp-dp-pp", ()),
    "tp1pp4dp2-tp-pp-dp": (1, 4, 2, "tp-pp-dp", ()),
}


@dataclasses.dataclass
class Run:
    out: Path
    truth: Layout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    out = {}
    for name, (tp, pp, dp, order, faults) in RUNS.items():
        d = tmp_path_factory.mktemp(name)
        # a generous stall timeout: on a loaded machine a slow (not hung) rank must not look hung
        run_local(DemoOptions(tp=tp, pp=pp, dp=dp, order=order, steps=2 if faults else 1, faults=faults, out=d,
                              stall_s=6.0, crash_grace_s=2.0), log=lambda msg: None)
        truth = load_layout(d / "layout.yaml")
        (d / "layout.yaml").unlink()
        out[name] = Run(d, truth)
    return out


def same_groups(a: Layout, b: Layout) -> bool:
    return all(getattr(a, f"{k}_groups")() == getattr(b, f"{k}_groups")() for k in ("tp", "pp", "dp"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
@pytest.mark.parametrize("descriptions", [True, False], ids=["with-group-desc", "groups-and-traffic-only"])
def test_group_inference_recovers_the_demo_layout(runs: dict[str, Run], name: str, descriptions: bool) -> None:
    run = runs[name]
    trace = load_trace(run.out)
    assert trace.layout is None  # layout.yaml is gone
    uses = group_uses(trace)
    if not descriptions:
        uses = [dataclasses.replace(u, desc="") for u in uses]
    got = infer_from_groups(uses, trace.world_size).layout_sizes()
    assert got is not None, name
    sizes, order = got
    inferred = Layout(trace.world_size, sizes["tp"], sizes["pp"], sizes["dp"], order=order)
    t = run.truth
    assert (inferred.tp, inferred.pp, inferred.dp) == (t.tp, t.pp, t.dp)
    assert same_groups(inferred, t), (order, t.order)


@pytest.mark.slow
def test_analysis_without_the_layout_file_names_the_injected_culprit(runs: dict[str, Run]) -> None:
    run = runs["tp2pp2dp2-megatron-hang"]
    (fault,) = json.loads((run.out / "fault.json").read_text())["faults"]
    result = analyze(run.out)
    top = result.findings[0]
    assert top.kind == Kind.COMPUTE_HANG and top.severity == Severity.CRITICAL, top.verdict
    assert top.subject.rank == fault["rank"], top.verdict
    assert top.subject.coords == dict(run.truth.coords(fault["rank"])._asdict()), top.verdict
    assert same_groups(result.trace.layout, run.truth)
    doc = load_job_yaml(run.out / "job.yaml")
    assert {n: doc["parallel"][n]["value"] for n in ("tp", "pp", "dp", "order")} == \
        {"tp": 2, "pp": 2, "dp": 2, "order": "tp-dp-pp"}
    assert doc["parallel"]["tp"]["source"].startswith("groups: ")
    assert len(doc["ranks"]) == 8 and doc["ranks"][5]["local_rank"] == 5
    assert not [f for f in result.findings if f.kind == Kind.CONFIG and f.severity != Severity.INFO]
