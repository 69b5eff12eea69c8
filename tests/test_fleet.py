"""The inspection loop's parts: the drain/resume decision, the history store, and alerts (levels,
deduplication, rate limits, delivery to a real webhook receiver on loopback and to a command hook).
The drain/resume round trip against real Slurm daemons is in tests/test_slurm_health.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from megatrace.check.results import Status
from megatrace.fleet.alerts import (Alert, AlertConfig, AlertConfigError, LevelRule, deliver, dispatch, level_of,
                                    load_alert_config)
from megatrace.fleet.health import NodeState, decide, parse_scontrol_node
from megatrace.fleet.history import History

CONFIGS = Path(__file__).parent.parent / "configs"


# -- drain / resume --------------------------------------------------------------------------------------------
OURS = NodeState("IDLE+DRAIN", "megatrace: GPU2 XID 79 in the kernel log")
THEIRS = NodeState("IDLE+DRAIN", "bad DIMM, ticket 4711")
UP = NodeState("IDLE", "")


@pytest.mark.parametrize("status, state, recent, expected", [
    (Status.FAIL, UP, ["fail"], "drain"),
    (Status.FAIL, OURS, ["fail", "fail"], None),  # already drained
    (Status.OK, OURS, ["ok", "ok", "ok"], "resume"),
    (Status.WARN, OURS, ["warn", "ok", "ok"], "resume"),  # warnings do not keep a node out
    (Status.OK, OURS, ["ok", "ok", "fail"], None),  # not yet 3 passes in a row
    (Status.OK, OURS, ["ok", "ok"], None),
    (Status.OK, THEIRS, ["ok", "ok", "ok", "ok"], None),  # drained by someone else: never resumed
    (Status.OK, UP, ["ok"], None),
    (Status.FAIL, None, ["fail"], None),  # no Slurm to ask
])
def test_drain_and_resume_decisions(status, state, recent, expected) -> None:
    assert decide(status, state, recent, resume_after=3) == expected


def test_scontrol_lines_are_parsed() -> None:
    line = ("NodeName=n2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 State=IDLE+DRAIN ThreadsPerCore=1 "
            "Partitions=lab BootTime=None Reason=megatrace: GPU1 XID 79 [root@2026-12-02T03:04:05]")
    st = parse_scontrol_node(line)
    assert st == NodeState("IDLE+DRAIN", "megatrace: GPU1 XID 79") and st.drained and st.ours
    assert parse_scontrol_node("NodeName=n1 State=MIXED Partitions=lab") == NodeState("MIXED", "")


# -- history ---------------------------------------------------------------------------------------------------
def test_history_summary_puts_flaky_nodes_first(tmp_path: Path) -> None:
    with History(tmp_path / "h.db") as h:
        for i, s in enumerate(["ok", "fail", "ok", "fail", "fail", "ok"]):
            h.record_check("n7", s, "gpu.ecc", "2 uncorrected ECC errors" if s == "fail" else None, t=100.0 + i)
        for i in range(4):
            h.record_check("n1", "ok", t=100.0 + i)
        h.record_check("n3", "warn", "gpu.pcie", "PCIe link x8 of x16", t=200.0)
        rows = h.summary(window=10)
        assert [r.node for r in rows] == ["n7", "n3", "n1"]
        assert rows[0].stands_out and rows[0].failed == 3 and rows[0].last_status == "ok"
        assert rows[0].last_problem == "2 uncorrected ECC errors"
        assert h.recent_statuses("n7", 3) == ["ok", "fail", "fail"]


# -- alerts ----------------------------------------------------------------------------------------------------
def test_levels_follow_the_first_matching_rule() -> None:
    cfg = AlertConfig()
    assert level_of(Alert("n1", "gpu.xid", "fail", ""), cfg) == "P0"
    assert level_of(Alert("n1", "gpu.ecc", "fail", ""), cfg) == "P1"
    assert level_of(Alert("n1", "node.shm", "fail", ""), cfg) == "P2"
    assert level_of(Alert("n1", "gpu.pcie", "warn", ""), cfg) == "P3"
    assert level_of(Alert("n1", "compute-hang", "critical", ""), cfg) == "P0"
    assert level_of(Alert("n1", "gpu.ecc", "ok", ""), cfg) is None


def test_deduplication_rate_limit_and_recurrence(tmp_path: Path) -> None:
    cfg = AlertConfig(dedupe_window_s=600, max_per_hour=3)
    with History(tmp_path / "h.db") as h:
        first = dispatch([Alert("n1", "gpu.ecc", "fail", "2 uncorrected ECC errors")], cfg, h, now=1000.0)
        assert len(first.sent) == 1 and first.sent[0].level == "P1"
        again = dispatch([Alert("n1", "gpu.ecc", "fail", "2 uncorrected ECC errors")] * 3, cfg, h, now=1100.0)
        assert not again.sent and len(again.suppressed) == 3  # within the window
        low = dispatch([Alert("n1", "gpu.pcie", "warn", "x8")], cfg, h, now=1100.0)
        assert not low.sent  # P3: recorded only
        later = dispatch([Alert("n1", "gpu.ecc", "fail", "2 uncorrected ECC errors")], cfg, h, now=1700.0)
        assert len(later.sent) == 1 and later.sent[0].recurrences == 3
        assert "recurred 3 times" in later.sent[0].payload()["text"]
        burst = dispatch([Alert(f"n{i}", "gpu.xid", "fail", "XID 79") for i in range(2, 8)], cfg, h, now=1800.0)
        assert len(burst.sent) == 1 and len(burst.suppressed) == 5  # 2 already sent this hour; cap 3


def test_two_gpus_failing_one_check_are_two_alerts(tmp_path: Path) -> None:
    """Deduplication goes by node, check and part: GPU1's ECC errors do not silence GPU5's."""
    with History(tmp_path / "h.db") as h:
        sent = dispatch([Alert("n1", "gpu.ecc", "fail", "2 uncorrected", part="GPU1"),
                         Alert("n1", "gpu.ecc", "fail", "1 uncorrected", part="GPU5"),
                         Alert("n1", "gpu.ecc", "fail", "2 uncorrected", part="GPU1")], AlertConfig(), h, now=10.0)
        assert sorted(a.key for a in sent.sent) == ["n1:gpu.ecc:GPU1", "n1:gpu.ecc:GPU5"]
        assert len(sent.suppressed) == 1


def test_checks_racing_on_one_history_send_one_alert(tmp_path: Path) -> None:
    """Health checks of one node overlapping (slurmd starts one while the last still runs): one alert."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(6)
        with ctx.Pool(6) as pool:
            sent = pool.starmap(_race_dispatch, [(str(tmp_path / "h.db"), barrier)] * 6)
    assert sum(sent) == 1, sent
    with History(tmp_path / "h.db") as h:
        assert h.alerts_since("n3:node.injected", 0) == (1, 5)


