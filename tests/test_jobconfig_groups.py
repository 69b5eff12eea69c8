"""Group inference: TP/PP/DP (and CP) sizes and the rank order from recorded process groups alone."""

from __future__ import annotations

import itertools

import pytest

from megatrace.config import ORDERS, Layout
from megatrace.analyze.jobconfig.groups import GroupUse, infer_from_groups

# Records per group member in one step of a Megatron-like job: TP all-reduces every layer of every
# microbatch, PP exchanges activations (p2p), DP reduces gradients once.
TRAFFIC = {"tp": (96, 0), "pp": (0, 32), "dp": (2, 0)}
SIZES = [c for c in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 3)) if sorted(c)[1] > 1]


def uses_of(layout: Layout, with_desc: bool, traffic: bool = True) -> list[GroupUse]:
    out = [GroupUse(tuple(range(layout.world_size)), "default_pg", 3, 0)]
    for kind in ("tp", "pp", "dp"):
        coll, p2p = TRAFFIC[kind] if traffic else (0, 0)
        for g in getattr(layout, f"{kind}_groups")():
            out.append(GroupUse(tuple(g), kind if with_desc else "", coll * len(g), p2p * len(g)))
    return out


def same_groups(a: Layout, b: Layout) -> bool:
    return all(getattr(a, f"{k}_groups")() == getattr(b, f"{k}_groups")() for k in ("tp", "pp", "dp"))


def inferred_layout(uses: list[GroupUse], world: int) -> Layout | None:
    got = infer_from_groups(uses, world).layout_sizes()
    if got is None:
        return None
    sizes, order = got
    return Layout(world, sizes["tp"], sizes["pp"], sizes["dp"], order=order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("tp, pp, dp", SIZES)
def test_sizes_and_order_come_back_from_the_groups_and_their_traffic(tp: int, pp: int, dp: int, order: str) -> None:
    truth = Layout(tp * pp * dp, tp, pp, dp, order=order)
    for with_desc in (True, False):
        got = inferred_layout(uses_of(truth, with_desc), truth.world_size)
        assert got is not None and (got.tp, got.pp, got.dp) == (tp, pp, dp), (with_desc, got)
        assert same_groups(got, truth), (with_desc, got)


def test_descriptions_alone_name_the_dimensions_without_traffic() -> None:
    truth = Layout(8, 2, 2, 2, order="tp-pp-dp")
    inf = infer_from_groups(uses_of(truth, with_desc=True, traffic=False), 8)
    assert [(d.name, d.size, d.stride) for d in inf.dims] == [("tp", 2, 1), ("pp", 2, 2), ("dp", 2, 4)]
    assert all("description" in d.how for d in inf.dims)


def test_without_descriptions_or_traffic_megatron_order_is_assumed_and_said() -> None:
    truth = Layout(8, 2, 1, 4)
    inf = infer_from_groups(uses_of(truth, with_desc=False, traffic=False), 8)
    assert inf.sizes == {"tp": 2, "dp": 4}
    assert any("assumption" in n for n in inf.notes)


def test_megatron_context_parallel_folds_into_dp_for_the_layout() -> None:
    # Megatron-LM's RankGenerator, order tp-cp-dp-pp: rank = tp + TP * (cp + CP * (dp + DP * pp)).
    TP, CP, DP, PP = 2, 2, 2, 2
    world = TP * CP * DP * PP
    rank = lambda t, c, d, p: t + TP * (c + CP * (d + DP * p))  # noqa: E731
    desc = {"t": "TENSOR_MODEL_PARALLEL_GROUP", "c": "CONTEXT_PARALLEL_GROUP", "d": "DATA_PARALLEL_GROUP",
            "p": "PIPELINE_MODEL_PARALLEL_GROUP"}
    sizes = {"t": TP, "c": CP, "d": DP, "p": PP}
    uses = []
    for dim in "tcdp":
        seen = set()
        for t, c, d, p in itertools.product(range(TP), range(CP), range(DP), range(PP)):
            coords = {"t": t, "c": c, "d": d, "p": p}
            members = tuple(sorted(rank(**{k: (i if k == dim else coords[k]) for k in "tcdp"})
                                   for i in range(sizes[dim])))
            if members not in seen:
                seen.add(members)
                uses.append(GroupUse(members, desc[dim]))
    # combined groups Megatron also creates: TENSOR_AND_DATA, DATA_PARALLEL_GROUP_WITH_CP, an embedding group
    uses.append(GroupUse(tuple(range(0, world // PP)), "TENSOR_AND_DATA_PARALLEL_GROUP"))
    uses.append(GroupUse((0, world - 2), "EMBEDDING_GROUP"))
    inf = infer_from_groups(uses, world)
    assert inf.sizes == {"tp": 2, "cp": 2, "dp": 2, "pp": 2}
    assert inf.layout_sizes() == ({"tp": 2, "dp": 4, "pp": 2}, "tp-dp-pp")


def test_a_dimension_whose_groups_were_never_recorded_is_the_stride_gap() -> None:
    truth = Layout(16, 2, 2, 4)
    uses = [u for u in uses_of(truth, with_desc=True) if u.desc != "dp"]
    inf = infer_from_groups(uses, 16)
    gap = next(d for d in inf.dims if not d.seen)
    assert (gap.name, gap.size, gap.stride) == ("dp", 4, 2) and gap.how.startswith("guessed")
    assert inf.sizes == {"tp": 2, "dp": 4, "pp": 2}
    assert inf.layout_sizes() is None  # a guessed name is shown, not used for the analysis layout


def test_partial_overlapping_and_empty_input_give_no_layout_and_no_crash() -> None:
    assert infer_from_groups([], 8).layout_sizes() is None
    partial = [GroupUse((0, 1)), GroupUse((2, 3))]  # does not cover the world
    assert infer_from_groups(partial, 8).dims == []
    odd = [GroupUse((0, 3, 5)), GroupUse((1, 2)), GroupUse((4, 6, 7))]
    inf = infer_from_groups(odd, 8)
    assert inf.layout_sizes() is None and inf.notes
