"""GPU preflight through NVML (pynvml): read the facts in a child process, then judge them.

Reading and judging are apart. :func:`read_gpus` asks NVML for every fact a
check needs and returns plain data (an error string where a call failed); it
runs in a child process (``python -m megatrace.check.gpu``) under a hard
timeout, because a wedged driver can block an NVML call forever and a prolog
must never hang. :func:`judge_gpus` turns the facts into results against
:class:`GpuThresholds`; it is pure, so every rule is tested without a GPU.

Under srun each task may check only its own GPUs (``select``: NVML indices or
UUIDs, as ``CUDA_VISIBLE_DEVICES`` names them); the node's results (driver,
count) then come from one task only (``node_level``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from megatrace.check.results import ProbeResult, Status, Subject

# nvmlClocksEventReason bits (nvml.h): the ones that mean a GPU runs below its clocks for a hardware or
# thermal reason. At idle (a prolog) none of them should be set; a GPU stuck in one is a silent straggler.
CLOCK_EVENTS_FAIL = {0x8: "HW slowdown", 0x40: "HW thermal slowdown", 0x80: "HW power brake"}
CLOCK_EVENTS_WARN = {0x20: "SW thermal slowdown", 0x4: "SW power cap"}
NVML_LIBRARY_NOT_FOUND = "NVML Shared Library Not Found"
# Xid codes (NVIDIA's Xid catalogue) that mean the GPU must not take a job: DBE (48), page retirement or
# row-remap failure (63/64), NVLink error (74), fallen off the bus (79), contained/uncontained ECC (94/95),
# GSP errors (119/120). Others are reported as warnings.
XID_FAIL = {48, 63, 64, 74, 79, 94, 95, 119, 120}
XID_LINE = re.compile(r"NVRM: Xid \(PCI:(?P<pci>[0-9a-fA-F:.]+)\): (?P<xid>\d+)(?:, (?P<rest>.*))?")


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


def parse_xids(text: str) -> list[dict[str, Any]]:
    """Xid events in kernel log text: ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.``"""
    out = []
    for m in XID_LINE.finditer(text):
        out.append({"pci": _bus_key(m["pci"]), "xid": int(m["xid"]), "message": (m["rest"] or "").strip()[:200]})
    return out


def _bus_key(pci: str) -> str:
    """The kernel's ``0019:3b:00`` or NVML's ``00000019:3B:00.0`` -> ``0019:3b:00``: PCI domain, bus and device in
    one notation (a GPU per domain, as on Grace Hopper, shares bus and device numbers with the others)."""
    parts = pci.strip().lower().split(".")[0].split(":")
    try:
        numbers = [int(p, 16) for p in parts]
    except ValueError:
        return pci.strip().lower()
    if len(numbers) == 2:  # bus:device, no domain: domain 0
        numbers.insert(0, 0)
    if len(numbers) != 3:
        return pci.strip().lower()
    domain, bus, device = numbers
    return f"{domain:04x}:{bus:02x}:{device:02x}"


def read_kernel_xids(timeout_s: float = 5.0) -> list[dict[str, Any]] | dict[str, str]:
    """Xid lines of the kernel log: ``$MEGATRACE_KERNEL_LOG`` (a file, e.g. /var/log/kern.log) or ``dmesg``
    (root, as in a prolog); an error dict where it is unreadable."""
    path = os.environ.get("MEGATRACE_KERNEL_LOG")
    if path:
        try:
            with open(path, errors="replace") as fh:
                return parse_xids(fh.read(64 << 20))
        except OSError as exc:
            return {"error": f"{path}: {exc.strerror}"}
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"dmesg: {exc}"}
    if done.returncode:
        return {"error": f"dmesg: {(done.stderr.strip() or 'failed').splitlines()[-1]}"}
    return parse_xids(done.stdout)


def selected(index: int, uuid: Any, select: list[str] | None) -> bool:
    """GPU ``index`` is among ``select`` (NVML indices or UUID prefixes; None: every GPU)."""
    if select is None:
        return True
    return any(t == str(index) or (isinstance(uuid, str) and t.startswith("GPU-") and uuid.startswith(t))
               for t in select)


def read_gpus(select: list[str] | None = None) -> dict[str, Any]:
    """Every NVML fact the checks need, as plain data; errors become strings, never exceptions.

    Only the GPUs in ``select`` (see :func:`selected`) are read in full; ``count`` is every GPU's. A GPU NVML
    cannot open (lost, fallen off the bus) is ``{"index": i, "error": ...}``; the others are still read.
    """
    try:
        import pynvml
    except ImportError:
        return {"error": "pynvml is not installed (pip install nvidia-ml-py)"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"error": str(exc)}
    try:
        out: dict[str, Any] = {"driver": _call(pynvml.nvmlSystemGetDriverVersion),
                               "cuda": _call(pynvml.nvmlSystemGetCudaDriverVersion), "gpus": [],
                               "xids": read_kernel_xids()}
        count = _call(pynvml.nvmlDeviceGetCount)
        if isinstance(count, dict):
            out["error"] = count["error"]
            return out
        out["count"] = count
        handles, uuids, unopened = [], [], []
        for i in range(count):
            h = _call(pynvml.nvmlDeviceGetHandleByIndex, i)
            if isinstance(h, dict):
                unopened.append({"index": i, "error": h["error"]})
                continue
            uuid = _call(pynvml.nvmlDeviceGetUUID, h)
            uuids.append(uuid)
            if selected(i, uuid, select):
                handles.append((i, h, uuid))
        # a GPU that cannot be opened has no UUID: it is this task's if selected by index, or if one of the task's
        # UUIDs names no GPU that could be opened
        orphan = select is not None and any(t.startswith("GPU-") and not any(
            isinstance(u, str) and u.startswith(t) for u in uuids) for t in select)
        events = XidEvents(pynvml, [h for _, h, _ in handles])  # Xids that happen while the facts are read
        for i, h, uuid in handles:
            pci = _call(pynvml.nvmlDeviceGetPciInfo_v3, h)
            out["gpus"].append({
                "index": i, "name": _call(pynvml.nvmlDeviceGetName, h), "uuid": uuid,
                "pci_bus": pci if isinstance(pci, dict) else _text(pci.busId),
                "temp": _call(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU),
                "slowdown_temp": _call(pynvml.nvmlDeviceGetTemperatureThreshold, h,
                                       pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                "shutdown_temp": _call(pynvml.nvmlDeviceGetTemperatureThreshold, h,
                                       pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
                "clock_events": _call(pynvml.nvmlDeviceGetCurrentClocksEventReasons, h),
                "ecc_sbe": _call(pynvml.nvmlDeviceGetTotalEccErrors, h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                 pynvml.NVML_VOLATILE_ECC),
                "ecc_dbe": _call(pynvml.nvmlDeviceGetTotalEccErrors, h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                 pynvml.NVML_VOLATILE_ECC),
                "remapped_rows": _call(pynvml.nvmlDeviceGetRemappedRows, h),
                "power_limit": _call(pynvml.nvmlDeviceGetPowerManagementLimit, h),
                "power_default": _call(pynvml.nvmlDeviceGetPowerManagementDefaultLimit, h),
                "pcie_gen": _call(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                "pcie_gen_max": _call(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                "pcie_gen_gpu_max": _call(pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration, h),
                "retired_pages": read_retired_pages(pynvml, h),
                "pcie_width": _call(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h),
                "pcie_width_max": _call(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h),
                "persistence": _call(pynvml.nvmlDeviceGetPersistenceMode, h),
                "mig": _call(pynvml.nvmlDeviceGetMigMode, h),
                "procs": _call(lambda d: [{"pid": p.pid, "bytes": p.usedGpuMemory}
                                          for p in pynvml.nvmlDeviceGetComputeRunningProcesses(d)], h),
                "nvlinks": read_nvlinks(pynvml, h),
            })
        for g, (_, h, _) in zip(out["gpus"], handles):
            g["xid_events"] = events.drain(h)
        out["gpus"] = sorted(out["gpus"] + [g for g in unopened if orphan or selected(g["index"], None, select)],
                             key=lambda g: g["index"])
        if select is not None:  # the job's GPUs that NVML does not show at all (a lost UUID counts as unopened)
            out["select"] = select
            out["missing"] = [t for t in select if not (t.isdigit() and int(t) < count) and not (
                t.startswith("GPU-") and (orphan or any(isinstance(u, str) and u.startswith(t) for u in uuids)))]
        return out
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


NVLINK_COUNTERS = {"replay": 0, "recovery": 1, "crc_flit": 2}  # nvmlNvLinkErrorCounter_t (DL_REPLAY, ...)


def read_nvlinks(pynvml: Any, h: Any) -> list[dict[str, Any]] | dict[str, str]:
    """Each NVLink's state and error counters; {"error": ...} when the GPU has none (NVML: not supported)."""
    links: list[dict[str, Any]] = []
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        state = _call(pynvml.nvmlDeviceGetNvLinkState, h, link)
        if isinstance(state, dict):
            if not links:
                return state
            break  # past the GPU's last link
        entry: dict[str, Any] = {"link": link, "up": bool(state)}
        for name, counter in NVLINK_COUNTERS.items():
            value = _call(pynvml.nvmlDeviceGetNvLinkErrorCounter, h, link, counter)
            if isinstance(value, int):
                entry[name] = value
        links.append(entry)
    return links