def _race_dispatch(path: str, barrier) -> int:
    with History(path) as h:
        barrier.wait()
        return len(dispatch([Alert("n3", "node.injected", "fail", "drill")], AlertConfig(), h, now=1000.0).sent)


class _Receiver(BaseHTTPRequestHandler):
    got: list[dict] = []
    delay = 0.0

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        time.sleep(self.delay)  # a duration, not a wait: a receiver that answers late (or hangs)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).got.append(json.loads(body))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def receiver():
    class Handler(_Receiver):
        got: list[dict] = []
    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", Handler
    server.shutdown()
    server.server_close()


def test_exactly_one_alert_reaches_the_webhook(tmp_path: Path, receiver) -> None:
    url, handler = receiver
    cfg = AlertConfig(webhook_url=url)
    with History(tmp_path / "h.db") as h:
        for now in (1000.0, 1060.0, 1120.0):  # three health checks in a row see the same failure
            out = dispatch([Alert("n2", "gpu.xid", "fail", "XID 79 in the kernel log")], cfg, h, now=now)
            assert not out.errors, out.errors
    assert len(handler.got) == 1
    assert handler.got[0]["text"] == "[P0] n2: XID 79 in the kernel log" and handler.got[0]["key"] == "n2:gpu.xid"


def test_a_receiver_that_is_down_or_hangs_costs_at_most_the_timeout(receiver) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/"
    t = time.monotonic()
    errors = deliver(Alert("n1", "gpu.xid", "fail", "x", level="P0"), AlertConfig(webhook_url=closed, timeout_s=2))
    assert errors and "webhook" in errors[0] and time.monotonic() - t < 3
    url, handler = receiver
    handler.delay = 10.0
    t = time.monotonic()
    errors = deliver(Alert("n1", "gpu.xid", "fail", "x", level="P0"), AlertConfig(webhook_url=url, timeout_s=1))
    assert errors and time.monotonic() - t < 4


