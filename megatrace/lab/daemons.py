"""Start, stop and inspect the lab's daemons: munged, slurmctld and one slurmd per virtual node.

Every pid ``up`` starts is recorded in the lab's state file; ``down`` stops only
those (checking that the pid still runs the same program), never by name.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megatrace.lab import LabError
from megatrace.lab.paths import LabPaths
from megatrace.lab.slurmconf import PARTITION, LabSpec

Log = Callable[[str], None]
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


@dataclass
class Daemon:
    name: str  # "munged", "slurmctld", "slurmd-n1", ...
    pid: int
    comm: str  # expected /proc/PID/comm

    def alive(self) -> bool:
        return process_comm(self.pid) == self.comm


def process_comm(pid: int) -> str | None:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        return None  # a zombie is not running
    return comm


def load_state(paths: LabPaths) -> dict:
    try:
        return json.loads(paths.state_file.read_text())
    except FileNotFoundError:
        return {"nodes": 0, "daemons": []}


def save_state(paths: LabPaths, state: dict) -> None:
    paths.root.mkdir(parents=True, exist_ok=True)
    tmp = paths.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, paths.state_file)


def recorded(state: dict) -> list[Daemon]:
    return [Daemon(**d) for d in state.get("daemons", [])]


def _record(paths: LabPaths, state: dict, daemon: Daemon) -> None:
    state["daemons"] = [d for d in state.get("daemons", []) if d["name"] != daemon.name]
    state["daemons"].append(vars(daemon))
    save_state(paths, state)


def _read_pid(path: Path, timeout: float) -> int:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        try:
            pid = int(path.read_text().strip())
            if process_comm(pid):
                return pid
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.1)
    raise LabError(f"no running daemon wrote {path} within {timeout:g} s")


def munge_works() -> bool:
    if not shutil.which("munge") or not shutil.which("unmunge"):
        return False
    cred = subprocess.run(["munge", "-n"], capture_output=True)
    if cred.returncode != 0:
        return False
    return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True).returncode == 0


def start_munge(paths: LabPaths, state: dict, log: Log) -> None:
    if munge_works():
        return  # a munged is running (ours from an earlier `up`, or the system's)
    sock_dir = Path("/run/munge")
    sock_dir.mkdir(parents=True, exist_ok=True)
    pidfile = paths.run_dir / "munged.pid"
    pidfile.unlink(missing_ok=True)
    proc = subprocess.run(["munged", "--force", f"--pid-file={pidfile}",
                           f"--log-file={paths.log_dir / 'munged.log'}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise LabError(f"munged failed to start: {proc.stderr.strip()}")
    pid = _read_pid(pidfile, 10)
    _record(paths, state, Daemon("munged", pid, process_comm(pid) or "munged"))
    log(f"lab: munged pid {pid}")


def _start(paths: LabPaths, state: dict, name: str, argv: list[str], pidfile: Path, log: Log) -> None:
    for d in recorded(state):
        if d.name == name and d.alive():
            return
    pidfile.unlink(missing_ok=True)
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LabError(f"{name} failed to start (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    pid = _read_pid(pidfile, 15)
    _record(paths, state, Daemon(name, pid, process_comm(pid) or name.split("-")[0]))
    log(f"lab: {name} pid {pid}")


def _scontrol_ping() -> bool:
    proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    return proc.returncode == 0 and "UP" in proc.stdout


def node_states(spec: LabSpec) -> dict[str, str]:
    proc = subprocess.run(["sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N %T"], capture_output=True, text=True)
    states = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in spec.node_names:
            states[parts[0]] = parts[1]
    return states


def start_slurm(spec: LabSpec, paths: LabPaths, state: dict, log: Log) -> None:
    # No -c: the controller recovers its state, so job ids keep counting up and a job
    # directory megatrace-<jobid> of an earlier lab is never reused.
    _start(paths, state, "slurmctld", ["slurmctld", "-f", str(paths.slurm_conf)],
           paths.run_dir / "slurmctld.pid", log)
    until = time.monotonic() + START_TIMEOUT_S
    while not _scontrol_ping():
        if time.monotonic() > until:
            raise LabError(f"slurmctld does not answer; see {paths.log_dir / 'slurmctld.log'}")
        time.sleep(0.3)
    for node in spec.node_names:
        _start(paths, state, f"slurmd-{node}", ["slurmd", "-N", node, "-f", str(paths.slurm_conf)],
               paths.run_dir / f"slurmd-{node}.pid", log)


def wait_nodes_idle(spec: LabSpec, paths: LabPaths, log: Log, timeout: float = START_TIMEOUT_S) -> None:
    """Wait until every lab node is usable; resume nodes an earlier run left drained or down."""
    until = time.monotonic() + timeout
    resumed: set[str] = set()
    states: dict[str, str] = {}
    while time.monotonic() < until:
        states = node_states(spec)
        # "idle*" (a trailing *) is a node whose slurmd does not answer: not ready yet.
        if len(states) == spec.nodes and all(s.rstrip("~#") in ("idle", "mixed", "allocated")
                                             for s in states.values()):
            return
        for node, st in states.items():
            if node not in resumed and any(k in st for k in ("drain", "down", "fail")):
                subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
                resumed.add(node)
        time.sleep(0.5)
    raise LabError(f"lab nodes not idle after {timeout:g} s: {states}; see {paths.log_dir}")


def _cancel_jobs() -> None:
    if shutil.which("scancel") and _scontrol_ping():
        subprocess.run(["scancel", "-p", PARTITION], capture_output=True, timeout=20)


def stop_all(paths: LabPaths, state: dict, log: Log) -> list[str]:
    """Stop every recorded daemon: slurmd first, then slurmctld, then munged. Returns what was stopped."""
    daemons = recorded(state)
    if any(d.name == "slurmctld" and d.alive() for d in daemons):
        try:
            _cancel_jobs()
        except subprocess.TimeoutExpired:
            pass
    order = sorted(daemons, key=lambda d: (0 if d.name.startswith("slurmd") else
                                           1 if d.name == "slurmctld" else 2))
    stopped = []
    for group in (("slurmd",), ("slurmctld",), ("munged",)):
        batch = [d for d in order if d.name.split("-")[0] in group and d.alive()]
        for d in batch:
            os.kill(d.pid, signal.SIGTERM)
        until = time.monotonic() + STOP_TIMEOUT_S
        while any(d.alive() for d in batch) and time.monotonic() < until:
            time.sleep(0.1)
        for d in batch:
            if d.alive():
                os.kill(d.pid, signal.SIGKILL)
                log(f"lab: {d.name} pid {d.pid} did not stop on SIGTERM; killed")
            stopped.append(f"{d.name} (pid {d.pid})")
        until = time.monotonic() + 5
        while any(d.alive() for d in batch) and time.monotonic() < until:
            time.sleep(0.05)
    state["daemons"] = []
    save_state(paths, state)
    return stopped
