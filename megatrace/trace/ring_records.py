"""Ring records as numpy rows: their dtype, both checksums, vectorised, and the per-row validity masks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatrace.trace import ring_format as fmt

try:
    from megatrace.trace._ringfast import scan_slots as _scan_slots  # type: ignore[import-not-found]
    from megatrace.trace._ringfast import split_records as _split_records  # type: ignore[import-not-found]
    from megatrace.trace._ringfast import whole_rows as _whole_rows  # type: ignore[import-not-found]
except ImportError:  # not built (no C compiler at install): numpy does the same checks and copies
    _scan_slots = _split_records = _whole_rows = None

RECORD_DTYPE = np.dtype([
    ("seq", "<u8"), ("group_seq", "<u8"), ("t_enqueue", "<i8"), ("nbytes", "<u8"),
    ("group_id", "<u4"), ("peer", "<i4"), ("op", "<u2"), ("dtype", "u1"), ("flags", "u1"),
    ("head_check", "<u4"), ("t_complete", "<i8"), ("state", "u1"), ("_pad", "V3"),
    ("tail_check", "<u4"),
])
assert RECORD_DTYPE.itemsize == fmt.RECORD_SIZE

_ADLER_MOD = 65521
# Adler32 of a record head as two dot products: A sums the bytes, B weighs byte j (44 - j) times.
_ADLER_A = np.ones(fmt.HEAD_LEN, np.float32)
_ADLER_B = np.arange(fmt.HEAD_LEN, 0, -1).astype(np.float32)
_TAIL_R = np.array([pow(2, 32 * k, fmt.TAIL_PRIME) for k in range(4)], dtype=np.uint64)
_CHUNK = 1 << 18  # records per vectorised checksum pass: bounds the temporaries to ~60 MB


def head_checks(raw: np.ndarray) -> np.ndarray:
    """Vectorised adler32 of the first 44 bytes of each 64-byte row of ``raw`` (uint8, shape (n, 64)).

    Both adler sums are float32 dot products: every partial sum is an integer below 255 * 990 < 2**24,
    so float32 holds it exactly, in any summation order. ``einsum`` rather than ``@``: a matrix product
    this skinny is fastest on one core, and a multi-threaded BLAS slows it down many times on a busy machine.
    """
    head = raw[:, :fmt.HEAD_LEN].astype(np.float32)
    a = (np.einsum("ij,j->i", head, _ADLER_A).astype(np.uint32) + 1) % _ADLER_MOD
    b = (np.einsum("ij,j->i", head, _ADLER_B).astype(np.uint32) + fmt.HEAD_LEN) % _ADLER_MOD
    return (b << 16) | a


def tail_checks(words: np.ndarray) -> np.ndarray:
    """Vectorised tail checksum of each record (``words``: uint32, shape (n, 16))."""
    return (words[:, 12].astype(np.uint64) * _TAIL_R[0] + words[:, 13] * _TAIL_R[1] + words[:, 14] * _TAIL_R[2]
            + words[:, 0] * _TAIL_R[3]) % np.uint64(fmt.TAIL_PRIME)


def _empty_rows(raw: np.ndarray) -> np.ndarray:
    """Rows of ``raw`` (uint8, (n, 64)) that are all zero (an OR of eight u64 columns beats ``any(axis=1)``)."""
    w = raw.view("<u8")
    acc = w[:, 0] | w[:, 1]
    for k in range(2, fmt.RECORD_SIZE // 8):
        acc |= w[:, k]
    return acc == 0


def validate(raw: np.ndarray, slots: np.ndarray,
             capacity: int | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (empty, head_ok, tail_ok) masks for rows of ``raw``, which sit in ring slots ``slots``.

    ``capacity``: of the one ring the rows come from, or per row (uint64) for rows of several rings.
    """
    per_row = isinstance(capacity, np.ndarray)
    n = len(raw)
    empty = np.empty(n, bool)
    head_ok = np.empty(n, bool)
    tail_ok = np.empty(n, bool)
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        part = raw[lo:hi]
        words = part.view("<u4")
        rec = part.view(RECORD_DTYPE).reshape(-1)
        empty[lo:hi] = _empty_rows(part)
        cap = capacity[lo:hi] if per_row else np.uint64(capacity)
        in_place = (rec["seq"] > 0) & ((rec["seq"] - np.uint64(1)) % cap == slots[lo:hi])
        head_ok[lo:hi] = in_place & (head_checks(part) == rec["head_check"])
        tail_ok[lo:hi] = ((tail_checks(words) == rec["tail_check"]) & (rec["state"] >= fmt.State.ENQUEUED)
                          & (rec["state"] <= fmt.State.FAILED))
    return empty, head_ok, tail_ok


@dataclass(frozen=True)
class SlotSummary:
    """What the C scan of a ring's slots also tells (row ``i`` being slot ``i``)."""

    whole: int  # rows with a whole head (head_ok)
    newest: int  # their largest sequence number (0: none)
    first: int  # the first and last such row (-1: none)
    last: int
    ascending: bool  # their sequence numbers ascend row by row
    clean: bool  # every row empty or whole (head and tail)


