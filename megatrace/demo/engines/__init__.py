"""The demo's engines: which parallel API trains the model, and the layout that says so.

* ``3d``: the hand-written Megatron-style TP x PP x DP job (:mod:`megatrace.demo.engines.manual3d`);
  every call goes through the public ``torch.distributed`` functions.
* ``ddp``: ``DistributedDataParallel`` with small gradient buckets, plus a script's explicit
  metric reductions (:mod:`~megatrace.demo.engines.ddp`).
* ``fsdp``: FSDP2 ``fully_shard`` per block and at the root (:mod:`~megatrace.demo.engines.fsdp`).
* ``tp``: DTensor ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on a
  ``DeviceMesh`` (``dp`` x ``tp`` when dp > 1) (:mod:`~megatrace.demo.engines.tp`).
* ``pipeline``: ``torch.distributed.pipelining`` ``PipelineStage`` + ``Schedule1F1B``, one stage
  per rank of each pipeline, ``dp`` pipelines averaging their gradients
  (:mod:`~megatrace.demo.engines.pipeline`).

This module is light (no torch): the command line checks options, layouts and faults with it
before any process starts. Each engine module is imported by the worker only.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from megatrace.config import Layout, LayoutError
from megatrace.demo.faults import FaultError, FaultSpec, format_fault


@dataclass(frozen=True)
class Engine:
    """One engine: what it is, which layout sizes and options it takes, which faults it can inject."""

    name: str
    summary: str
    module: str  # megatrace.demo.engines.<module>: train(session, args)
    sizes: tuple[str, ...]  # the layout sizes a user may set (the others are fixed or derived)
    microbatches: bool  # takes --microbatches (a pipeline schedule)
    faults: tuple[str, ...]
    default_ranks: int
    point_to_point: bool = False  # trains by sends and receives only: a commhang stops in those too

    def trainer(self) -> Callable[..., int]:
        """The engine's ``train(session, args)`` (imports torch)."""
        return importlib.import_module(f"megatrace.demo.engines.{self.module}").train


_ALL_FAULTS = ("hang", "commhang", "slow", "crash", "slowlink")
_NO_P2P = ("hang", "commhang", "slow", "crash")  # slowlink delays point-to-point messages: none here

ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("3d", "hand-written Megatron-style TP x PP x DP (1F1B, batch_isend_irecv)", "manual3d",
           ("tp", "pp", "dp"), True, _ALL_FAULTS, 8),
    Engine("ddp", "DistributedDataParallel (gradient buckets) + explicit metric reduce/all_reduce", "ddp",
           ("dp",), False, _NO_P2P, 4),
    Engine("fsdp", "FSDP2 fully_shard per block (all_gather + reduce_scatter)", "fsdp",
           ("dp",), False, _NO_P2P, 4),
    Engine("tp", "DTensor parallelize_module, ColwiseParallel + RowwiseParallel on a DeviceMesh", "tp",
           ("tp", "dp"), False, _NO_P2P, 4),
    Engine("pipeline", "torch.distributed.pipelining PipelineStage + Schedule1F1B, one stage per rank (x DP)",
           "pipeline", ("pp", "dp"), True, _ALL_FAULTS, 4, point_to_point=True),
)}
DEFAULT_ENGINE = "3d"


def get_engine(name: str) -> Engine:
    """The engine called ``name``; :class:`LayoutError` lists the known ones."""
    try:
        return ENGINES[name]
    except KeyError:
        raise LayoutError(f"unknown engine {name!r} (known: {', '.join(ENGINES)})") from None


def engine_layout(name: str, world: int | None = None, *, tp: int | None = None, pp: int | None = None,
                  dp: int | None = None, microbatches: int | None = None, layers_per_stage: int = 2,
                  order: str = "tp-dp-pp", schedule: str = "1f1b") -> Layout:
    """The layout of an ``name`` job: what the engine really is, checked; None means the engine's default.

    ``3d`` is TP x PP x DP (tp and pp 2 by default); ``ddp`` and ``fsdp`` are data parallel over the
    world (dp = world); ``tp`` is ``dp`` x ``tp`` with TP ranks adjacent (the DeviceMesh's row-major
    order, ``tp-dp-pp``; tp 2 by default); ``pipeline`` is one stage per rank under the 1F1B schedule
    (pp = world / dp, dp 1 by default). ``world`` defaults to the product of the given sizes, else the engine's default.
    :class:`LayoutError` names the option that does not fit.
    """
    engine = get_engine(name)
    for size, value in (("tp", tp), ("pp", pp), ("dp", dp)):
        if value is not None and value != 1 and size not in engine.sizes:
            raise LayoutError(f"the {name} engine has no --{size} (it sets {', '.join(engine.sizes)}); "
                              f"got --{size} {value}")
    if microbatches is not None and not engine.microbatches:
        raise LayoutError(f"the {name} engine has no pipeline schedule: --microbatches does not apply")
    tp = tp or (2 if name in ("3d", "tp") else 1)
    if name == "pipeline":
        if world is None and dp is None:
            dp = 1  # one pipeline unless the ranks say otherwise
        if pp is None:
            pp = max(1, (world or engine.default_ranks) // (dp or 1))
    pp = pp or (2 if name == "3d" else 1)
    if world is None:
        world = tp * pp * dp if dp else engine.default_ranks
    if dp is None:
        if world % (tp * pp):
            raise LayoutError(f"{world} ranks (--ranks) are not divisible by tp*pp = {tp}*{pp} = {tp * pp}")
        dp = world // (tp * pp)
    if world != tp * pp * dp:
        raise LayoutError(f"{world} ranks (--ranks) != tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp}")
    microbatches = (microbatches or 4) if engine.microbatches else 1
    if name == "pipeline" and microbatches < pp:
        raise LayoutError(f"Schedule1F1B needs at least as many microbatches as stages: "
                          f"--microbatches {microbatches} < {pp} stages")
    return Layout(world_size=world, tp=tp, pp=pp, dp=dp, microbatches=microbatches, schedule=schedule,
                  order=order if name == "3d" else "tp-dp-pp", layers_per_stage=layers_per_stage).validate()


def check_engine_fault(name: str, fault: FaultSpec, text: str | None = None) -> None:
    """Refuse a fault kind the engine cannot inject (e.g. ``slowlink`` where no p2p message is sent)."""
    engine = get_engine(name)
    if fault.kind not in engine.faults:
        raise FaultError(f"--fault {text or format_fault(fault)}: the {name} engine cannot inject {fault.kind} "
                         f"(it supports {', '.join(engine.faults)})")
