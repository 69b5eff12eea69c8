"""The post-mortem report from findings.json: the analysis export, the page's content, escaping, the CLI.

Traces come from the analysis factory (real ring files, no torch); the browser checks are in
test_report_browser.py, the 16,384-rank size and open time in test_report_scale.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
from helpers.analysis_factory import TraceBuilder
from click.testing import CliRunner

from megatrace.analyze.engine import analyze
from megatrace.cli import main
from megatrace.config import ORDERS, Layout
from megatrace.report import perfetto
from megatrace.report.model import ReportError, build, rank_coords
from megatrace.report.render import render, write_report
from megatrace.report.timeline import MAX_RANK_LANES


class Page(HTMLParser):
    """Every start tag with its attributes, the text, and the inline scripts of a page."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.scripts: list[tuple[dict, str]] = []
        self._in_script: dict | None = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "script":
            self._in_script = dict(attrs)

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = None

    def handle_data(self, data):
        if self._in_script is not None:
            self.scripts.append((self._in_script, data))
        else:
            self.text.append(data)

    def all_text(self) -> str:
        return "".join(self.text)

    def ids(self) -> set[str]:
        return {a["id"] for _, a in self.tags if "id" in a}


def hung_trace(tmp: Path) -> Path:
    """8 ranks TP2 x PP2 x DP2 (tp-dp-pp): rank 5 never enters a TP all_reduce; 4, 6 and 7 wait for it."""
    b = TraceBuilder(world=8, hosts={r: f"n{r // 4 + 1}" for r in range(8)})
    layout = Layout(world_size=8, tp=2, pp=2, dp=2)
    tps = [b.group("tp", g) for g in layout.tp_groups()]
    dps = [b.group("dp", g) for g in layout.dp_groups()]
    b.healthy_steps(tps + dps, steps=5)
    for g in tps:
        if 5 in g.ranks:
            b.collective(g, at=200.0, skip=(5,), stuck=(4,))
        else:
            b.collective(g, at=200.0)
    for g in dps:  # rank 6 waits in DP for rank 4 (itself waiting for 5), rank 7 in DP for rank 5
        if 4 in g.ranks or 5 in g.ranks:
            b.collective(g, at=205.0, skip=tuple(r for r in g.ranks if r in (4, 5)),
                         stuck=tuple(r for r in g.ranks if r not in (4, 5)))
        else:
            b.collective(g, at=205.0)
    return b.write(tmp / "hung", layout=layout)


def healthy_trace(tmp: Path) -> Path:
    b = TraceBuilder(world=4)
    b.healthy_steps([b.group("tp", [0, 1]), b.group("tp", [2, 3]), b.group("dp", [0, 2]), b.group("dp", [1, 3])],
                    steps=6)
    return b.write(tmp / "ok", closed=True)


@pytest.fixture(scope="module")
def hung(tmp_path_factory) -> tuple[Path, dict]:
    root = hung_trace(tmp_path_factory.mktemp("hung"))
    result = analyze(root)
    result.write_json(root / "findings.json")
    return root, json.loads((root / "findings.json").read_text())


def test_the_analysis_exports_ranks_wait_graph_and_timeline_for_the_report(hung) -> None:
    _, doc = hung
    top = doc["findings"][0]
    assert top["kind"] == "compute-hang" and top["subject"]["rank"] == 5
    rep = doc["analysis"]["report"]
    assert rep["version"] == 1
    assert len(rep["ranks"]["host"]) == 8 and rep["ranks"]["hosts"][rep["ranks"]["host"][5]] == "n2"
    assert rep["ranks"]["statuses"][rep["ranks"]["status"][5]] == "stopped"
    assert rep["ranks"]["statuses"][rep["ranks"]["status"][4]] == "blocked"
    roots = [n for n in rep["wait_for"]["nodes"] if n["root"]]
    assert [n["id"] for n in roots] == ["r5"]
    assert any(e["dst"] == "r5" for e in rep["wait_for"]["edges"])  # someone waits for the culprit
    tl = rep["timeline"]
    cols = ("rank", "group", "op", "seq", "peer", "bytes", "start_us", "dur_us", "state")
    assert len({len(tl[c]) for c in cols}) == 1 and set(tl["rank"]) == set(range(8))
    stuck4 = [i for i, r in enumerate(tl["rank"]) if r == 4 and tl["dur_us"][i] < 0]
    assert stuck4, "rank 4's TP all_reduce never completed: duration -1"
    assert tl["incident_us"] is not None and 0 < tl["incident_us"] <= tl["end_us"]
    assert tl["groups"][tl["group"][stuck4[0]]]["kind"] == "tp"


