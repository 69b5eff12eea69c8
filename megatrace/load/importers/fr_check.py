"""Every field of a Flight Recorder dump the importer reads, checked in one place before anything is imported.

:func:`check_dump` raises :class:`ImportFormatError` naming the file, the entry (and its record id) and
the field: ``FILE: entry N (record R): field X: expected ..., got ...``. The work is bounded by the size
of the input: a list of tensor shapes shared by many entries (a pickle's memo lets a few bytes reference
it again and again) is measured once, and a product of dimensions stops as soon as it passes what an
int64 byte count can hold, however many dimensions follow (:func:`tensor_bytes`).
"""

from __future__ import annotations

import json

from megatrace.load.importers.common import INT64_MAX, MAX_RANKS, Fields, ImportFormatError, shown
from megatrace.trace.ring_format import Dtype

REQUIRED = ("record_id", "process_group", "collective_seq_id", "profiling_name", "time_created_ns")
DTYPES: dict[str, tuple[Dtype, int]] = {
    "Float": (Dtype.FLOAT32, 4), "Half": (Dtype.FLOAT16, 2), "BFloat16": (Dtype.BFLOAT16, 2),
    "Double": (Dtype.FLOAT64, 8), "Char": (Dtype.INT8, 1), "Byte": (Dtype.UINT8, 1), "Short": (Dtype.INT16, 2),
    "Int": (Dtype.INT32, 4), "Long": (Dtype.INT64, 8), "Bool": (Dtype.BOOL, 1),
    "Float8_e4m3fn": (Dtype.FLOAT8_E4M3, 1), "Float8_e5m2": (Dtype.FLOAT8_E5M2, 1),
    "ComplexFloat": (Dtype.COMPLEX64, 8), "ComplexDouble": (Dtype.COMPLEX128, 16),
}
MAX_DIMS = 64  # dimensions of one tensor shape: torch allows at most 64 (its TensorImpl limit); more is not a shape


MIXED_SHAPES = 256  # tensors of an entry summed one by one when their dtypes differ in width; past it, the widest


class Sizes:
    """Byte counts of ``input_sizes`` lists, bounded by the size of the input (see the module docstring): each
    distinct list of shapes is checked and summed once (elements per shape), each distinct list of dtype names
    checked once; an entry then costs one multiplication, unless its tensors have dtypes of different widths
    (a coalesced call mixing them), summed per tensor up to :data:`MIXED_SHAPES` tensors."""

    def __init__(self) -> None:
        self._shapes: dict[int, tuple[object, list[int], int]] = {}  # id -> (sizes, elements per shape, total)
        self._names: dict[int, tuple[object, tuple[int, ...]]] = {}  # id -> (dtypes, their widths)

    def dtypes(self, at: Fields, raw: object) -> tuple[int, ...]:
        """``input_dtypes``: a list of strings; returns the width in bytes of each (1 when unknown)."""
        dtypes = at.sequence("input_dtypes", raw, optional=True)
        hit = self._names.get(id(dtypes))
        if hit is not None and hit[0] is dtypes:
            return hit[1]
        for k, name in enumerate(dtypes):
            at.text(f"input_dtypes[{k}]", name)
        widths = tuple(DTYPES.get(name, (Dtype.UNKNOWN, 1))[1] for name in dtypes)
        self._names[id(dtypes)] = (dtypes, widths)
        return widths

    def total(self, at: Fields, sizes: object, widths: tuple[int, ...]) -> int:
        """Bytes of all tensors of an entry (``input_sizes`` checked; ``widths`` of its dtypes)."""
        hit = self._shapes.get(id(sizes))
        if hit is None or hit[0] is not sizes:
            counts = []
            for k, shape in enumerate(at.sequence("input_sizes", sizes, optional=True)):
                dims = at.sequence(f"input_sizes[{k}]", shape)
                if len(dims) > MAX_DIMS:
                    at.fail(f"input_sizes[{k}]", f"a tensor shape of at most {MAX_DIMS} dimensions",
                            f"{len(dims)} dimensions")
                counts.append(tensor_bytes(at, f"input_sizes[{k}]", dims, 1))
            hit = (sizes, counts, sum(counts))
            self._shapes[id(sizes)] = hit
        counts, elements = hit[1], hit[2]
        if len(set(widths[:len(counts)])) <= 1 and len(widths) >= len(counts):
            total = elements * (widths[0] if widths else 1)
        elif len(counts) <= MIXED_SHAPES:
            total = sum(c * (widths[k] if k < len(widths) else 1) for k, c in enumerate(counts))
        else:
            total = elements * max(widths + (1,))
        if total > INT64_MAX:
            at.fail("input_sizes", "tensors of fewer than 2**63 bytes in all", sizes)
        return total