def test_the_command_hook_gets_the_alert_on_stdin(tmp_path: Path) -> None:
    out = tmp_path / "got.json"
    script = tmp_path / "hook.py"
    script.write_text(f"import sys; open({str(out)!r}, 'w').write(sys.stdin.read())\n")
    errors = deliver(Alert("n4", "node.ib", "fail", "port mlx5_1/1 is 1: DOWN", level="P2"),
                     AlertConfig(command=(sys.executable, str(script))))
    assert not errors
    assert json.loads(out.read_text())["text"] == "[P2] n4: port mlx5_1/1 is 1: DOWN"
    bad = deliver(Alert("n4", "x", "fail", "y", level="P2"), AlertConfig(command=(sys.executable, "-c", "exit(3)")))
    assert bad and "exit 3" in bad[0]


def test_alert_files_are_strict(tmp_path: Path) -> None:
    assert load_alert_config(CONFIGS / "alerts.yaml") == AlertConfig()  # the shipped file is the defaults
    path = tmp_path / "a.yaml"
    for text, words in [("webhok: {url: http://x}\n", "webhok: unknown setting"),
                        ("webhook: {url: ftp://x}\n", "webhook.url: expected an http"),
                        ("levels: [{match: '*', when: fail, level: P9}]\n", r"levels\[0\]\.level"),
                        ("command: 'rm -rf /'\n", "command: expected a list")]:
        path.write_text(text)
        with pytest.raises(AlertConfigError, match=words) as info:
            load_alert_config(path)
        assert str(path) in str(info.value)
    path.write_text("levels: [{match: 'gpu.*', when: warn, level: P1}]\nmin_level: P1\n")
    cfg = load_alert_config(path)
    assert cfg.rules == (LevelRule("gpu.*", "warn", "P1"),) and cfg.min_level == "P1"


# -- delivery that fails is not "sent"; no token in messages; one deadline (issue 20, item 16) ----------------

def _closed_url(path: str = "/hook") -> str:
    with socket.socket() as s:  # a port nobody listens on: the receiver refuses
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}{path}"


def test_an_alert_no_receiver_took_is_not_counted_as_sent_and_is_tried_again(tmp_path: Path, receiver) -> None:
    """A failed delivery was stored as sent: its retry was deduplicated away for an hour and the P0 was lost."""
    alert = lambda: Alert("n5", "gpu.xid", "fail", "XID 79")  # noqa: E731
    with History(tmp_path / "h.db") as h:
        first = dispatch([alert()], AlertConfig(webhook_url=_closed_url(), timeout_s=2), h, now=1000.0)
        assert not first.sent and len(first.failed) == 1 and first.errors
        assert h.alerts_since("n5:gpu.xid", 0) == (0, 1)
        url, handler = receiver  # the receiver is back: the next check delivers it, not "already sent"
        again = dispatch([alert()], AlertConfig(webhook_url=url), h, now=1060.0)
        assert len(again.sent) == 1 and not again.suppressed and len(handler.got) == 1
        assert h.alerts_since("n5:gpu.xid", 0)[0] == 1


