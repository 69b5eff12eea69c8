"""GPU preflight through NVML (pynvml): read the facts in a child process, then judge them.

Reading and judging are apart. :func:`megatrace.check.nvml.read_gpus` asks NVML for every fact a
check needs and returns plain data (an error string where a call failed); it
runs in a child process (``python -m megatrace.check.gpu``) under a hard
timeout, because a wedged driver can block an NVML call forever and a prolog
must never hang. :func:`judge_gpus` turns the facts (a :class:`GpuFacts` per GPU)
into results against :class:`GpuThresholds`, one small check after another
(:data:`GPU_CHECKS`); it is pure, so every rule is tested without a GPU.

Under srun each task may check only its own GPUs (``select``: NVML indices or
UUIDs, as ``CUDA_VISIBLE_DEVICES`` names them); the node's results (driver,
count) then come from one task only (``node_level``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatrace.check.nvml import NVLINK_COUNTERS, read_gpus
from megatrace.check.results import ProbeResult, Status, Subject
from megatrace.check.xid import XID_FAIL, bus_key

# nvmlClocksEventReason bits (nvml.h): the ones that mean a GPU runs below its clocks for a hardware or
# thermal reason. At idle (a prolog) none of them should be set; a GPU stuck in one is a silent straggler.
CLOCK_EVENTS_FAIL = {0x8: "HW slowdown", 0x40: "HW thermal slowdown", 0x80: "HW power brake"}
CLOCK_EVENTS_WARN = {0x20: "SW thermal slowdown", 0x4: "SW power cap"}
NVML_LIBRARY_NOT_FOUND = "NVML Shared Library Not Found"


@dataclass(frozen=True)
class GpuThresholds:
    """Limits a GPU is held against (the site's ``configs/thresholds.yaml`` may override them).

    ``models`` holds per-model overrides: (NVML name pattern, {limit: value}) pairs, each setting only the
    limits it names; :meth:`for_model` lays the first matching one over the others.
    """

    temp_margin_c: int = 5  # warn this close to the slowdown temperature, fail at it
    ecc_sbe_warn: int = 100  # volatile single-bit (corrected) errors since boot
    ecc_dbe_fail: int = 1  # volatile double-bit (uncorrected) errors since boot
    stray_memory_mib: int = 1024  # memory held by processes at job start
    nvlinks: int = 0  # NVLinks each GPU must have up (0: any; a model section sets it, e.g. 18 for H100 SXM)
    nvlink_errors_warn: int = 100  # replay, recovery and CRC errors of one link since boot
    retired_pages_fail: int = 60  # pages retired (pre-Ampere page retirement; the GPU's limit is 64)
    # (name pattern, the limits it sets): the file's models section, or the built-in ones
    models: tuple[tuple[str, dict[str, int]], ...] = field(default=(), hash=False)

    def for_model(self, name: Any) -> GpuThresholds:
        """The limits for a GPU called ``name``: these, with the limits that the first ``models`` pattern matching
        it (fnmatch, case-insensitive) sets in place of theirs; without a match, these (``models`` left out)."""
        own = dataclasses.replace(self, models=())
        if isinstance(name, str):
            for pattern, overrides in self.models:
                if fnmatch.fnmatch(name.lower(), pattern.lower()):
                    return dataclasses.replace(own, **overrides)
        return own


Err = dict[str, str]  # what NVML could not read: {"error": <NVML's message>}


@dataclass(frozen=True)
class GpuFacts:
    """What :func:`~megatrace.check.nvml.read_gpus` read of one GPU NVML could open; each reading is its value,
    ``{"error": ...}`` where NVML could not make it, or None where it is absent."""

    index: int
    name: str | Err | None = None
    uuid: str | Err | None = None
    pci_bus: str | Err | None = None
    temp: int | Err | None = None  # °C
    slowdown_temp: int | Err | None = None
    shutdown_temp: int | Err | None = None
    clock_events: int | Err | None = None  # nvmlClocksEventReason bits
    ecc_sbe: int | Err | None = None  # volatile corrected errors
    ecc_dbe: int | Err | None = None  # volatile uncorrected errors
    remapped_rows: list[int] | Err | None = None  # (corrected, uncorrected, pending, failure)
    power_limit: int | Err | None = None  # mW
    power_default: int | Err | None = None  # mW
    pcie_gen: int | Err | None = None
    pcie_gen_max: int | Err | None = None
    pcie_gen_gpu_max: int | Err | None = None
    retired_pages: dict[str, Any] | None = None  # {"sbe": n, "dbe": n, "pending": bool} or {"error": ...}
    pcie_width: int | Err | None = None
    pcie_width_max: int | Err | None = None
    persistence: int | Err | None = None
    mig: list[int] | Err | None = None  # (current, pending)
    procs: list[dict[str, Any]] | Err | None = None  # {"pid": ..., "bytes": ... or None}
    nvlinks: list[dict[str, Any]] | Err | None = None  # {"link": ..., "up": ..., error counters}
    xid_events: list[int] | Err | None = None  # Xid codes NVML reported while the facts were read

    @classmethod
    def of(cls, g: dict[str, Any]) -> GpuFacts:
        """The facts of one entry of ``read_gpus()["gpus"]`` (the plain data the child prints)."""
        return cls(**{f.name: g[f.name] for f in dataclasses.fields(cls) if f.name in g})

    def subject(self, node: str) -> Subject:
        return Subject(node, self.index, self.uuid if isinstance(self.uuid, str) else None,
                       self.pci_bus if isinstance(self.pci_bus, str) else None)


Add = Callable[..., None]  # add(probe, status, message, value=None, threshold=None, remediation="")


def _unsupported(add: Add, probe: str, value: Any) -> bool:
    """A reading NVML could not make: the check is skipped, saying why."""
    if isinstance(value, dict):
        add(probe, Status.SKIP, f"{probe}: {value['error']}")
        return True
    return False


def _check_temperature(g: GpuFacts, t: GpuThresholds, add: Add) -> None:
    temp, slow, shut = g.temp, g.slowdown_temp, g.shutdown_temp
    if _unsupported(add, "temperature", temp):
        return
    # the slowdown threshold comes first; a GPU that does not report one is held to its shutdown one
    limit, what = (slow, "slowdown") if isinstance(slow, int) else (shut, "shutdown") if isinstance(shut, int) \
        else (None, "")
    if limit is not None and temp >= limit:
        add("temperature", Status.FAIL, f"{temp} °C at its {what} temperature {limit} °C", temp, limit,
            "Check the node's cooling and airflow; drain it.")
    elif limit is not None and temp >= limit - t.temp_margin_c:
        add("temperature", Status.WARN, f"{temp} °C, within {t.temp_margin_c} °C of {what} at {limit} °C",
            temp, limit, "Check the node's cooling.")
    else:
        add("temperature", Status.OK, f"{temp} °C", temp, limit)


def _check_clocks(g: GpuFacts, t: GpuThresholds, add: Add) -> None:
    events = g.clock_events
    if _unsupported(add, "clocks", events):
        return
    bad = [name for bit, name in CLOCK_EVENTS_FAIL.items() if events & bit]
    soft = [name for bit, name in CLOCK_EVENTS_WARN.items() if events & bit]
    if bad:
        add("clocks", Status.FAIL, f"clocks held down: {', '.join(bad)}", hex(events), None,
            "A GPU in hardware slowdown runs the whole job at its speed: check power and cooling "
            "(nvidia-smi -q -d PERFORMANCE); drain the node.")
    elif soft:
        add("clocks", Status.WARN, f"clocks held down: {', '.join(soft)}", hex(events))
    else:
        add("clocks", Status.OK, "no slowdown reason", hex(events))


def _check_ecc(g: GpuFacts, t: GpuThresholds, add: Add) -> None:
    dbe, sbe = g.ecc_dbe, g.ecc_sbe
    if _unsupported(add, "ecc", dbe):
        return
    if dbe >= t.ecc_dbe_fail:
        add("ecc", Status.FAIL, f"{dbe} uncorrected ECC errors since boot", dbe, t.ecc_dbe_fail,
            "Uncorrectable memory errors corrupt or kill jobs: drain the node and reset the GPU.")
    elif isinstance(sbe, int) and sbe >= t.ecc_sbe_warn:
        add("ecc", Status.WARN, f"{sbe} corrected ECC errors since boot", sbe, t.ecc_sbe_warn)
    else:
        add("ecc", Status.OK, "no uncorrected ECC errors", dbe, t.ecc_dbe_fail)


def _check_remap(g: GpuFacts, t: GpuThresholds, add: Add) -> None:
    rows = g.remapped_rows
    if _unsupported(add, "remap", rows):
        return
    _corr, _unc, pending, failure = rows
    if failure:
        add("remap", Status.FAIL, "row remapping failed", rows, None,
            "The GPU ran out of spare rows: replace it.")
    elif pending:
        add("remap", Status.WARN, "a row remap is pending a GPU reset", rows, None,
            "Reset the GPU (nvidia-smi -r) when the node is idle.")
    else:
        add("remap", Status.OK, "no pending or failed row remap", rows)


def _check_power(g: GpuFacts, t: GpuThresholds, add: Add) -> None:
    limit, default = g.power_limit, g.power_default
    if _unsupported(add, "power", limit) or not isinstance(default, int):
        return
    if limit < default:
        add("power", Status.WARN, f"power limit {limit // 1000} W below its default {default // 1000} W", limit,
            default, "Someone capped this GPU (nvidia-smi -pl): restore the default.")
    else:
        add("power", Status.OK, f"power limit {limit // 1000} W", limit, default)


def _check_pcie(g: GpuFacts, t: GpuThresholds, add: Add) -> None:
    width, width_max = g.pcie_width, g.pcie_width_max
    if _unsupported(add, "pcie", width) or not isinstance(width_max, int):
        return
    if width < width_max:
        add("pcie", Status.WARN, f"PCIe link x{width} of x{width_max}", width, width_max,
            "A degraded PCIe link slows every host-device copy: reseat the GPU or check the riser.")
    else:
        add("pcie", Status.OK, f"PCIe link x{width}", width, width_max)


def _check_pcie_gen(g: GpuFacts, t: GpuThresholds, add: Add) -> None:
    gen, gen_gpu = g.pcie_gen_max, g.pcie_gen_gpu_max  # (the current gen drops at idle: not judged)
    if not (isinstance(gen, int) and isinstance(gen_gpu, int)):
        return
    if gen < gen_gpu:
        add("pcie_gen", Status.WARN, f"PCIe link limited to Gen{gen}; the GPU does Gen{gen_gpu}", gen, gen_gpu,
            "The slot, riser or BIOS setting holds the link below the GPU's generation: check them.")
    else:
        add("pcie_gen", Status.OK, f"PCIe Gen{gen} link", gen, gen_gpu)


def _check_retired(g: GpuFacts, t: GpuThresholds, add: Add) -> None:
    retired = g.retired_pages
    if not isinstance(retired, dict) or "error" in retired:
        return
    total = retired["sbe"] + retired["dbe"]
    if total >= t.retired_pages_fail:
        add("retired", Status.FAIL, f"{total} pages retired ({retired['dbe']} for double-bit errors), near "
            "the GPU's limit", total, t.retired_pages_fail, "The GPU is running out of memory pages to "
            "retire: replace it.")
    elif retired["pending"]:
        add("retired", Status.WARN, "a page retirement is pending a GPU reset", total, t.retired_pages_fail,
            "Reset the GPU (nvidia-smi -r) when the node is idle.")
    else:
        add("retired", Status.OK, f"{total} pages retired", total, t.retired_pages_fail)


def _check_memory(g: GpuFacts, t: GpuThresholds, add: Add) -> None:
    if not _unsupported(add, "memory", g.procs):
        _judge_memory(g.procs, t, add)


def _check_nvlink(g: GpuFacts, t: GpuThresholds, add: Add) -> None:
    if g.nvlinks is not None and not _unsupported(add, "nvlink", g.nvlinks):
        _judge_nvlinks(g.nvlinks, t, add)


def _check_mig(g: GpuFacts, t: GpuThresholds, add: Add) -> None:
    if isinstance(g.mig, list) and g.mig[0]:
        add("mig", Status.WARN, "MIG mode is on", g.mig)


def _check_persistence(g: GpuFacts, t: GpuThresholds, add: Add) -> None:
    if g.persistence == 0:
        add("persistence", Status.WARN, "persistence mode is off (slow first CUDA call, flaky clocks)", 0, 1,
            "nvidia-smi -pm 1, or run nvidia-persistenced.")


# The checks of one GPU, in the order of its results.
GPU_CHECKS: tuple[Callable[[GpuFacts, GpuThresholds, Add], None], ...] = (
    _check_temperature, _check_clocks, _check_ecc, _check_remap, _check_power, _check_pcie, _check_pcie_gen,
    _check_retired, _check_memory, _check_nvlink, _check_mig, _check_persistence)


def _judge_one(node: str, g: GpuFacts, t: GpuThresholds) -> list[ProbeResult]:
    subj = g.subject(node)
    res: list[ProbeResult] = []

    def add(probe: str, status: Status, message: str, value: Any = None, threshold: Any = None,
            remediation: str = "") -> None:
        res.append(ProbeResult(f"gpu.{probe}", status, subj, message, value, threshold, remediation))

    for check in GPU_CHECKS:
        check(g, t, add)
    return res


def probe_gpus(node: str, expected: int | None, timeout_s: float = 20.0,
               thresholds: GpuThresholds = GpuThresholds(), select: list[str] | None = None,
               node_level: bool = True) -> list[ProbeResult]:
    """Read the facts in a child process (killed after ``timeout_s``) and judge them.

    ``select``: the GPUs to check (None: all); ``node_level``: also the node's results (driver, count).
    """
    argv = [sys.executable, "-m", "megatrace.check.gpu"] + ([] if select is None else ["--select", ",".join(select)])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return [ProbeResult("gpu.nvml", Status.FAIL, Subject(node),
                            f"NVML did not answer within {timeout_s:g} s (driver wedged?)", value=None,
                            threshold=timeout_s, remediation="Check `nvidia-smi` and the kernel log (XID); "
                                                             "reset the GPU or reboot the node.")]
    try:
        facts = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        facts = {"error": f"the NVML reader failed (exit {done.returncode}): {tail}"}
    return judge_gpus(facts, node, expected, thresholds, node_level)


def judge_gpus(facts: dict[str, Any], node: str, expected: int | None,
               thresholds: GpuThresholds = GpuThresholds(), node_level: bool = True) -> list[ProbeResult]:
    """Results for the node (NVML, count, versions; with ``node_level``) and for each GPU read."""
    here = Subject(node)
    if "error" in facts and not facts.get("gpus"):
        missing_lib = NVML_LIBRARY_NOT_FOUND in facts["error"] or "pynvml is not installed" in facts["error"]
        if missing_lib and not expected:
            return [ProbeResult("gpu.nvml", Status.SKIP, here, f"no GPU expected and no NVML: {facts['error']}")]
        return [ProbeResult("gpu.nvml", Status.FAIL, here, f"NVML unusable: {facts['error']}",
                            threshold=expected, remediation="Check the NVIDIA driver (nvidia-smi, dmesg); "
                                                            "drain the node until it is fixed.")]
    gpus = facts.get("gpus", [])
    count = facts.get("count", len(gpus))
    out = []
    if node_level:
        out.append(ProbeResult("gpu.driver", Status.OK, here, f"driver {facts.get('driver')}, CUDA "
                               f"{_cuda(facts.get('cuda'))}", value={"driver": facts.get("driver"),
                                                                     "cuda": facts.get("cuda")}))
    select, missing = facts.get("select"), facts.get("missing") or []
    lost = "A GPU fell off the bus or is hidden: check `nvidia-smi -L` and the kernel log for XID 79; drain the node."
    # The job's own GPUs known (a shared node): the node may have more than the job got, not fewer.
    if node_level and expected is not None and (count < expected or (select is None and count != expected)):
        out.append(ProbeResult("gpu.count", Status.FAIL, here, f"{count} GPUs visible, {expected} allocated",
                               value=count, threshold=expected, remediation=lost))
    elif missing:
        out.append(ProbeResult("gpu.count", Status.FAIL, here, f"allocated GPU {', '.join(missing)} not found among "
                               f"the {count} GPUs NVML sees", value=count, threshold=select, remediation=lost))
    elif node_level and select is not None and count != len(select):
        out.append(ProbeResult("gpu.count", Status.OK, here, f"{count} GPUs on the node; the job's "
                               f"{expected if expected is not None else len(select)} present and checked",
                               value=count, threshold=expected))
    elif node_level:
        out.append(ProbeResult("gpu.count", Status.OK, here, f"{count} GPUs", value=count, threshold=expected))
    xids = facts.get("xids")
    for g in gpus:
        if "error" in g:  # NVML could not open it: nothing else to read
            out.append(ProbeResult("gpu.nvml", Status.FAIL, Subject(node, g["index"]),
                                   f"NVML cannot open the GPU: {g['error']}", g["error"], None,
                                   "The driver lost this GPU: look for XID 79 (fallen off the bus) in the kernel log; "
                                   "reset it (nvidia-smi -r) or reboot the node, and drain it until it passes again."))
            continue
        gpu = GpuFacts.of(g)
        out += _judge_one(node, gpu, thresholds.for_model(gpu.name))
        seen = None  # the GPU's Xids: from the kernel log where readable, and from NVML events
        if isinstance(xids, list) and isinstance(gpu.pci_bus, str):
            seen = [x for x in xids if x["pci"] == bus_key(gpu.pci_bus)]
        if isinstance(gpu.xid_events, list):
            seen = (seen or []) + [{"xid": code, "message": "an NVML Xid event during the check", "pci": None}
                                   for code in gpu.xid_events]
        if seen is not None:
            out += _judge_xids(node, gpu, seen)
    return out


def _judge_xids(node: str, g: GpuFacts, xids: list[dict[str, Any]]) -> list[ProbeResult]:
    subj = g.subject(node)
    if not xids:
        return [ProbeResult("gpu.xid", Status.OK, subj, "no Xid in the kernel log or from NVML")]
    codes = sorted({x["xid"] for x in xids})
    bad = [c for c in codes if c in XID_FAIL]
    last = xids[-1]
    status = Status.FAIL if bad else Status.WARN
    shown = bad or codes
    where = "from NVML" if all(x["pci"] is None for x in xids) else "in the kernel log"
    return [ProbeResult("gpu.xid", status, subj, f"XID {', '.join(map(str, shown))} {where}"
                        + (f" ({last['message']})" if last["message"] else ""), codes, sorted(XID_FAIL),
                        "Xids since boot: see `dmesg | grep Xid`; reset the GPU or reboot, and drain the node "
                        "until it passes again." if bad else "")]


def _cuda(v: Any) -> str:
    return f"{v // 1000}.{v % 1000 // 10}" if isinstance(v, int) else str(v)


def _judge_memory(procs: list[dict[str, Any]], t: GpuThresholds, add: Any) -> None:
    """Memory held by processes before the job: too much fails; a process whose amount NVML cannot report (None:
    MIG, containers) is named, and warns where what is known stays below the limit."""
    known = [p for p in procs if isinstance(p.get("bytes"), int)]
    unknown = [str(p["pid"]) for p in procs if not isinstance(p.get("bytes"), int)]
    held = sum(p["bytes"] for p in known) >> 20
    if held >= t.stray_memory_mib:
        pids = ", ".join(str(p["pid"]) for p in procs)
        add("memory", Status.FAIL, f"{held} MiB held by processes {pids} before the job starts"
            + (f" ({', '.join(unknown)}: amount unknown)" if unknown else ""), held, t.stray_memory_mib,
            "A previous job left processes on the GPU: kill them or drain the node.")
    elif unknown:
        who = f"process {unknown[0]} holds" if len(unknown) == 1 else f"processes {', '.join(unknown)} hold"
        also = f"; {held} MiB held by {', '.join(str(p['pid']) for p in known)}" if known else ""
        add("memory", Status.WARN, f"{who} an unknown amount of GPU memory before the job starts (NVML cannot "
            f"report it){also}", held, t.stray_memory_mib, "A previous job may have left processes on the GPU: "
            "check them (nvidia-smi, ps); kill them or drain the node.")
    else:
        add("memory", Status.OK, f"{held} MiB held by other processes", held, t.stray_memory_mib)


def _judge_nvlinks(links: list[dict[str, Any]], t: GpuThresholds, add: Any) -> None:
    """A link down among up ones (or fewer up than the model has) fails; many link errors warn."""
    up = [x["link"] for x in links if x.get("up")]
    down = [x["link"] for x in links if not x.get("up")]
    errors = {x["link"]: sum(x.get(k, 0) for k in NVLINK_COUNTERS) for x in links}
    noisy = {k: v for k, v in errors.items() if v >= t.nvlink_errors_warn}
    if t.nvlinks and len(up) < t.nvlinks:
        add("nvlink", Status.FAIL, f"{len(up)} of {t.nvlinks} NVLinks up (down: {', '.join(map(str, down)) or '-'})",
            len(up), t.nvlinks, "A GPU with NVLinks down falls back to slower paths and slows every collective: "
            "check nvidia-smi nvlink -s; reset the GPU or drain the node.")
    elif up and down and not t.nvlinks:
        add("nvlink", Status.FAIL, f"NVLink {', '.join(map(str, down))} down while {len(up)} others are up",
            len(up), len(links), "check nvidia-smi nvlink -s and the fabric manager; reset the GPU or drain the node.")
    elif not up:
        add("nvlink", Status.SKIP, "no NVLink up (none connected)", 0, t.nvlinks or None)
    elif noisy:
        worst = max(noisy, key=noisy.get)
        add("nvlink", Status.WARN, f"NVLink {worst}: {noisy[worst]} replay/recovery/CRC errors since boot"
            + (f" (and {len(noisy) - 1} more links)" if len(noisy) > 1 else ""), noisy, t.nvlink_errors_warn,
            "A link that keeps retrying slows NVLink traffic: watch nvidia-smi nvlink -e; reseat or replace.")
    else:
        add("nvlink", Status.OK, f"{len(up)} NVLinks up", len(up), t.nvlinks or None)


def main(argv: list[str] | None = None) -> int:
    """Child entry: print the facts as one JSON line (``--select 0,3``: only those GPUs in full)."""
    args = sys.argv[1:] if argv is None else argv
    select = args[1].split(",") if len(args) == 2 and args[0] == "--select" else None
    print(json.dumps(read_gpus([t for t in select if t] if select is not None else None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
