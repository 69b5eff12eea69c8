"""Output files are written whole, and a device given as the output path is written into, never replaced."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from megatrace.files import write_atomic


def test_a_regular_file_is_replaced_whole(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_text("old")
    write_atomic(target, '{"new": 1}\n')
    assert target.read_text() == '{"new": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary left behind


def test_dev_null_stays_a_device() -> None:
    write_atomic("/dev/null", "x" * 100)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_fifo_is_written_into(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        write_atomic(fifo, b"hello")
        assert os.read(reader, 16) == b"hello"
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    finally:
        os.close(reader)
