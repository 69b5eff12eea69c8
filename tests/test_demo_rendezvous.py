"""The demo's rendezvous fails fast with one line naming the address, port and reason (real processes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank1(tmp_path: Path, addr: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR=addr, MASTER_PORT=str(_free_port()))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatrace.demo", "--engine", "ddp", "--steps", "2",
                           "-o", str(tmp_path / "out"), *args], env=env, capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - t0


def test_a_master_addr_that_does_not_resolve_fails_at_once(tmp_path: Path) -> None:
    proc, took = _rank1(tmp_path, "megatrace-no-such-node-n1")
    assert proc.returncode == 3, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("megatrace demo: error:")]
    assert len(errors) == 1 and "MASTER_ADDR 'megatrace-no-such-node-n1' does not resolve" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "cannot be retrieved" not in proc.stderr, proc.stderr
    assert took < 60, took  # (the interpreter and torch start; no retries)


def test_a_rendezvous_nobody_hosts_fails_after_its_timeout(tmp_path: Path) -> None:
    proc, took = _rank1(tmp_path, "127.0.0.1", "--rendezvous-timeout", "2")
    assert proc.returncode == 3, proc.stderr
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("megatrace demo: error:")]
    assert "rank 1 cannot reach the rendezvous 127.0.0.1:" in error and "within 2 s" in error, error
    assert "Traceback" not in proc.stderr
    assert took < 120, took
