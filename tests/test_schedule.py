"""Pipeline schedules and the per-step communication counts of the demo."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatrace.config import Layout, LayoutError
from megatrace.schedule import expected_collectives_per_step, gpipe, one_f_one_b


def test_one_f_one_b_matches_megatron() -> None:
    # 4 stages, 6 microbatches: stage 0 warms up with 3 forwards, the last stage with none.
    assert one_f_one_b(0, 4, 6) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                    ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert one_f_one_b(3, 4, 6)[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert one_f_one_b(0, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # fewer microbatches than stages


def test_gpipe() -> None:
    assert gpipe(1, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@given(st.integers(1, 8), st.integers(1, 12), st.data())
def test_one_f_one_b_properties(stages: int, mbs: int, data: st.DataObject) -> None:
    stage = data.draw(st.integers(0, stages - 1))
    actions = one_f_one_b(stage, stages, mbs)
    assert sorted(actions) == sorted([("F", m) for m in range(mbs)] + [("B", m) for m in range(mbs)])
    assert [m for k, m in actions if k == "F"] == list(range(mbs))
    assert [m for k, m in actions if k == "B"] == list(range(mbs))
    in_flight = 0
    for kind, mb in actions:  # backward of mb only after its forward; at most (stages - stage) in flight
        in_flight += 1 if kind == "F" else -1
        assert 0 <= in_flight <= stages - stage
        if kind == "B":
            assert actions.index(("F", mb)) < actions.index(("B", mb))


def test_bad_schedule_arguments() -> None:
    with pytest.raises(ValueError, match="stage 2 is outside"):
        one_f_one_b(2, 2, 4)
    with pytest.raises(ValueError, match="positive"):
        gpipe(0, 1, 0)


def test_expected_counts() -> None:
    layout = Layout(world_size=8, tp=2, pp=2, dp=2, microbatches=4, layers_per_stage=2)
    assert expected_collectives_per_step(layout, 0) == {
        ("tp", "all_reduce"): 16, ("pp", "send"): 4, ("pp", "recv"): 4, ("dp", "all_reduce"): 1}
    assert expected_collectives_per_step(layout, 5, dp_mode="reduce-scatter") == {
        ("tp", "all_reduce"): 16, ("pp", "send"): 4, ("pp", "recv"): 4,
        ("dp", "reduce_scatter"): 1, ("dp", "all_gather"): 1}
    middle = Layout(world_size=3, tp=1, pp=3, dp=1, microbatches=2)
    assert expected_collectives_per_step(middle, 1, layers_per_stage=3) == {("pp", "send"): 4, ("pp", "recv"): 4}
    assert expected_collectives_per_step(Layout(1, 1, 1, 1), 0, 2) == {}
    with pytest.raises(LayoutError, match="layers_per_stage"):
        expected_collectives_per_step(Layout(1, 1, 1, 1), 0)
    with pytest.raises(LayoutError, match="dp_mode"):
        expected_collectives_per_step(layout, 0, dp_mode="zero3")
