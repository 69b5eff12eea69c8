"""The limits checks are held against: built-in defaults, a site's YAML file, and calibration from a healthy run.

The file has three sections, each optional, with strict keys (an unknown key is an error naming the
file and the field, as a typo must not silently keep a default)::

    gpu:  {temp_margin_c: 5, ecc_sbe_warn: 100, ecc_dbe_fail: 1, stray_memory_mib: 1024}
    node: {min_free_shm_mib: 1024, min_free_job_mib: 1024, cpu_ratio_warn: 0.75, ...}
    net:  {slow_ratio: 0.5, min_busbw_gbps: 40.0}
    models:                       # per GPU model (fnmatch on the NVML name, first match wins)
      "*H100*SXM*": {gpu: {nvlinks: 18}}
    nics:                         # per NIC model (fnmatch on sysfs hca_type or board_id, first match wins)
      "MT4129": {rate_gbps: 400}  # every ConnectX-7 port of this fabric must train to NDR

``megatrace-check --calibrate FILE`` runs the checks on an allocation known to be healthy and writes
such a file with ``net.min_busbw_gbps`` set to a share of the bus bandwidth it measured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatrace.check.gpu import GpuThresholds
from megatrace.check.host import HostThresholds
from megatrace.check.network import NetThresholds
from megatrace.config import read_yaml

CALIBRATION_SHARE = 0.8  # a calibrated floor: this share of what the healthy allocation measured


class ThresholdsError(ValueError):
    """A thresholds file that cannot be used; the message names the file and the field."""


# Per-model GPU limits built in (configs/thresholds.yaml lists the same): NVLinks each must have up.
DEFAULT_GPU_MODELS = (("NVIDIA H100 80GB HBM3", GpuThresholds(nvlinks=18)),  # H100 SXM5
                      ("NVIDIA H200", GpuThresholds(nvlinks=18)),  # H200 SXM (the H200 NVL has fewer)
                      ("*A100-SXM4*", GpuThresholds(nvlinks=12)))


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
            out["models"] = {pattern: {"gpu": {k: v for k, v in dataclasses.asdict(limits).items()
                                               if k != "models" and v != out["gpu"][k]}}
                             for pattern, limits in self.gpu.models}
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
        entries, plain = [], dataclasses.replace(out.gpu, models=())
        for pattern, limits in models.items():
            where = f"models.{pattern}"
            if not isinstance(limits, dict) or set(limits) - {"gpu"}:
                raise ThresholdsError(f"{path}: {where}: expected {{gpu: {{...}}}} (per-model GPU limits)")
            entries.append((str(pattern), _section(path, f"{where}.gpu", plain, limits.get("gpu") or {})))
        out = dataclasses.replace(out, gpu=dataclasses.replace(out.gpu, models=tuple(entries)))
    if "nics" in data:
        out = dataclasses.replace(out, node=dataclasses.replace(out.node, nics=_nics(path, data["nics"])))
    return out


def _nics(path: str | Path, nics: Any) -> tuple[tuple[str, float], ...]:
    """The ``nics`` section: HCA type (or board id) pattern -> {rate_gbps: N}."""
    if not isinstance(nics, dict):
        raise ThresholdsError(f"{path}: nics: expected a mapping of NIC model patterns (sysfs hca_type or board_id) "
                              "to {rate_gbps: N}")
    out = []
    for pattern, limits in nics.items():
        where = f"nics.{pattern}"
        if not isinstance(limits, dict) or set(limits) != {"rate_gbps"}:
            raise ThresholdsError(f"{path}: {where}: expected {{rate_gbps: N}} (the Gb/s its ports must run at)")
        rate = limits["rate_gbps"]
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0:
            raise ThresholdsError(f"{path}: {where}.rate_gbps: expected a positive number, got {rate!r}")
        out.append((str(pattern), float(rate)))
    return tuple(out)


def _section(path: str | Path, where: str, base: Any, value: Any) -> Any:
    """``base`` (a limits dataclass) with the numbers of ``value`` (checked: known keys, types, signs)."""
    if not isinstance(value, dict):
        raise ThresholdsError(f"{path}: {where}: expected a mapping of limits")
    known = {f.name: f for f in dataclasses.fields(base) if f.name not in ("models", "nics")}
    for key, v in value.items():
        if key not in known:
            raise ThresholdsError(f"{path}: {where}.{key}: unknown limit (known: {', '.join(known)})")
        want = type(getattr(base, key))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (want is int and not float(v).is_integer()):
            raise ThresholdsError(f"{path}: {where}.{key}: expected a {want.__name__}, got {v!r}")
        if v < 0:
            raise ThresholdsError(f"{path}: {where}.{key}: must not be negative, got {v}")
    return dataclasses.replace(base, **{k: type(getattr(base, k))(v) for k, v in value.items()})


def calibrated(current: Thresholds, busbw_gbps: float | None) -> Thresholds:
    """``current`` with the network floor set from a healthy run's measured bus bandwidth."""
    if busbw_gbps is None:
        return current
    return dataclasses.replace(current, net=dataclasses.replace(
        current.net, min_busbw_gbps=round(CALIBRATION_SHARE * busbw_gbps, 3)))


def save_thresholds(t: Thresholds, path: str | Path, note: str = "") -> None:
    header = "# megatrace-check thresholds" + (f": {note}" if note else "") + "\n"
    Path(path).write_text(header + yaml.safe_dump(t.to_dict(), sort_keys=False))