class XidEvents:
    """NVML Xid critical-error events of some GPUs, registered now and drained without waiting.

    NVML delivers only events that happen after registration: this sees an Xid raised while the
    check runs (where the kernel log cannot be read, the only way to see one at all).
    """

    MAX_EVENTS = 256

    def __init__(self, pynvml: Any, handles: list[Any]) -> None:
        self.pynvml, self.error, self.set = pynvml, None, None
        self.by_gpu: dict[int, list[int]] = {}
        try:
            self.set = pynvml.nvmlEventSetCreate()
            for h in handles:
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self.set)
        except pynvml.NVMLError as exc:
            self.error = str(exc)
        except AttributeError:  # an NVML without events
            self.error = "NVML has no event API"
        self._drained = False

    def drain(self, handle: Any) -> list[int] | dict[str, str]:
        """The Xid codes NVML reported for ``handle`` (oldest first), or {"error": ...}."""
        import ctypes

        if self.error:
            return {"error": self.error}
        if not self._drained:
            self._drained = True
            try:
                for _ in range(self.MAX_EVENTS):
                    data = self.pynvml.nvmlEventSetWait_v2(self.set, 0)
                    key = ctypes.cast(data.device, ctypes.c_void_p).value or 0
                    self.by_gpu.setdefault(key, []).append(int(data.eventData))
            except self.pynvml.NVMLError:
                pass  # NVML_ERROR_TIMEOUT: no more events
            try:
                self.pynvml.nvmlEventSetFree(self.set)
            except self.pynvml.NVMLError:
                pass
        return self.by_gpu.get(ctypes.cast(handle, ctypes.c_void_p).value or 0, [])


