"""What every analysis stage sees: the trace, its aligned clocks, the matched calls, and the results of the stages
before it (:mod:`megatrace.analyze.engine` runs the stages in order; a stage returns findings and may leave results
under ``results``, e.g. ``results["hang"]``, ``results["critical_path"]``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatrace.analyze.clock import ClockAlignment
from megatrace.analyze.findings import Finding
from megatrace.analyze.match import MatchResult
from megatrace.load.traceset import TraceSet


@dataclass
class AnalysisContext:
    """What every stage sees: the trace and the results of the stages before it."""

    trace: TraceSet
    clock: ClockAlignment
    match: MatchResult
    findings: list[Finding] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)


Stage = Callable[[AnalysisContext], list[Finding]]