def validate_ring(raw: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, SlotSummary | None]:
    """:func:`validate` of a whole ring's copy, row ``i`` being slot ``i``: in one pass of C when the extension
    is built (a full load checks every slot of every ring), else with numpy; both give the same masks. The C pass
    also gives their :class:`SlotSummary` (None without it)."""
    if _scan_slots is None or not raw.flags.c_contiguous:
        return (*validate(raw, np.arange(len(raw), dtype=np.uint64), capacity), None)
    masks = np.empty((3, len(raw)), bool)
    summary = SlotSummary(*_scan_slots(raw, capacity, masks[0], masks[1], masks[2]))
    return masks[0], masks[1], masks[2], summary


def whole_records(raw: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """Rows of ``raw`` that hold exactly record ``seqs`` (hence in their slot), both checksums and state right: in
    one pass of C when the extension is built, else with numpy (a test holds both to the same mask)."""
    if _whole_rows is None or not raw.flags.c_contiguous or not len(raw):
        return whole_records_numpy(raw, seqs)
    out = np.empty(len(raw), bool)
    _whole_rows(raw, np.ascontiguousarray(seqs, np.uint64), out.view(np.uint8))
    return out


def whole_records_numpy(raw: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """:func:`whole_records` with numpy (its twin where the extension is not built)."""
    out = np.empty(len(raw), bool)
    for lo in range(0, len(raw), _CHUNK):
        part = raw[lo:lo + _CHUNK]
        rec = part.view(RECORD_DTYPE).reshape(-1)
        out[lo:lo + _CHUNK] = ((rec["seq"] == seqs[lo:lo + _CHUNK]) & (head_checks(part) == rec["head_check"])
                               & (tail_checks(part.view("<u4")) == rec["tail_check"])
                               & (rec["state"] - np.uint8(fmt.State.ENQUEUED) <= fmt.State.FAILED - fmt.State.ENQUEUED))
    return out


def older_or_empty(raw: np.ndarray, seqs: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Rows that are empty or hold a valid head of an older lap than record ``seqs`` (nothing newer)."""
    empty, head_ok, _ = validate(raw, (seqs - np.uint64(1)) % caps, caps)
    return empty | (head_ok & (raw.view(RECORD_DTYPE).reshape(-1)["seq"] < seqs))


@dataclass
class SlotCopy:
    """Rows copied from one ring's slots, with their validity masks, for re-reading the ones that fail.

    ``suspects`` names the rows to read again (it sees the masks, which re-reads update in place); a
    re-read returning a record numbered past ``limits`` (per row) is a later lap: the row is ``raced``.
    """

    raw: np.ndarray  # uint8, (n, 64)
    slots: np.ndarray  # uint64: the ring slot of each row
    limits: int | np.ndarray  # the newest record a re-read may return: for every row, or per row
    capacity: int
    empty: np.ndarray
    head_ok: np.ndarray
    tail_ok: np.ndarray
    suspects: Callable[[], np.ndarray]
    raced: np.ndarray  # bool: the row's slot was refilled on a later lap while it was read
    quiet: SlotSummary | None = None  # set when no row is suspect (none is read again): the masks' summary


# The columns split_records fills, in its order (the record's fields but the checksums and padding).
SPLIT_COLUMNS = ("seq", "group_seq", "t_enqueue", "t_complete", "nbytes", "group_id", "peer", "op", "dtype", "flags",
                 "state")
# The columns split_records also fills when they are narrower than their field, in these dtypes (half its size).
NARROWED: dict[str, type] = {"seq": np.int32, "group_seq": np.int32, "nbytes": np.int32, "peer": np.int16,
                             "op": np.uint8}
NARROWABLE = tuple(NARROWED)


def native_split() -> bool:
    """Whether :func:`split_records` runs in C (else it returns None and the caller copies field by field)."""
    return _split_records is not None


def split_records(recs: np.ndarray, columns: dict[str, np.ndarray], at: int) -> tuple[str, ...] | None:
    """Copy the fields of ``recs`` (rows of :data:`RECORD_DTYPE`) into rows ``at..`` of ``columns`` (a 1-D array per
    name of :data:`SPLIT_COLUMNS`, each of its field's dtype, or for those of :data:`NARROWED` that narrower one), in
    one pass of C. Returns the narrowed columns that a value does not fit (their rows then not all written; () when
    done), or None when the extension is not built or the rows are not ring records (the caller copies field by
    field)."""
    if _split_records is None or recs.dtype != RECORD_DTYPE:  # (an importer's rows: another layout)
        return None
    over = _split_records(np.ascontiguousarray(recs).view(np.uint8), at, *(columns[name] for name in SPLIT_COLUMNS))
    return tuple(name for bit, name in enumerate(NARROWABLE) if over >> bit & 1)
