"""Pipeline schedules and the communication a demo rank issues per training step.

Shared by the demo job (which executes the schedules), the analyzer and the
trace simulator (which predict what every rank should have issued).
"""

from __future__ import annotations

from megatrace.config import Layout, LayoutError

Action = tuple[str, int]  # ("F" | "B", microbatch)
DP_MODES = ("allreduce", "reduce-scatter")
# The pipeline point-to-point roles of an exchange block (numbered as the analyzer's record roles,
# megatrace.analyze.segments): activations in/out, gradients in/out.
ACT_IN, ACT_OUT, GRAD_IN, GRAD_OUT = 4, 5, 6, 7


def _check(stage: int, num_stages: int, microbatches: int) -> None:
    if num_stages < 1 or microbatches < 1:
        raise ValueError(f"num_stages and microbatches must be positive, got {num_stages}, {microbatches}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")


def one_f_one_b(stage: int, num_stages: int, microbatches: int) -> list[Action]:
    """The 1F1B (PipeDream-flush, Megatron-LM) order of forward and backward microbatches for ``stage``.

    Warmup runs ``min(num_stages - stage - 1, microbatches)`` forwards, the steady
    phase alternates one forward and one backward, and cooldown drains the backwards.
    """
    _check(stage, num_stages, microbatches)
    warmup = min(num_stages - stage - 1, microbatches)
    actions: list[Action] = [("F", mb) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [("F", warmup + i), ("B", i)]
    actions += [("B", mb) for mb in range(microbatches - warmup, microbatches)]
    return actions


def gpipe(stage: int, num_stages: int, microbatches: int) -> list[Action]:
    """GPipe order: every forward, then every backward (both in microbatch order)."""
    _check(stage, num_stages, microbatches)
    return [("F", mb) for mb in range(microbatches)] + [("B", mb) for mb in range(microbatches)]


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def exchange_blocks(actions: list[Action], stage: int, num_stages: int) -> list[list[tuple[int, int]]]:
    """For a stage's per-step action list, the p2p ops expected before each action and after the last.

    Block ``j`` (``0 <= j <= len(actions)``) holds (role, microbatch) pairs: the receives action ``j`` needs
    and the sends of what action ``j - 1`` produced.
    """
    blocks: list[list[tuple[int, int]]] = [[] for _ in range(len(actions) + 1)]
    for j, (kind, mb) in enumerate(actions):
        if kind == "F":
            if stage > 0:
                blocks[j].append((ACT_IN, mb))
            if stage < num_stages - 1:
                blocks[j + 1].append((ACT_OUT, mb))
        else:
            if stage < num_stages - 1:
                blocks[j].append((GRAD_IN, mb))
            if stage > 0:
                blocks[j + 1].append((GRAD_OUT, mb))
    return blocks


def schedule_for(layout: Layout, stage: int) -> list[Action]:
    """The action order of ``stage`` under ``layout.schedule``."""
    return SCHEDULES[layout.schedule](stage, layout.pp, layout.microbatches)


def expected_collectives_per_step(layout: Layout, rank: int, layers_per_stage: int | None = None,
                                  dp_mode: str = "allreduce") -> dict[tuple[str, str], int]:
    """How many of each traced op ``rank`` issues per demo training step, keyed by (group kind, op name).

    Op names are those of :class:`megatrace.trace.ring_format.Op` in lower case.
    Groups of size 1 issue nothing (like Megatron-LM, the demo skips them):

    * TP: one ``all_reduce`` per block in forward and one in backward, per microbatch;
    * PP: per microbatch, a ``recv`` of activations and a ``send`` of input gradients
      unless first stage, a ``send`` of activations and a ``recv`` of output gradients
      unless last stage;
    * DP: one ``all_reduce`` of the flat gradient buffer, or with ``reduce-scatter``
      one ``reduce_scatter`` and one ``all_gather``.

    Not per step: the demo's single world ``barrier`` on the default group at the end of the run.
    """
    if dp_mode not in DP_MODES:
        raise LayoutError(f"dp_mode {dp_mode!r} is not one of {', '.join(DP_MODES)}")
    layers = layers_per_stage or layout.layers_per_stage
    if not layers:
        raise LayoutError("layers_per_stage is neither given nor set in the layout")
    stage = layout.coords(rank).pp
    mb = layout.microbatches
    counts: dict[tuple[str, str], int] = {}
    if layout.tp > 1:
        counts[("tp", "all_reduce")] = 2 * layers * mb
    if layout.pp > 1:
        boundaries = (stage > 0) + (stage < layout.pp - 1)
        counts[("pp", "send")] = mb * boundaries
        counts[("pp", "recv")] = mb * boundaries
    if layout.dp > 1:
        if dp_mode == "allreduce":
            counts[("dp", "all_reduce")] = 1
        else:
            counts[("dp", "reduce_scatter")] = 1
            counts[("dp", "all_gather")] = 1
    return counts
