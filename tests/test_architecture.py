"""The package's shape: the pipeline's stages import only earlier ones, no two modules import each other, no
private name crosses a module boundary, and no module or function outgrows what a reader can hold.

Stages, in order: ``trace → collect → load → analyze → report``. Every import counts, function-level ones
included (a late import hides a cycle; it does not remove it).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatrace"
STAGES = ("trace", "collect", "load", "analyze", "report")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()
# Native extension modules (built from trace/native/*.c, *.cpp at install): modules, not private names.
NATIVE = {f"megatrace.trace._{p.stem.lstrip('_')}" for p in (PACKAGE / "trace" / "native").glob("*.c*")}


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every import of ``megatrace`` in the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.startswith("megatrace")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if not base.startswith("megatrace"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, None, node.lineno) if sub in MODULES or sub in NATIVE else (base, a.name, node.lineno))
    return out


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _stage(module: str) -> int | None:
    parts = module.split(".")
    return STAGES.index(parts[1]) if len(parts) > 1 and parts[1] in STAGES else None


def test_a_stage_imports_only_earlier_stages() -> None:
    wrong = [f"{m}:{line} imports {target}" for m, found in IMPORTS.items() for target, _, line in found
             if _stage(m) is not None and _stage(target) is not None and _stage(target) > _stage(m)]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    """No cycle among modules (a package's ``__init__`` re-exporting its modules is no cycle of its own)."""
    graph = {m: {t for t, _, _ in found if t in MODULES and t != m} for m, found in IMPORTS.items()}
    for m, targets in graph.items():  # a package importing its own submodules (its public face) is not an edge back
        graph[m] = {t for t in targets if not (MODULES[m].name == "__init__.py" and t.startswith(m + "."))}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_no_private_name_is_imported_from_another_module() -> None:
    wrong = [f"{m}:{line} imports {name} from {target}" for m, found in IMPORTS.items()
             for target, name, line in found
             if name and name.startswith("_") and not name.startswith("__") and target != m]
    assert not wrong, "\n".join(wrong)


TESTS = Path(__file__).resolve().parent


def _imported_test_modules(path: Path) -> list[tuple[str, int]]:
    """(module, line) for every import of a test module (``test_*``) or of conftest in the file, function-level
    imports and ``importlib.import_module("...")`` / ``__import__("...")`` of a literal name included."""
    names: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.append((node.module, node.lineno))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None)
                   in ("__import__", "import_module"))):
            names.append((node.args[0].value, node.lineno))
    return [(n, line) for n, line in names if n.split(".")[0].startswith("test_") or n.split(".")[0] == "conftest"]


def test_no_test_module_imports_another_test_module_or_conftest() -> None:
    """Shared test code lives in tests/helpers/; a test module imports from there, never from another test
    module (which would run that module's import-time skips and marks, and hide what is shared) or conftest."""
    files = sorted(TESTS.glob("*.py")) + sorted((TESTS / "helpers").glob("*.py"))
    wrong = [f"{path.relative_to(TESTS.parent)}:{line} imports {name}" for path in files
             for name, line in _imported_test_modules(path)]
    assert not wrong, "\n".join(wrong)


def test_no_module_or_function_outgrows_a_reader() -> None:
    """At most MAX_MODULE_LINES per module, MAX_FUNCTION_LINES per function (its ``def`` to its last line; a
    command's stacked click options are decorators, not body)."""
    wrong = []
    for name, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > MAX_MODULE_LINES:
            wrong.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    wrong.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not wrong, "\n".join(wrong)
