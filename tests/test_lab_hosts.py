"""The lab's managed block of the hosts file: added by `lab up`, removed by `lab down`, nothing else touched."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from megatrace.lab import hosts

ORIGINAL = "127.0.0.1 localhost\n::1 localhost ip6-localhost\n10.0.0.7 n2  # a real host of that name\n"


def test_node_names_are_added_once_and_removed_to_the_original(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text(ORIGINAL)
    assert hosts.add_nodes(["n1", "n2", "n3"], path) == ["n1", "n3"]  # n2 is mapped by the file already
    text = path.read_text()
    assert text.startswith(ORIGINAL) and f"{hosts.LAB_ADDR} n1 n3\n" in text
    assert hosts.add_nodes(["n1", "n2", "n3"], path) == ["n1", "n3"] and path.read_text() == text  # idempotent
    hosts.add_nodes(["n1", "n2"], path)  # a lab of another size replaces the block
    assert path.read_text().count(hosts.BEGIN) == 1 and f"{hosts.LAB_ADDR} n1\n" in path.read_text()
    assert hosts.remove_nodes(path) and path.read_text() == ORIGINAL
    assert not hosts.remove_nodes(path) and path.read_text() == ORIGINAL


def test_a_begin_marker_without_its_end_loses_no_line(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text(ORIGINAL + hosts.BEGIN + "\n10.1.1.1 keepme\n")
    assert not hosts.remove_nodes(path)
    assert "10.1.1.1 keepme" in path.read_text()


def test_a_planted_link_is_not_written_through(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("secret\n")
    link = tmp_path / "hosts"
    os.symlink(target, link)
    with pytest.raises(OSError):
        hosts.add_nodes(["n1"], link)
    assert target.read_text() == "secret\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="maps names in /etc/hosts: root only")
def test_the_lab_node_names_resolve_while_the_block_is_there() -> None:
    name = "megatrace-lab-probe-n9"
    before = hosts.HOSTS.read_bytes()  # (a lab that is up keeps its block: the file is restored as it was)
    try:
        assert hosts.add_nodes([name]) == [name]
        assert socket.getaddrinfo(name, 1, type=socket.SOCK_STREAM)[0][4][0] == hosts.LAB_ADDR
        hosts.remove_nodes()
    finally:
        with open(hosts.HOSTS, "r+b") as fh:
            fh.truncate(0)
            fh.write(before)
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo(name, 1, type=socket.SOCK_STREAM)
