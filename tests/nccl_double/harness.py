"""Build the NCCL test double and its driver, and run traced jobs on them under ``mpiexec``.

Shared by tests/test_nccl_*.py and bench/nccl_interposer.py. The double (``libnccl.so.2``) and
the driver are compiled with the system C compiler against the MPI of the ``mpich`` wheel in
this Python's prefix; the interposer is compiled from the repository by
:func:`megatrace.trace.nccl.build`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers.shm import mpich_segments, remove_left_by

from megatrace.trace.nccl import build as build_interposer
from megatrace.trace.nccl.build import HERE as API_DIR
from megatrace.trace.nccl.build import compiler

DOUBLE_DIR = Path(__file__).resolve().parent
PREFIX = Path(sys.prefix)


class BuildUnavailable(RuntimeError):
    """No C compiler or no MPI (the ``mpich`` wheel) here: the tests that need them skip."""


@dataclass(frozen=True)
class Build:
    interposer: Path
    double: Path
    driver: Path
    mpiexec: Path
    cudart: Path  # a CUDA runtime double (events on host), for the interposer's event completion path


@dataclass
class Job:
    """How a driver run ended: per rank the exit code or signal the wrapper saw (absent: killed with the job)."""

    returncode: int
    stderr: str
    exits: dict[int, int] = field(default_factory=dict)
    stalled: bool = False
    wall_s: float = 0.0
    stdout: str = ""


def build_all(out: Path) -> Build:
    """Compile the interposer, the double and the driver into ``out``."""
    cc = compiler()
    mpi_h, libmpi, mpiexec = PREFIX / "include" / "mpi.h", PREFIX / "lib" / "libmpi.so", PREFIX / "bin" / "mpiexec"
    if not cc:
        raise BuildUnavailable("no C compiler")
    if not (mpi_h.exists() and libmpi.exists() and mpiexec.exists()):
        raise BuildUnavailable(f"no MPI in {PREFIX} (pip install mpich)")
    out.mkdir(parents=True, exist_ok=True)
    interposer = build_interposer(out / "interposer")
    double, driver, cudart = out / "libnccl.so.2", out / "driver", out / "libcudart.so.12"
    common = ["-O2", "-Wall", "-Wextra", f"-I{API_DIR}", f"-I{PREFIX / 'include'}"]
    link = [f"-L{PREFIX / 'lib'}", "-lmpi", f"-Wl,-rpath,{out}:{PREFIX / 'lib'}"]
    for cmd in ([cc, *common, "-fPIC", "-shared", str(DOUBLE_DIR / "libnccl.c"), "-o", str(double),
                 "-Wl,-soname,libnccl.so.2", *link],
                [cc, *common, str(DOUBLE_DIR / "driver.c"), "-o", str(driver), str(double), *link],
                [cc, "-O2", "-Wall", "-Wextra", "-fPIC", "-shared", str(DOUBLE_DIR / "libcudart.c"), "-o", str(cudart),
                 "-Wl,-soname,libcudart.so.12"]):
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr}")
    return Build(interposer, double, driver, mpiexec, cudart)


def build_local_scope(build: Build) -> Build:
    """The same build with the driver loaded as PyTorch loads NCCL: from a library dlopen()ed with
    RTLD_LOCAL (``local_scope.c``), so the double is out of the preloaded interposer's RTLD_NEXT."""
    out = build.driver.parent
    library, launcher = out / "libdriver.so", out / "driver-local"
    link = [f"-L{PREFIX / 'lib'}", "-lmpi", f"-Wl,-rpath,{out}:{PREFIX / 'lib'}"]
    for cmd in ([compiler(), "-O2", "-Wall", "-Wextra", f"-I{API_DIR}", f"-I{PREFIX / 'include'}", "-fPIC", "-shared",
                 "-Dmain=megatrace_driver_main", str(DOUBLE_DIR / "driver.c"), "-o", str(library), str(build.double),
                 *link],
                [compiler(), "-O2", "-Wall", "-Wextra", f'-DDRIVER_LIB="{library}"', str(DOUBLE_DIR / "local_scope.c"),
                 "-o", str(launcher), "-ldl"]):
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr}")
    return dataclasses.replace(build, driver=launcher)


def write_counters(ring_dir: Path) -> int:
    """Sum of the rings' write counters (header offset 256): grows while any rank makes calls."""
    total = 0
    for ring in ring_dir.glob("rank-*.ring"):
        try:
            with open(ring, "rb") as fh:
                fh.seek(256)
                raw = fh.read(8)
        except OSError:
            continue
        if len(raw) == 8:
            total += struct.unpack("<Q", raw)[0]
    return total


