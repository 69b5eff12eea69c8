"""``lab up``, ``lab down`` and ``lab status``: the facade over install, configuration and daemons."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path
from typing import Callable

from megatrace.lab import LabError
from megatrace.lab import daemons as dm
from megatrace.lab import hosts, install, slurmconf
from megatrace.lab.paths import LabPaths
from megatrace.lab.slurm_install import SlurmInstall, activate
from megatrace.lab.slurmconf import LabSpec

Log = Callable[[str], None]


def _require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise LabError(f"`megatrace lab {what}` runs Slurm daemons and installs packages: run it as root")


def up(spec: LabSpec, paths: LabPaths, log: Log, skip_install: bool = False,
       slurm: SlurmInstall | None = None) -> dict:
    """Install what is missing, write the configuration, start what is not running. Idempotent.

    ``slurm``: the Slurm to run (default: the one a running lab runs, else Debian's packages)."""
    _require_root("up")
    state = dm.load_state(paths)
    running = [d for d in dm.recorded(state) if d.alive()]
    if running and state.get("nodes") not in (None, spec.nodes):
        raise LabError(f"the lab is up with {state['nodes']} nodes; run `megatrace lab down` first")
    current = lab_slurm(state) if running else None
    if slurm is None:
        slurm = current or SlurmInstall()
    elif current is not None and current != slurm:
        raise LabError(f"the lab is up on {_name(current)}; run `megatrace lab down` first to run {_name(slurm)}")
    activate(slurm)
    paths = dataclasses.replace(paths, slurm_tag=(slurm.version() or "other") if slurm.prefix else "")
    if not skip_install:
        install.install_all(paths, log, slurm)
    conf_changed = slurmconf.install_slurm_conf(spec, paths)
    slurmconf.install_site_conf(paths)
    state["nodes"] = spec.nodes
    state["root"] = str(paths.root)
    state["slurm_prefix"] = str(slurm.prefix or "")
    dm.save_state(paths, state)
    _resolve_node_names(spec, log)
    dm.start_munge(paths, state, log)
    ctld_was_up = any(d.name == "slurmctld" and d.alive() for d in dm.recorded(state))
    dm.start_slurm(spec, paths, state, log)
    if ctld_was_up and conf_changed:
        subprocess.run(["scontrol", "reconfigure"], capture_output=True)
    dm.wait_nodes_idle(spec, paths, log)
    return status(paths)


def down(paths: LabPaths, log: Log) -> list[str]:
    """Stop what `up` started (by recorded pid), nothing else."""
    _require_root("down")
    state = dm.load_state(paths)
    activate(lab_slurm(state))  # (its scancel cancels the jobs left)
    stopped = dm.stop_all(paths, state, log)
    try:
        if hosts.remove_nodes():
            log(f"removed the lab's node names from {hosts.HOSTS}")
    except OSError as exc:
        log(f"warning: could not remove the lab's node names from {hosts.HOSTS}: {exc}")
    return stopped


def _resolve_node_names(spec: LabSpec, log: Log) -> None:
    """Map the node names to this host, so that jobs that take addresses from them run unchanged."""
    try:
        mapped = hosts.add_nodes(spec.node_names)
    except OSError as exc:  # (a read-only hosts file of a container): the lab works, node names stay unresolved
        log(f"warning: cannot map the lab's node names to this host in {hosts.HOSTS} ({exc}): jobs must set "
            "MASTER_ADDR=127.0.0.1 themselves")
        return
    if mapped:
        log(f"node names {', '.join(mapped)} resolve to {hosts.LAB_ADDR} ({hosts.HOSTS})")


def status(paths: LabPaths) -> dict:
    state = dm.load_state(paths)
    slurm = lab_slurm(state)
    activate(slurm)
    spec = LabSpec(nodes=state.get("nodes") or 0)
    daemons = [{"name": d.name, "pid": d.pid, "running": d.alive()} for d in dm.recorded(state)]
    up_ = bool(daemons) and all(d["running"] for d in daemons)
    nodes = dm.node_states(spec) if up_ and spec.nodes else {}
    return {"up": up_, "root": str(paths.root), "nodes": nodes, "daemons": daemons, "slurm": slurm.describe()}


def lab_slurm(state: dict) -> SlurmInstall:
    """The Slurm the lab's state records (Debian's when none)."""
    prefix = state.get("slurm_prefix") or ""
    return SlurmInstall(Path(prefix)) if prefix else SlurmInstall()


def _name(slurm: SlurmInstall) -> str:
    return f"Slurm {slurm.version() or '?'} ({slurm.prefix})" if slurm.prefix else "the system's Slurm"


def require_up(paths: LabPaths) -> dict:
    st = status(paths)
    if not st["up"]:
        raise LabError("the lab is not up: run `megatrace lab up` (as root)")
    return st
