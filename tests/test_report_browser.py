"""Every report of the demo fault matrix, opened in headless Chromium over the DevTools protocol.

Per scenario (healthy, hang, commhang, slow, crash, slowlink on an 8-rank TP2 x PP2 x DP2 demo): no console
error or exception, no request leaves the file (the network is also switched off), the verdict is
visible in the first screen, the script ran; a screenshot of each is kept in test-artifacts/report/.

Chromium is Debian's ``chromium`` package (``.ci/run`` installs it). Without it these tests fail under CI
(``CI`` set) and skip on a developer machine. The browser and the page check are in tests/helpers/browser.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.analysis_factory import TraceBuilder
from helpers.browser import ARTIFACTS, check_page  # the `browser` fixture: tests/conftest.py

from megatrace.analyze.engine import analyze
from megatrace.report.model import HANG_KINDS, HEADLINES
from megatrace.report.render import write_report

DEMO_MATRIX = {  # scenario -> fault spec (None: healthy), on TP2 x PP2 x DP2
    "healthy": None,
    "hang": "hang:rank=5,step=3",
    "commhang": "commhang:rank=3,step=3",
    "slow": "slow:rank=6,factor=3,from_step=2",
    "crash": "crash:rank=2,step=3",
    "slowlink": "slowlink:ranks=1-5,delay_ms=30",
}


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    return tmp_path_factory.mktemp("demo-matrix")


def demo_report(root: Path, name: str) -> Path:
    """One short demo run of the scenario, analysed, its report written beside findings.json."""
    from megatrace.demo.launcher import DemoOptions, run_local, summary_lines

    spec = DEMO_MATRIX[name]
    d = root / name
    run = run_local(DemoOptions(tp=2, pp=2, dp=2, steps=6, faults=(spec,) if spec else (), out=d, stall_s=3.0,
                                crash_grace_s=2.0, deadline_s=150.0), log=lambda msg: None)
    assert list((d / "rings").glob("rank-*.ring")), f"the demo wrote no trace: {summary_lines(run)}"
    analyze(d).write_json(d / "findings.json")
    write_report(d / "findings.json")
    return d


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(DEMO_MATRIX))
def test_each_demo_report_opens_cleanly_with_the_verdict_visible(demo_root, browser, scenario) -> None:
    d = demo_report(demo_root, scenario)
    doc = json.loads((d / "findings.json").read_text())
    facts = check_page(browser, d / "report.html", ARTIFACTS / f"demo-{scenario}.png")
    assert doc["findings"][0]["verdict"] in facts["verdict"] or scenario == "healthy", facts["verdict"]
    # The report shows what the analysis concluded (whether that names the injected fault is the analysis'
    # tests' business: tests/test_analyze_demo.py); here: the right headline, culprit and sections.
    top = doc["findings"][0]
    assert facts["tooltips"] > 0 and (d / "trace.json").exists()
    assert facts["heat"][0] > 10, "the rank grid was drawn"
    if top["severity"] == "info":
        assert facts["verdict"].startswith("HEALTHY — ")
        assert "critical-path" in facts["sections"]  # the step-time breakdown, not an empty page
        assert "wait-for" not in facts["sections"] and "culprits" not in facts["sections"]
    else:
        assert facts["verdict"] == f"{HEADLINES[top['kind']]} — {top['verdict']}"
        assert "culprits" in facts["sections"]
        rank = top["subject"].get("rank", (top["subject"].get("ranks") or [None])[0])
        assert facts["first_culprit"] == str(rank), (facts["first_culprit"], top["subject"])
    if top["kind"] in HANG_KINDS:
        assert "wait-for" in facts["sections"] and "timeline" in facts["sections"]
    if scenario == "slowlink" and top["kind"] == "slow-link":
        assert "delay-matrix" in facts["sections"] and facts["delay"][0] > 10
    if scenario == "healthy":
        assert not json.loads((d / "fault.json").read_text())["faults"]
    browser.screenshot(ARTIFACTS / f"demo-{scenario}-full.png", full_page=True)


HOSTILE_HOST = "<script>alert(1)</script>"
HOSTILE_GROUP = "tp\"'><img src=x onerror=\"window.__pwned=1\">&amp;"
HOSTILE_ARGV = ["python", "train.py", "--name", "a\"b'c & <b>bold</b>", "</script><script>window.__pwned=2</script>"]


def hostile_trace(tmp: Path) -> Path:
    """A real (factory-written) hung trace whose host names, group names and command line are hostile."""
    b = TraceBuilder(world=4, hosts={0: HOSTILE_HOST, 1: HOSTILE_HOST, 2: "n&2", 3: "n\"3"})
    tp = b.group("tp", HOSTILE_GROUP, [0, 1], name=HOSTILE_GROUP)
    tp2 = b.group("tp", "tp", [2, 3])
    b.healthy_steps([tp, tp2], steps=4)
    b.collective(tp, at=100.0, skip=(1,), stuck=(0,))
    b.collective(tp2, at=100.0, stuck_all=False)
    root = b.write(tmp / "hostile")
    meta = root / "rings" / "rank-00000.meta.jsonl"
    lines = meta.read_text().splitlines()
    lines.insert(0, json.dumps({"kind": "process", "rank": 0, "world_size": 4, "host": HOSTILE_HOST,
                                "argv": HOSTILE_ARGV, "torch": "<i>2</i>", "backend": "gloo"}))
    lines.insert(1, json.dumps({"kind": "env", "vars": {"NCCL_DEBUG": "<script>x()</script>", "SLURM_JOB_ID": "7&8"}}))
    meta.write_text("\n".join(lines) + "\n")
    return root


def test_hostile_strings_are_text_in_the_browser(browser, tmp_path) -> None:
    root = hostile_trace(tmp_path)
    result = analyze(root)
    result.write_json(root / "findings.json")
    html, _ = write_report(root / "findings.json")
    check_page(browser, html, ARTIFACTS / "hostile.png")
    got = browser.evaluate("""(() => ({
        pwned: window.__pwned === undefined ? null : window.__pwned,
        scripts: Array.from(document.scripts).map(s => s.type || 'js'),
        imgs: document.images.length, bolds: document.querySelectorAll('main b').length,
        italics: document.querySelectorAll('i').length - document.querySelectorAll('.legend i, .bar i').length,
        text: document.body.innerText, all: document.body.textContent}))()""")
    assert got["pwned"] is None
    assert got["scripts"] == ["application/json", "application/json", "js"]
    assert got["imgs"] == 0 and got["bolds"] == 0 and got["italics"] == 0
    assert HOSTILE_HOST in got["text"]  # shown as text, e.g. in the verdict and the culprit table
    assert "a\"b'c & <b>bold</b>" in got["text"]
    assert "NCCL_DEBUG" in got["all"] and "<script>x()</script>" in got["all"]  # in the folded settings table


def test_the_browser_check_catches_console_errors_exceptions_and_requests(browser, tmp_path) -> None:
    """The harness itself: a page that logs an error, throws and fetches must fail ``check_page``."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><h1 id='verdict-text'>x</h1>"
                   "<img src='http://192.0.2.1/pixel.png'><script>console.error('boom'); null.x;</script>"
                   "</body></html>")
    browser.open(bad)
    problems = browser.problems(bad.resolve().as_uri())
    assert any(p.startswith("console.error") and "boom" in p for p in problems), problems
    assert any(p.startswith("exception") for p in problems), problems
    assert any(p.startswith("request: http://192.0.2.1/") for p in problems), problems
    with pytest.raises(AssertionError):
        check_page(browser, bad, tmp_path / "bad.png")
