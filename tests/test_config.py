"""The parallel layout: rank coordinates, groups, validation and the YAML round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatrace.config import ORDERS, Layout, LayoutError, RankPlacement, load_layout, save_layout

layouts = st.builds(lambda tp, pp, dp, order: Layout(tp * pp * dp, tp, pp, dp, order=order),
                    st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.sampled_from(ORDERS))


def test_megatron_default_order() -> None:
    layout = Layout(world_size=8, tp=2, pp=2, dp=2)
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(5) == (1, 0, 1)  # (pp, dp, tp)
    assert layout.coords(5).pp == 1 and layout.coords(5).tp == 1
    assert layout.rank_of(pp=1, dp=1, tp=0) == 6
    assert layout.group_of("tp", 5) == [4, 5]
    assert layout.group_of("pp", 5) == [1, 5]


def test_any_permutation_is_an_order_read_fastest_first() -> None:
    layout = Layout(world_size=12, tp=2, pp=2, dp=3, order="dp-tp-pp")
    assert layout.strides() == {"dp": 1, "tp": 3, "pp": 6}
    assert layout.dp_groups() == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert layout.tp_groups() == [[0, 3], [1, 4], [2, 5], [6, 9], [7, 10], [8, 11]]
    assert layout.coords(10) == (1, 1, 1)  # (pp, dp, tp)
    assert layout.rank_of(pp=1, dp=1, tp=1) == 10


def test_tp_pp_dp_order() -> None:
    layout = Layout(world_size=8, tp=2, pp=2, dp=2, order="tp-pp-dp")
    assert layout.pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(6) == (1, 1, 0)


@given(layouts)
def test_groups_partition_the_world(layout: Layout) -> None:
    for rank in range(layout.world_size):
        assert layout.rank_of(*layout.coords(rank)) == rank
    for kind, size in (("tp", layout.tp), ("pp", layout.pp), ("dp", layout.dp)):
        groups = getattr(layout, f"{kind}_groups")()
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
        assert all(len(g) == size and g == sorted(g) for g in groups)
        assert groups == sorted(groups)
        for rank in range(layout.world_size):
            assert layout.group_of(kind, rank) in groups
    for group in layout.pp_groups():  # rank order within a pipeline is stage order
        assert [layout.coords(r).pp for r in group] == list(range(layout.pp))


@pytest.mark.parametrize("kwargs, field", [
    (dict(world_size=8, tp=2, pp=2, dp=3), "world_size"),
    (dict(world_size=0, tp=0, pp=1, dp=1), "world_size"),
    (dict(world_size=4, tp=2, pp=2, dp=-1), "dp"),
    (dict(world_size=4, tp=2, pp=2, dp=1, order="pp-dp-cp"), "order"),
    (dict(world_size=4, tp=2, pp=2, dp=1, order="tp-dp"), "order"),
    (dict(world_size=4, tp=2, pp=2, dp=1, schedule="zb-v"), "schedule"),
    (dict(world_size=4, tp=2, pp=2, dp=1, microbatches=0), "microbatches"),
    (dict(world_size=4, tp=2, pp=2, dp=1, layers_per_stage=0), "layers_per_stage"),
])
def test_validate_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(LayoutError, match=field):
        Layout(**kwargs).validate()


def test_fewer_microbatches_than_stages_is_fine() -> None:
    Layout(world_size=4, tp=1, pp=4, dp=1, microbatches=1).validate()


def test_coords_out_of_range() -> None:
    with pytest.raises(LayoutError, match="rank 8 is outside"):
        Layout(8, 2, 2, 2).coords(8)
    with pytest.raises(LayoutError, match="pp index 2"):
        Layout(8, 2, 2, 2).rank_of(pp=2, dp=0, tp=0)
    with pytest.raises(LayoutError, match="group kind"):
        Layout(8, 2, 2, 2).group_of("ep", 0)


def test_yaml_round_trip(tmp_path: Path) -> None:
    layout = Layout(world_size=4, tp=2, pp=2, dp=1, microbatches=4, layers_per_stage=2,
                    ranks={r: RankPlacement(f"n{r // 2 + 1}", r % 2) for r in range(4)})
    path = tmp_path / "layout.yaml"
    save_layout(layout, path)
    assert load_layout(path) == layout
    assert path.read_text().startswith("world_size: 4\ntp: 2\n")


def test_yaml_defaults_and_strict_keys(tmp_path: Path) -> None:
    path = tmp_path / "layout.yaml"
    path.write_text("world_size: 2\ntp: 1\npp: 2\ndp: 1\n")
    assert load_layout(path) == Layout(world_size=2, tp=1, pp=2, dp=1)
    path.write_text("world_size: 2\ntp: 1\npp: 2\ndp: 1\nmicro_batches: 4\n")
    with pytest.raises(LayoutError, match=r"layout\.yaml: unknown key 'micro_batches'"):
        load_layout(path)
    path.write_text("world_size: 2\ntp: 1\npp: 2\n")
    with pytest.raises(LayoutError, match="missing required key 'dp'"):
        load_layout(path)
    path.write_text("world_size: 2\ntp: 1\npp: 2\ndp: 2\n")
    with pytest.raises(LayoutError, match=r"layout\.yaml: world_size 2 != tp\*pp\*dp"):
        load_layout(path)
    path.write_text("world_size: 2\ntp: 1\npp: 2\ndp: 1\nranks:\n  0: {host: n1, gpu: 0}\n")
    with pytest.raises(LayoutError, match="ranks: rank 0"):
        load_layout(path)
    path.write_text("- 1\n")
    with pytest.raises(LayoutError, match="expected a mapping"):
        load_layout(path)
    with pytest.raises(LayoutError, match="cannot read"):
        load_layout(tmp_path / "missing.yaml")
