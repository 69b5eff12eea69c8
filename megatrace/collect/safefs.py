"""File access that is safe when run as root over directories a user controls.

The collector and the agent may run as root (from a prolog or epilog) while the
ring directory (``/dev/shm/megatrace/<job>``) and the job directory belong to
the job's user. Nothing here follows a symbolic link that a non-root user could
have planted: directories are walked one component at a time with
``O_NOFOLLOW``, and only links owned by root (``/dev/shm -> /run/shm`` on some
systems) are followed. Files are opened relative to the directory's descriptor
with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO cannot block the reader) and must be
regular files. New files are created with ``O_EXCL``, so an existing name,
link or not, is never written through.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_MAX_LINKS = 16


class UnsafePathError(OSError):
    """A path crosses a link or file type that we refuse to follow."""


def open_dir(path: str | os.PathLike[str]) -> int:
    """A descriptor for directory ``path``, reached without following links a non-root user owns.

    Raises :class:`UnsafePathError` for such a link (or a non-directory), OSError otherwise.
    """
    return _walk(os.path.abspath(os.fspath(path)), 0)


def _walk(path: str, depth: int) -> int:
    if depth > _MAX_LINKS:
        raise UnsafePathError(errno.ELOOP, f"{path}: too many levels of symbolic links")
    fd = os.open("/", _DIR_FLAGS)
    try:
        parts = [p for p in path.split("/") if p and p != "."]
        walked = ""
        for i, part in enumerate(parts):
            if part == "..":
                raise UnsafePathError(errno.EINVAL, f"{path}: '..' in a collector path")
            walked += "/" + part
            st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                if st.st_uid != 0:
                    raise UnsafePathError(errno.ELOOP, f"{walked}: a symbolic link owned by uid {st.st_uid}; "
                                                       "not followed")
                target = os.readlink(part, dir_fd=fd)
                base = "/" + "/".join(parts[:i])
                rest = "/".join(parts[i + 1:])
                resolved = os.path.normpath(os.path.join(base, target, rest))
                os.close(fd)
                fd = -1
                return _walk(resolved, depth + 1)
            if not stat.S_ISDIR(st.st_mode):
                raise UnsafePathError(errno.ENOTDIR, f"{walked}: not a directory")
            nfd = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        out, fd = fd, -1
        return out
    finally:
        if fd >= 0:
            os.close(fd)


def list_dir(dir_fd: int) -> list[str]:
    """Names in the directory open at ``dir_fd``."""
    dup = os.dup(dir_fd)
    try:
        with os.scandir(dup) as it:
            return sorted(e.name for e in it)
    finally:
        os.close(dup)


def open_regular(dir_fd: int, name: str) -> int:
    """A read-only descriptor of regular file ``name`` in ``dir_fd``; a link or another file type is refused.

    ``/proc/self/fd/<fd>`` then reaches exactly this file, for readers that take a path.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(errno.ELOOP, f"{name}: a symbolic link; not followed") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(errno.EINVAL, f"{name}: not a regular file")
    return fd


def read_file(dir_fd: int, name: str, limit: int) -> bytes:
    """The bytes of regular file ``name`` in ``dir_fd`` (no link followed), at most ``limit`` of them.

    Raises :class:`UnsafePathError` for a link or a non-regular file, OSError on read errors.
    """
    fd = open_regular(dir_fd, name)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{name}: {st.st_size} bytes, more than the limit of {limit}")
        chunks = []
        left = limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 22))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class OutDir:
    """A directory to write new files into; created if absent, never reached through a user's link.

    When run as root, ``owner`` (uid, gid) is given to every file created, and to the directory itself
    by :meth:`give_away` once everything is written (until then the user cannot plant a link in it),
    so that the job's user owns the bundle written into their job directory.
    """

    def __init__(self, path: str | os.PathLike[str], owner: tuple[int, int] | None = None,
                 exclusive: bool = False) -> None:
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.owner = owner
        parent_fd = open_dir(self.path.parent)
        try:
            try:
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

    def subdir(self, name: str) -> "OutDir":
        return OutDir(self.path / name, self.owner)

    def write(self, name: str, data: bytes, replace: bool = False) -> Path:
        """Write a new file ``name``; with ``replace``, an existing regular file is replaced atomically."""
        target = name
        if replace:
            target = f".{name}.tmp{os.getpid()}"
            try:
                os.unlink(target, dir_fd=self.fd)
            except FileNotFoundError:
                pass
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=self.fd)
        try:
            self._chown(fd)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        finally:
            os.close(fd)
        if replace:
            os.rename(target, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        return self.path / name

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
