"""The limits checks are held against: built-in defaults, a site's YAML file, and calibration from a healthy run.

The file has three sections, each optional, with strict keys (an unknown key is an error naming the
file and the field, as a typo must not silently keep a default)::

    gpu:  {temp_margin_c: 5, ecc_sbe_warn: 100, ecc_dbe_fail: 1, stray_memory_mib: 1024}
    node: {min_free_shm_mib: 1024, min_free_job_mib: 1024, cpu_ratio_warn: 0.75, ...}
    net:  {slow_ratio: 0.5, min_busbw_gbps: 40.0}

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


@dataclass(frozen=True)
class Thresholds:
    gpu: GpuThresholds = field(default_factory=GpuThresholds)
    node: HostThresholds = field(default_factory=HostThresholds)
    net: NetThresholds = field(default_factory=NetThresholds)

    def to_dict(self) -> dict[str, Any]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in ("gpu", "node", "net")}


def load_thresholds(path: str | Path | None) -> Thresholds:
    """The built-in defaults, overridden by the file at ``path`` (None: defaults only)."""
    if path is None:
        return Thresholds()
    data = read_yaml(path, ThresholdsError, "thresholds") or {}
    if not isinstance(data, dict):
        raise ThresholdsError(f"{path}: expected a mapping with sections gpu, node, net")
    defaults = Thresholds()
    parts = {}
    for section, value in data.items():
        if section not in ("gpu", "node", "net"):
            raise ThresholdsError(f"{path}: unknown section {section!r} (one of gpu, node, net)")
        base = getattr(defaults, section)
        if not isinstance(value, dict):
            raise ThresholdsError(f"{path}: {section}: expected a mapping of limits")
        known = {f.name: f for f in dataclasses.fields(base)}
        for key, v in value.items():
            if key not in known:
                raise ThresholdsError(f"{path}: {section}.{key}: unknown limit (known: {', '.join(known)})")
            want = type(getattr(base, key))
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (want is int and not float(v).is_integer()):
                raise ThresholdsError(f"{path}: {section}.{key}: expected a {want.__name__}, got {v!r}")
            if v < 0:
                raise ThresholdsError(f"{path}: {section}.{key}: must not be negative, got {v}")
        parts[section] = dataclasses.replace(base, **{k: type(getattr(base, k))(v) for k, v in value.items()})
    return dataclasses.replace(defaults, **parts)


def calibrated(current: Thresholds, busbw_gbps: float | None) -> Thresholds:
    """``current`` with the network floor set from a healthy run's measured bus bandwidth."""
    if busbw_gbps is None:
        return current
    return dataclasses.replace(current, net=dataclasses.replace(
        current.net, min_busbw_gbps=round(CALIBRATION_SHARE * busbw_gbps, 3)))


def save_thresholds(t: Thresholds, path: str | Path, note: str = "") -> None:
    header = "# megatrace-check thresholds" + (f": {note}" if note else "") + "\n"
    Path(path).write_text(header + yaml.safe_dump(t.to_dict(), sort_keys=False))
