"""Analysis of real demo runs (gloo ranks with injected faults): the top finding names the injected rank.

Only these tests read ``fault.json`` (the ground truth); the analyzer never does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity

pytest.importorskip("torch")

from megatrace.demo.launcher import DemoOptions, run_local  # noqa: E402

# A compute hang in each phase on the first, a middle and the last pipeline stage of TP2 x PP3
# (order tp-dp-pp: stage 0 holds ranks 0-1, stage 1 ranks 2-3, stage 2 ranks 4-5).
STAGE_RANK = {"first": 1, "middle": 3, "last": 4}
CASES = {
    # fault spec, (tp, pp, dp), expected kind
    **{f"hang-{phase}-{stage}-stage": (f"hang:rank={rank},step=2,phase={phase}", (2, 3, 1), Kind.COMPUTE_HANG)
       for phase in ("forward", "backward", "optimizer") for stage, rank in STAGE_RANK.items()},
    "commhang": ("commhang:rank=1,step=2", (2, 2, 1), Kind.COMM_HANG),
    "crash": ("crash:rank=2,step=2", (2, 2, 1), Kind.CRASHED_PROCESS),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_top_finding_names_the_injected_rank_and_class(tmp_path: Path, case: str) -> None:
    spec, (tp, pp, dp), kind = CASES[case]
    out = tmp_path / case
    run_local(DemoOptions(tp=tp, pp=pp, dp=dp, steps=4, faults=(spec,), out=out, stall_s=4.0, crash_grace_s=2.0),
              log=lambda msg: None)
    (fault,) = json.loads((out / "fault.json").read_text())["faults"]
    result = analyze(out)
    top = result.findings[0]
    assert top.kind == kind, top.verdict
    assert top.severity == Severity.CRITICAL, top.verdict
    if kind == Kind.COMM_HANG:
        assert fault["rank"] in top.subject.ranks and top.subject.group["desc"] == "tp", top.verdict
    else:
        assert top.subject.rank == fault["rank"], top.verdict
    assert sum(f.severity == Severity.CRITICAL for f in result.findings) == 1, [f.verdict for f in result.findings]