def test_a_hang_report_leads_with_the_verdict_and_draws_chain_timeline_and_grid(hung) -> None:
    _, doc = hung
    page = Page(render(doc, trace_json="trace.json"))
    text = page.all_text()
    banner = next(a for t, a in page.tags if a.get("id") == "verdict")
    assert "critical" in banner["class"].split()
    assert re.search(r"HANG — rank 5 \(host n2, GPU 5, pp=1 dp=0 tp=1\) stopped outside communication", text)
    assert "Confidence:" in text and "What to do:" in text and "Incident:" in text
    assert {"culprits", "wait-for", "timeline", "critical-path", "rank-grid", "findings", "job", "command"} <= page.ids()
    root_groups = [a for t, a in page.tags if t == "g" and "root" in a.get("class", "").split()]
    assert len(root_groups) == 1
    lanes = [a for t, a in page.tags if t == "rect" and "lane-bg" in a.get("class", "")]
    assert len(lanes) == 8  # one lane per rank up to 64 ranks
    stuck = [a for t, a in page.tags if t == "rect" and a.get("class") == "stuck"]
    assert stuck, "operations that never completed are drawn"
    assert ("a", {"href": "trace.json", "id": "trace-link"}) in page.tags
    culprit_row = text[text.index("Culprits"):text.index("Wait-for chain")]
    assert "n2" in culprit_row and "PP 1 TP 1 DP 0" in culprit_row
    assert "megatrace analyze" in text


def test_the_content_security_policy_allows_exactly_the_inline_script(hung) -> None:
    _, doc = hung
    html = render(doc)
    page = Page(html)
    csp = next(a["content"] for t, a in page.tags if a.get("http-equiv") == "Content-Security-Policy")
    assert "default-src 'none'" in csp
    code = [s for a, s in page.scripts if "type" not in a]
    assert len(code) == 1
    digest = base64.b64encode(hashlib.sha256(code[0].encode()).digest()).decode()
    assert f"'sha256-{digest}'" in csp
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", html)  # nothing to fetch


def test_a_healthy_report_is_short_and_reassuring_with_the_step_time(tmp_path: Path) -> None:
    root = healthy_trace(tmp_path)
    analyze(root).write_json(root / "findings.json")
    html, _ = write_report(root / "findings.json")
    page = Page(html.read_text())
    text = page.all_text()
    assert "HEALTHY — " in text and "No rank stopped" in text
    banner = next(a for t, a in page.tags if a.get("id") == "verdict")
    assert "info" in banner["class"].split()
    assert "wait-for" not in page.ids() and "culprits" not in page.ids()
    assert "critical-path" in page.ids() and "step time" in text


def test_the_report_renders_from_findings_json_alone(hung, tmp_path: Path) -> None:
    root, doc = hung
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(root / "findings.json", alone / "findings.json")  # no rings, no layout beside it
    html, trace = write_report(alone / "findings.json")
    assert html == alone / "report.html" and trace == alone / "trace.json"
    assert html.read_text() == render(doc, trace_json="trace.json")


def test_the_perfetto_export_has_one_event_per_operation_and_names_the_stuck_ones(hung) -> None:
    _, doc = hung
    trace = json.loads(perfetto.dumps(perfetto.trace_events(doc)))
    tl = doc["analysis"]["report"]["timeline"]
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(ops) == len(tl["rank"])
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in ops)
    stuck = [e for e in ops if e["name"].endswith("(never completed)")]
    assert {e["tid"] for e in stuck} >= {4}
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert threads[5] == "rank 5"
    procs = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert procs == {"n1", "n2"}


def test_beyond_64_ranks_the_timeline_aggregates_by_group_and_expands_the_culprits(tmp_path: Path) -> None:
    world = 96
    b = TraceBuilder(world=world, hosts={r: f"node{r // 8}" for r in range(world)})
    tps = [b.group("tp", list(range(k, k + 8))) for k in range(0, world, 8)]
    b.healthy_steps(tps, steps=3)
    for g in tps:
        b.collective(g, at=100.0, skip=(37,), stuck=tuple(r for r in g.ranks if r != 37)) if 37 in g.ranks \
            else b.collective(g, at=100.0)
    root = b.write(tmp_path / "wide")
    analyze(root).write_json(root / "findings.json")
    doc = json.loads((root / "findings.json").read_text())
    assert doc["findings"][0]["subject"]["rank"] == 37
    model = build(doc)
    tl = model.timeline
    assert world > MAX_RANK_LANES and tl["aggregated"]
    labels = [lane["label"] for lane in tl["lanes"]]
    assert labels[0].startswith("all TP (96 ranks)")
    rank_lanes = [lb for lb in labels if lb.startswith("rank ")]
    assert rank_lanes[0].startswith("rank 37 ")  # the culprit first, then its TP group's members
    assert {int(lb.split()[1]) for lb in rank_lanes} == set(range(32, 40))
    assert any(lane["culprit"] for lane in tl["lanes"])


