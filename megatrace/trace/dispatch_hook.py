"""The c10d dispatcher hook: trace every collective, whichever code path issued it.

``torch.distributed``'s Python functions are one of many callers of a process group. DDP's
reducer, functional collectives (DTensor, tensor parallelism, ``torch.compile``), FSDP and
pipelining call the ``ProcessGroup`` from C++; all of them end in a c10d operator
(``c10d::allreduce_``, ``c10d::send``, ...) dispatched to its per-device kernel. The native
module ``megatrace.trace._c10d_hook`` (``native/c10d_hook.cpp``) puts a kernel in front of each
operator's CPU kernel that writes the record and calls the original: every gloo call is seen
once, at about a microsecond.

The module is compiled against the installed torch (``python -m megatrace.trace.dispatch_hook
--build``, run by ``make install``) and refuses to load under another torch version. Without it
the tracer falls back to the Python wrappers of :mod:`megatrace.trace.torch_hook` and says, once,
what it cannot see. The same kernel sits in front of each operator's CUDA kernel, so device (NCCL)
calls from C++ are recorded too, completed when the GPU has run them; the NCCL interposer
(``docs/nccl-interposer.md``) sees what NCCL does beneath.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrace.errors import MegatraceError
from megatrace.trace import ring_format as fmt

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "native" / "c10d_hook.cpp"
MODULE = "_c10d_hook"

Op, Flag = fmt.Op, fmt.Flag
COLLECTIVE, SEND, RECV = 0, 1, 2
_DATA_KINDS = {"Tensor": 1, "List[Tensor]": 2, "List[List[Tensor]]": 3}  # schema type -> native DataKind


@dataclass(frozen=True)
class HookSpec:
    """One c10d operator: what it records and the names of the arguments it reads."""

    op: Op
    data: str | None = None  # the argument whose bytes and dtype are recorded
    root: str | None = None  # a group rank: the root, or the peer of a send/recv
    kind: int = COLLECTIVE
    flags: int = 0


_T = int(Flag.TENSOR_API)
# The operators of torch/csrc/distributed/c10d/Ops.cpp; arguments are looked up by name in each
# operator's schema, so an operator whose arguments were renamed is skipped, never misread.
HOOK_SPECS: dict[str, HookSpec] = {
    "allreduce_": HookSpec(Op.ALL_REDUCE, "tensors"),
    "allreduce_coalesced_": HookSpec(Op.ALL_REDUCE, "tensors"),
    "broadcast_": HookSpec(Op.BROADCAST, "tensors", "root_rank"),
    "reduce_": HookSpec(Op.REDUCE, "tensors", "root_rank"),
    "allgather_": HookSpec(Op.ALL_GATHER, "input_tensors"),
    "allgather_coalesced_": HookSpec(Op.ALL_GATHER, "input_list"),
    "allgather_into_tensor_coalesced_": HookSpec(Op.ALL_GATHER, "inputs", flags=_T),
    "_allgather_base_": HookSpec(Op.ALL_GATHER, "input_tensor", flags=_T),
    "reduce_scatter_": HookSpec(Op.REDUCE_SCATTER, "output_tensors"),
    "reduce_scatter_tensor_coalesced_": HookSpec(Op.REDUCE_SCATTER, "outputs", flags=_T),
    "_reduce_scatter_base_": HookSpec(Op.REDUCE_SCATTER, "output_tensor", flags=_T),
    "alltoall_": HookSpec(Op.ALL_TO_ALL, "input_tensors"),
    "alltoall_base_": HookSpec(Op.ALL_TO_ALL, "input", flags=_T),
    "gather_": HookSpec(Op.GATHER, "input_tensors", "root_rank"),
    "scatter_": HookSpec(Op.SCATTER, "output_tensors", "root_rank"),
    "barrier": HookSpec(Op.BARRIER),
    "monitored_barrier_": HookSpec(Op.BARRIER),
    "send": HookSpec(Op.SEND, "tensors", "dst", SEND),
    "recv_": HookSpec(Op.RECV, "tensors", "src", RECV),
    "recv_any_source_": HookSpec(Op.RECV, "tensors", None, RECV),
}


class HookUnavailable(MegatraceError, RuntimeError):
    """The native hook cannot be used here; the message says why and what to do."""


def spec_rows(torch: Any, specs: dict[str, HookSpec] = HOOK_SPECS) -> tuple[list[tuple], list[str]]:
    """The rows ``_c10d_hook.install`` takes, from each operator's schema; and the operators skipped."""
    rows, skipped = [], []
    for name, spec in specs.items():
        try:
            schema = torch._C._get_schema(f"c10d::{name}", "")
        except (AttributeError, RuntimeError):
            skipped.append(name)
            continue
        args = {a.name: (i, str(a.type)) for i, a in enumerate(schema.arguments)}
        pg = args.get("process_group")
        data = args.get(spec.data) if spec.data else (-1, "")
        root = args.get(spec.root) if spec.root else (-1, "int")
        if pg is None or data is None or root is None or (spec.data and data[1] not in _DATA_KINDS):
            skipped.append(name)
            continue
        async_arg = args.get("async_op", (-1, ""))[0]
        rows.append((name, int(spec.op), data[0], _DATA_KINDS.get(data[1], 0), pg[0], root[0], async_arg,
                     spec.kind, spec.flags))
    return rows, skipped


