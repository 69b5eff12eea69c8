"""The lab's configuration files: slurm.conf, the MegaTrace site config read by the prolog and epilog.

Settings verified on Debian 12 / Slurm 22.05 (docs/slurm.md): several slurmd on
one host as ``slurmd -N nX`` with per-node ports and ``%n`` in their paths,
proctrack/linuxproc, task/none, cons_tres, and a partition with OverSubscribe.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from megatrace.lab import LabError
from megatrace.lab.paths import LabPaths

MARKER = "# Written by `megatrace lab up`"
PARTITION = "lab"
CTLD_PORT = 16817
FIRST_NODE_PORT = 17001


@dataclass(frozen=True)
class LabSpec:
    nodes: int = 4
    cpus: int = 2
    health_interval: int = 300  # seconds between slurmd's runs of slurm/healthcheck (0: never)

    @property
    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    @property
    def node_expr(self) -> str:
        return f"n[1-{self.nodes}]" if self.nodes > 1 else "n1"


def render_slurm_conf(spec: LabSpec, paths: LabPaths) -> str:
    host = socket.gethostname()
    last_port = FIRST_NODE_PORT + spec.nodes - 1
    ports = f"{FIRST_NODE_PORT}-{last_port}" if spec.nodes > 1 else str(FIRST_NODE_PORT)
    return f"""{MARKER}: {spec.nodes} virtual nodes on {host}. Do not edit; `megatrace lab up` rewrites it.
ClusterName=megatrace-lab
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={paths.ctld_state_dir}
SlurmdSpoolDir={paths.spool_dir}/%n
SlurmctldPidFile={paths.run_dir}/slurmctld.pid
SlurmdPidFile={paths.run_dir}/slurmd-%n.pid
SlurmctldLogFile={paths.log_dir}/slurmctld.log
SlurmdLogFile={paths.log_dir}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# Finished jobs go to a text file that `sacct --completion` reads (no slurmdbd in the lab).
JobCompType=jobcomp/filetxt
JobCompLoc={paths.log_dir}/jobcomp.txt
ReturnToService=2
SlurmdTimeout=60
SlurmctldTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=600
# The MegaTrace prolog/epilog; Alloc runs the prolog on every node at allocation
# (and passes the SPANK job control environment). A failed prolog drains the node
# and requeues the job, without holding it.
Prolog={paths.prolog}
Epilog={paths.epilog}
PrologFlags=Alloc
PrologEpilogTimeout=120
SchedulerParameters=nohold_on_prolog_fail
PlugStackConfig=/etc/slurm/plugstack.conf
# The MegaTrace inspection loop: slurmd runs `megatrace health` on every node each interval.
HealthCheckProgram={paths.healthcheck}
HealthCheckInterval={spec.health_interval}
HealthCheckNodeState=ANY
NodeName={spec.node_expr} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports} CPUs={spec.cpus} State=UNKNOWN
PartitionName={PARTITION} Nodes={spec.node_expr} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def render_site_conf(paths: LabPaths) -> str:
    """/etc/megatrace/slurm.conf: KEY=VALUE lines read (never sourced) by the prolog and epilog."""
    check = Path(paths.megatrace_bin).with_name("megatrace-check")
    return f"""# MegaTrace site configuration for the Slurm prolog and epilog (see slurm/INSTALL.md).
# Root-owned; the scripts read KEY=VALUE lines and never execute this file.
MEGATRACE_BIN={paths.megatrace_bin}
CHECK_CMD={check} --level {{level}} --node {{node}} --ring-dir {{ring_base}} --only node --only gpu --thresholds {paths.site_conf_dir / "thresholds.yaml"}
LOCAL_DIR=/dev/shm/megatrace
FALLBACK_DIR=/var/tmp/megatrace
HEALTH_ARGS=--resume-after 2 --thresholds {paths.site_conf_dir / "thresholds.yaml"}
HEALTH_ALERTS={paths.site_conf_dir / "alerts.yaml"}
HEALTH_TIMEOUT=60
"""


def write_file(path: Path, text: str, mode: int = 0o644) -> bool:
    """Write atomically when the content differs; True when it changed."""
    try:
        if path.read_text() == text:
            os.chmod(path, mode)
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return True


def install_slurm_conf(spec: LabSpec, paths: LabPaths) -> bool:
    """Write slurm.conf into the lab dir and to /etc/slurm (where sbatch and srun look), never over a site's own."""
    text = render_slurm_conf(spec, paths)
    if paths.slurm_conf.exists() and not paths.slurm_conf.read_text().startswith(MARKER):
        raise LabError(f"{paths.slurm_conf} exists and was not written by the lab; "
                       "refusing to replace a real cluster's configuration")
    for d in (paths.log_dir, paths.run_dir, paths.spool_dir, paths.ctld_state_dir):
        d.mkdir(parents=True, exist_ok=True)
    write_file(paths.lab_slurm_conf, text)
    return write_file(paths.slurm_conf, text)


def install_site_conf(paths: LabPaths) -> bool:
    paths.site_conf_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(paths.site_conf_dir, 0o755)
    changed = write_file(paths.site_conf_dir / "thresholds.yaml", LAB_THRESHOLDS)
    return write_file(paths.site_conf, render_site_conf(paths)) or changed


# The lab's nodes share one host and its /dev/shm: hold them to what a test machine has, not a GPU node.
LAB_THRESHOLDS = """# megatrace-check limits for the local lab (see configs/thresholds.yaml for every key)
node:
  min_free_shm_mib: 64
  min_free_job_mib: 64
  min_free_ring_mib: 64
net:
  latency_floor_us: 10000  # four nodes' MPI tasks busy-poll on one host's few cores: ms round trips are noise
"""
