"""A small local store of node health results, findings and sent alerts (SQLite, one file per site or node).

Writers are short transactions with a busy timeout, so a health check and a
collector on the same node never block each other for long; a store that
cannot be opened is reported by the caller and never stops a check.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PATH = "/var/lib/megatrace/history.db"
SCHEMA = """
CREATE TABLE IF NOT EXISTS checks (
    t REAL NOT NULL, node TEXT NOT NULL, status TEXT NOT NULL, worst_probe TEXT, message TEXT);
CREATE INDEX IF NOT EXISTS checks_node_t ON checks (node, t);
CREATE TABLE IF NOT EXISTS findings (
    t REAL NOT NULL, job TEXT, node TEXT, severity TEXT NOT NULL, kind TEXT NOT NULL, verdict TEXT);
CREATE INDEX IF NOT EXISTS findings_node_t ON findings (node, t);
CREATE TABLE IF NOT EXISTS alerts (
    t REAL NOT NULL, key TEXT NOT NULL, level TEXT NOT NULL, sent INTEGER NOT NULL, text TEXT);
CREATE INDEX IF NOT EXISTS alerts_key_t ON alerts (key, t);
"""


def default_path() -> Path:
    return Path(os.environ.get("MEGATRACE_HISTORY") or DEFAULT_PATH)


def open_history(path: str | os.PathLike[str] | None = None) -> tuple["History", str | None]:
    """The store, whatever state its file is in, and what was wrong with it (None when nothing was).

    A health check must run even when its memory cannot: a file that is not an SQLite database (or
    a damaged one) is moved aside to ``<name>.corrupt-<unix time>`` and a new store made in its place;
    a store that stays locked past the busy timeout, or cannot be opened at all, is replaced for this
    run by one in memory (the check runs and drains; only deduplication against earlier runs is lost).
    """
    path = Path(path) if path else default_path()
    try:
        return History(path), None
    except sqlite3.Error as exc:
        if not _corrupt(exc):
            return History(":memory:"), f"history store {path} unusable ({exc}); this check keeps no history"
        aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
        try:
            os.replace(path, aside)
        except OSError as move:
            return History(":memory:"), (f"history store {path} is corrupt ({exc}) and cannot be moved aside "
                                         f"({move.strerror}); this check keeps no history")
        try:
            return History(path), f"history store {path} was corrupt ({exc}): moved to {aside}, started anew"
        except sqlite3.Error as again:
            return History(":memory:"), f"history store {path} unusable ({again}); this check keeps no history"
    except OSError as exc:
        return History(":memory:"), f"history store {path} unusable ({exc.strerror or exc}); this check keeps no history"


def _corrupt(exc: sqlite3.Error) -> bool:
    """Not a database, or a damaged one (as opposed to locked, read-only or missing: OperationalError)."""
    return isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError)


@dataclass(frozen=True)
class NodeSummary:
    node: str
    checks: int  # of the last ``window`` checks
    failed: int
    warned: int
    last_status: str
    last_t: float
    last_problem: str | None

    @property
    def stands_out(self) -> bool:
        """Failed 3 or more of its last checks: flaky or broken, worth a look even when passing now."""
        return self.failed >= 3


class History:
    """The store; use as a context manager or call :meth:`close`."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path else default_path()
        memory = str(path) == ":memory:"
        if not memory:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(":memory:" if memory else self.path, timeout=5.0, isolation_level=None)
        try:
            self.db.executescript(SCHEMA)
        except sqlite3.Error:
            self.db.close()
            raise

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.db.close()

    def record_check(self, node: str, status: str, worst_probe: str | None = None, message: str | None = None,
                     t: float | None = None) -> None:
        self.db.execute("INSERT INTO checks VALUES (?, ?, ?, ?, ?)",
                        (t if t is not None else time.time(), node, status, worst_probe, message))

    def record_finding(self, severity: str, kind: str, verdict: str, node: str | None = None, job: str | None = None,
                       t: float | None = None) -> None:
        self.db.execute("INSERT INTO findings VALUES (?, ?, ?, ?, ?, ?)",
                        (t if t is not None else time.time(), job, node, severity, kind, verdict))

    def recent_statuses(self, node: str, n: int) -> list[str]:
        """The node's last ``n`` check statuses, newest first."""
        rows = self.db.execute("SELECT status FROM checks WHERE node = ? ORDER BY t DESC LIMIT ?", (node, n))
        return [r[0] for r in rows]

    def summary(self, window: int = 10) -> list[NodeSummary]:
        """Per node, its last ``window`` checks; nodes that stand out first."""
        out = []
        for (node,) in self.db.execute("SELECT DISTINCT node FROM checks ORDER BY node").fetchall():
            rows = self.db.execute("SELECT t, status, message FROM checks WHERE node = ? ORDER BY t DESC LIMIT ?",
                                   (node, window)).fetchall()
            problem = next((m for _, s, m in rows if s in ("fail", "warn") and m), None)
            out.append(NodeSummary(node, len(rows), sum(s == "fail" for _, s, _ in rows),
                                   sum(s == "warn" for _, s, _ in rows), rows[0][1], rows[0][0], problem))
        return sorted(out, key=lambda s: (-s.failed, -s.warned, s.node))

    def findings_of(self, node: str, limit: int = 20) -> list[tuple[float, str | None, str, str, str]]:
        rows = self.db.execute("SELECT t, job, severity, kind, verdict FROM findings WHERE node = ? "
                               "ORDER BY t DESC LIMIT ?", (node, limit))
        return list(rows)

    @contextmanager
    def exclusive(self) -> Iterator[History]:
        """One write transaction taken up front (BEGIN IMMEDIATE): what is read inside it cannot change
        before what is written inside it, across processes (two health checks deciding one alert)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # -- alerts (used by megatrace.fleet.alerts for deduplication) --------------------------------------------
    def record_alert(self, key: str, level: str, sent: bool, text: str, t: float) -> int:
        """Record a decision; returns its row, for :meth:`set_alert_sent` once delivery is known."""
        cur = self.db.execute("INSERT INTO alerts VALUES (?, ?, ?, ?, ?)", (t, key, level, int(sent), text))
        return int(cur.lastrowid or 0)

    def set_alert_sent(self, row: int, sent: bool) -> None:
        """Correct a recorded decision: an alert meant to be sent that no receiver took is not sent."""
        self.db.execute("UPDATE alerts SET sent = ? WHERE rowid = ?", (int(sent), row))

    def alerts_since(self, key: str, since: float) -> tuple[int, int]:
        """(alerts sent, alerts suppressed) for ``key`` since ``since``."""
        sent, suppressed = self.db.execute(
            "SELECT COALESCE(SUM(sent), 0), COALESCE(SUM(1 - sent), 0) FROM alerts WHERE key = ? AND t >= ?",
            (key, since)).fetchone()
        return int(sent), int(suppressed)

    def suppressed_since_sent(self, key: str) -> int:
        """Alerts of ``key`` suppressed since one was last sent (all of them if none was)."""
        last = self.db.execute("SELECT MAX(t) FROM alerts WHERE key = ? AND sent = 1", (key,)).fetchone()[0]
        return int(self.db.execute("SELECT COUNT(*) FROM alerts WHERE key = ? AND sent = 0 AND t > ?",
                                   (key, last if last is not None else -1.0)).fetchone()[0])

    def sent_since(self, since: float) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM alerts WHERE sent = 1 AND t >= ?", (since,)).fetchone()[0])
