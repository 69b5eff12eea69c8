"""Node facts and node checks: what a job needs of its host besides the GPUs.

:func:`read_host` gathers plain facts (kernel, CPUs, memory, free space where
the rings and the job directory go, InfiniBand/RoCE ports from sysfs, library
versions, the wall clock, whether the tracer imports, and a failure the site
injected for drills: a root-owned ``/etc/megatrace/fail-preflight-<node>``);
:func:`judge_host` checks one node alone, and
:func:`judge_allocation` compares the nodes of one allocation with each other
(a node with fewer CPUs, less memory, other versions or a clock far from the
rest slows or breaks the whole job).
"""

from __future__ import annotations

import fnmatch
import os
import platform
import re
import shutil
import stat
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrace.check.plugin import REBUILD, read_plugin
from megatrace.check.results import ProbeResult, Status, Subject

IB_ROOT = Path("/sys/class/infiniband")
SITE_DIR = Path("/etc/megatrace")  # root-owned site files: fail-preflight-<node> injects a failure (drills, tests)


# Error counters of an InfiniBand/RoCE port (sysfs ``ports/<n>/counters``), judged against ``ib_<name>_warn``.
# They count since boot or the last reset, and saturate: link_downed and link_error_recovery are 8-bit,
# local_link_integrity_errors and excessive_buffer_overrun_errors 4-bit (15 at most), the others 16-bit.
IB_COUNTERS = ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors",
               "local_link_integrity_errors", "excessive_buffer_overrun_errors", "port_xmit_discards")


@dataclass(frozen=True)
class HostThresholds:
    min_free_shm_mib: int = 1024  # /dev/shm: NCCL and the rings live there
    min_free_job_mib: int = 1024  # the job directory: traces and reports
    min_free_ring_mib: int = 64  # the node-local ring directory: 4 MiB per rank at the default ring size
    cpu_ratio_warn: float = 0.75  # fewer CPUs than this share of the allocation's median
    mem_ratio_warn: float = 0.75
    clock_offset_warn_ms: float = 50.0  # wall clocks this far from the allocation's median
    clock_offset_fail_ms: float = 1000.0
    nic_rate_ratio_warn: float = 0.75  # a port slower than this share of the same model's ports elsewhere
    # A port warns when an error counter reaches its limit (0: that counter is not judged).
    ib_symbol_error_warn: int = 100  # bit errors on the wire, mostly corrected by FEC: many mean a bad cable
    ib_link_downed_warn: int = 1  # the link went down and up again (a flap: collectives on it stalled or failed)
    ib_link_error_recovery_warn: int = 10  # the link retrained without going down: a stall each time
    ib_port_rcv_errors_warn: int = 100  # packets received malformed (CRC, length): dropped and resent
    ib_local_link_integrity_errors_warn: int = 10  # physical errors past the link's tolerance (4-bit counter)
    ib_excessive_buffer_overrun_errors_warn: int = 10  # receive buffer overruns (4-bit counter)
    ib_port_xmit_discards_warn: int = 1000  # packets dropped on send (congestion, a peer gone): some are normal
    # Per NIC: (pattern, Gb/s every port it matches must run at; 0: the port is not in use and not judged).
    # A pattern matches the HCA type or board id (a model) or the device or port name ("mlx5_1", "mlx5_1/1").
    nics: tuple[tuple[str, float], ...] = ()

    def nic_rate(self, port: dict[str, Any]) -> tuple[str, float] | None:
        """(pattern, Gb/s) of the first ``nics`` entry with a rate that matches the port."""
        return next(((pattern, rate) for pattern, rate in self.nics if rate > 0 and _nic_match(pattern, port)),
                    None)

    def nic_ignored(self, port: dict[str, Any]) -> str | None:
        """The pattern of a ``nics`` entry that marks the port unused (rate 0, ``ignore:``), or None."""
        return next((pattern for pattern, rate in self.nics if rate <= 0 and _nic_match(pattern, port)), None)

    def ib_limit(self, counter: str) -> int:
        """The warning limit of an error counter (0: not judged)."""
        return int(getattr(self, f"ib_{counter}_warn", 0))


