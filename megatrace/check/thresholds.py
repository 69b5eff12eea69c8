"""The limits checks are held against: built-in defaults, a site's YAML file, and calibration from a healthy run.

The file has three sections, each optional, with strict keys (an unknown key is an error naming the
file and the field, as a typo must not silently keep a default)::

    gpu:  {temp_margin_c: 5, ecc_sbe_warn: 100, ecc_dbe_fail: 1, stray_memory_mib: 1024}
    node: {min_free_shm_mib: 1024, min_free_job_mib: 1024, cpu_ratio_warn: 0.75, ...}
    net:  {slow_ratio: 0.5, min_busbw_gbps: 40.0}
    models:                       # per GPU model (fnmatch on the NVML name, first match wins): the gpu
      "*H100*SXM*": {gpu: {nvlinks: 18}}  # limits it sets replace the gpu section's, the others stay
    nics:                         # per NIC model (fnmatch on sysfs hca_type or board_id, first match wins)
      "MT4129": {rate_gbps: 400}  # every ConnectX-7 port of this fabric must train to NDR

A file's ``models`` section replaces the built-in one (:data:`DEFAULT_GPU_MODELS`). Limits that would judge
every GPU or node (a count limit of 0, a share of the median above 1) and NaN or infinite values are errors.

``megatrace-check --calibrate FILE`` runs the checks on an allocation known to be healthy and writes
such a file with ``net.min_busbw_gbps`` set to a share of the bus bandwidth it measured.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatrace.check.gpu import GpuThresholds
from megatrace.check.host import HostThresholds
from megatrace.check.network import NetThresholds
from megatrace.config import read_yaml
from megatrace.errors import MegatraceError

CALIBRATION_SHARE = 0.8  # a calibrated floor: this share of what the healthy allocation measured


class ThresholdsError(MegatraceError, ValueError):
    """A thresholds file that cannot be used; the message names the file and the field."""


# Per-model GPU limits built in (configs/thresholds.yaml lists the same): NVLinks each must have up. Each entry
# sets only the limits it names; the others come from the gpu section (see GpuThresholds.for_model).
DEFAULT_GPU_MODELS: tuple[tuple[str, dict[str, int]], ...] = (
    ("NVIDIA H100 80GB HBM3", {"nvlinks": 18}),  # H100 SXM5
    ("NVIDIA H200", {"nvlinks": 18}),  # H200 SXM (the H200 NVL has fewer)
    ("*A100-SXM4*", {"nvlinks": 12}))
# Limits a count is held against with ``>=`` (warn or fail at that many): 0 would judge every GPU.
AT_LEAST_ONE = frozenset({"ecc_sbe_warn", "ecc_dbe_fail", "stray_memory_mib", "nvlink_errors_warn",
                          "retired_pages_fail"})
POSITIVE = frozenset({"clock_offset_warn_ms", "clock_offset_fail_ms"})  # |offset| >= limit: 0 flags every node
SHARES = frozenset({"cpu_ratio_warn", "mem_ratio_warn", "nic_rate_ratio_warn", "slow_ratio"})  # x < share * median


@dataclass(frozen=True)
class Thresholds:
    gpu: GpuThresholds = field(default_factory=lambda: GpuThresholds(models=DEFAULT_GPU_MODELS))
    node: HostThresholds = field(default_factory=HostThresholds)
    net: NetThresholds = field(default_factory=NetThresholds)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: dataclasses.asdict(getattr(self, name)) for name in ("gpu", "node", "net")}
        out["gpu"].pop("models", None)
        out["node"].pop("nics", None)
        if self.gpu.models:
            out["models"] = {pattern: {"gpu": dict(overrides)} for pattern, overrides in self.gpu.models}
        if self.node.nics:
            out["nics"] = {pattern: {"rate_gbps": rate} for pattern, rate in self.node.nics}
        return out


def load_thresholds(path: str | Path | None) -> Thresholds:
    """The built-in defaults, overridden by the file at ``path`` (None: defaults only)."""
    if path is None:
        return Thresholds()
    data = read_yaml(path, ThresholdsError, "thresholds") or {}
    if not isinstance(data, dict):
        raise ThresholdsError(f"{path}: expected a mapping with sections gpu, node, net, models, nics")
    defaults = Thresholds()
    parts = {}
    for section, value in data.items():
        if section in ("models", "nics"):
            continue
        if section not in ("gpu", "node", "net"):
            raise ThresholdsError(f"{path}: unknown section {section!r} (one of gpu, node, net, models, nics)")
        parts[section] = _section(path, section, getattr(defaults, section), value)
    out = dataclasses.replace(defaults, **parts)
    if "models" in data:
        models = data["models"]
        if not isinstance(models, dict):
            raise ThresholdsError(f"{path}: models: expected a mapping of GPU name patterns to limits")
        entries = []
        for pattern, limits in models.items():
            where = f"models.{pattern}"
            if not isinstance(limits, dict) or set(limits) - {"gpu"}:
                raise ThresholdsError(f"{path}: {where}: expected {{gpu: {{...}}}} (per-model GPU limits)")
            entries.append((str(pattern), _limits(path, f"{where}.gpu", out.gpu, limits.get("gpu") or {})))
        out = dataclasses.replace(out, gpu=dataclasses.replace(out.gpu, models=tuple(entries)))
    if "nics" in data:
        out = dataclasses.replace(out, node=dataclasses.replace(out.node, nics=_nics(path, data["nics"])))
    return out


def _nics(path: str | Path, nics: Any) -> tuple[tuple[str, float], ...]:
    """The ``nics`` section: pattern -> {rate_gbps: N}, and ``ignore: [pattern, ...]`` (ports not in use).

    A pattern matches a port's HCA type or board id (its model), or its device or port name (``mlx5_1``,
    ``mlx5_1/1``). ``rate_gbps: 0`` marks the ports a pattern matches unused, as ``ignore`` does (a saved
    file writes ignored patterns that way): they are reported SKIP, not judged.
    """
    if not isinstance(nics, dict):
        raise ThresholdsError(f"{path}: nics: expected a mapping of NIC patterns (sysfs hca_type, board_id, device "
                              "or device/port) to {rate_gbps: N}, and ignore: [port patterns]")
    out = []
    for pattern, limits in nics.items():
        if pattern == "ignore":
            if not isinstance(limits, list):
                raise ThresholdsError(f"{path}: nics.ignore: expected a list of port patterns (e.g. [\"mlx5_1/*\", "
                                      f"\"mlx5_bond*\"]), got {limits!r}")
            for i, ignored in enumerate(limits):
                if not isinstance(ignored, str) or not ignored.strip():
                    raise ThresholdsError(f"{path}: nics.ignore[{i}]: expected a port pattern (a string such as "
                                          f"\"mlx5_1/*\"), got {ignored!r}")
                out.append((ignored.strip(), 0.0))
            continue
        where = f"nics.{pattern}"
        if not isinstance(limits, dict) or set(limits) != {"rate_gbps"}:
            raise ThresholdsError(f"{path}: {where}: expected {{rate_gbps: N}} (the Gb/s its ports must run at; 0: "
                                  "not in use)")
        rate = limits["rate_gbps"]
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < float("inf"):
            raise ThresholdsError(f"{path}: {where}.rate_gbps: expected a positive number (or 0: ports not in use), "
                                  f"got {rate!r}")
        out.append((str(pattern), float(rate)))
    return tuple(out)


def _section(path: str | Path, where: str, base: Any, value: Any) -> Any:
    """``base`` (a limits dataclass) with the numbers of ``value`` (checked as :func:`_limits` does)."""
    return dataclasses.replace(base, **_limits(path, where, base, value))


def _limits(path: str | Path, where: str, base: Any, value: Any) -> dict[str, Any]:
    """The limits ``value`` sets, as ``base``'s types, checked: known keys, numbers, finite, in range."""
    if not isinstance(value, dict):
        raise ThresholdsError(f"{path}: {where}: expected a mapping of limits")
    known = {f.name: f for f in dataclasses.fields(base) if f.name not in ("models", "nics")}
    for key, v in value.items():
        if key not in known:
            raise ThresholdsError(f"{path}: {where}.{key}: unknown limit (known: {', '.join(known)})")
        want = type(getattr(base, key))
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ThresholdsError(f"{path}: {where}.{key}: expected a {want.__name__}, got {v!r}")
        if not math.isfinite(v):
            raise ThresholdsError(f"{path}: {where}.{key}: expected a finite number, got {v}")
        if want is int and not float(v).is_integer():
            raise ThresholdsError(f"{path}: {where}.{key}: expected a {want.__name__}, got {v!r}")
        if v < 0:
            raise ThresholdsError(f"{path}: {where}.{key}: must not be negative, got {v}")
        if key in AT_LEAST_ONE and v < 1:
            raise ThresholdsError(f"{path}: {where}.{key}: must be at least 1, got {v} (0 would flag every GPU)")
        if key in POSITIVE and v == 0:
            raise ThresholdsError(f"{path}: {where}.{key}: must be positive, got {v} (0 would flag every node)")
        if key in SHARES and v > 1:
            raise ThresholdsError(f"{path}: {where}.{key}: expected a share of the median from 0 to 1, got {v}")
    return {k: type(getattr(base, k))(v) for k, v in value.items()}


def calibrated(current: Thresholds, busbw_gbps: float | None) -> Thresholds:
    """``current`` with the network floor set from a healthy run's measured bus bandwidth."""
    if busbw_gbps is None:
        return current
    return dataclasses.replace(current, net=dataclasses.replace(
        current.net, min_busbw_gbps=round(CALIBRATION_SHARE * busbw_gbps, 3)))


def save_thresholds(t: Thresholds, path: str | Path, note: str = "") -> None:
    header = "# megatrace-check thresholds" + (f": {note}" if note else "") + "\n"
    Path(path).write_text(header + yaml.safe_dump(t.to_dict(), sort_keys=False))
