"""File access that is safe when another user controls part of the path, whoever runs it (root included).

Every part of MegaTrace may read or write in a directory that someone else can change: root's
collector and ``megatrace analyze`` in a user's job directory, a user's tracer under a shared
base like ``/dev/shm``. The rules (docs/security.md) live here, once:

* **Links.** A symbolic link is followed only when root or this process's own user owns it
  (:func:`trusted_owner`): a link planted by another user is never followed, so root never
  writes or reads through a user's link, whatever ``fs.protected_symlinks`` says.
* **Inputs** (:func:`open_input`, :func:`read_input`) are regular files, opened with
  ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO or device cannot block or feed the reader), read up to a limit.
* **Outputs** (:func:`write_atomic`, :func:`atomic_output`) are written to a new file created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` beside the target and renamed over it, both relative to one
  descriptor of the directory: a reader never sees half a file and nothing is written through an
  existing name. A FIFO or device at the target is written into only when root or this user owns
  it (``-o /dev/stdout``); one planted by someone else is replaced, never written into.
* **Private directories** (:func:`private_dir`) for a user's own files (rings, meta with the
  environment): created mode 0700, owned by this user, writable by nobody else, and every
  directory above them owned by root or this user and not writable by others unless sticky.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from megatrace.errors import MegatraceError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_MAX_LINKS = 16
INPUT_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafePathError(MegatraceError, OSError):
    """A path crosses a link, file type or owner that we refuse; the message names the path and why."""


def trusted_owner(uid: int) -> bool:
    """Whether a link or special file owned by ``uid`` may be followed or written into: root's or our own."""
    return uid == 0 or uid == os.geteuid()


# -- directories ------------------------------------------------------------------------------------

def open_dir(path: str | os.PathLike[str]) -> int:
    """A descriptor for directory ``path``, reached without following a link that another user owns.

    Walks the path one component at a time with ``O_NOFOLLOW``; a link owned by root or by this
    user is resolved and walked in turn. Raises :class:`UnsafePathError` for another user's link
    (or a non-directory), OSError otherwise.
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
                raise UnsafePathError(errno.EINVAL, f"{path}: '..' in a path that must not leave its directory")
            walked += "/" + part
            st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                if not trusted_owner(st.st_uid):
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


def private_dir(path: str | os.PathLike[str]) -> int:
    """A descriptor of directory ``path`` fit for this user's private files; created (parents too) mode 0700.

    The directory must be a real directory (not a link) owned by this user and writable by nobody
    else; every directory above it (as the kernel reaches it: links on the way do not matter, the
    place does) must be owned by root or this user, and not writable by others unless it is sticky
    like ``/tmp``. Raises :class:`UnsafePathError` naming the directory and what is wrong.
    """
    path = os.path.abspath(os.fspath(path))
    _make_dirs(path)
    try:
        fd = os.open(path, _DIR_FLAGS | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(exc.errno, f"{path}: a symbolic link or not a directory; not used") from None
        raise
    try:
        check_private_dir(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_dirs(path: str) -> None:
    """``mkdir -p`` with mode 0700 for every directory it creates (os.makedirs gives parents the umask's)."""
    missing = []
    head = path
    while head and not os.path.lexists(head):
        missing.append(head)
        head = os.path.dirname(head)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass


def check_private_dir(fd: int, path: str) -> None:
    """Raise :class:`UnsafePathError` unless directory ``fd`` (named ``path`` in messages) is private; see
    :func:`private_dir`. The ancestors are checked by walking ``..`` from the descriptor to ``/``."""
    euid = os.geteuid()
    st = os.fstat(fd)
    if st.st_uid != euid:
        raise UnsafePathError(errno.EPERM, f"{path}: owned by uid {st.st_uid}, not by this user (uid {euid}); "
                                           "not used")
    if st.st_mode & 0o022:
        raise UnsafePathError(errno.EPERM, f"{path}: writable by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
                                           "not used")
    cur = os.dup(fd)
    try:
        here = st
        for _ in range(4096):
            up = os.open("..", _DIR_FLAGS, dir_fd=cur)
            os.close(cur)
            cur = up
            parent = os.fstat(cur)
            if (parent.st_dev, parent.st_ino) == (here.st_dev, here.st_ino):
                return  # "/"
            if parent.st_uid not in (0, euid):
                raise UnsafePathError(errno.EPERM, f"{path}: a directory above it is owned by uid {parent.st_uid}, "
                                                   "who could replace it; not used")
            if parent.st_mode & 0o002 and not parent.st_mode & stat.S_ISVTX:
                raise UnsafePathError(errno.EPERM, f"{path}: a directory above it is writable by everyone and not "
                                                   "sticky; not used")
            here = parent
    finally:
        os.close(cur)


def create_private(dir_fd: int, name: str, flags: int = os.O_RDWR) -> int:
    """A new file ``name`` in ``dir_fd``, mode 0600, created with O_EXCL: an existing name (a link too) fails."""
    return os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)


