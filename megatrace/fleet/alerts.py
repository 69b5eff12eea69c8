"""Alerts: health failures and findings mapped to levels, deduplicated, rate-limited and delivered.

Delivery is a generic webhook (one JSON POST per alert, so Slack, Feishu, Teams
or PagerDuty bridges can take it), a command hook (the JSON on stdin) and a
Prometheus textfile. Nothing here may block a check or a job: all the deliveries of
one dispatch share one deadline (``deadline_s``, each also bounded by ``timeout_s``),
and failures are returned, never raised.

An alert counts as sent (for deduplication and the hourly limit) only once a receiver
took it: the decision is recorded before delivery, so that two concurrent checks do not
both send, and turned back into "not sent" when delivery fails or the deadline passed,
so that the next check tries again. Messages never show a receiver's URL beyond its
host (:func:`megatrace.redact.redact_text`): webhook URLs carry their token.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any


from megatrace.config import read_yaml
from megatrace.errors import MegatraceError
from megatrace.files import write_atomic
from megatrace.fleet.history import History
from megatrace.redact import redact_text

LEVELS = ("P0", "P1", "P2", "P3")  # P0 most urgent


class AlertConfigError(MegatraceError, ValueError):
    """An alerts file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class LevelRule:
    match: str  # glob on the probe (gpu.xid) or finding kind (compute-hang)
    when: str  # status or severity: fail, warn, critical, error, warning
    level: str


@dataclass(frozen=True)
class AlertConfig:
    rules: tuple[LevelRule, ...] = (
        LevelRule("gpu.xid", "fail", "P0"), LevelRule("gpu.count", "fail", "P0"),
        LevelRule("*hang*", "critical", "P0"), LevelRule("crashed-process", "critical", "P0"),
        LevelRule("gpu.*", "fail", "P1"), LevelRule("net.*", "fail", "P1"), LevelRule("*", "critical", "P1"),
        LevelRule("node.*", "fail", "P2"), LevelRule("*", "fail", "P2"), LevelRule("*", "error", "P2"),
        LevelRule("*", "warn", "P3"), LevelRule("*", "warning", "P3"))
    min_level: str = "P2"  # alerts below this are recorded, not sent
    dedupe_window_s: float = 3600.0  # the same node and check is not re-sent within this window
    max_per_hour: int = 30  # across all keys: beyond this, alerts are recorded and summarised later
    webhook_url: str | None = None
    command: tuple[str, ...] = ()
    prom_textfile: str | None = None
    timeout_s: float = 5.0  # one delivery (webhook, then command)
    deadline_s: float = 15.0  # all the deliveries of one check together: slurmd gives the whole check 60 s


@dataclass
class Alert:
    node: str
    subject: str  # the probe or finding kind
    status: str  # fail/warn or critical/error/warning
    text: str
    level: str = "P3"
    t: float = field(default_factory=time.time)
    recurrences: int = 0  # suppressed repeats folded into this one
    part: str = ""  # the GPU, NIC port or link of the node it is about ("GPU1", "mlx5_0/1"); "" the node

    @property
    def key(self) -> str:
        """What deduplication goes by: two GPUs (or ports) failing one check on a node are two alerts."""
        return f"{self.node}:{self.subject}" + (f":{self.part}" if self.part else "")

    def payload(self) -> dict[str, Any]:
        text = self.text + (f" (recurred {self.recurrences} times since the last alert)" if self.recurrences else "")
        return {**asdict(self), "key": self.key, "text": f"[{self.level}] {self.node}: {text}",
                "source": "megatrace"}


def level_of(alert: Alert, cfg: AlertConfig) -> str | None:
    for rule in cfg.rules:
        if rule.when == alert.status and fnmatch(alert.subject, rule.match):
            return rule.level
    return None


def load_alert_config(path: str | Path | None) -> AlertConfig:
    """Defaults overridden by the YAML at ``path``; unknown keys are errors that name the file and field."""
    if path is None:
        return AlertConfig()
    data = read_yaml(path, AlertConfigError, "alert settings") or {}
    if not isinstance(data, dict):
        raise AlertConfigError(f"{path}: expected a mapping")
    known = {"levels", "min_level", "dedupe_window_s", "max_per_hour", "webhook", "command", "prom_textfile",
             "timeout_s", "deadline_s"}
    for key in data:
        if key not in known:
            raise AlertConfigError(f"{path}: {key}: unknown setting (known: {', '.join(sorted(known))})")
    kw: dict[str, Any] = {}
    if "levels" in data:
        rules = []
        for i, r in enumerate(data["levels"] or []):
            if not isinstance(r, dict) or set(r) - {"match", "when", "level"} or not {"match", "when", "level"} <= set(r):
                raise AlertConfigError(f"{path}: levels[{i}]: expected {{match, when, level}}, got {r!r}")
            if r["level"] not in LEVELS:
                raise AlertConfigError(f"{path}: levels[{i}].level: {r['level']!r} is not one of {', '.join(LEVELS)}")
            rules.append(LevelRule(str(r["match"]), str(r["when"]), r["level"]))
        kw["rules"] = tuple(rules)
    if "min_level" in data:
        if data["min_level"] not in LEVELS:
            raise AlertConfigError(f"{path}: min_level: {data['min_level']!r} is not one of {', '.join(LEVELS)}")
        kw["min_level"] = data["min_level"]
    for key in ("dedupe_window_s", "timeout_s", "deadline_s"):
        if key in data:
            if not isinstance(data[key], (int, float)) or data[key] < 0:
                raise AlertConfigError(f"{path}: {key}: expected a number of seconds, got {data[key]!r}")
            kw[key] = float(data[key])
    if "max_per_hour" in data:
        if not isinstance(data["max_per_hour"], int) or data["max_per_hour"] < 0:
            raise AlertConfigError(f"{path}: max_per_hour: expected a count, got {data['max_per_hour']!r}")
        kw["max_per_hour"] = data["max_per_hour"]
    if "webhook" in data:
        hook = data["webhook"]
        url = hook.get("url") if isinstance(hook, dict) else hook
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            shown = redact_text(url) if isinstance(url, str) else type(url).__name__
            raise AlertConfigError(f"{path}: webhook.url: expected an http(s) URL, got {shown!r}")
        kw["webhook_url"] = url
    if "command" in data:
        cmd = data["command"]
        if not isinstance(cmd, list) or not cmd or not all(isinstance(c, str) for c in cmd):
            raise AlertConfigError(f"{path}: command: expected a list of arguments (no shell), got {cmd!r}")
        kw["command"] = tuple(cmd)
    if "prom_textfile" in data:
        kw["prom_textfile"] = str(data["prom_textfile"])
    return AlertConfig(**kw)


