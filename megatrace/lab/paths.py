"""Where the lab keeps its files, and where it installs what Slurm runs as root."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import megatrace

DEFAULT_ROOT = "/var/lib/megatrace-lab"
ENV_ROOT = "MEGATRACE_LAB_DIR"


def repo_root() -> Path:
    """The source tree (spank_plugin/ and slurm/ live beside the package in a checkout)."""
    return Path(megatrace.__file__).resolve().parent.parent


@dataclass(frozen=True)
class LabPaths:
    root: Path
    # Installed, root-owned copies: Slurm runs the prolog/epilog as root, so never from the checkout.
    libexec: Path = Path("/usr/local/lib/megatrace")
    site_conf_dir: Path = Path("/etc/megatrace")
    slurm_conf: Path = Path("/etc/slurm/slurm.conf")
    plugstack_dir: Path = Path("/etc/slurm/plugstack.conf.d")
    # The release of a Slurm under a prefix ("" for Debian's): its controller and slurmd state apart, as a release
    # refuses the state files of another ("Can not recover assoc_usage state, incompatible version").
    slurm_tag: str = ""

    @classmethod
    def default(cls, root: str | os.PathLike[str] | None = None) -> "LabPaths":
        return cls(Path(root or os.environ.get(ENV_ROOT) or DEFAULT_ROOT))

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def spool_dir(self) -> Path:
        return self.root / ("spool" + (f"-{self.slurm_tag}" if self.slurm_tag else ""))

    @property
    def ctld_state_dir(self) -> Path:
        return self.root / ("ctld" + (f"-{self.slurm_tag}" if self.slurm_tag else ""))

    @property
    def lab_slurm_conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def site_conf(self) -> Path:
        return self.site_conf_dir / "slurm.conf"

    @property
    def prolog(self) -> Path:
        return self.libexec / "prolog"

    @property
    def epilog(self) -> Path:
        return self.libexec / "epilog"

    @property
    def healthcheck(self) -> Path:
        return self.libexec / "healthcheck"

    @property
    def plugin(self) -> Path:
        return self.libexec / "megatrace.so"

    @property
    def megatrace_bin(self) -> Path:
        return Path(sys.executable).parent / "megatrace"