# -- building ---------------------------------------------------------------------------------
def target_path() -> Path:
    return HERE / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def build_command(target: Path, torch: Any, std: str = "c++17") -> list[str]:
    """The compiler command for the installed torch (its headers, libraries and C++ ABI)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    root = Path(torch.__file__).resolve().parent
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    return [cxx, "-O2", f"-std={std}", "-fPIC", "-shared", "-fvisibility=hidden", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f'-DMEGATRACE_TORCH_VERSION="{torch.__version__}"',
            f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-I{sysconfig.get_paths()['include']}", f"-I{HERE / 'native'}", str(SOURCE),
            f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{root / 'lib'}", "-o", str(target)]


def build(target: Path | None = None) -> Path:
    """Compile the hook for the installed torch; raise :class:`HookUnavailable` with the compiler's words."""
    try:
        import torch
    except ImportError as exc:
        raise HookUnavailable(f"torch is not importable ({exc}); nothing to build against") from None
    target = target or target_path()
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    errors = []
    for std in ("c++20", "c++17"):  # torch 2.x headers want C++17 at least; newer ones prefer 20
        result = subprocess.run(build_command(tmp, torch, std), capture_output=True, text=True, check=False)
        if result.returncode == 0:
            os.replace(tmp, target)
            return target
        errors.append(result.stderr.strip()[-2000:])
    tmp.unlink(missing_ok=True)
    raise HookUnavailable(f"cannot compile {SOURCE.name} against torch {torch.__version__}:\n{errors[-1]}")


# -- loading ----------------------------------------------------------------------------------
def poll_cpu() -> bool:
    """``MEGATRACE_DISPATCH_HOOK=poll``: complete CPU works as device works are, by polling them
    (how the device path's completion is tested on a machine without a GPU)."""
    return os.environ.get("MEGATRACE_DISPATCH_HOOK", "1") == "poll"


def load(torch: Any) -> Any:
    """The native module, built for this very torch; :class:`HookUnavailable` otherwise."""
    if os.environ.get("MEGATRACE_DISPATCH_HOOK", "1") == "0":
        raise HookUnavailable("MEGATRACE_DISPATCH_HOOK=0")
    try:
        from megatrace.trace import _c10d_hook  # type: ignore[attr-defined]
    except ImportError as exc:
        raise HookUnavailable(f"the c10d hook is not built ({exc}); build it with "
                              "`python -m megatrace.trace.dispatch_hook --build`") from None
    if _c10d_hook.TORCH_VERSION != torch.__version__:
        raise HookUnavailable(f"the c10d hook was built for torch {_c10d_hook.TORCH_VERSION}, this is "
                              f"{torch.__version__}; rebuild it with `python -m megatrace.trace.dispatch_hook --build`")
    return _c10d_hook


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatrace.trace.dispatch_hook", description=__doc__.splitlines()[0])
    p.add_argument("--build", action="store_true", help="compile the hook against the installed torch")
    p.add_argument("--check", action="store_true", help="say whether the hook loads here (exit 1 if not)")
    args = p.parse_args(argv)
    if not (args.build or args.check):
        p.print_help()
        return 2
    try:
        if args.build:
            print(f"built {build()}")
        if args.check:
            import torch

            load(torch)
            rows, skipped = spec_rows(torch)
            print(f"c10d hook loads for torch {torch.__version__}: {len(rows)} operators"
                  + (f", skipped (schema changed): {', '.join(skipped)}" if skipped else ""))
    except HookUnavailable as exc:
        print(f"megatrace: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
