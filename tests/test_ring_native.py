"""The C hot path and the pure-Python writer produce the same records, both valid for the reader."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatrace.trace.ring_reader import read_ring
from megatrace.trace.ring_writer import RingIdentity, RingWriter

pytest.importorskip("megatrace.trace._ringfast", reason="C hot path not built (no compiler at install)")

calls = st.lists(st.tuples(
    st.integers(1, 9), st.integers(0, 2**32 - 1), st.integers(0, 2**40), st.integers(0, 2**50),
    st.integers(-1, 2**31 - 1), st.integers(0, 14), st.integers(0, 31), st.sampled_from([None, 2, 3, "now"])),
    min_size=1, max_size=60)


def _write(directory: Path, native: bool, stream: list[tuple]) -> list[dict]:
    writer = RingWriter(directory, RingIdentity(rank=0, world_size=1), capacity=32, use_native=native)
    assert writer.native is native
    for op, gid, gseq, nbytes, peer, dtype, flags, end in stream:
        handle = writer.begin(op, gid, gseq, nbytes, peer, dtype, flags)
        if end == "now":
            writer.complete_now(handle)
        elif end is not None:
            writer.complete(handle, end)
    writer.close()
    snap = read_ring(writer.path)
    assert snap.problems == [] and snap.dropped == max(0, len(stream) - 32)
    return [{k: v for k, v in r.items() if not k.startswith("t_")} | {"timed": r["t_complete"] > 0}
            for r in snap.to_dicts()]


@settings(max_examples=40, deadline=None)
@given(stream=calls)
def test_c_and_python_writers_agree_field_by_field(tmp_path_factory: pytest.TempPathFactory,
                                                   stream: list[tuple]) -> None:
    base = tmp_path_factory.mktemp("agree")
    assert _write(base / "c", True, stream) == _write(base / "py", False, stream)


def test_c_writer_refuses_a_buffer_smaller_than_its_capacity() -> None:
    from megatrace.trace._ringfast import FastRing

    with pytest.raises(ValueError, match="smaller than header"):
        FastRing(bytearray(4096 + 64 * 3), 4)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("args", [(70000, 1, 1, 1), (1, 2**32, 1, 1), (1, 1, -1, 1), (1, 1, 1, 1, 2**31),
                                  (1, 1, 1, 1, -1, 256), (1, 1, 1, 1, -1, 0, -1)])
def test_both_writers_reject_out_of_range_fields(tmp_path: Path, native: bool, args: tuple) -> None:
    import struct

    writer = RingWriter(tmp_path, RingIdentity(rank=0, world_size=1), capacity=16, use_native=native)
    with pytest.raises((OverflowError, struct.error)):
        writer.begin(*args)
