"""Whether the installed SPANK plugin fits the running Slurm (``node.plugin``).

Slurm loads a plugin only when it was built against the same major.minor release; otherwise sbatch and
srun print ``Incompatible Slurm plugin ... version`` and, since the plugstack line is ``optional``, go on
without ``--megatrace``: after every Slurm upgrade tracing silently disappears until someone rebuilds.
This probe reads the release the plugin was built for (its ``plugin_version`` symbol, which
``SPANK_PLUGIN()`` sets to ``SLURM_VERSION_NUMBER``) straight from the ELF file, without loading it, and
compares it with the release of the site's Slurm (``slurmd -V``).
"""

from __future__ import annotations

import glob
import os
import re
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

PLUGIN_NAME = "megatrace.so"
REBUILD = "make -C spank_plugin clean install"  # from the megatrace checkout, against the running Slurm's headers
ELF_LIMIT = 64 << 20  # a SPANK plugin is tens of KiB; refuse to read anything absurd


@dataclass(frozen=True)
class PluginFacts:
    """The plugin a plugstack file names, the release it was built for and the one running."""

    path: str | None = None
    built_for: int | None = None  # SLURM_VERSION_NUMBER, 0xMMmmuu
    running: int | None = None
    problem: str | None = None  # why one of them could not be read

    def to_dict(self) -> dict[str, object]:
        fits = None if self.built_for is None or self.running is None else same_release(self.built_for, self.running)
        return {"path": self.path, "built_for": release(self.built_for), "running": release(self.running),
                "fits": fits, "problem": self.problem}


def release(number: int | None) -> str | None:
    """``0x160508`` -> ``"22.05.8"``."""
    if number is None:
        return None
    return f"{number >> 16 & 0xff}.{number >> 8 & 0xff:02d}.{number & 0xff}"


def same_release(a: int, b: int) -> bool:
    """What Slurm's plugin loader requires: the same major and minor release."""
    return a >> 8 == b >> 8


def elf_symbol_u32(path: str | os.PathLike[str], name: str) -> int | None:
    """The 32-bit value a defined data symbol holds in an ELF64 little-endian shared object (None if absent).

    Raises ValueError for a file that is not such an object."""
    with open(path, "rb") as f:
        blob = f.read(ELF_LIMIT + 1)
    if len(blob) > ELF_LIMIT or blob[:4] != b"\x7fELF" or blob[4] != 2 or blob[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    try:
        shoff, = struct.unpack_from("<Q", blob, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", blob, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
        for sh in sections:
            if sh[1] != 11:  # SHT_DYNSYM
                continue
            strtab = sections[sh[6]]  # sh_link: its string table
            str_off, sym_off, sym_size, entsize = strtab[4], sh[4], sh[5], sh[9] or 24
            for i in range(sym_size // entsize):
                st_name, _info, _other, st_shndx, st_value, _size = struct.unpack_from("<IBBHQQ", blob,
                                                                                     sym_off + i * entsize)
                end = blob.index(b"\0", str_off + st_name)
                if blob[str_off + st_name:end] != name.encode() or st_shndx == 0 or st_shndx >= len(sections):
                    continue
                home = sections[st_shndx]
                return struct.unpack_from("<I", blob, home[4] + st_value - home[3])[0]
    except (struct.error, IndexError, ValueError) as exc:
        raise ValueError(f"damaged ELF file ({exc})") from None
    return None


def running_release(timeout: float = 10.0) -> int | None:
    """SLURM_VERSION_NUMBER of the Slurm on PATH: ``slurmd -V`` ("slurm 22.05.8"; it reads no configuration),
    else ``scontrol --version`` (which needs a readable slurm.conf)."""
    for argv in (["slurmd", "-V"], ["scontrol", "--version"]):
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        m = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
        if m:
            return (int(m[1]) << 16) + (int(m[2]) << 8) + int(m[3])
    return None


def plugstack_plugins(plugstack: str | os.PathLike[str]) -> list[str]:
    """The megatrace plugins a plugstack.conf names, following its ``include`` globs (64 files at most)."""
    found: list[str] = []
    files = [str(plugstack)]
    seen: set[str] = set()
    while files:
        conf = files.pop(0)
        if conf in seen or len(seen) > 64:
            continue
        seen.add(conf)
        try:
            lines = Path(conf).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            words = line.split("#", 1)[0].split()
            if len(words) >= 2 and words[0] == "include":
                files += sorted(glob.glob(words[1]))
            elif len(words) >= 2 and words[0] in ("required", "optional") and Path(words[1]).name == PLUGIN_NAME:
                found.append(words[1])
    return found


def default_plugstack() -> str:
    """plugstack.conf beside the slurm.conf in use (``SLURM_CONF``, else Debian's /etc/slurm)."""
    return str(Path(os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf").with_name("plugstack.conf"))


def read_plugin(plugstack: str | None = None, plugin: str | None = None) -> PluginFacts | None:
    """The facts for ``plugin`` (else the first megatrace plugin ``plugstack`` names); None when none is
    installed (nothing to check)."""
    if plugin is None:
        named = plugstack_plugins(plugstack or default_plugstack())
        if not named:
            return None
        plugin = named[0]
    running = running_release()
    try:
        built = elf_symbol_u32(plugin, "plugin_version")
    except OSError as exc:
        return PluginFacts(plugin, None, running, f"cannot read {plugin}: {exc.strerror}")
    except ValueError as exc:
        return PluginFacts(plugin, None, running, f"{plugin}: {exc}")
    if built is None:
        return PluginFacts(plugin, None, running, f"{plugin} has no plugin_version symbol (not a SPANK plugin?)")
    unknown = "neither slurmd -V nor scontrol --version gave a release"
    return PluginFacts(plugin, built, running, None if running is not None else unknown)