def port_name(port: dict[str, Any]) -> str:
    """``<device>/<port>`` as sysfs names it: ``mlx5_0/1``."""
    return f"{port.get('device')}/{port.get('port')}"


def _nic_match(pattern: str, port: dict[str, Any]) -> bool:
    """fnmatch (case-insensitive) on the port's HCA type, board id, device or device/port name."""
    values = (port.get("hca_type"), port.get("board_id"), port.get("device"), port_name(port))
    return any(isinstance(v, str) and fnmatch.fnmatch(v.lower(), pattern.lower()) for v in values)


RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")  # sysfs ``rate``: "400 Gb/sec (4X NDR)"


def port_rate_gbps(port: dict[str, Any]) -> float | None:
    """The port's link rate in Gb/s, from its sysfs ``rate`` line (None when unreadable)."""
    m = RATE.match(port.get("rate") or "")
    return float(m.group(1)) if m else None


def read_host(job_dir: str | None = None, ring_dir: str | None = None, node: str | None = None,
              site_dir: Path | None = None) -> dict[str, Any]:
    """This node's facts as plain data."""
    facts: dict[str, Any] = {"kernel": platform.release(), "cpus": len(os.sched_getaffinity(0)),
                             "cpus_online": os.cpu_count(), "wall_ns": time.time_ns()}
    if node:
        facts["injected"] = read_injected(node, site_dir)
    facts["tracer"] = _tracer_import_error()
    try:
        facts["mem_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        facts["mem_bytes"] = None
    for name, path in (("shm", "/dev/shm"), ("job_dir", job_dir), ("ring_dir", ring_dir)):
        if path:
            probe = Path(path)
            if name == "ring_dir":  # created per job later: its nearest existing parent holds the space
                while not probe.exists() and probe != probe.parent:
                    probe = probe.parent
            try:
                facts[f"{name}_free"] = shutil.disk_usage(probe).free
            except OSError as exc:
                facts[f"{name}_free"] = {"error": f"{path}: {exc.strerror}"}
    facts["ib_ports"] = read_ib_ports()
    facts["versions"] = _versions()
    plugin = read_plugin()
    facts["plugin"] = plugin.to_dict() if plugin is not None else None
    return facts


def _root_owned(path: Path) -> bool:
    """Owned by root all the way up, and no component replaceable by others: a file users cannot plant.

    A directory others may write is accepted only with the sticky bit (like /tmp): there,
    nobody but root can rename or remove root's entries.
    """
    for p in [path, *path.parents]:
        st = os.lstat(p)
        if st.st_uid != 0:
            return False
        if stat.S_ISLNK(st.st_mode):
            continue
        writable_by_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if writable_by_others and (p == path or not st.st_mode & stat.S_ISVTX):
            return False
    return True


def read_injected(node: str, site_dir: Path | None = None, kind: str = "fail-preflight") -> dict[str, str] | None:
    """The site's injected fault ``<kind>-<node>``: {"text", "path"}, {"ignored", "path"} when others could have
    written it, or None. Kinds: ``fail-preflight`` (node.injected fails with the text), ``slow-net`` (see
    :func:`read_net_delay`)."""
    path = (site_dir or Path(os.environ.get("MEGATRACE_SITE_DIR") or SITE_DIR)) / f"{kind}-{node}"
    try:
        if not path.exists():
            return None
        if not _root_owned(path):
            return {"ignored": "not root-owned, or in a directory others may write", "path": str(path)}
        text = " ".join(path.read_text(errors="replace").split())[:120] or "injected failure"
    except OSError as exc:
        return {"ignored": f"unreadable: {exc.strerror}", "path": str(path)}
    return {"text": text, "path": str(path)}


def read_net_delay(node: str, site_dir: Path | None = None) -> float:
    """Seconds this node's network test waits before each message it sends: a root-owned ``slow-net-<node>``
    holding milliseconds makes the node slow in the network test (drills and tests); 0 without one."""
    got = read_injected(node, site_dir, "slow-net")
    try:
        return max(0.0, min(float(got["text"]), 10_000.0)) / 1000.0 if got and "text" in got else 0.0
    except ValueError:
        return 0.0


def _tracer_import_error() -> str | None:
    try:
        from megatrace.trace import ring_writer  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (any import failure is the finding)
        return f"megatrace.trace does not import in {sys.executable}: {exc!r}"
    return None


def read_ib_ports(root: Path = IB_ROOT) -> list[dict[str, Any]]:
    """Every InfiniBand/RoCE port under ``root``: state, rate and the error counters that matter."""
    ports = []
    if not root.is_dir():
        return ports
    for dev in sorted(root.iterdir()):
        for port in sorted((dev / "ports").glob("*")):
            entry: dict[str, Any] = {"device": dev.name, "port": port.name,
                                     "state": _read(port / "state"), "rate": _read(port / "rate"),
                                     "link_layer": _read(port / "link_layer"), "hca_type": _read(dev / "hca_type"),
                                     "board_id": _read(dev / "board_id"), "fw_ver": _read(dev / "fw_ver")}
            counters = {}
            for name in IB_COUNTERS:
                value = _read(port / "counters" / name)
                if value is not None and value.isdigit():
                    counters[name] = int(value)
            entry["counters"] = counters
            ports.append(entry)
    return ports


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return out
    for pkg in ("torch", "nvidia-nccl-cu12", "nvidia-nccl-cu13", "megatrace"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def judge_host(facts: dict[str, Any], node: str, t: HostThresholds = HostThresholds()) -> list[ProbeResult]:
    """Checks of one node on its own: the injected drill, the tracer, free space, and each network port."""
    here = Subject(node)
    res = []
    injected = facts.get("injected")
    if injected and "text" in injected:
        res.append(ProbeResult("node.injected", Status.FAIL, here, f"{injected['text']} ({injected['path']})",
                               remediation="A failure injected by the site (a drill or a test): remove the file "
                                           "to return the node."))
    elif injected:
        res.append(ProbeResult("node.injected", Status.WARN, here, f"ignored {injected['path']}: "
                               f"{injected['ignored']}", remediation="Remove the file: only root may inject."))
    elif "injected" in facts:
        res.append(ProbeResult("node.injected", Status.OK, here, "no injected failure"))
    if facts.get("tracer"):
        res.append(ProbeResult("node.tracer", Status.FAIL, here, facts["tracer"],
                               remediation="Install megatrace into the Python the jobs use."))
    elif "tracer" in facts:
        res.append(ProbeResult("node.tracer", Status.OK, here, f"the tracer imports in {sys.executable}"))
    res += _judge_plugin(facts.get("plugin"), here)
    for name, label, floor in (("shm", "/dev/shm", t.min_free_shm_mib), ("job_dir", "the job directory",
                                                                         t.min_free_job_mib),
                               ("ring_dir", "the ring directory", t.min_free_ring_mib)):
        free = facts.get(f"{name}_free")
        if free is None:
            continue
        if isinstance(free, dict):
            res.append(ProbeResult(f"node.{name}", Status.FAIL, here, f"{label} unusable: {free['error']}",
                                   remediation="Check the mount and its permissions."))
            continue
        mib = free >> 20
        status = Status.FAIL if mib < floor else Status.OK
        res.append(ProbeResult(f"node.{name}", status, here, f"{mib:,} MiB free in {label}", mib, floor,
                               "" if status == Status.OK else f"Free space in {label}: traces, NCCL and "
                                                              "checkpoints need it."))
    for p in facts.get("ib_ports", []):
        res += _judge_port(p, node, t)
    return res


def _judge_plugin(plugin: dict[str, Any] | None, here: Subject) -> list[ProbeResult]:
    """The installed SPANK plugin against the running Slurm (``node.plugin``): a warning, never a drain (jobs
    run; only ``--megatrace`` is missing)."""
    if not plugin:
        return []
    path, built, running = plugin["path"], plugin["built_for"], plugin["running"]
    rebuild = (f"Rebuild it against the running Slurm's headers and reinstall: {REBUILD} "
               "SLURM_INCLUDE=<the Slurm prefix>/include (slurm/INSTALL.md).")
    if plugin.get("problem") and built is None:
        return [ProbeResult("node.plugin", Status.WARN, here, plugin["problem"], remediation=rebuild)]
    if running is None:
        return [ProbeResult("node.plugin", Status.WARN, here, f"{path} is built for Slurm {built}; the running "
                            f"release is unknown ({plugin.get('problem')})",
                            remediation="Put the site's Slurm on PATH (SLURM_BIN in /etc/megatrace/slurm.conf).")]
    if not plugin["fits"]:
        return [ProbeResult("node.plugin", Status.WARN, here,
                            f"the SPANK plugin {path} is built for Slurm {built} but {running} runs: Slurm will not "
                            "load it, and sbatch/srun go on without --megatrace", built, running, rebuild)]
    return [ProbeResult("node.plugin", Status.OK, here, f"the SPANK plugin {path} fits Slurm {running}", built,
                        running)]


def _judge_port(p: dict[str, Any], node: str, t: HostThresholds) -> list[ProbeResult]:
    """One InfiniBand/RoCE port: not in use (the site's ``nics``: SKIP), else its state and rate (``node.ib``)
    and, when it is up, its error counters (``node.ib_errors``)."""
    where = port_name(p)
    subj = Subject(node, port=where)
    state = p.get("state") or ""
    if (pattern := t.nic_ignored(p)) is not None:
        return [ProbeResult("node.ib", Status.SKIP, subj, f"port {where} ({state or 'state unknown'}) not checked: "
                            f"not in use (thresholds nics {pattern!r})", state)]
    if "ACTIVE" not in state:
        return [ProbeResult("node.ib", Status.FAIL, subj, f"port {where} is {state or 'unknown'}", state, "ACTIVE",
                            "Check the cable and the switch port; drain the node. A port that is not used (not "
                            "cabled, a bond member) goes under `nics: {ignore: [...]}` in the thresholds.")]
    if (model := t.nic_rate(p)) and (rate := port_rate_gbps(p)) is not None and rate < model[1]:
        res = [ProbeResult("node.ib", Status.WARN, subj, f"port {where} runs at {rate:g} Gb/s; its model "
                           f"({p.get('hca_type') or p.get('board_id')}, thresholds nics {model[0]!r}) "
                           f"runs at {model[1]:g}", rate, model[1],
                           "A port that trained to a lower rate halves what collectives get through "
                           "it: check the cable, the transceiver and the switch port.")]
    else:
        res = [ProbeResult("node.ib", Status.OK, subj, f"port {where} ACTIVE, {p.get('rate')}", state)]
    counters = p.get("counters") or {}
    limits = {k: t.ib_limit(k) for k in sorted(counters) if t.ib_limit(k) > 0}
    over = {k: counters[k] for k in limits if counters[k] >= limits[k]}
    if over:
        res.append(ProbeResult("node.ib_errors", Status.WARN, subj, f"port {where} has errors: "
                               + ", ".join(f"{k} {v} (limit {limits[k]})" for k, v in over.items()), over,
                               {k: limits[k] for k in over},
                               "A flapping or noisy link slows collectives: check the cable and the transceiver; "
                               "reset the counters after a fix (perfquery -x -R), as they count since boot."))
    elif limits:
        res.append(ProbeResult("node.ib_errors", Status.OK, subj, f"error counters of port {where} under their "
                               "limits", {k: counters[k] for k in limits}, limits))
    return res


def _slow_ports(hosts: dict[str, dict[str, Any]], t: HostThresholds) -> list[ProbeResult]:
    """Active ports slower than the same model's ports elsewhere in the allocation (the median of all nodes);
    ports the site marked unused (``nics``) are left out."""
    rates: dict[str, list[tuple[str, str, float]]] = {}
    for node, f in hosts.items():
        for p in f.get("ib_ports") or []:
            rate = port_rate_gbps(p)
            if rate is not None and "ACTIVE" in (p.get("state") or "") and t.nic_ignored(p) is None:
                model = f"{p.get('hca_type') or p.get('board_id') or '?'} {p.get('link_layer') or ''}".strip()
                rates.setdefault(model, []).append((node, port_name(p), rate))
    res = []
    for model, ports in sorted(rates.items()):
        if len({n for n, _, _ in ports}) < 2:
            continue
        med = statistics.median(r for _, _, r in ports)
        for node, where, rate in ports:
            if rate < t.nic_rate_ratio_warn * med:
                res.append(ProbeResult("node.ib_rate", Status.WARN, Subject(node, port=where),
                                       f"port {where} runs at {rate:g} Gb/s, the allocation's {model} ports at "
                                       f"{med:g} (median)", rate, med,
                                       "A port that trained to a lower rate slows every collective crossing this "
                                       "node: check the cable, the transceiver and the switch port."))
    return res


def judge_allocation(hosts: dict[str, dict[str, Any]], t: HostThresholds = HostThresholds()) -> list[ProbeResult]:
    """Compare the nodes with each other: CPUs, memory, kernel, library and GPU driver versions, port rates,
    wall clocks."""
    res: list[ProbeResult] = []
    if len(hosts) < 2:
        return res
    for key, label, ratio in (("cpus", "CPUs", t.cpu_ratio_warn), ("mem_bytes", "memory", t.mem_ratio_warn)):
        values = {n: f[key] for n, f in hosts.items() if isinstance(f.get(key), int)}
        if len(values) < 2:
            continue
        med = statistics.median(values.values())
        for node, v in sorted(values.items()):
            if v < ratio * med:
                shown = (lambda x: f"{x >> 30} GiB") if key == "mem_bytes" else str
                res.append(ProbeResult(f"node.{key}", Status.WARN, Subject(node),
                                       f"{shown(v)} {label}, the allocation's median is {shown(int(med))}", v,
                                       int(med), "A smaller node slows every rank that waits for it."))
    for key, label in (("kernel", "kernel"), ("versions", "library versions"), ("gpu_driver", "GPU driver and CUDA")):
        groups: dict[str, list[str]] = {}
        for node, f in hosts.items():
            groups.setdefault(repr(f.get(key)), []).append(node)
        if len(groups) > 1:
            majority = max(groups.values(), key=len)
            for nodes in groups.values():
                if nodes is majority:
                    continue
                for node in nodes:
                    res.append(ProbeResult(f"node.{key}", Status.WARN, Subject(node),
                                           f"{label} differ from the rest of the allocation: "
                                           f"{hosts[node].get(key)} vs {hosts[majority[0]].get(key)}",
                                           hosts[node].get(key), hosts[majority[0]].get(key),
                                           "Mixed software versions break or slow collectives: align the image."))
    res += _slow_ports(hosts, t)
    walls = {n: f["wall_ns"] for n, f in hosts.items() if isinstance(f.get("wall_ns"), int)}
    if len(walls) >= 2:
        med = statistics.median(walls.values())
        for node, w in sorted(walls.items()):
            off_ms = (w - med) / 1e6
            status = (Status.FAIL if abs(off_ms) >= t.clock_offset_fail_ms else
                      Status.WARN if abs(off_ms) >= t.clock_offset_warn_ms else Status.OK)
            if status != Status.OK:
                res.append(ProbeResult("node.clock", status, Subject(node),
                                       f"wall clock {off_ms:+.0f} ms from the allocation's median", round(off_ms, 1),
                                       t.clock_offset_warn_ms, "Check NTP/chrony on this node."))
    return res
