"""Install what the lab needs and is missing: Debian packages, the MPI wheels, the plugin, prolog and epilog."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
from pathlib import Path

from megatrace.lab import LabError
from megatrace.lab.apt import Log, apt_install, run_quiet
from megatrace.lab.paths import LabPaths, repo_root
from megatrace.lab.slurm_install import SlurmInstall

# Debian package -> a file that proves it is installed: what any lab needs, and Debian's Slurm (the default).
BASE_PACKAGES = {"munge": "/usr/sbin/munged", "make": "/usr/bin/make", "gcc": "/usr/bin/cc"}
SLURM_PACKAGES = {
    "slurmctld": "/usr/sbin/slurmctld",
    "slurm-client": "/usr/bin/sbatch",
    "slurmd": "/usr/sbin/slurmd",
    "libslurm-dev": "/usr/include/slurm/spank.h",
}
APT_PACKAGES = {**SLURM_PACKAGES, **BASE_PACKAGES}
# Python distribution -> pip requirement (the `mpi` extra): MPICH wheels work with `srun --mpi=pmi2`.
PIP_PACKAGES = {"mpi4py": "mpi4py>=3.1", "mpich": "mpich"}



def missing_apt(packages: dict[str, str] = APT_PACKAGES) -> list[str]:
    return [pkg for pkg, proof in packages.items() if not os.path.exists(proof)]


def ensure_apt(log: Log, slurm: SlurmInstall = SlurmInstall()) -> None:
    """The packages the lab needs: Debian's Slurm too unless it runs one under a prefix."""
    apt_install(missing_apt(APT_PACKAGES if slurm.prefix is None else BASE_PACKAGES), log)


def missing_pip() -> list[str]:
    missing = []
    for dist, req in PIP_PACKAGES.items():
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(req)
    return missing


def ensure_pip(log: Log) -> None:
    missing = missing_pip()
    if not missing:
        return
    log(f"lab: pip install {' '.join(missing)} (into {sys.prefix})")
    run_quiet([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *missing],
              "pip install")


def install_plugin(paths: LabPaths, log: Log, slurm: SlurmInstall = SlurmInstall()) -> None:
    """Build spank_plugin/ against ``slurm``'s headers and install the .so and the plugstack.conf.d snippet."""
    src = repo_root() / "spank_plugin"
    if not (src / "Makefile").exists():
        raise LabError(f"no {src}/Makefile: the lab needs a source checkout of megatrace")
    args = "hang_timeout=600 check=quick"
    interposer = install_interposer(paths, log)
    if interposer is not None:
        args += f" nccl_preload={interposer}"
    make = ["make", "-s", "-C", str(src), f"LIBDIR={paths.libexec}", f"PLUGSTACK_DIR={paths.plugstack_dir}",
            f"MEGATRACE_BIN={paths.megatrace_bin}", f"PLUGSTACK_ARGS={args}", f"SLURM_INCLUDE={slurm.include}"]
    run_quiet(make + ["clean"], "cleaning the SPANK plugin's build")  # (objects of another release's headers)
    run_quiet(make + ["all"], "building the SPANK plugin")
    run_quiet(make + ["install"], "installing the SPANK plugin")
    log(f"lab: plugin {paths.plugin}, {paths.plugstack_dir / 'megatrace.conf'}")


def install_interposer(paths: LabPaths, log: Log) -> Path | None:
    """A root-owned copy of the NCCL interposer, which the plugin puts in front of every traced task's
    LD_PRELOAD (plugstack nccl_preload=); built from the package's sources when the wheel had no compiler."""
    from megatrace.trace.nccl import InterposerMissing, build, library_path

    dest = paths.libexec / "libmegatrace_nccl.so"
    paths.libexec.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".new-{dest.name}")
    try:
        try:
            shutil.copyfile(library_path(), tmp)
        except InterposerMissing:
            build(tmp)
    except OSError as exc:
        log(f"lab: no NCCL interposer ({exc}); traced jobs get the Python tracer only")
        return None
    os.chown(tmp, 0, 0)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)
    return dest


def install_scripts(paths: LabPaths, log: Log) -> None:
    """Root-owned copies of slurm/prolog, epilog and healthcheck (Slurm runs them as root, never from the checkout)."""
    src = repo_root() / "slurm"
    paths.libexec.mkdir(parents=True, exist_ok=True)
    for name, dest in (("prolog", paths.prolog), ("epilog", paths.epilog), ("healthcheck", paths.healthcheck),
                       ("megatrace-lib.sh", paths.libexec / "megatrace-lib.sh")):  # what all three source
        tmp = dest.with_name(f".{name}.tmp")
        shutil.copyfile(src / name, tmp)
        os.chown(tmp, 0, 0)
        os.chmod(tmp, 0o644 if name.endswith(".sh") else 0o755)
        os.replace(tmp, dest)
    log(f"lab: prolog {paths.prolog}, epilog {paths.epilog}, HealthCheckProgram {paths.healthcheck}")


def install_all(paths: LabPaths, log: Log, slurm: SlurmInstall = SlurmInstall()) -> None:
    ensure_apt(log, slurm)
    ensure_pip(log)
    install_plugin(paths, log, slurm)
    install_scripts(paths, log)