def test_delivery_errors_never_show_the_webhook_token(tmp_path: Path) -> None:
    url = _closed_url("/services/T0AAAA/B0BBBB/hooksecret123?token=qsecret")
    with History(tmp_path / "h.db") as h:
        out = dispatch([Alert("n5", "gpu.xid", "fail", "XID 79")], AlertConfig(webhook_url=url, timeout_s=2), h)
    assert out.errors and all("hooksecret123" not in e and "qsecret" not in e for e in out.errors), out.errors
    assert "http://127.0.0.1:" in out.errors[0]
    bad = tmp_path / "alerts.yaml"
    bad.write_text("webhook: {url: 'ftp://u:pw-secret@relay/x'}\n")
    with pytest.raises(AlertConfigError) as info:
        load_alert_config(bad)
    assert "pw-secret" not in str(info.value)


def test_eight_alerts_to_a_silent_receiver_share_one_deadline(tmp_path: Path) -> None:
    """At the default 5 s timeout, 8 alerts to a receiver that never answers took ~48 s of the 60 s health check."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections complete in the kernel; nothing ever answers
    try:
        cfg = AlertConfig(webhook_url=f"http://127.0.0.1:{silent.getsockname()[1]}/hook")  # defaults: 5 s, 15 s
        alerts = [Alert(f"n{i}", "gpu.xid", "fail", "XID 79") for i in range(8)]
        t = time.monotonic()
        with History(tmp_path / "h.db") as h:
            out = dispatch(alerts, cfg, h, now=1000.0)
            elapsed = time.monotonic() - t
            assert elapsed < cfg.deadline_s + 2, elapsed
            assert not out.sent and len(out.failed) == 8
            assert sum("deadline" in e for e in out.errors) >= 5  # the rest were not even tried
            assert h.sent_since(0) == 0  # none counts as sent: the next check tries them all again
    finally:
        silent.close()


# -- a broken history never stops the health check (issue 20, item 17) ----------------------------------------

def _health(tmp_path: Path, history: Path) -> subprocess.CompletedProcess[str]:
    limits = tmp_path / "limits.yaml"
    limits.write_text("node: {min_free_shm_mib: 0, min_free_job_mib: 0}\n")  # a container's small /dev/shm
    exe = Path(sys.executable).parent / "megatrace"
    return subprocess.run([str(exe), "health", "--no-act", "--node", "t1", "--history", str(history),
                           "--thresholds", str(limits)], capture_output=True, text=True, timeout=120)


def test_a_corrupt_history_is_moved_aside_and_the_check_runs(tmp_path: Path) -> None:
    db = tmp_path / "history.db"
    db.write_bytes(b"this is not an SQLite database\n" * 100)
    done = _health(tmp_path, db)
    assert "Traceback" not in done.stderr and done.returncode in (0, 4), done.stderr
    assert done.stdout.startswith("megatrace health t1: ")  # the checks ran and were judged
    aside = list(tmp_path.glob("history.db.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not")
    assert f"moved to {aside[0]}" in done.stderr
    with History(db) as h:
        assert h.recent_statuses("t1", 5)  # the new store has this check


def test_a_history_locked_past_the_busy_timeout_still_lets_the_check_run(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "history.db"
    History(db).close()
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process holding the store for longer than 5 s
    try:
        done = _health(tmp_path, db)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert "Traceback" not in done.stderr and done.returncode in (0, 4), done.stderr
    assert done.stdout.startswith("megatrace health t1: ")
    assert "unusable (database is locked); this check keeps no history" in done.stderr
    assert not list(tmp_path.glob("*.corrupt-*"))  # locked is not corrupt: nothing moved
