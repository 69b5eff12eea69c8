"""megatrace.files: outputs written whole and never through another user's link or FIFO; inputs that are regular
files; private directories. Root analysing a user's directory is the case that matters (issue 20, item 2)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from megatrace.files import write_atomic

OTHER_UID = 4242
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making another user's files needs root")


def _as_other(path: Path) -> Path:
    os.lchown(path, OTHER_UID, OTHER_UID)
    return path


def test_a_regular_file_is_replaced_whole(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_text("old")
    write_atomic(target, '{"new": 1}\n')
    assert target.read_text() == '{"new": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary left behind


def test_dev_null_stays_a_device() -> None:
    write_atomic("/dev/null", "x" * 100)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_our_own_fifo_is_written_into(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        write_atomic(fifo, b"hello")
        assert os.read(reader, 16) == b"hello"
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    finally:
        os.close(reader)


@needs_root
def test_a_temporary_name_planted_as_a_link_is_never_written_through(tmp_path: Path) -> None:
    """The old temporary name was predictable (.NAME.<pid>.tmp): a link there made root overwrite its target."""
    victim = tmp_path / "root-owned"
    victim.write_text("keep")
    for pid in (os.getpid(), *range(os.getpid() + 1, os.getpid() + 4)):
        link = tmp_path / f".findings.json.{pid}.tmp"
        link.symlink_to(victim)
        _as_other(link)
    write_atomic(tmp_path / "findings.json", "{}\n")
    assert victim.read_text() == "keep" and (tmp_path / "findings.json").read_text() == "{}\n"


@needs_root
def test_another_users_fifo_or_link_to_a_device_is_replaced_not_written_into(tmp_path: Path) -> None:
    fifo = tmp_path / "report.html"
    os.mkfifo(fifo)
    _as_other(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()), daemon=True)
    reader.start()  # the attacker reading what root writes
    write_atomic(fifo, "<html>report</html>")
    assert stat.S_ISREG(os.stat(fifo, follow_symlinks=False).st_mode) and fifo.read_text() == "<html>report</html>"
    assert not got  # nothing reached the FIFO (the reader still waits for a writer)
    link = tmp_path / "trace.json"
    link.symlink_to("/dev/zero")
    _as_other(link)
    write_atomic(link, "{}")
    assert not link.is_symlink() and link.read_text() == "{}"


@needs_root
def test_inputs_are_regular_files_reached_without_another_users_link(tmp_path: Path) -> None:
    from megatrace.files import UnsafePathError, read_input

    secret = tmp_path / "secret"
    secret.write_text("root's first line\n")
    secret.chmod(0o600)
    link = _as_other(_symlink(tmp_path / "layout.yaml", secret))
    with pytest.raises(UnsafePathError, match="a symbolic link owned by uid 4242; not followed"):
        read_input(link)
    os.lchown(link, 0, 0)  # root's own link is followed
    assert read_input(link) == b"root's first line\n"
    os.mkfifo(tmp_path / "procs.json")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        read_input(tmp_path / "procs.json")  # and never blocks
    with pytest.raises(OSError, match="larger than the limit of 4 bytes"):
        read_input(secret, limit=4)


def _symlink(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


def test_a_private_directory_is_made_0700_and_its_parents_too(tmp_path: Path) -> None:
    from megatrace.files import UnsafePathError, private_dir

    old = os.umask(0)
    try:
        os.close(private_dir(tmp_path / "x" / "y"))
    finally:
        os.umask(old)
    assert (tmp_path / "x").stat().st_mode & 0o777 == 0o700 and (tmp_path / "x" / "y").stat().st_mode & 0o777 == 0o700
    (tmp_path / "open").mkdir(mode=0o777)
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(UnsafePathError, match="writable by other users"):
        private_dir(tmp_path / "open")
    (tmp_path / "link").symlink_to(tmp_path / "x")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        private_dir(tmp_path / "link")
