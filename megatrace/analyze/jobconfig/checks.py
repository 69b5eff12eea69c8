"""Derived fields and consistency checks of a job configuration; issues become findings of kind ``config``.

Checks: the world size against the product of the parallel sizes; sizes (and
rank order) inferred from the process groups against the arguments or the
explicit layout; the global batch against micro batch x DP (and DeepSpeed's
``train_batch_size`` = micro x accumulation x DP); any other field on which two
sources disagree. Settings and library versions that differ across ranks are
compared by the rules engine (``comm-env-differs-across-ranks``,
``torch-version-skew``) from the same meta lines; NCCL, CUDA and driver versions
that differ between nodes are checked here (:func:`check_versions`).
"""

from __future__ import annotations

from typing import Any

from megatrace.config import SCHEDULES, Layout, LayoutError
from megatrace.analyze.jobconfig.groups import Inference
from megatrace.analyze.jobconfig.model import KINDS, JobConfig, Value

SIZES = ("tp", "pp", "dp", "cp", "ep")


def _src(v: Value | None) -> str:
    return "unknown" if v is None else f"{v.source} ({v.kind})"


def derive(job: JobConfig) -> None:
    """Fill what the sources leave open: DP from the world, microbatches and the global batch."""
    world = job.get("world_size")
    if not job.has("dp") and world and all(job.has(n) for n in ("tp", "pp")):
        model = job.get("tp") * job.get("pp") * job.get("cp", 1) * job.get("dp_replicate", 1)
        if model and world % model == 0:
            job.offer("dp", world // model * job.get("dp_replicate", 1), "derived",
                      "world size / (TP x PP x CP)")
    dp, micro, glob = job.get("dp"), job.get("micro_batch"), job.get("global_batch")
    if not job.has("microbatches"):
        if job.has("grad_accum"):
            job.offer("microbatches", job.get("grad_accum"), "derived", "gradient accumulation steps")
        elif dp and micro and glob and glob % (micro * dp) == 0:
            job.offer("microbatches", glob // (micro * dp), "derived", "global batch / (micro batch x DP)")
    if not job.has("global_batch") and dp and micro and job.has("grad_accum"):
        job.offer("global_batch", micro * job.get("grad_accum") * dp, "derived",
                  "micro batch x gradient accumulation x DP")


def check(job: JobConfig, inference: Inference) -> None:
    """Add an :class:`~megatrace.analyze.jobconfig.model.Issue` for each inconsistency (see the module docstring)."""
    world = job.chosen("world_size")
    sizes = {n: job.chosen(n) for n in ("tp", "pp", "dp", "cp")}
    if world is not None and sizes["dp"] is not None and sizes["dp"].kind != "derived" \
            and all(sizes[n] is not None for n in ("tp", "pp")):
        cp = sizes["cp"].value if sizes["cp"] is not None else 1
        product = sizes["tp"].value * sizes["pp"].value * sizes["dp"].value * cp
        if product != world.value:
            job.issue("world-size", "error",
                      f"world size {world.value} ({_src(world)}) is not TP x PP x DP"
                      f"{' x CP' if cp != 1 else ''} = {product} (TP from {_src(sizes['tp'])}, PP from "
                      f"{_src(sizes['pp'])}, DP from {_src(sizes['dp'])})", "world_size", "tp", "pp", "dp")
    elif world is not None and sizes["dp"] is None and all(sizes[n] is not None for n in ("tp", "pp")):
        model = sizes["tp"].value * sizes["pp"].value * (sizes["cp"].value if sizes["cp"] else 1)
        if model and world.value % model:
            job.issue("world-size", "error",
                      f"world size {world.value} ({_src(world)}) is not a multiple of TP x PP x CP = {model} "
                      f"(TP from {_src(sizes['tp'])}, PP from {_src(sizes['pp'])})", "world_size", "tp", "pp")
    for name in SIZES:
        best, seen = job.chosen(name), job.value_of(name, ("groups",))
        if best is not None and seen is not None and best.kind != "groups" and best.value != seen.value:
            job.issue("groups-disagree", "error",
                      f"{name.upper()} is {best.value} by {_src(best)}, but the recorded process groups show "
                      f"{name.upper()} = {seen.value} ({seen.source})", name)
    _check_order(job, inference)
    check_versions(job)
    dp, micro, glob = job.get("dp"), job.get("micro_batch"), job.get("global_batch")
    if dp and micro and glob and job.chosen("global_batch").kind != "derived" and glob % (micro * dp):
        job.issue("batch", "error",
                  f"global batch {glob} ({_src(job.chosen('global_batch'))}) is not a multiple of micro batch x DP "
                  f"= {micro} x {dp} = {micro * dp}", "global_batch", "micro_batch", "dp")
    elif dp and micro and glob and job.has("grad_accum") and glob != micro * job.get("grad_accum") * dp:
        job.issue("batch", "error",
                  f"global batch {glob} ({_src(job.chosen('global_batch'))}) is not micro batch x gradient "
                  f"accumulation x DP = {micro} x {job.get('grad_accum')} x {dp} = {micro * job.get('grad_accum') * dp}",
                  "global_batch", "micro_batch", "grad_accum", "dp")
    for name, values in job.offered.items():
        best = job.chosen(name)
        others = [v for v in job.alternatives(name) if v.kind not in ("groups", "derived")]
        if others and best.kind != "groups":
            job.issue("sources-disagree", "warning",
                      f"{name}: {best.value!r} from {_src(best)} (used) but "
                      + "; ".join(f"{v.value!r} from {_src(v)}" for v in others), name)
    if not any(job.has(n, kinds=("explicit", "arguments", "groups")) for n in ("tp", "pp", "dp")):
        job.issue("layout-unknown", "info",
                  "no source gives the parallel sizes (no layout, no known trainer arguments, no process groups "
                  "that form a rank order): analysis runs without a layout", "tp", "pp", "dp")


def _check_order(job: JobConfig, inference: Inference) -> None:
    """The recorded groups against the layout the other sources give (same sizes, another rank order)."""
    got = inference.layout_sizes()
    mine = job_layout(job)
    if got is None or mine is None:
        return
    sizes, order = got
    seen = Layout(world_size=inference.world, tp=sizes["tp"], pp=sizes["pp"], dp=sizes["dp"], order=order)
    if (mine.tp, mine.pp, mine.dp) != (seen.tp, seen.pp, seen.dp):
        return  # the sizes disagree: reported per size
    def strides(layout: Layout) -> dict[str, int]:  # equal sizes and strides <=> the same groups
        return {k: v for k, v in layout.strides().items() if getattr(layout, k) > 1}

    if strides(mine) != strides(seen):
        job.issue("groups-disagree", "error",
                  f"rank order {mine.order} ({_src(job.chosen('order'))}) does not match the recorded process "
                  f"groups, which follow {order}", "order")


def job_layout(job: JobConfig, kinds: tuple[str, ...] = KINDS) -> Layout | None:
    """The :class:`~megatrace.config.Layout` these fields give (CP folded into DP), from sources of ``kinds``
    only; None when sizes are missing or do not fit the world."""
    def get(name: str, default: Any = None) -> Any:
        v = job.value_of(name, kinds)
        return default if v is None else v.value

    world, tp, pp, dp = (get(n) for n in ("world_size", "tp", "pp", "dp"))
    if not all(isinstance(v, int) and v > 0 for v in (world, tp, pp, dp)):
        return None
    order = get("order") or "tp-dp-pp"
    schedule = get("schedule") if get("schedule") in SCHEDULES else "1f1b"
    micro = get("microbatches")
    try:
        return Layout(world_size=world, tp=tp, pp=pp, dp=dp * get("cp", 1), order=order, schedule=schedule,
                      microbatches=micro if isinstance(micro, int) and micro > 0 else 1).validate("job config")
    except (LayoutError, TypeError):
        return None


def check_versions(job: JobConfig) -> None:
    """NCCL, CUDA and driver versions that differ between nodes or ranks (torch: rule torch-version-skew)."""
    for key in ("nccl", "cuda", "driver"):
        value = (job.environment.get("versions") or {}).get(key)
        if isinstance(value, dict) and value.get("differs"):
            where = "; ".join(f"{node}: {v}" for node, v in value["by_node"].items())
            job.issue("version-skew", "error" if key == "nccl" else "warning",
                      f"ranks run different {key.upper() if key != 'driver' else 'NVIDIA driver'} versions: {where}")
