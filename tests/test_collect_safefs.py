"""safefs: what the collector and agent, possibly root, refuse to follow in directories a user controls."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatrace.collect import safefs
from megatrace.collect.node import job_ring_dirs, read_trace_dir


def test_a_link_owned_by_a_user_is_never_followed_anywhere_in_the_path(tmp_path: Path) -> None:
    real = tmp_path / "real" / "rings"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    if os.geteuid() == 0:  # as a user, the link is already the user's own
        os.lchown(tmp_path / "link", 4242, 4242)
    with pytest.raises(safefs.UnsafePathError, match="owned by uid"):
        safefs.open_dir(tmp_path / "link" / "rings")
    if os.geteuid() == 0:  # a link owned by root (like /dev/shm -> /run/shm) is followed
        os.lchown(tmp_path / "link", 0, 0)
        os.close(safefs.open_dir(tmp_path / "link" / "rings"))


def test_links_fifos_and_oversized_files_in_a_ring_directory_are_skipped_not_followed(tmp_path: Path) -> None:
    (tmp_path / "rank-00000.ring").write_bytes(b"r" * 100)
    (tmp_path / "elsewhere").write_text("secret")
    (tmp_path / "rank-00001.ring").symlink_to(tmp_path / "elsewhere")
    if os.geteuid() != 0:
        pytest.skip("needs root: a link of another user")
    os.lchown(tmp_path / "rank-00001.ring", 4242, 4242)  # another user's (root's own links are followed)
    os.mkfifo(tmp_path / "rank-00002.meta.jsonl")  # an open() without O_NONBLOCK would block here
    dfd, files, skipped = read_trace_dir(str(tmp_path))
    assert {n: f.read() for n, f in files.items()} == {"rank-00000.ring": b"r" * 100}
    os.close(dfd)
    assert {s["name"] for s in skipped} == {"rank-00001.ring", "rank-00002.meta.jsonl"}
    fd = safefs.open_dir(tmp_path)
    try:
        with pytest.raises(OSError, match="limit"):
            safefs.read_file(fd, "rank-00000.ring", 10)
    finally:
        os.close(fd)


def test_new_files_never_write_through_an_existing_name(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("keep")
    with safefs.OutDir(tmp_path / "out") as out:
        (tmp_path / "out" / "findings.json").symlink_to(target)
        with pytest.raises(FileExistsError):
            out.write("findings.json", b"x")
        out.write("findings.json", b"new", replace=True)  # replaces the link itself, atomically
    assert target.read_text() == "keep" and (tmp_path / "out" / "findings.json").read_bytes() == b"new"
    with pytest.raises(FileExistsError):
        safefs.OutDir(tmp_path / "out", exclusive=True)


def test_the_job_ring_directories_are_found_by_job_id_newest_first(tmp_path: Path) -> None:
    for name, mtime in (("77", 100), ("77.0", 300), ("77.1", 200), ("770", 400), ("77.2", 500)):
        d = tmp_path / name
        d.mkdir()
        if name != "77.2":  # a step without rings (the agent's own step) is not a trace directory
            (d / "rank-00000.ring").write_bytes(b"")
        os.utime(d, (mtime, mtime))
    assert job_ring_dirs("77", str(tmp_path)) == [str(tmp_path / n) for n in ("77.0", "77.1", "77")]
    assert job_ring_dirs(None, str(tmp_path)) == []


def test_as_root_a_file_in_a_users_ring_directory_that_the_user_does_not_own_is_not_collected(tmp_path: Path) -> None:
    """A hard link to a file the user could not read (where protected_hardlinks is off), or any file planted by
    someone else, is not the writer's: a collector run as root never copies it into the user's bundle."""
    if os.geteuid() != 0:
        pytest.skip("needs root: files of two users")
    ring_dir = tmp_path / "job"
    ring_dir.mkdir()
    (ring_dir / "rank-00000.ring").write_bytes(b"mine")
    secret = tmp_path / "secret"
    secret.write_text("root only")
    os.chmod(secret, 0o600)
    os.link(secret, ring_dir / "rank-00001.ring")  # root's file, under a ring's name
    for p in (ring_dir, ring_dir / "rank-00000.ring"):
        os.chown(p, 4242, 4242)
    dfd, files, skipped = read_trace_dir(str(ring_dir))
    os.close(dfd)
    assert list(files) == ["rank-00000.ring"]
    assert skipped == [{"name": "rank-00001.ring", "reason": "rank-00001.ring: owned by uid 0, not by the trace "
                                                              "directory's owner (uid 4242)"}]