def tensor_bytes(at: Fields, name: str, dims: list | tuple, width: int) -> int:
    """``width * prod(dims)``, each dimension checked; fails as soon as the product passes 2**63 - 1 (a zero
    dimension later on would not make such a shape a real one)."""
    product = width
    for d in dims:
        at.integer(name, d, what="a tensor shape (integers from 0 to 2**63-1)")
        product *= d
        if product > INT64_MAX:
            at.fail("input_sizes", "tensors of fewer than 2**63 bytes in all", f"a shape past 2**63 bytes at {name}")
    return product


def members(raw: object) -> tuple[int, ...] | None:
    """The ranks of a ``pg_config`` entry (a list, or its text as torch writes it: ``"[0, 1]"``; ``()`` when empty,
    as on gloo), or None when they are not a list of ranks."""
    if isinstance(raw, str):
        if len(raw) > 16 * MAX_RANKS:  # (the text of MAX_RANKS ranks and their separators)
            return None
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):
            return None
    if not isinstance(raw, (list, tuple)) or not all(type(r) is int and 0 <= r < MAX_RANKS for r in raw):
        return None
    return tuple(raw)


def check_dump(path: object, dump: object) -> dict[int, int]:
    """Check every field the importer reads: its type, and its range for the column it goes into. Returns
    record id -> the bytes of the entry's input tensors."""
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        keys = ", ".join(sorted(map(shown, dump))[:12]) if isinstance(dump, dict) else type(dump).__name__
        raise ImportFormatError(f"{path}: not a Flight Recorder dump (no 'entries' list; keys: {keys})")
    sizes = Sizes()
    top = Fields(str(path))
    if type(dump.get("version", "")) not in (str, int, float):
        top.fail("version", "a version string", dump["version"])
    config = top.mapping("pg_config", dump.get("pg_config"), optional=True)
    for name, c in config.items():
        if type(name) not in (str, int) or not isinstance(c, dict):
            raise ImportFormatError(f"{path}: pg_config: expected group name -> {{name, desc, ranks}}, got "
                                    f"{shown(name)} -> {shown(c)}")
        if "ranks" in c and members(c["ranks"]) is None:
            Fields(f"{path}: pg_config[{shown(name)}]").fail(
                "ranks", f"a list of ranks from 0 to {MAX_RANKS - 1} (or its text, e.g. '[0, 1]')", c["ranks"])
    records: dict[int, int] = {}
    nbytes: dict[int, int] = {}
    for i, e in enumerate(dump["entries"]):
        if not isinstance(e, dict):
            raise ImportFormatError(f"{path}: entry {i}: expected an entry (a dict), got {shown(e)}")
        missing = [k for k in REQUIRED if k not in e]
        if missing:
            raise ImportFormatError(f"{path}: entry {i}: missing {', '.join(missing)} (a Flight Recorder dump of "
                                    f"another version, or a damaged one)")
        rid = Fields(f"{path}: entry {i}").integer("record_id", e["record_id"], what="a record id (an integer "
                                                                                     "from 0 to 2**63-1)")
        if rid in records:
            raise ImportFormatError(f"{path}: entry {i}: field record_id: expected a record id of its own, got {rid} "
                                    f"(entry {records[rid]}'s too: a damaged dump)")
        records[rid] = i
        nbytes[rid] = _check_entry(Fields(f"{path}: entry {i} (record {rid})"), e, sizes)
    return nbytes


def _check_entry(at: Fields, e: dict, sizes: Sizes) -> int:
    pg = e["process_group"]
    if not (isinstance(pg, (list, tuple)) and len(pg) == 2 and all(type(x) in (str, int) for x in pg)):
        at.fail("process_group", "(name, description), two strings", pg)
    at.text("profiling_name", e["profiling_name"])
    at.integer("time_created_ns", e["time_created_ns"], what="a wall-clock time in ns (an integer from 0 to 2**63-1)")
    at.integer("collective_seq_id", e["collective_seq_id"], what="a sequence number (an integer from 0 to 2**63-1)")
    if e.get("p2p_seq_id") is not None:
        at.integer("p2p_seq_id", e["p2p_seq_id"], what="a sequence number (an integer from 0 to 2**63-1) or null")
    if e.get("pg_id") is not None and type(e["pg_id"]) not in (int, str):
        at.fail("pg_id", "a local process group id (an integer or its text) or null", e["pg_id"])
    if e.get("time_discovered_completed_ns") is not None:
        at.integer("time_discovered_completed_ns", e["time_discovered_completed_ns"],
                   what="a wall-clock time in ns (an integer from 0 to 2**63-1) or null")
    at.text("state", e.get("state"), optional=True)
    if e.get("retired") not in (None, True, False):
        at.fail("retired", "true, false or null", e["retired"])
    return sizes.total(at, e.get("input_sizes"), sizes.dtypes(at, e.get("input_dtypes")))
