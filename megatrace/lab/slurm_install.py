"""Which Slurm the lab runs: Debian's packages (the default), one installed under a prefix, or one built from a
source tarball and kept for the next run.

A Slurm under a prefix is used by putting ``PREFIX/bin`` and ``PREFIX/sbin`` ahead of ``PATH`` in the lab's own
process (:func:`activate`): every command the lab runs by name (slurmctld, slurmd, scontrol, sbatch) and every
job it submits then use that Slurm, and the prolog and epilog find it beside the running slurmd
(``SLURM_BIN``, slurm/megatrace-lib.sh). Its configuration is the lab's ``/etc/slurm/slurm.conf``: builds made
here use ``--sysconfdir=/etc/slurm``; another build is pointed there with ``SLURM_CONF``.

A build runs ``configure`` with :data:`CONFIGURE` (``--enable-multiple-slurmd``: several slurmd on one host),
``make`` and ``make install`` into ``BUILD_ROOT/<version>-<digest>``, where the digest covers the tarball and
the options; a finished build writes :data:`MARKER` last, so only a complete one is ever reused.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatrace.lab import LabError
from megatrace.lab.apt import Log, apt_install

BUILD_ROOT = Path("/opt/megatrace-slurm")
CONFIGURE = ("--sysconfdir=/etc/slurm", "--disable-debug", "--without-hdf5", "--without-rpath",
             "--enable-multiple-slurmd")
MARKER = ".megatrace-build"
# Debian package -> a file that proves it is installed: what a source build needs beyond a compiler.
BUILD_PACKAGES = {"libmunge-dev": "/usr/include/munge.h", "make": "/usr/bin/make", "gcc": "/usr/bin/cc",
                  "python3": "/usr/bin/python3", "bzip2": "/bin/bzip2"}
NEEDED = ("sbin/slurmctld", "sbin/slurmd", "bin/sbatch", "bin/srun", "bin/scontrol", "bin/sinfo",
          "include/slurm/spank.h")
VERSION_RE = re.compile(r"(\d+\.\d+\.\d+)")  # "slurm 26.05.3", Debian's "slurm-wlm 22.05.8"
TARBALL_TOP = re.compile(r"slurm-(\d+\.\d+\.\d+)")


@dataclass(frozen=True)
class SlurmInstall:
    """A Slurm the lab can run; ``prefix`` None is the system's (Debian's packages, on PATH)."""

    prefix: Path | None = None

    @property
    def bin_dirs(self) -> list[str]:
        return [str(self.prefix / "bin"), str(self.prefix / "sbin")] if self.prefix is not None else []

    @property
    def include(self) -> Path:
        return self.prefix / "include" if self.prefix is not None else Path("/usr/include")

    def version(self) -> str:
        """``slurmd -V``'s release (``26.05.3``), or "" when it cannot say."""
        exe = str(self.prefix / "sbin" / "slurmd") if self.prefix is not None else (shutil.which("slurmd") or "")
        if not exe:
            return ""
        try:
            out = subprocess.run([exe, "-V"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
        m = VERSION_RE.search(out)
        return m.group(1) if m else ""

    def describe(self) -> dict[str, str]:
        return {"prefix": str(self.prefix or ""), "version": self.version(), "bin_dirs": ":".join(self.bin_dirs)}


def activate(slurm: SlurmInstall) -> None:
    """Put ``slurm``'s commands ahead of the others on this process's PATH (and its children's)."""
    dirs = slurm.bin_dirs
    if not dirs:
        return
    rest = [d for d in os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").split(":") if d not in dirs]
    os.environ["PATH"] = ":".join(dirs + rest)


def from_prefix(prefix: str | os.PathLike[str]) -> SlurmInstall:
    """The Slurm installed under ``prefix``; LabError naming what is missing or unusable."""
    root = Path(prefix).resolve()
    missing = [p for p in NEEDED if not (root / p).is_file()]
    if missing:
        raise LabError(f"--slurm {prefix}: not a Slurm installation: no {', '.join(missing)} under it (give the "
                       f"--prefix of its configure, or build one with --slurm-source TARBALL)")
    slurm = SlurmInstall(root)
    if not multiple_slurmd(slurm):
        raise LabError(f"--slurm {prefix}: its slurmd was built without --enable-multiple-slurmd, so the lab's "
                       f"several slurmd cannot share this host (\"Duplicated NodeHostName\"); rebuild it with that "
                       f"option, or let the lab build one: --slurm-source TARBALL")
    return slurm


def multiple_slurmd(slurm: SlurmInstall) -> bool:
    """Whether its slurmd takes ``-N NODENAME`` (built with --enable-multiple-slurmd)."""
    exe = slurm.prefix / "sbin" / "slurmd" if slurm.prefix is not None else Path(shutil.which("slurmd") or "slurmd")
    try:
        out = subprocess.run([str(exe), "-h"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return re.search(r"^\s*-N\b", out.stdout + out.stderr, re.M) is not None


def build_from_source(tarball: str | os.PathLike[str], log: Log, jobs: int | None = None,
                      root: Path = BUILD_ROOT) -> SlurmInstall:
    """Build the Slurm of ``tarball`` under ``root`` (or reuse the build of the same tarball and options)."""
    src = Path(tarball)
    try:
        digest = hashlib.sha256()
        with src.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as exc:
        raise LabError(f"--slurm-source {tarball}: cannot read it: {exc.strerror}") from None
    digest.update("\0".join(CONFIGURE).encode())
    version = _tarball_version(src)
    prefix = root / f"{version}-{digest.hexdigest()[:12]}"
    stamp = f"{digest.hexdigest()} {' '.join(CONFIGURE)}\n"
    if _read(prefix / MARKER) == stamp:
        log(f"lab: Slurm {version} already built in {prefix}")
        return from_prefix(prefix)
    _ensure_build_packages(log)
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    shutil.rmtree(prefix, ignore_errors=True)  # a build that never finished
    jobs = jobs or os.cpu_count() or 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="megatrace-slurm-build-") as work:
        log(f"lab: building Slurm {version} into {prefix} (configure, make -j{jobs}, make install: about 5 minutes "
            f"on 2 cores; kept for the next run)")
        logfile = Path(work) / "build.log"
        _run(["tar", "-xzf", str(src.resolve()), "--no-same-owner"], "unpacking the Slurm source", Path(work), logfile)
        tree = Path(work) / f"slurm-{version}"
        if not (tree / "configure").is_file():
            raise LabError(f"--slurm-source {tarball}: no slurm-{version}/configure in it")
        for what, argv in (("configure", ["./configure", f"--prefix={prefix}", *CONFIGURE]),
                           ("make", ["make", f"-j{jobs}"]), ("make install", ["make", "install"])):
            t = time.monotonic()
            _run(argv, f"Slurm {version}: {what}", cwd=tree, logfile=logfile)
            log(f"lab: Slurm {version}: {what} done in {time.monotonic() - t:.0f} s")
    (prefix / MARKER).write_text(stamp)
    log(f"lab: Slurm {version} built in {time.monotonic() - t0:.0f} s: {prefix}")
    return from_prefix(prefix)


def _tarball_version(src: Path) -> str:
    """The release of a ``slurm-X.Y.Z`` source tarball, from its top directory."""
    try:
        with tarfile.open(src) as tar:
            first = next(iter(tar), None)
    except (OSError, tarfile.TarError) as exc:
        raise LabError(f"--slurm-source {src}: not a readable tarball: {exc}") from None
    m = TARBALL_TOP.match(first.name) if first is not None else None
    if m is None:
        raise LabError(f"--slurm-source {src}: not a Slurm source tarball (its top directory is not slurm-X.Y.Z)")
    return m.group(1)


def _ensure_build_packages(log: Log) -> None:
    apt_install([pkg for pkg, proof in BUILD_PACKAGES.items() if not os.path.exists(proof)], log)


def _run(argv: list[str], what: str, cwd: Path, logfile: Path) -> None:
    """Run a build step, its output into ``logfile``; on failure, LabError with the output's tail."""
    with logfile.open("a") as out:
        proc = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = "\n".join(logfile.read_text(errors="replace").strip().splitlines()[-20:])
        raise LabError(f"{what} failed (exit {proc.returncode}): {' '.join(argv)}\n{tail}")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