@dataclass
class Dispatch:
    sent: list[Alert] = field(default_factory=list)  # taken by every receiver
    suppressed: list[Alert] = field(default_factory=list)  # deduplicated, rate-limited or below min_level
    failed: list[Alert] = field(default_factory=list)  # due, but not delivered: not counted as sent, tried again
    errors: list[str] = field(default_factory=list)  # deliveries that failed (never raised), URLs redacted


def dispatch(alerts: list[Alert], cfg: AlertConfig, history: History, now: float | None = None) -> Dispatch:
    """Level, deduplicate, rate-limit and deliver ``alerts``; every decision is recorded in ``history``."""
    now = time.time() if now is None else now
    deadline = time.monotonic() + cfg.deadline_s
    out = Dispatch()
    for alert in alerts:
        level = level_of(alert, cfg)
        if level is None:
            continue
        alert.level, alert.t = level, now
        with history.exclusive():  # decide and record at once: a concurrent check must see this decision
            sent_recently, _ = history.alerts_since(alert.key, now - cfg.dedupe_window_s)
            send = not (LEVELS.index(level) > LEVELS.index(cfg.min_level) or sent_recently
                        or history.sent_since(now - 3600) >= cfg.max_per_hour)
            if send:
                alert.recurrences = history.suppressed_since_sent(alert.key)  # repeats folded into this one
            row = history.record_alert(alert.key, level, send, alert.text, now)
        if not send:
            out.suppressed.append(alert)
            continue
        errors = deliver(alert, cfg, deadline)
        if errors:  # not taken: undo "sent", so that deduplication does not swallow the next try
            history.set_alert_sent(row, False)
            out.failed.append(alert)
            out.errors += errors
        else:
            out.sent.append(alert)
    if cfg.prom_textfile:
        try:
            _prom(history, cfg.prom_textfile, now)
        except OSError as exc:
            out.errors.append(f"prometheus textfile {cfg.prom_textfile}: {exc.strerror}")
    return out


def deliver(alert: Alert, cfg: AlertConfig, deadline: float | None = None) -> list[str]:
    """Send one alert through the webhook and the command hook; returns the errors, URLs redacted.

    Each receiver gets at most ``timeout_s``, and nothing runs past ``deadline`` (``time.monotonic()``).
    """
    errors: list[str] = []
    body = json.dumps(alert.payload()).encode()
    deadline = time.monotonic() + 2 * cfg.timeout_s if deadline is None else deadline

    def budget() -> float:
        return min(cfg.timeout_s, deadline - time.monotonic())

    if cfg.webhook_url:
        where = redact_text(cfg.webhook_url)
        wait = budget()
        if wait <= 0:
            errors.append(f"webhook {where}: not tried, the alerts' deadline ({cfg.deadline_s:g} s) passed")
        else:
            def post() -> None:
                req = urllib.request.Request(cfg.webhook_url, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=wait) as resp:  # noqa: S310 (the site's URL)
                        resp.read(1024)
                except Exception as exc:  # noqa: BLE001 (any failure of the receiver is reported, never raised)
                    errors.append(f"webhook {where}: {redact_text(str(exc))}")
            worker = threading.Thread(target=post, daemon=True)  # DNS has no timeout of its own: bound it here
            worker.start()
            worker.join(wait)
            if worker.is_alive():
                errors.append(f"webhook {where}: no answer within {wait:.3g} s")
    if cfg.command:
        wait = budget()
        if wait <= 0:
            errors.append(f"command {cfg.command[0]}: not run, the alerts' deadline ({cfg.deadline_s:g} s) passed")
            return errors
        try:
            done = subprocess.run(list(cfg.command), input=body, capture_output=True, timeout=wait)
            if done.returncode:
                errors.append(f"command {cfg.command[0]}: exit {done.returncode}: "
                              f"{redact_text(done.stderr.decode(errors='replace').strip()[:200])}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            errors.append(f"command {cfg.command[0]}: {redact_text(str(exc))}")
    return errors


def _prom(history: History, path: str, now: float) -> None:
    rows = history.db.execute("SELECT level, SUM(sent), SUM(1 - sent) FROM alerts WHERE t >= ? GROUP BY level",
                              (now - 86400,)).fetchall()
    lines = ["# HELP megatrace_alerts_24h MegaTrace alerts in the last 24 h by level and outcome",
             "# TYPE megatrace_alerts_24h gauge"]
    for level, sent, suppressed in rows:
        lines.append(f'megatrace_alerts_24h{{level="{level}",outcome="sent"}} {int(sent)}')
        lines.append(f'megatrace_alerts_24h{{level="{level}",outcome="suppressed"}} {int(suppressed)}')
    write_atomic(path, "\n".join(lines) + "\n")
