"""Autoload: imported at interpreter start by ``megatrace-autoload.pth`` when MEGATRACE_ENABLE=1.

It does not import torch. It waits for ``torch.distributed.distributed_c10d`` to
be imported and wraps it right after the module body runs, before
``torch.distributed`` re-exports its names, so every later import sees the
traced functions. Nothing here may raise: a broken tracer must not stop Python.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

TARGET = "torch.distributed.distributed_c10d"


class _InstallAfterExec(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        try:
            from megatrace.trace import torch_hook

            torch_hook.install(module)
        except Exception as exc:  # noqa: BLE001
            sys.stderr.write(f"megatrace: warning: tracer not installed: {exc!r}\n")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _InstallAfterExec(spec.loader)
        return spec


def activate() -> None:
    """Install the tracer now if torch.distributed is loaded, else when it is."""
    if TARGET in sys.modules:
        from megatrace.trace import torch_hook

        torch_hook.install(sys.modules[TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


try:
    activate()
except Exception as _exc:  # noqa: BLE001
    sys.stderr.write(f"megatrace: warning: autoload failed: {_exc!r}\n")