RETIRE_CAUSES = {"sbe": 0, "dbe": 1}  # NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, _DOUBLE_BIT_


def read_retired_pages(pynvml: Any, h: Any) -> dict[str, Any]:
    """Pages retired per cause and whether more wait for a reset; {"error": ...} where NVML has no page
    retirement (Ampere and later remap rows instead)."""
    out: dict[str, Any] = {}
    for name, cause in RETIRE_CAUSES.items():
        pages = _call(pynvml.nvmlDeviceGetRetiredPages, h, cause)
        if isinstance(pages, dict):
            return pages
        out[name] = len(pages)
    pending = _call(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
    out["pending"] = bool(pending) if isinstance(pending, int) else False
    return out


def _call(fn: Any, *args: Any) -> Any:
    from pynvml import NVMLError

    try:
        value = fn(*args)
    except NVMLError as exc:
        return {"error": str(exc)}
    return _text(value) if isinstance(value, bytes) else list(value) if isinstance(value, tuple) else value


def _text(value: Any) -> Any:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


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
        out += _judge_one(node, g, thresholds.for_model(g.get("name")))
        seen = None  # the GPU's Xids: from the kernel log where readable, and from NVML events
        if isinstance(xids, list) and isinstance(g.get("pci_bus"), str):
            seen = [x for x in xids if x["pci"] == _bus_key(g["pci_bus"])]
        if isinstance(g.get("xid_events"), list):
            seen = (seen or []) + [{"xid": code, "message": "an NVML Xid event during the check", "pci": None}
                                   for code in g["xid_events"]]
        if seen is not None:
            out += _judge_xids(node, g, seen)
    return out


def _judge_xids(node: str, g: dict[str, Any], xids: list[dict[str, Any]]) -> list[ProbeResult]:
    subj = Subject(node, g["index"], g.get("uuid") if isinstance(g.get("uuid"), str) else None,
                   g.get("pci_bus") if isinstance(g.get("pci_bus"), str) else None)
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


def _judge_one(node: str, g: dict[str, Any], t: GpuThresholds) -> list[ProbeResult]:
    subj = Subject(node, g["index"], g.get("uuid") if isinstance(g.get("uuid"), str) else None,
                   g.get("pci_bus") if isinstance(g.get("pci_bus"), str) else None)
    res: list[ProbeResult] = []

    def add(probe: str, status: Status, message: str, value: Any = None, threshold: Any = None,
            remediation: str = "") -> None:
        res.append(ProbeResult(f"gpu.{probe}", status, subj, message, value, threshold, remediation))

    def unsupported(probe: str, value: Any) -> bool:
        if isinstance(value, dict):
            add(probe, Status.SKIP, f"{probe}: {value['error']}")
            return True
        return False

    temp, slow, shut = g.get("temp"), g.get("slowdown_temp"), g.get("shutdown_temp")
    if not unsupported("temperature", temp):
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
    events = g.get("clock_events")
    if not unsupported("clocks", events):
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
    dbe, sbe = g.get("ecc_dbe"), g.get("ecc_sbe")
    if not unsupported("ecc", dbe):
        if dbe >= t.ecc_dbe_fail:
            add("ecc", Status.FAIL, f"{dbe} uncorrected ECC errors since boot", dbe, t.ecc_dbe_fail,
                "Uncorrectable memory errors corrupt or kill jobs: drain the node and reset the GPU.")
        elif isinstance(sbe, int) and sbe >= t.ecc_sbe_warn:
            add("ecc", Status.WARN, f"{sbe} corrected ECC errors since boot", sbe, t.ecc_sbe_warn)
        else:
            add("ecc", Status.OK, "no uncorrected ECC errors", dbe, t.ecc_dbe_fail)
    rows = g.get("remapped_rows")
    if not unsupported("remap", rows):
        _corr, _unc, pending, failure = rows
        if failure:
            add("remap", Status.FAIL, "row remapping failed", rows, None,
                "The GPU ran out of spare rows: replace it.")
        elif pending:
            add("remap", Status.WARN, "a row remap is pending a GPU reset", rows, None,
                "Reset the GPU (nvidia-smi -r) when the node is idle.")
        else:
            add("remap", Status.OK, "no pending or failed row remap", rows)
    limit, default = g.get("power_limit"), g.get("power_default")
    if not unsupported("power", limit) and isinstance(default, int):
        if limit < default:
            add("power", Status.WARN, f"power limit {limit // 1000} W below its default {default // 1000} W", limit,
                default, "Someone capped this GPU (nvidia-smi -pl): restore the default.")
        else:
            add("power", Status.OK, f"power limit {limit // 1000} W", limit, default)
    width, width_max = g.get("pcie_width"), g.get("pcie_width_max")
    if not unsupported("pcie", width) and isinstance(width_max, int):
        if width < width_max:
            add("pcie", Status.WARN, f"PCIe link x{width} of x{width_max}", width, width_max,
                "A degraded PCIe link slows every host-device copy: reseat the GPU or check the riser.")
        else:
            add("pcie", Status.OK, f"PCIe link x{width}", width, width_max)
    gen, gen_gpu = g.get("pcie_gen_max"), g.get("pcie_gen_gpu_max")  # (the current gen drops at idle: not judged)
    if isinstance(gen, int) and isinstance(gen_gpu, int):
        if gen < gen_gpu:
            add("pcie_gen", Status.WARN, f"PCIe link limited to Gen{gen}; the GPU does Gen{gen_gpu}", gen, gen_gpu,
                "The slot, riser or BIOS setting holds the link below the GPU's generation: check them.")
        else:
            add("pcie_gen", Status.OK, f"PCIe Gen{gen} link", gen, gen_gpu)
    retired = g.get("retired_pages")
    if isinstance(retired, dict) and "error" not in retired:
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
    procs = g.get("procs")
    if not unsupported("memory", procs):
        _judge_memory(procs, t, add)
    links = g.get("nvlinks")
    if links is not None and not unsupported("nvlink", links):
        _judge_nvlinks(links, t, add)
    mig = g.get("mig")
    if isinstance(mig, list) and mig[0]:
        add("mig", Status.WARN, "MIG mode is on", mig)
    if g.get("persistence") == 0:
        add("persistence", Status.WARN, "persistence mode is off (slow first CUDA call, flaky clocks)", 0, 1,
            "nvidia-smi -pm 1, or run nvidia-persistenced.")
    return res


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
