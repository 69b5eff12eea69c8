"""Writing output files safely: whole or not at all, and never replacing what is not a regular file."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file renamed over it: a reader never sees half a file.

    A path that exists and is not a regular file (``/dev/null``, ``/dev/stdout``, a FIFO) is written
    in place: renaming over it would replace a device node with a file, as root even ``/dev/null``.
    """
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    try:
        special = not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        special = False
    if special:
        with open(path, "wb") as fh:
            fh.write(raw)
        return path
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(raw)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
