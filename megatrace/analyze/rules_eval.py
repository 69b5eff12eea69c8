"""Rule evaluation: conditions over a fact dictionary, message templates, and the findings rules produce.

Semantics (docs/rules.md): a comparison whose fact is missing is false (only
``exists: false`` is true then) and the path is noted in the rule's debug
listing; values of different types never compare, except that a number and a
string that reads as a number compare as numbers (environment values are
strings). Nothing here raises on odd facts: a comparison that cannot be made
is false.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from megatrace.analyze.findings import Finding, Kind, Severity, Subject
from megatrace.analyze.rules_parse import (PLACEHOLDER_RE, AllOf, AnyOf, Compare, Condition, Not, Rule,
                                           RuleProblem)
from megatrace.load.traceset import rank_list

MAX_MATCH_TEXT = 4096  # characters of a fact value that `matches` looks at
MAX_RENDER_ITEMS = 12  # list items (or per-rank groups) written into a message before "and N more"
MAX_QUOTED_RANKS = 64  # per-rank values quoted one by one in a finding's data before they are summarised
MISSING = object()


# -- fact lookup --------------------------------------------------------------

def lookup(facts: Any, path: str) -> Any:
    """The value at a dotted ``path`` in nested dicts/lists, or :data:`MISSING`.

    A segment of digits also finds an integer key (per-rank maps are keyed by rank) or a list index.
    """
    value = facts
    for part in path.split("."):
        if isinstance(value, dict):
            if part in value:
                value = value[part]
            elif part.lstrip("-").isdigit() and int(part) in value:
                value = value[int(part)]
            else:
                return MISSING
        elif isinstance(value, (list, tuple)) and part.isdigit():
            index = int(part)
            if index >= len(value):
                return MISSING
            value = value[index]
        else:
            return MISSING
    return MISSING if value is None else value


# -- comparisons --------------------------------------------------------------

def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_number(value: Any) -> float | int | None:
    """A number, or a string that reads as one (environment values are strings)."""
    if _is_number(value):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


def _pair(a: Any, b: Any) -> tuple[Any, Any] | None:
    """Make two values comparable, or None when they are not (different kinds)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return (a, b) if isinstance(a, bool) and isinstance(b, bool) else None
    if _is_number(a) or _is_number(b):
        na, nb = _as_number(a), _as_number(b)
        return None if na is None or nb is None else (na, nb)
    if isinstance(a, str) and isinstance(b, str):
        return a, b
    return None


def _equal(a: Any, b: Any) -> bool:
    pair = _pair(a, b)
    if pair is None:
        return a == b if type(a) is type(b) else False
    return pair[0] == pair[1]


