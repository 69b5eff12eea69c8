"""NVIDIA DCGM's level-1 diagnostic (``dcgmi diag -r 1 -j``) as preflight results, for ``--level full``.

Runs only where ``dcgmi`` is installed (and its host engine answers). The JSON is read as DCGM 3.x
and 4.x write it: ``{"DCGM Diagnostic" | "DCGM GPU Diagnostic": {"test_categories": [{"category",
"tests": [{"name", "results": [{"entity_group": "GPU", "entity_id": N, "status": "Pass" | "Fail" |
"Warn" | "Skip", "warnings": [{"warning": text}]}], "test_summary": {"status"}}]}]}}``. A failed
test becomes a FAIL on its GPU, a warning a WARN; a tool that cannot run is a WARN on the node (the
GPU probes through NVML still decide), never a hang: the run has a timeout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

from megatrace.check.results import ProbeResult, Status, Subject

STATUS = {"fail": Status.FAIL, "warn": Status.WARN, "warning": Status.WARN, "pass": Status.OK, "skip": Status.SKIP}


def probe_dcgm(node: str, timeout_s: float = 120.0, dcgmi: str | None = None) -> list[ProbeResult]:
    """``dcgmi diag -r 1 -j`` judged; [] when dcgmi is not installed."""
    exe = dcgmi or shutil.which("dcgmi")
    if exe is None:
        return []
    here = Subject(node)
    try:
        proc = subprocess.run([exe, "diag", "-r", "1", "-j"], capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return [ProbeResult("gpu.dcgm", Status.FAIL, here, f"dcgmi diag -r 1 did not finish within {timeout_s:g} s",
                            remediation="A diagnostic that hangs points at a wedged GPU or driver: drain the node.")]
    except OSError as exc:
        return [ProbeResult("gpu.dcgm", Status.WARN, here, f"cannot run {exe}: {exc}")]
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        tail = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[-1][:200]
        return [ProbeResult("gpu.dcgm", Status.WARN, here, f"dcgmi diag gave no JSON ({tail}); is nv-hostengine running?")]
    return judge_dcgm(doc, node)


def judge_dcgm(doc: Any, node: str) -> list[ProbeResult]:
    """Results from a ``dcgmi diag -j`` document (pure)."""
    here = Subject(node)
    root = doc.get("DCGM Diagnostic") or doc.get("DCGM GPU Diagnostic") if isinstance(doc, dict) else None
    categories = root.get("test_categories") if isinstance(root, dict) else None
    if not isinstance(categories, list):
        error = root.get("runtime_error") if isinstance(root, dict) else None
        return [ProbeResult("gpu.dcgm", Status.WARN, here, f"dcgmi diag: {error or 'no test results in its JSON'}")]
    out: list[ProbeResult] = []
    tests = 0
    for category in categories:
        for test in (category.get("tests") or []) if isinstance(category, dict) else []:
            if not isinstance(test, dict):
                continue
            tests += 1
            name = str(test.get("name", "?"))
            for result in test.get("results") or []:
                status = STATUS.get(str(result.get("status", "")).lower()) if isinstance(result, dict) else None
                if status not in (Status.FAIL, Status.WARN):
                    continue
                gpu = result.get("entity_id", result.get("gpu_id")) if result.get("entity_group", "GPU") == "GPU" \
                    else None
                words = "; ".join(str(w.get("warning", w)) if isinstance(w, dict) else str(w)
                                  for w in result.get("warnings") or [])[:300]
                out.append(ProbeResult("gpu.dcgm", status, Subject(node, gpu if isinstance(gpu, int) else None),
                                       f"DCGM {name}: {words or status.value}", value=name,
                                       remediation="See `dcgmi diag -r 1` on the node; a failed DCGM test is a "
                                                   "reason to drain it." if status == Status.FAIL else ""))
    if not out:
        out.append(ProbeResult("gpu.dcgm", Status.OK, here, f"DCGM level-1 diagnostic passed ({tests} tests)",
                               value=tests))
    return out
