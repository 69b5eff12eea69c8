"""Headless Chromium over the DevTools protocol, for the report tests (tests/test_report_browser.py,
tests/test_report_scale.py): :class:`Browser`, the session fixture ``browser`` and :func:`check_page`.

Chromium is Debian's ``chromium`` package (``.ci/run`` installs it). Without it the tests that use the
fixture fail under CI (``CI`` set) and skip on a developer machine. Screenshots go to test-artifacts/report/.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "report"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
                  "--remote-debugging-port=0", "--window-size=1366,900"]


def chromium_binary() -> str | None:
    for path in ("/usr/lib/chromium/chromium",):  # Debian's binary, without the wrapper script's extra flags
        if os.access(path, os.X_OK):
            return path
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def require_chromium() -> str:
    binary = chromium_binary()
    missing = None if binary else "chromium is not installed (apt-get install chromium, as .ci/run does)"
    try:
        import websocket  # noqa: F401  (the test extra's websocket-client)
    except ImportError:
        missing = missing or "websocket-client is not installed (pip install -e '.[test]')"
    if missing:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing + "; these tests fail under CI")
    return binary  # type: ignore[return-value]


class Browser:
    """One headless Chromium and one DevTools session (websocket-client), network off, events recorded."""

    def __init__(self, binary: str) -> None:
        import websocket  # the test extra's websocket-client

        self.profile = tempfile.mkdtemp(prefix="megatrace-chromium-")
        self.proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        url = self._devtools_url()
        # keep draining the browser's stderr so that a chatty browser never blocks on a full pipe
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()
        self.ws = websocket.create_connection(url, timeout=30, suppress_origin=True)
        self._ids = itertools.count(1)
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)
        self.call("Network.emulateNetworkConditions", session=True, offline=True, latency=0,
                  downloadThroughput=-1, uploadThroughput=-1)

    def _devtools_url(self) -> str:
        deadline = time.monotonic() + 30
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            if m:
                return m.group(1)
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError("chromium did not start its DevTools endpoint")

    def call(self, method: str, session: bool = False, timeout: float = 30.0, **params) -> dict:
        msg_id = next(self._ids)
        msg = {"id": msg_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)
        raise TimeoutError(method)

    def wait_event(self, method: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events:
                if e["method"] == method:
                    return e
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            reply = json.loads(self.ws.recv())
            if "method" in reply:
                self.events.append(reply)
        raise TimeoutError(method)

    def open(self, path: Path) -> float:
        """Load ``path``; returns seconds from navigation to the load event."""
        self.events.clear()
        t = time.perf_counter()
        self.call("Page.navigate", session=True, url=path.resolve().as_uri())
        self.wait_event("Page.loadEventFired", timeout=60)
        return time.perf_counter() - t

    def evaluate(self, expression: str):
        res = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(res["exceptionDetails"])
        return res["result"].get("value")

    def screenshot(self, path: Path, full_page: bool = False) -> None:
        params: dict = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        data = self.call("Page.captureScreenshot", session=True, **params)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def problems(self, page_url: str) -> list[str]:
        """Console errors, exceptions, CSP violations and every request other than the page itself."""
        self.call("Runtime.evaluate", session=True, expression="0")  # flush pending events
        out = []
        for e in self.events:
            m, p = e["method"], e.get("params", {})
            if m == "Runtime.exceptionThrown":
                details = p["exceptionDetails"]
                out.append(f"exception: {details.get('text')} {details.get('exception', {})}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
                out.append(f"console.{p['type']}: {[a.get('value', a.get('description')) for a in p.get('args', [])]}")
            elif m == "Log.entryAdded" and p["entry"].get("level") in ("error", "warning"):
                out.append(f"log {p['entry']['level']}: {p['entry'].get('text')}")
            elif m == "Network.requestWillBeSent" and p["request"]["url"] != page_url:
                out.append(f"request: {p['request']['url']}")
        return out

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the browser we started and its children
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="session")
def browser():
    b = Browser(require_chromium())
    yield b
    b.close()


def check_page(browser: Browser, html: Path, shot: Path) -> dict:
    """Open ``html``; assert nothing went wrong; save a screenshot; return facts about the page."""
    seconds = browser.open(html)
    url = html.resolve().as_uri()
    facts = browser.evaluate("""(() => {
        const v = document.getElementById('verdict-text');
        const r = v ? v.getBoundingClientRect() : null;
        const s = v ? getComputedStyle(v) : null;
        return {verdict: v ? v.innerText : null, top: r && r.top, bottom: r && r.bottom, height: r && r.height,
                visible: !!(r && r.height > 0 && r.bottom <= innerHeight && s.visibility === 'visible'
                            && s.display !== 'none'),
                ready: document.documentElement.getAttribute('data-report-ready'),
                heat: (c => c ? [c.width, c.height] : null)(document.getElementById('heat')),
                delay: (c => c ? [c.width, c.height] : null)(document.getElementById('delay')),
                tooltips: document.querySelectorAll('#timeline-svg rect > title').length,
                first_culprit: (td => td ? td.textContent : null)(
                    document.querySelector('#culprits + table tr:nth-child(2) td')),
                scripts: document.scripts.length, title: document.title,
                sections: Array.from(document.querySelectorAll('h2')).map(h => h.id || h.textContent)};
    })()""")
    browser.screenshot(shot)
    problems = browser.problems(url)
    assert problems == [], problems
    assert facts["visible"], facts
    assert facts["ready"] == "1", "the report's script did not run to its end"
    facts["seconds"] = seconds
    return facts