def _order(op: str, a: Any, b: Any) -> bool:
    pair = _pair(a, b)
    if pair is None:
        return False
    x, y = pair
    try:
        return {"lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y}[op]
    except TypeError:
        return False


def _distinct(values: Any) -> int:
    """Number of distinct (non-null) values in a mapping's values or a list."""
    items = values.values() if isinstance(values, dict) else values if isinstance(values, (list, tuple)) else None
    if items is None:
        return 0
    seen: list = []
    for item in items:
        if item is None:
            continue
        if not any(_equal(item, s) for s in seen):
            seen.append(item)
    return len(seen)


def _contains(container: Any, needle: Any) -> bool:
    if isinstance(container, str):
        return str(needle) in container if not isinstance(needle, bool) else False
    if isinstance(container, dict):
        return any(_equal(k, needle) for k in container)
    if isinstance(container, (list, tuple, set, frozenset)):
        return any(_equal(item, needle) for item in container)
    return False


def _apply(op: str, value: Any, operand: Any, facts: Any, missing: list[str]) -> bool:
    if op == "exists":
        return (value is not MISSING) == operand
    if value is MISSING:
        return False
    if op == "eq":
        return _equal(value, operand)
    if op == "ne":
        return not _equal(value, operand)
    if op in ("lt", "le", "gt", "ge"):
        return _order(op, value, operand)
    if op.endswith("_fact"):
        other = lookup(facts, operand)
        if other is MISSING:
            missing.append(operand)
            return False
        base = op[:-5]
        if base == "eq":
            return _equal(value, other)
        if base == "ne":
            return not _equal(value, other)
        return _order(base, value, other)
    if op == "in":
        return any(_equal(value, item) for item in operand)
    if op == "contains":
        return _contains(value, operand)
    if op == "matches":
        if isinstance(value, (dict, list, tuple)):
            return False
        text = str(value).lower() if isinstance(value, bool) else str(value)
        return operand.search(text[:MAX_MATCH_TEXT]) is not None
    if op == "differs_across":
        return _distinct(value) > 1
    return False


def evaluate(cond: Condition, facts: Any, missing: list[str]) -> bool:
    """Evaluate a compiled condition; append the missing fact paths it met to ``missing``."""
    if isinstance(cond, AllOf):
        return all([evaluate(c, facts, missing) for c in cond.items])  # every branch, for a full missing list
    if isinstance(cond, AnyOf):
        return any([evaluate(c, facts, missing) for c in cond.items])
    if isinstance(cond, Not):
        return not evaluate(cond.item, facts, missing)
    if isinstance(cond, Compare):
        value = lookup(facts, cond.fact)
        if value is MISSING:
            missing.append(cond.fact)
        return all(_apply(op, value, operand, facts, missing) for op, operand in cond.ops)
    return False


# -- rendering ----------------------------------------------------------------

def render_value(value: Any) -> str:
    """A fact value as text: lists joined, per-rank maps grouped by value, missing as '?'."""
    if value is MISSING or value is None:
        return "?"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        if value and all(isinstance(k, int) and not isinstance(k, bool) for k in value):
            return _render_per_rank(value)
        nested = any(isinstance(v, (dict, list, tuple)) for v in value.values())
        items = [f"{k}: {render_value(v)}" if nested else f"{k}={render_value(v)}"
                 for k, v in list(value.items())[:MAX_RENDER_ITEMS]]
        more = len(value) - MAX_RENDER_ITEMS
        return (" | " if nested else ", ").join(items) + (f" and {more} more" if more > 0 else "")
    if isinstance(value, (list, tuple)):
        items = [render_value(v) for v in value[:MAX_RENDER_ITEMS]]
        more = len(value) - MAX_RENDER_ITEMS
        return ", ".join(items) + (f" and {more} more" if more > 0 else "")
    return str(value)


def _render_per_rank(mapping: dict[int, Any]) -> str:
    groups: dict[str, list[int]] = {}
    for rank in sorted(mapping):
        groups.setdefault(render_value(mapping[rank]), []).append(rank)
    if len(groups) == 1:
        return next(iter(groups))
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    parts = [f"{text} on ranks {rank_list(ranks)}" for text, ranks in ordered[:MAX_RENDER_ITEMS]]
    more = len(ordered) - MAX_RENDER_ITEMS
    return "; ".join(parts) + (f"; and {more} more values" if more > 0 else "")


def render(template: str, facts: Any, missing: list[str]) -> str:
    """Fill ``{fact.path}`` placeholders (templates were checked when the rule was parsed)."""
    def sub(m: re.Match[str]) -> str:
        token = m.group(0)
        if token == "{{":
            return "{"
        if token == "}}":
            return "}"
        path = (m.group(1) or "").strip()
        value = lookup(facts, path)
        if value is MISSING:
            missing.append(path)
        return render_value(value)
    return PLACEHOLDER_RE.sub(sub, template)


# -- results ------------------------------------------------------------------

@dataclass
class RuleResult:
    """What one rule did: fired, did not, was disabled, or failed."""

    rule: Rule
    status: str  # "fired", "quiet", "disabled", "error"
    missing: list[str] = field(default_factory=list)  # fact paths that were absent (debug listing only)
    finding: Finding | None = None
    error: str = ""


def _ints(value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, (list, tuple)) else value.keys() if isinstance(value, dict) else [value]
    out = []
    for item in items:
        number = _as_number(item)
        if isinstance(number, int):
            out.append(number)
    return tuple(sorted(set(out)))


def _strs(value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, (list, tuple)) else value.values() if isinstance(value, dict) else [value]
    return tuple(sorted({str(v) for v in items if v is not None and not isinstance(v, (dict, list))}))


def _subject(rule: Rule, facts: Any) -> Subject:
    fields: dict[str, Any] = {}
    for key, path in rule.subject:
        value = lookup(facts, path)
        if value is MISSING:
            continue
        if key == "rank":
            ranks = _ints(value)
            if len(ranks) == 1:
                fields["rank"] = ranks[0]
        elif key == "ranks":
            fields["ranks"] = _ints(value)
        elif key == "host":
            hosts = _strs(value)
            if len(hosts) == 1:
                fields["host"] = hosts[0]
        elif key == "hosts":
            fields["hosts"] = _strs(value)
    return Subject(**fields)


def _plain(value: Any) -> Any:
    """A JSON-friendly copy of a fact value for findings.json: keys become strings, and a per-rank map
    of more than :data:`MAX_QUOTED_RANKS` ranks is summarised as {value: {count, ranks (the first ones)}}."""
    if isinstance(value, dict):
        if len(value) > MAX_QUOTED_RANKS and all(isinstance(k, int) for k in value):
            groups: dict[str, list[int]] = {}
            for rank in sorted(value):
                groups.setdefault(render_value(value[rank]), []).append(rank)
            return {"by_value": {v: {"count": len(rs), "ranks": rs[:MAX_QUOTED_RANKS]} for v, rs in groups.items()}}
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def rule_finding(rule: Rule, facts: Any, missing: list[str]) -> Finding:
    """The finding a fired rule produces: id ``rule:<id>``, the rendered message as its verdict."""
    verdict = render(rule.message, facts, missing)
    remediation = render(rule.remediation, facts, missing) if rule.remediation else ""
    evidence: list[str | dict[str, Any]] = []
    quoted: dict[str, Any] = {}
    for path in rule.evidence:
        value = lookup(facts, path)
        if value is MISSING:
            missing.append(path)
            evidence.append(f"{path}: not known")
            continue
        evidence.append(f"{path} = {render_value(value)}")
        quoted[path] = _plain(value)
    return Finding(id=f"rule:{rule.id}", severity=rule.severity, kind=Kind.RULE, subject=_subject(rule, facts),
                   verdict=verdict, evidence=evidence, remediation=remediation,
                   data={"rule": rule.id, "title": rule.title, "source": rule.source, "facts": quoted})


def evaluate_rule(rule: Rule, facts: Any) -> RuleResult:
    """Evaluate one rule; never raises (an unexpected failure is an ``error`` result)."""
    if not rule.enabled:
        return RuleResult(rule, "disabled")
    missing: list[str] = []
    try:
        fired = evaluate(rule.when, facts, missing)
        finding = rule_finding(rule, facts, missing) if fired else None
    except Exception as exc:  # noqa: BLE001 - one bad rule must not stop the others
        return RuleResult(rule, "error", _unique(missing), error=f"evaluation failed: {exc!r}")
    return RuleResult(rule, "fired" if fired else "quiet", _unique(missing), finding)


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def problem_finding(problem: RuleProblem, index: int = 0) -> Finding:
    """A broken rule file (or rule) as a finding of its own: severity warning, kind ``rule-error``."""
    name = problem.file.replace("\\", "/").rsplit("/", 1)[-1]
    rid = f"rule-error:{name}:{problem.rule_id or '-'}:{problem.field or '-'}" + (f":{index}" if index else "")
    return Finding(id=rid, severity=Severity.WARNING, kind=Kind.RULE_ERROR, subject=Subject(),
                   verdict=f"rule not used: {problem}",
                   evidence=[f"file: {problem.file}"] + ([f"rule: {problem.rule_id}"] if problem.rule_id else [])
                   + ([f"field: {problem.field}"] if problem.field else []),
                   remediation="Fix the rule file; the other rules ran without it (see docs/rules.md for the format).",
                   data={"file": problem.file, "rule": problem.rule_id, "field": problem.field,
                         "message": problem.message})