HOSTILE = "<script>alert(1)</script>"
HOSTILE_GROUP = "dp\"'><img src=x onerror=alert(2)>"
HOSTILE_CMD = "python train.py --tag \"a&b\" '<c>' && rm -rf / </pre><script>alert(3)</script>"


def test_hostile_strings_from_traces_hosts_and_command_lines_are_escaped(hung) -> None:
    _, doc = hung
    doc = json.loads(json.dumps(doc))
    top = doc["findings"][0]
    top["verdict"] += " " + HOSTILE
    top["evidence"].append(HOSTILE_GROUP)
    top["remediation"] = HOSTILE_CMD
    top["subject"]["host"] = HOSTILE
    rep = doc["analysis"]["report"]
    rep["ranks"]["hosts"] = [HOSTILE for _ in rep["ranks"]["hosts"]]
    rep["timeline"]["groups"][0]["label"] = HOSTILE_GROUP
    rep["timeline"]["groups"][0]["kind"] = HOSTILE_GROUP
    rep["wait_for"]["nodes"][0]["label"] = HOSTILE
    rep["job"] = {"argv": HOSTILE_CMD.split(" "), "torch": HOSTILE, "env": {"NCCL_SOCKET_IFNAME": HOSTILE_GROUP}}
    rep["command"] = HOSTILE_CMD
    doc["trace"]["hosts"] = [HOSTILE]
    doc["trace"]["job_id"] = HOSTILE_GROUP
    html = render(doc, trace_json="trace.json")
    page = Page(html)
    assert [t for t, _ in page.tags].count("script") == 3  # two JSON blocks and our own script
    assert not [a for t, a in page.tags if t == "img"]
    assert not [a for t, a in page.tags if any(k.startswith("on") for k in a)]
    text = page.all_text()
    for s in (HOSTILE, HOSTILE_GROUP, HOSTILE_CMD):
        assert s in text, s  # shown as text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    for attrs, body in page.scripts:
        if attrs.get("type") == "application/json":
            assert "<" not in body and json.loads(body) is not None or body == "null"


def test_a_document_that_is_not_findings_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="not a MegaTrace findings document"):
        render({"schema": "other"})
    with pytest.raises(ReportError, match="version 2"):
        render({"schema": "megatrace.findings", "version": 2, "findings": []})


def test_rank_coordinates_agree_with_the_layout_for_every_order() -> None:
    for order in ORDERS:  # the report computes them from findings.json alone; the layout is the reference
        layout = Layout(world_size=12, tp=2, pp=3, dp=2, order=order)
        data = {"tp": 2, "pp": 3, "dp": 2, "order": order}
        for r in range(12):
            c = layout.coords(r)
            assert rank_coords(data, r) == {"tp": c.tp, "pp": c.pp, "dp": c.dp}, (order, r)
    assert rank_coords({"tp": 2}, 5) is None


# -- the command line ------------------------------------------------------------------------------------------

def test_analyze_writes_the_report_and_trace_beside_findings_unless_no_report(tmp_path: Path) -> None:
    runner = CliRunner()
    root = hung_trace(tmp_path)
    result = runner.invoke(main, ["analyze", str(root)])
    assert result.exit_code == 0, result.output
    assert (root / "report.html").exists() and (root / "trace.json").exists()
    doc = json.loads((root / "findings.json").read_text())
    assert doc["analysis"]["report"]["command"] == f"megatrace analyze {root.resolve()}"
    assert f"megatrace analyze {root.resolve()}" in Page((root / "report.html").read_text()).all_text()
    other = hung_trace(tmp_path / "b")
    assert runner.invoke(main, ["analyze", str(other), "--no-report"]).exit_code == 0
    assert (other / "findings.json").exists() and not (other / "report.html").exists()
    assert not (other / "trace.json").exists()


def test_report_rerenders_a_findings_file_and_reports_bad_input_in_one_line(hung, tmp_path: Path) -> None:
    root, _ = hung
    runner = CliRunner()
    out = tmp_path / "x" / "post-mortem.html"
    out.parent.mkdir()
    result = runner.invoke(main, ["report", str(root / "findings.json"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.exists() and (out.parent / "post-mortem.trace.json").exists()
    assert runner.invoke(main, ["report", str(root / "findings.json"), "-o", str(tmp_path / "n.html"),
                                "--no-trace"]).exit_code == 0
    assert not (tmp_path / "n.trace.json").exists()
    bad = tmp_path / "bad.json"
    bad.write_text("{\"schema\": \"nope\"}")
    for path, message in ((bad, "not a MegaTrace findings document"), (tmp_path / "missing.json", "cannot read")):
        result = runner.invoke(main, ["report", str(path)])
        assert result.exit_code == 1
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.output
    help_text = runner.invoke(main, ["report", "--help"])
    assert help_text.exit_code == 0 and "Render the post-mortem HTML report" in help_text.output
    assert "report" in runner.invoke(main, ["--help"]).output
