"""File access that is safe when run as root over directories a user controls.

The collector and the agent may run as root (from a prolog or epilog) while the
ring directory (``/dev/shm/megatrace/job-<id>.<node>``) and the job directory belong to
the job's user. Nothing here follows a symbolic link that another user could
have planted (the rules are :mod:`megatrace.files`'): directories are walked one
component at a time with ``O_NOFOLLOW``, and only links owned by root (``/dev/shm ->
/run/shm`` on some systems) or by this process's own user are followed. Files are
opened relative to the directory's descriptor with ``O_NOFOLLOW | O_NONBLOCK`` (a
FIFO cannot block the reader) and must be regular files. New files are created
with ``O_EXCL``, so an existing name, link or not, is never written through, and
an existing directory is used only when this user, root or the owner files are
given to owns it and others cannot write in it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path

from megatrace.files import UnsafePathError, open_dir, open_input, read_fd

__all__ = ["OutDir", "UnsafePathError", "list_dir", "open_dir", "open_regular", "owner_of", "read_file",
           "sha256_file"]
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def list_dir(dir_fd: int) -> list[str]:
    """Names in the directory open at ``dir_fd``."""
    dup = os.dup(dir_fd)
    try:
        with os.scandir(dup) as it:
            return sorted(e.name for e in it)
    finally:
        os.close(dup)


def open_regular(dir_fd: int, name: str) -> int:
    """A read-only descriptor of regular file ``name`` in ``dir_fd``; another user's link or another file
    type is refused (:func:`megatrace.files.open_input`).

    ``/proc/self/fd/<fd>`` then reaches exactly this file, for readers that take a path.
    """
    return open_input(name, dir_fd=dir_fd)


def read_file(dir_fd: int, name: str, limit: int) -> bytes:
    """The bytes of regular file ``name`` in ``dir_fd`` (no link of another user followed), at most ``limit``.

    Raises :class:`UnsafePathError` for such a link or a non-regular file, OSError on read errors.
    """
    fd = open_regular(dir_fd, name)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{name}: {st.st_size} bytes, more than the limit of {limit}")
        return read_fd(fd, limit, name)
    finally:
        os.close(fd)


def sha256_file(dir_fd: int, name: str, limit: int) -> tuple[int, str]:
    """(size, sha256) of regular file ``name`` in ``dir_fd`` (opened as by :func:`read_file`), read a chunk at a
    time: never held whole."""
    fd = open_regular(dir_fd, name)
    try:
        if os.fstat(fd).st_size > limit:
            raise OSError(errno.EFBIG, f"{name}: more than the limit of {limit} bytes")
        digest, size = hashlib.sha256(), 0
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
            size += len(chunk)
        return size, digest.hexdigest()
    finally:
        os.close(fd)


class OutDir:
    """A directory to write new files into; created if absent, never reached through a user's link.

    When run as root, ``owner`` (uid, gid) is given to every file created, and to the directory itself
    by :meth:`give_away` once everything is written (until then the user cannot plant a link in it),
    so that the job's user owns the bundle written into their job directory.
    """

    def __init__(self, path: str | os.PathLike[str], owner: tuple[int, int] | None = None,
                 exclusive: bool = False, create: bool = True) -> None:
        """``exclusive``: the directory must be new; ``create`` False: it must exist (FileNotFoundError)."""
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.owner = owner
        parent_fd = open_dir(self.path.parent)
        try:
            try:
                if not create:
                    raise FileExistsError
                os.mkdir(self.path.name, 0o755, dir_fd=parent_fd)
                created = True
            except FileExistsError:
                if exclusive:
                    raise
                created = False
            self.fd = os.open(self.path.name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
            self.created = created
        finally:
            os.close(parent_fd)
        if not created:
            self._check_existing()

    def _check_existing(self) -> None:
        """An existing directory is written into only when root, this user or ``owner`` owns it and
        nobody else can write in it (a job directory someone else planted is refused)."""
        st = os.fstat(self.fd)
        owners = {0, os.geteuid()} | ({self.owner[0]} if self.owner else set())
        problem = None
        if st.st_uid not in owners:
            problem = f"owned by uid {st.st_uid}"
        elif st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            problem = f"writable by everyone (mode {stat.S_IMODE(st.st_mode):04o})"
        if problem:
            os.close(self.fd)
            self.fd = -1
            raise UnsafePathError(errno.EPERM, f"{self.path}: {problem}; not written into")

    def _chown(self, fd: int) -> None:
        if self.owner is not None and os.geteuid() == 0:
            try:
                os.fchown(fd, *self.owner)
            except OSError:
                pass

    def give_away(self) -> None:
        """Hand the directory to ``owner`` (if this process created it): call after the last write."""
        if self.created:
            self._chown(self.fd)

    @property
    def fd_path(self) -> str:
        """A path that reaches this very directory even if its name was since replaced by a link."""
        return f"/proc/self/fd/{self.fd}"

    def subdir(self, name: str, create: bool = True) -> "OutDir":
        return OutDir(self.path / name, self.owner, create=create)

    def write(self, name: str, data: bytes, replace: bool = False) -> Path:
        """Write a new file ``name``; with ``replace``, an existing regular file is replaced atomically."""
        target = name
        if replace:
            target = f".{name}.tmp{os.getpid()}"
            try:
                os.unlink(target, dir_fd=self.fd)
            except FileNotFoundError:
                pass
        self.append(target, data, new=True)
        if replace:
            os.rename(target, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        return self.path / name

    def create(self, name: str) -> int:
        """A new file ``name`` (O_EXCL, never through a link), open for writing: the caller closes it."""
        fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=self.fd)
        self._chown(fd)
        return fd

    def append(self, name: str, data: bytes | memoryview, new: bool) -> None:
        """Write ``data`` at the end of file ``name``: a new file (O_EXCL) when ``new``, else one this
        directory holds already (a regular file, never through a link)."""
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if new else os.O_APPEND)
        fd = os.open(name, flags, 0o644, dir_fd=self.fd)
        try:
            if new:
                self._chown(fd)
            elif not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UnsafePathError(errno.EPERM, f"{self.path / name}: not a regular file; not written into")
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        finally:
            os.close(fd)

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "OutDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def owner_of(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(uid, gid) of directory ``path`` (not following a final link), or None."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_uid, st.st_gid
