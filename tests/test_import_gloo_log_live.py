"""A real gloo job under torchrun (torch, 4 processes), its rank 1 stopped from outside until the others time out:
the log today's torch and torchrun print still names rank 1. tests/test_import_gloo_log.py reads checked-in logs of
the same job, this fault and three others, without torch."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # a real multi-process torch run

from helpers.torch_runs import stop_rank_1  # noqa: E402
from helpers.torchrun_job import torchrun_job  # noqa: E402

from megatrace.analyze.engine import analyze  # noqa: E402
from megatrace.analyze.findings import Kind, Severity  # noqa: E402


def test_the_rank_the_others_failed_waiting_for_is_named_live(tmp_path: Path) -> None:
    log = torchrun_job(tmp_path, stop_rank_1)
    assert "Timed out waiting" in log.read_text()
    top = analyze(log).findings[0]
    assert top.subject.rank == 1 and top.severity == Severity.CRITICAL, top.verdict
    assert top.kind == Kind.NO_TRACE and "3 ranks wait for it" in top.verdict, top.verdict
    assert "printed nothing" in top.remediation
