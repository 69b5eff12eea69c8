"""Xid errors in the kernel log: read them (``$MEGATRACE_KERNEL_LOG`` or ``dmesg``) and tell which GPU each names."""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

# Xid codes (NVIDIA's Xid catalogue) that mean the GPU must not take a job: DBE (48), page retirement or
# row-remap failure (63/64), NVLink error (74), fallen off the bus (79), contained/uncontained ECC (94/95),
# GSP errors (119/120). Others are reported as warnings.
XID_FAIL = {48, 63, 64, 74, 79, 94, 95, 119, 120}
XID_LINE = re.compile(r"NVRM: Xid \(PCI:(?P<pci>[0-9a-fA-F:.]+)\): (?P<xid>\d+)(?:, (?P<rest>.*))?")


def parse_xids(text: str) -> list[dict[str, Any]]:
    """Xid events in kernel log text: ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.``"""
    out = []
    for m in XID_LINE.finditer(text):
        out.append({"pci": bus_key(m["pci"]), "xid": int(m["xid"]), "message": (m["rest"] or "").strip()[:200]})
    return out


def bus_key(pci: str) -> str:
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
