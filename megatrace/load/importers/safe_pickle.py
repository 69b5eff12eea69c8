"""A restricted unpickler for untrusted pickles (PyTorch Flight Recorder dumps).

``pickle.load`` runs code: a pickle can name any importable callable (``os.system``) and call it
while it is read. A Flight Recorder dump only holds plain data (dicts, lists, tuples, strings,
numbers, booleans, None), so this reader admits exactly those:

1. Every opcode is checked *before* anything is built (``pickletools.genops``, which only parses):
   opcodes that import or call (GLOBAL, STACK_GLOBAL, INST, OBJ, REDUCE, NEWOBJ, NEWOBJ_EX, BUILD,
   EXT1/2/4, PERSID, BINPERSID) and out-of-band buffers are refused, naming the opcode and its
   byte offset.
2. The data is then read by an :class:`pickle.Unpickler` whose ``find_class`` and
   ``persistent_load`` refuse everything, so that even an opcode missed by step 1 cannot reach a
   callable.
3. The result is walked once more: anything that is not a plain container or scalar is refused. The
   walk visits each container once (a pickle's memo lets a few hundred bytes reference one list from
   many places: 2**60 paths, one object per level), refuses a container that contains itself (a
   cycle) and containers nested deeper than :data:`MAX_DEPTH`, so that what the importer reads next
   is a finite tree of bounded depth; a pickle above :data:`MAX_BYTES` is refused unread.

Every refusal raises :class:`UnsafePickleError` (a ``ValueError``) naming the file.
"""

from __future__ import annotations

import io
import pickle
import pickletools

from megatrace.errors import MegatraceError
from megatrace.files import open_input_file

MAX_BYTES = 1 << 30  # a dump above 1 GiB is not a Flight Recorder dump (default ring: 2,000 entries)
MAX_DEPTH = 32  # containers in containers: a Flight Recorder dump nests 5 deep (dump, entries, entry, sizes, shape)

# Opcodes that only build plain values (containers, scalars) or manage the memo and the stack.
ALLOWED_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE",
    "BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
    "EMPTY_LIST", "APPEND", "APPENDS", "LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_SET", "ADDITEMS", "FROZENSET",
    "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE",
})
PLAIN_TYPES = (dict, list, tuple, set, frozenset, str, bytes, bytearray, int, float, bool, type(None))


class UnsafePickleError(MegatraceError, ValueError):
    """The pickle holds something other than plain data, or is not a readable pickle; names the file."""


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: ANN201 - never returns
        raise pickle.UnpicklingError(f"refused to import {module}.{name}")

    def persistent_load(self, pid):  # noqa: ANN001, ANN201 - never returns
        raise pickle.UnpicklingError("refused a persistent id")


def check_opcodes(data: bytes, source: str) -> None:
    """Raise :class:`UnsafePickleError` unless every opcode of ``data`` builds plain data."""
    try:
        for opcode, _arg, pos in pickletools.genops(data):
            if opcode.name not in ALLOWED_OPCODES:
                raise UnsafePickleError(
                    f"{source}: refused to unpickle: opcode {opcode.name} at byte {pos} would import or call "
                    f"code (a Flight Recorder dump holds only dicts, lists, strings and numbers); nothing was "
                    f"executed")
    except UnsafePickleError:
        raise
    except (ValueError, EOFError, IndexError, KeyError, UnicodeDecodeError) as exc:
        raise UnsafePickleError(f"{source}: not a readable pickle (truncated or damaged): {exc}") from None


def _check_plain(value: object, source: str) -> None:
    """Refuse anything but plain containers and scalars, a container inside itself, or nesting deeper than
    MAX_DEPTH. Depth first; a container is checked again only when reached deeper than before (at most
    MAX_DEPTH times): linear in the number of distinct objects, however often they are referenced."""
    containers = (dict, list, tuple, set, frozenset)
    done: dict[int, int] = {}  # container id -> deepest depth it was checked at (ids are stable: ``value`` holds them)
    path: set[int] = set()  # containers on the way from the top to the one being checked ...
    keys: list[object] = []  # ... and the keys (indexes) that lead there, for the error messages
    stack: list[tuple[object, int, bool, object]] = [(value, 1, False, None)]
    while stack:
        v, depth, leaving, key = stack.pop()
        if leaving:
            path.discard(id(v))
            done[id(v)] = max(done.get(id(v), 0), depth)
            keys.pop()
            continue
        kind = type(v)
        if kind not in PLAIN_TYPES:
            raise UnsafePickleError(f"{source}: refused: the pickle holds a {kind.__name__}{_at(keys, key)}, not "
                                    f"plain data")
        if kind not in containers or depth <= done.get(id(v), 0):
            continue
        if id(v) in path:
            raise UnsafePickleError(f"{source}: refused: a {kind.__name__}{_at(keys, key)} contains itself (a cycle; "
                                    f"a Flight Recorder dump is a tree of plain data)")
        if depth > MAX_DEPTH:
            raise UnsafePickleError(f"{source}: refused: containers nested more than {MAX_DEPTH} deep{_at(keys, key)} "
                                    f"(a Flight Recorder dump nests 5 deep)")
        path.add(id(v))
        keys.append(key)
        stack.append((v, depth, True, key))
        pairs = [*((k, "<key>") for k in v), *((c, k) for k, c in v.items())] if kind is dict else \
            [(c, i) for i, c in enumerate(v)]
        stack.extend((c, depth + 1, False, k) for c, k in pairs if type(c) in containers or type(c) not in PLAIN_TYPES)


def _at(keys: list[object], key: object) -> str:
    """Where a value is in the pickle: `` at ['entries'][5]['frames']`` (the first levels only)."""
    steps = [k for k in [*keys, key] if k is not None]
    if not steps:
        return ""
    text = "".join("[<key>]" if k == "<key>" else f"[{str(k)[:40]!r}]" if isinstance(k, str) else f"[{k}]"
                   for k in steps[:8])
    return f" at {text}" + ("…" if len(steps) > 8 else "")


def safe_loads(data: bytes, source: str = "<bytes>") -> object:
    """Unpickle ``data`` if it holds only plain containers and scalars; see the module docstring."""
    if len(data) > MAX_BYTES:
        raise UnsafePickleError(f"{source}: {len(data)} bytes: too large for a Flight Recorder dump")
    check_opcodes(data, source)
    try:
        value = _NoGlobals(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, IndexError, KeyError,
            AttributeError, UnicodeDecodeError, MemoryError) as exc:
        raise UnsafePickleError(f"{source}: refused to unpickle: {exc}") from None
    _check_plain(value, source)
    return value


def safe_load_file(path: str) -> object:
    """:func:`safe_loads` of a file's bytes."""
    with open_input_file(path) as fh:
        return safe_loads(fh.read(MAX_BYTES + 1), str(path))
