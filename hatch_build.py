"""Build hook: compile the ring writer's C hot path (megatrace/trace/native/_ringfast.c) and the analysis's
C kernels (megatrace/analyze/native/_kernels.c).

Uses the system C compiler and Python's own headers. If either is missing the
build goes on without them: the tracer runs its pure-Python writer (slower,
same bytes) and the analysis its numpy twins (slower, same results); set MEGATRACE_REQUIRE_NATIVE=1 to make the
first an error instead.

It also compiles the NCCL interposer, megatrace/trace/nccl/libmegatrace_nccl.so (plain C, no
Python or NCCL headers; megatrace/trace/nccl/build.py has the one compiler command). Without it
only the LD_PRELOAD tracing of NCCL is missing; MEGATRACE_REQUIRE_NATIVE=1 makes that an error too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = Path("megatrace/trace/native/_ringfast.c")
KERNELS = Path("megatrace/analyze/native/_kernels.c")  # the analysis's passes over every record (numpy twins)
NCCL_BUILD = Path("megatrace/trace/nccl/build.py")


def compile_extension(root: Path, source: Path, package: Path) -> Path | None:
    """Compile the extension ``source`` into ``package`` (its module named as the file); return its path, or None
    if it cannot be built."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = root / package / f"{source.stem}{suffix}"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    include = sysconfig.get_paths()["include"]
    if not cc or not Path(include, "Python.h").exists():
        return None
    # -O3: the record head checksum (ring_record.h) vectorises; a full load checks every slot of every ring.
    cmd = [cc, "-O3", "-fPIC", "-shared", "-Wall", "-Wextra", "-fvisibility=hidden",
           f"-I{include}", str(root / source), "-o", str(target)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(f"megatrace: building {source} failed:\n{result.stderr}\n")
        return None
    return target


def compile_ringfast(root: Path) -> Path | None:
    """Compile the ring's extension next to its package; return its path, or None if it cannot be built."""
    return compile_extension(root, SOURCE, Path("megatrace/trace"))


def compile_nccl_interposer(root: Path) -> tuple[Path, str | None]:
    """Compile libmegatrace_nccl.so in place; return (its path, None) or (path, why it failed)."""
    spec = importlib.util.spec_from_file_location("_megatrace_nccl_build", root / NCCL_BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # stdlib only: the package itself is not importable here
    target = root / NCCL_BUILD.parent / module.LIBRARY
    return target, module.compile_interposer(target, root / NCCL_BUILD.parent)


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        self._nccl_interposer(version, build_data)
        built = compile_ringfast(Path(self.root))
        if built is None:
            message = ("megatrace: the C ring writer was not built (no C compiler or Python headers); "
                       "the tracer will use its pure-Python writer")
            if os.environ.get("MEGATRACE_REQUIRE_NATIVE") == "1":
                raise RuntimeError(message)
            sys.stderr.write(message + "\n")
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":
            build_data["force_include"][str(built)] = f"megatrace/trace/{built.name}"
        kernels = compile_extension(Path(self.root), KERNELS, Path("megatrace/analyze"))
        if kernels is None:  # (the analysis then makes the same passes with numpy)
            sys.stderr.write("megatrace: the analysis's C kernels were not built; numpy does their work\n")
        elif version != "editable":
            build_data["force_include"][str(kernels)] = f"megatrace/analyze/{kernels.name}"

    def _nccl_interposer(self, version: str, build_data: dict) -> None:
        target, failure = compile_nccl_interposer(Path(self.root))
        if failure is not None:
            message = f"megatrace: the NCCL interposer ({target.name}) was not built: {failure}"
            if os.environ.get("MEGATRACE_REQUIRE_NATIVE") == "1":
                raise RuntimeError(message)
            sys.stderr.write(message + "\n")
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":
            build_data["force_include"][str(target)] = f"megatrace/trace/nccl/{target.name}"