def move_aside(dir_fd: int, name: str, *also: str) -> None:
    """Keep an earlier attempt's ``name`` (and its companions ``also``) as ``name.K``, K the first free number,
    so that the new file can be created with O_EXCL: a writer never overwrites what a previous run left."""
    if not _exists(name, dir_fd):
        return
    k = 1
    while _exists(f"{name}.{k}", dir_fd):
        k += 1
    os.rename(name, f"{name}.{k}", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    for other in also:
        if _exists(other, dir_fd):
            os.rename(other, f"{other}.{k}", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


# -- inputs -----------------------------------------------------------------------------------------

def open_input(path: str | os.PathLike[str], dir_fd: int | None = None) -> int:
    """A read-only descriptor of regular file ``path``; a link is followed only when root or this user owns it.

    Raises :class:`UnsafePathError` for another user's link or a FIFO, device, socket or directory
    (opened with O_NONBLOCK: nothing blocks), OSError when it cannot be opened.
    """
    try:
        fd = os.open(path, INPUT_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        if not trusted_owner(st.st_uid):
            raise UnsafePathError(errno.ELOOP, f"{os.fspath(path)}: a symbolic link owned by uid {st.st_uid}; "
                                               "not followed") from None
        fd = os.open(path, INPUT_FLAGS & ~os.O_NOFOLLOW, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(errno.EINVAL, f"{os.fspath(path)}: not a regular file; not read")
    return fd


def read_fd(fd: int, limit: int | None = None, name: str = "") -> bytes:
    """The bytes of open file ``fd`` (at most ``limit``: more raises OSError EFBIG naming ``name``)."""
    chunks = []
    left = limit
    while left is None or left >= 0:
        chunk = os.read(fd, 1 << 20 if left is None else min(left + 1, 1 << 20))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        if left is not None:
            left -= len(chunk)
    raise OSError(errno.EFBIG, f"{name}: larger than the limit of {limit} bytes")


def open_input_file(path: str | os.PathLike[str]) -> BinaryIO:
    """A binary file object of regular file ``path`` (see :func:`open_input`: no FIFO, device or foreign link)."""
    return os.fdopen(open_input(path), "rb")


def read_input(path: str | os.PathLike[str], limit: int | None = None) -> bytes:
    """The bytes of regular file ``path`` (see :func:`open_input`), at most ``limit`` of them."""
    fd = open_input(path)
    try:
        return read_fd(fd, limit, os.fspath(path))
    finally:
        os.close(fd)


# -- outputs ----------------------------------------------------------------------------------------

def _write_in_place(path: Path) -> bool:
    """Whether ``path`` is a FIFO or device (or a link to one) that root or this user owns: written into."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        if not trusted_owner(st.st_uid):
            return False
        try:
            st = os.stat(path)
        except OSError:
            return False
    return not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode) and trusted_owner(st.st_uid)


@contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` when the block ends without an exception; see the module docstring.

    The new file gets the usual mode (0666 less the umask). Anything at ``path`` that is not a FIFO
    or device of root or this user, a link of anyone included, is replaced, never written through.
    """
    path = Path(path)
    if _write_in_place(path):
        with open(path, "wb") as fh:
            yield fh
        return
    dfd = open_dir(path.parent)
    tmp = f".{path.name}.{os.urandom(6).hex()}.tmp"  # (secrets.token_hex: the same bytes)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as fh:
                yield fh
            os.rename(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            tmp = ""
        finally:
            if tmp:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
    finally:
        os.close(dfd)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` to ``path`` whole or not at all (:func:`atomic_output`); returns the path."""
    raw = data.encode() if isinstance(data, str) else data
    with atomic_output(path) as fh:
        fh.write(raw)
    return Path(path)
