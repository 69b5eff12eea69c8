"""The report of a 16,384-rank hang: under 5 MB, opens in under 2 s in headless Chromium, culprit visible.

The trace is synthetic (bench/synth_trace.py writes real ring files with numpy: TP8 x PP8 x DP256, one rank
stopped in the last step), analysed in full. Measured numbers go to test-artifacts/report/scale.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from helpers.browser import ARTIFACTS, check_page  # the `browser` fixture: tests/conftest.py

from megatrace.analyze.engine import analyze
from megatrace.report.render import write_report

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from synth_trace import generate  # noqa: E402

RANKS, TP, PP, HUNG = 16_384, 8, 8, 1234
MAX_BYTES = 5 * 1024 * 1024
MAX_OPEN_S = 2.0


@pytest.mark.slow
def test_a_16k_rank_report_is_small_and_opens_fast_with_the_culprit_named(tmp_path: Path, browser) -> None:
    root = tmp_path / "16k"
    t = time.perf_counter()
    generate(root, RANKS, TP, PP, records=60, microbatches=4, hung=HUNG)
    t_gen = time.perf_counter() - t
    t = time.perf_counter()
    result = analyze(root)
    t_analyze = time.perf_counter() - t
    result.write_json(root / "findings.json")
    t = time.perf_counter()
    html, trace = write_report(root / "findings.json")
    t_render = time.perf_counter() - t
    size = html.stat().st_size
    assert result.findings[0].subject.rank == HUNG
    facts = check_page(browser, html, ARTIFACTS / "scale-16384.png")
    measured = {"ranks": RANKS, "report_bytes": size, "open_s": round(facts["seconds"], 3),
                "findings_bytes": (root / "findings.json").stat().st_size,
                "trace_json_bytes": trace.stat().st_size if trace else None, "generate_s": round(t_gen, 1),
                "analyze_s": round(t_analyze, 1), "render_s": round(t_render, 2)}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "scale.json").write_text(json.dumps(measured, indent=1) + "\n")
    assert size < MAX_BYTES, measured
    assert facts["seconds"] < MAX_OPEN_S, measured
    assert f"rank {HUNG} " in facts["verdict"]
    assert facts["verdict"].startswith("HANG")