def run_job(build: Build, trace_dir: Path, args: list[str], *, ranks: int = 8, trace: bool = True,
            env: dict[str, str] | None = None, stall_s: float | None = None, deadline_s: float = 60.0,
            kill_after_records: int | None = None, stdout: bool = False, preload: tuple[Path, ...] = (),
            srun: list[str] | None = None) -> Job:
    """Run the driver on ``ranks`` MPI ranks through the interposer.

    ``srun``: launch with these srun arguments (a Slurm step, e.g. on ``megatrace lab``) instead of
    mpiexec; LD_PRELOAD is then set in the tasks only, and the job is stopped with SIGTERM (srun
    cancels the step). ``preload``: more libraries for LD_PRELOAD, after the interposer. ``stall_s``: kill the job (SIGKILL to its process group) once no rank has written a record
    for that long, as the demo launcher does with a hung job. ``kill_after_records``: SIGKILL it
    once the rings hold that many records in all. Each rank's exit status is kept by a small
    shell wrapper (``exit-<rank>``), so a rank that crashed can be told from those killed with it.
    """
    trace_dir.mkdir(parents=True, exist_ok=True)
    exits = trace_dir / "exits"
    exits.mkdir(exist_ok=True)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRACE_", "PMI_", "SLURM_"))}
    run_env.update({"MEGATRACE_DIR": str(trace_dir), "MEGATRACE_JOB_ID": "ncclt", "MEGATRACE_RING_RECORDS": "4096"})
    if trace:
        run_env["MEGATRACE_ENABLE"] = "1"
    run_env.update(env or {})
    wrapper = 'r=${PMI_RANK:-$SLURM_PROCID}; "$@" & p=$!; echo $p > "$0/pid-$r"; wait $p; echo $? > "$0/exit-$r"'
    # When a rank dies, mpiexec kills the others at once (its default; with -disable-auto-cleanup
    # MPICH stalls even collectives that do not involve the dead rank).
    libs = ":".join(str(p) for p in (build.interposer, *preload))
    if srun is not None:
        cmd = ["srun", f"-n{ranks}", "--mpi=pmi2", *srun, *(["env", f"LD_PRELOAD={libs}"] if trace else [])]
    else:
        cmd = [str(build.mpiexec), "-n", str(ranks), *(["-genv", "LD_PRELOAD", libs] if trace else [])]
    cmd += ["sh", "-c", wrapper, str(exits), str(build.driver), *args]
    stop = _kill if srun is None else _cancel
    start, segments = time.monotonic(), mpich_segments()
    proc = subprocess.Popen(cmd, env=run_env, stdout=subprocess.PIPE if stdout else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    stalled, last, last_change = False, -1, time.monotonic()
    try:
        while proc.poll() is None:
            time.sleep(0.1)
            now = time.monotonic()
            if stall_s is not None or kill_after_records is not None:
                count = write_counters(trace_dir)
                if count != last:
                    last, last_change = count, now
                if kill_after_records is not None and count >= kill_after_records:
                    stop(proc)
                    break
                if stall_s is not None and count > 0 and now - last_change > stall_s:
                    stalled = True
                    stop(proc)
                    break
            if now - start > deadline_s:
                stop(proc)
                raise TimeoutError(f"driver {' '.join(args)} still running after {deadline_s} s")
    finally:
        if proc.poll() is None:
            stop(proc)
    _reap(exits, build.driver)
    remove_left_by(segments)  # (the driver stands for the user's MPI program: ranks killed leave MPICH's segment)
    stderr = proc.stderr.read() if proc.stderr else ""
    out = proc.stdout.read() if proc.stdout else ""
    proc.wait()
    codes = {}
    for f in exits.glob("exit-*"):
        text = f.read_text().strip()
        if text.isdigit() and f.name[5:].isdigit():
            codes[int(f.name[5:])] = int(text)
    return Job(proc.returncode, stderr, codes, stalled, time.monotonic() - start, out)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec, its proxy and every rank: one process group
    except ProcessLookupError:
        pass
    proc.wait()


def _reap(exits: Path, driver: Path, wait_s: float = 20.0) -> None:
    """SIGKILL rank processes that outlived their launcher (a wedged MPI can leave them running), and
    wait until every rank process is gone, as a launcher does before it reports the job's end."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = 0
        for f in exits.glob("pid-*"):
            text = f.read_text().strip()
            if not text.isdigit():
                continue
            try:
                if Path(f"/proc/{text}/cmdline").read_bytes().split(b"\0")[0] == str(driver).encode():
                    os.kill(int(text), signal.SIGKILL)
                    alive += 1
            except (OSError, ValueError, IndexError):
                pass  # already gone (a zombie's cmdline is empty)
        if not alive or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _cancel(proc: subprocess.Popen) -> None:
    """Stop an srun step: on SIGTERM srun kills every task (SIGKILL after a grace) and exits."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        _kill(proc)


def write_procs(trace_dir: Path, job: Job, ranks: int) -> None:
    """``procs.json`` as the demo launcher writes it: per rank its exit, or killed by the launcher."""
    procs = {}
    for rank in range(ranks):
        code = job.exits.get(rank)
        if code is None:
            procs[str(rank)] = {"pid": None, "exit_code": None, "signal": None, "killed_by_launcher": True}
        elif code > 128:  # the shell's report of a child killed by signal (code - 128)
            procs[str(rank)] = {"pid": None, "exit_code": None, "signal": signal.Signals(code - 128).name,
                                "killed_by_launcher": False}
        else:
            procs[str(rank)] = {"pid": None, "exit_code": code, "signal": None, "killed_by_launcher": False}
    outcome = "stalled" if job.stalled else ("ok" if job.returncode == 0 else "failed")
    (trace_dir / "procs.json").write_text(json.dumps({"outcome": outcome, "message": "", "ranks": procs}) + "\n")
