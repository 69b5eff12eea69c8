"""The lab's node names resolve to the lab host: a managed block of ``/etc/hosts``.

A job written for a real cluster takes addresses from its node names (``MASTER_ADDR`` from the first
node of ``SLURM_NODELIST``); the lab's virtual nodes all run on this host, so ``lab up`` maps their names
to 127.0.0.1 and ``lab down`` removes the mapping. Only the block between the markers is ever changed;
a name the file already maps elsewhere (outside the block) is left to that line. The file is rewritten in
place (it is often a bind mount that cannot be replaced by a rename).
"""

from __future__ import annotations

import os
from pathlib import Path

HOSTS = Path("/etc/hosts")
BEGIN = "# BEGIN megatrace lab: node names of `megatrace lab up` (removed by `megatrace lab down`)"
END = "# END megatrace lab"
LAB_ADDR = "127.0.0.1"
MAX_BYTES = 1 << 20  # a hosts file larger than this is not ours to rewrite


def _without_block(lines: list[str]) -> list[str]:
    """The lines outside every managed block (a begin marker without its end is kept, with what follows)."""
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == BEGIN:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == END), None)
            if end is not None:
                i = end + 1
                continue
        out.append(lines[i])
        i += 1
    return out


def _mapped(lines: list[str]) -> set[str]:
    """Names the lines map to an address."""
    names: set[str] = set()
    for line in lines:
        fields = line.split("#", 1)[0].split()
        names.update(fields[1:])
    return names


def _read(path: Path) -> list[str]:
    with open(path, "rb") as fh:
        data = fh.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise OSError(f"{path}: larger than {MAX_BYTES} bytes, not rewritten")
    return data.decode("utf-8", errors="surrogateescape").splitlines()


def _write(path: Path, lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines).encode("utf-8", errors="surrogateescape")
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, text)
    finally:
        os.close(fd)


def add_nodes(names: list[str], path: Path = HOSTS) -> list[str]:
    """Map ``names`` to the lab host in ``path``'s managed block (replacing an older block); returns the
    names mapped there (those not already mapped by another line). Idempotent."""
    kept = _without_block(_read(path))
    mine = [n for n in names if n not in _mapped(kept)]
    block = [BEGIN, f"{LAB_ADDR} {' '.join(mine)}", END] if mine else []
    if kept + block != _read(path):
        _write(path, kept + block)
    return mine


def remove_nodes(path: Path = HOSTS) -> bool:
    """Remove the managed block; True when there was one."""
    lines = _read(path)
    kept = _without_block(lines)
    if kept == lines:
        return False
    _write(path, kept)
    return True
