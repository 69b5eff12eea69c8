"""Reading a node's GPUs through NVML (pynvml): every fact the GPU checks need, as plain data.

:func:`read_gpus` runs in the child process of :func:`megatrace.check.gpu.probe_gpus` (``python -m
megatrace.check.gpu``), under a hard timeout: a wedged driver can block an NVML call forever. A call that
fails becomes ``{"error": ...}`` in place of its value, never an exception.
"""

from __future__ import annotations

from typing import Any

from megatrace.check.xid import read_kernel_xids


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
        _read_devices(pynvml, count, select, out)
        return out
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _read_devices(pynvml: Any, count: int, select: list[str] | None, out: dict[str, Any]) -> None:
    """``out``'s GPUs (those selected, and those NVML cannot open that are this task's) and, with ``select``,
    the job's GPUs NVML does not show."""
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
        out["gpus"].append(_read_device(pynvml, i, h, uuid))
    for g, (_, h, _) in zip(out["gpus"], handles):
        g["xid_events"] = events.drain(h)
    out["gpus"] = sorted(out["gpus"] + [g for g in unopened if orphan or selected(g["index"], None, select)],
                         key=lambda g: g["index"])
    if select is not None:  # the job's GPUs that NVML does not show at all (a lost UUID counts as unopened)
        out["select"] = select
        out["missing"] = [t for t in select if not (t.isdigit() and int(t) < count) and not (
            t.startswith("GPU-") and (orphan or any(isinstance(u, str) and u.startswith(t) for u in uuids)))]


def _read_device(pynvml: Any, i: int, h: Any, uuid: Any) -> dict[str, Any]:
    """The facts of one GPU NVML opened (``h``), each value or {"error": ...}."""
    pci = _call(pynvml.nvmlDeviceGetPciInfo_v3, h)
    return {
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
    }


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
