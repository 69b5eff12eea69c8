"""Optional iteration and phase markers (``megatrace.step()``, ``megatrace.phase()``).

Markers are records like any other (op MARK_STEP / MARK_PHASE, group 0). They
help a reader of the timeline; analysis never depends on them.
"""

from __future__ import annotations

from megatrace.trace import ring_format as fmt

_PHASES = {p.name.lower(): int(p) for p in fmt.Phase}


def _tracer():
    from megatrace.trace.torch_hook import TRACER

    return TRACER


def step(number: int | None = None) -> None:
    tracer = _tracer()
    writer = tracer.writer
    if writer is None:
        return
    tracer.step = tracer.step + 1 if number is None else int(number)
    writer.complete(writer.begin(fmt.Op.MARK_STEP, 0, max(tracer.step, 0), 0))


def phase(name: str, microbatch: int | None = None) -> None:
    tracer = _tracer()
    writer = tracer.writer
    if writer is None:
        return
    code = _PHASES.get(name.lower(), int(fmt.Phase.OTHER))
    mb = -1 if microbatch is None else int(microbatch)
    writer.complete(writer.begin(fmt.Op.MARK_PHASE, 0, max(tracer.step, 0), 0, mb, code))
