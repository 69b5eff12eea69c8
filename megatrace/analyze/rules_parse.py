"""Rule files: strict parsing of YAML rules and their conditions (the language is in docs/rules.md).

Nothing here evaluates rule text as code: a ``when`` condition is YAML data
compiled into a small tree of :class:`Condition` nodes, a message is a
template whose only placeholders are fact paths, and a regex is compiled
once, with a length cap, by RE2 (``google-re2``): matching takes time linear in
the text whatever the pattern, so a pattern like ``^((a+))+$`` cannot stall an
analysis (Python's ``re`` backtracks exponentially on it).

Every mistake becomes a :class:`RuleProblem` naming the file, the rule id and
the field; a bad rule is skipped and the rules around it still load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from megatrace.analyze.findings import Severity
from megatrace.errors import MegatraceError

MAX_FILE_BYTES = 1 << 20  # a rule file larger than 1 MiB is refused (rule files are a few KiB)
MAX_DEPTH = 16  # nesting of all/any/not; deeper conditions are refused
MAX_NODES = 256  # condition nodes per rule (also defeats YAML alias bombs)
MAX_REGEX = 200  # characters in a `matches` pattern
MAX_TEXT = 2000  # characters in a title, message or remediation

RULE_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
FACT_PATH_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_-]+)*$")
PLACEHOLDER_RE = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")

RULE_KEYS = {"id", "title", "severity", "when", "message", "remediation", "evidence", "subject", "enabled"}
REQUIRED_KEYS = ("id", "title", "severity", "when", "message")
SUBJECT_KEYS = {"rank", "ranks", "host", "hosts"}
FILE_KEYS = {"rules", "version"}
FILE_VERSION = 1

VALUE_OPS = ("eq", "ne", "lt", "le", "gt", "ge")
FACT_OPS = tuple(f"{op}_fact" for op in VALUE_OPS)
OTHER_OPS = ("in", "contains", "exists", "matches", "differs_across")
OPERATORS = VALUE_OPS + FACT_OPS + OTHER_OPS
DIFFERS_ACROSS = ("ranks", "hosts")
LOGIC = ("all", "any", "not")


@dataclass(frozen=True)
class RuleProblem:
    """A mistake in a rule file. ``rule_id`` is None when the rule has no readable id."""

    file: str
    rule_id: str | None
    field: str | None
    message: str

    def __str__(self) -> str:
        parts = [self.file]
        if self.rule_id is not None:
            parts.append(f"rule {self.rule_id!r}")
        if self.field:
            parts.append(f"field {self.field!r}")
        return ": ".join(parts) + f": {self.message}"


class RuleSyntaxError(MegatraceError, ValueError):
    """Raised inside the parser; carries the field path that is wrong."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(message)
        self.field = field_path
        self.message = message


# -- conditions ---------------------------------------------------------------

@dataclass(frozen=True)
class Condition:
    """A node of a compiled ``when`` condition."""

    def paths(self) -> list[str]:
        """Every fact path the condition reads."""
        raise NotImplementedError


@dataclass(frozen=True)
class AllOf(Condition):
    items: tuple[Condition, ...]

    def paths(self) -> list[str]:
        return [p for c in self.items for p in c.paths()]


@dataclass(frozen=True)
class AnyOf(Condition):
    items: tuple[Condition, ...]

    def paths(self) -> list[str]:
        return [p for c in self.items for p in c.paths()]


@dataclass(frozen=True)
class Not(Condition):
    item: Condition

    def paths(self) -> list[str]:
        return self.item.paths()


@dataclass(frozen=True)
class Compare(Condition):
    """``{fact: PATH, OP: OPERAND, ...}``; several operators must all hold."""

    fact: str
    ops: tuple[tuple[str, Any], ...]  # (operator, operand); a regex operand is compiled

    def paths(self) -> list[str]:
        return [self.fact] + [operand for op, operand in self.ops if op.endswith("_fact")]


@dataclass(frozen=True)
class Rule:
    """One parsed rule."""

    id: str
    title: str
    severity: Severity
    when: Condition
    message: str
    remediation: str = ""
    evidence: tuple[str, ...] = ()
    subject: tuple[tuple[str, str], ...] = ()  # (subject field, fact path)
    enabled: bool = True
    source: str = ""  # the file it came from


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_path(value: Any, where: str) -> str:
    if not isinstance(value, str) or not FACT_PATH_RE.match(value):
        raise RuleSyntaxError(where, f"expected a fact path like 'env.NCCL_DEBUG' or 'layout.tp', got {value!r}")
    return value


def _compile_regex(pattern: Any, where: str) -> Any:
    """A compiled RE2 pattern (linear-time matching; no look-around or back-references)."""
    if not isinstance(pattern, str):
        raise RuleSyntaxError(where, f"expected a regular expression string, got {type(pattern).__name__}")
    if len(pattern) > MAX_REGEX:
        raise RuleSyntaxError(where, f"regular expression is {len(pattern)} characters; the limit is {MAX_REGEX}")
    try:
        import re2  # type: ignore[import-not-found]
    except ImportError:
        raise RuleSyntaxError(where, "regular expressions need the google-re2 package (pip install google-re2); "
                                     "this rule is skipped") from None
    options = re2.Options()
    options.log_errors = False  # the error comes back as an exception: nothing on stderr
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        why = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise RuleSyntaxError(where, f"bad regular expression {pattern!r}: {why} (RE2 syntax: no look-around "
                                     "or back-references)") from None


def _operand(op: str, value: Any, where: str) -> Any:
    """Check (and for ``matches``, compile) one operator's operand."""
    if op in FACT_OPS:
        return _check_path(value, where)
    if op in ("eq", "ne"):
        if not (isinstance(value, (str, bool)) or _is_number(value)):
            raise RuleSyntaxError(where, f"expected a string, number or true/false, got {_type_name(value)}")
        return value
    if op in ("lt", "le", "gt", "ge"):
        if not (isinstance(value, str) or _is_number(value)):
            raise RuleSyntaxError(where, f"expected a number or a string to order by, got {_type_name(value)}")
        return value
    if op == "in":
        if not isinstance(value, list) or not value:
            raise RuleSyntaxError(where, f"expected a non-empty list of values, got {_type_name(value)}")
        for item in value:
            if not (isinstance(item, (str, bool)) or _is_number(item)):
                raise RuleSyntaxError(where, f"list items must be strings, numbers or true/false, got "
                                             f"{_type_name(item)}")
        return tuple(value)
    if op == "contains":
        if not (isinstance(value, (str, bool)) or _is_number(value)):
            raise RuleSyntaxError(where, f"expected a string or number to look for, got {_type_name(value)}")
        return value
    if op == "exists":
        if not isinstance(value, bool):
            raise RuleSyntaxError(where, f"expected true or false, got {value!r}")
        return value
    if op == "matches":
        return _compile_regex(value, where)
    if op == "differs_across":
        if value not in DIFFERS_ACROSS:
            raise RuleSyntaxError(where, f"expected one of {', '.join(DIFFERS_ACROSS)}, got {value!r}")
        return value
    raise RuleSyntaxError(where, f"unknown operator {op!r}")  # pragma: no cover - callers check first


def _type_name(value: Any) -> str:
    return "null" if value is None else "a list" if isinstance(value, list) else \
        "a mapping" if isinstance(value, dict) else f"{value!r}"


def compile_condition(data: Any, where: str = "when") -> Condition:
    """Compile a YAML ``when`` value into a :class:`Condition`; raise :class:`RuleSyntaxError`."""
    budget = [MAX_NODES]
    return _compile(data, where, 0, budget)


def _compile(data: Any, where: str, depth: int, budget: list[int]) -> Condition:
    budget[0] -= 1
    if budget[0] < 0:
        raise RuleSyntaxError(where, f"condition has more than {MAX_NODES} parts")
    if depth > MAX_DEPTH:
        raise RuleSyntaxError(where, f"condition nests deeper than {MAX_DEPTH} levels")
    if not isinstance(data, dict) or not data:
        raise RuleSyntaxError(where, "expected a condition mapping: {all: [...]}, {any: [...]}, {not: ...} or "
                                     f"{{fact: PATH, OPERATOR: VALUE}}, got {_type_name(data)}")
    logic = [k for k in data if k in LOGIC]
    if logic:
        if len(data) != 1:
            other = next(k for k in data if k != logic[0])
            raise RuleSyntaxError(f"{where}.{other}", f"'{logic[0]}' must stand alone in its mapping; "
                                                      f"found {other!r} beside it")
        key = logic[0]
        value = data[key]
        if key == "not":
            return Not(_compile(value, f"{where}.not", depth + 1, budget))
        if not isinstance(value, list) or not value:
            raise RuleSyntaxError(f"{where}.{key}", f"expected a non-empty list of conditions, got {_type_name(value)}")
        items = tuple(_compile(item, f"{where}.{key}[{i}]", depth + 1, budget) for i, item in enumerate(value))
        return AllOf(items) if key == "all" else AnyOf(items)
    if "fact" not in data:
        key = next(iter(data))
        raise RuleSyntaxError(f"{where}.{key}", f"unknown key {key!r}: a condition starts with 'fact', 'all', "
                                                "'any' or 'not'")
    fact = _check_path(data["fact"], f"{where}.fact")
    ops: list[tuple[str, Any]] = []
    for key, value in data.items():
        if key == "fact":
            continue
        if key not in OPERATORS:
            raise RuleSyntaxError(f"{where}.{key}", f"unknown operator {key!r} (known: {', '.join(OPERATORS)})")
        ops.append((key, _operand(key, value, f"{where}.{key}")))
    if not ops:
        raise RuleSyntaxError(where, f"condition on {fact!r} has no operator (e.g. eq, gt, exists)")
    return Compare(fact, tuple(ops))


# -- templates ----------------------------------------------------------------

def template_paths(text: str, where: str) -> list[str]:
    """The fact paths a message template refers to; raise on a malformed placeholder."""
    paths = []
    for m in PLACEHOLDER_RE.finditer(text):
        token = m.group(0)
        if token in ("{{", "}}"):
            continue
        if m.group(1) is None:
            raise RuleSyntaxError(where, f"unbalanced {token!r} at character {m.start()} (write '{{{{' or '}}}}' "
                                         "for a literal brace)")
        paths.append(_check_path(m.group(1).strip(), where))
    return paths


# -- rules and files ----------------------------------------------------------

class _StrictLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """SafeLoader (libyaml's parser where PyYAML has it: the shipped rules load in every analysis) that refuses
    duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.constructor.SafeConstructor.construct_mapping(loader, node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _text(data: dict, key: str, required: bool) -> str:
    value = data.get(key)
    if value is None:
        if required:
            raise RuleSyntaxError(key, "missing (required)")
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        hint = " (YAML reads bare yes/no/on/off/true/false as booleans: quote the text)" \
            if isinstance(value, bool) else ""
        raise RuleSyntaxError(key, f"expected non-empty text, got {_type_name(value)}{hint}")
    if len(value) > MAX_TEXT:
        raise RuleSyntaxError(key, f"{len(value)} characters; the limit is {MAX_TEXT}")
    return value.strip()


def parse_rule(data: Any, source: str) -> Rule:
    """Build one :class:`Rule` from its YAML mapping; raise :class:`RuleSyntaxError` naming the field."""
    if not isinstance(data, dict):
        raise RuleSyntaxError("", f"expected a rule mapping (id, title, severity, when, message, ...), got "
                                  f"{_type_name(data)}")
    for key in data:
        if key not in RULE_KEYS:
            raise RuleSyntaxError(str(key), f"unknown key (known: {', '.join(sorted(RULE_KEYS))})")
    for key in REQUIRED_KEYS:
        if key not in data:
            raise RuleSyntaxError(key, "missing (required)")
    rid = data["id"]
    if not isinstance(rid, str) or not RULE_ID_RE.match(rid):
        raise RuleSyntaxError("id", f"expected lower-case letters, digits, '.', '_' or '-' (at most 64), got {rid!r}")
    sev = data["severity"]
    try:
        severity = Severity.parse(sev) if isinstance(sev, str) else Severity.parse(repr(sev))
    except ValueError as exc:
        raise RuleSyntaxError("severity", str(exc)) from None
    title = _text(data, "title", True)
    message = _text(data, "message", True)
    remediation = _text(data, "remediation", False)
    template_paths(message, "message")
    template_paths(remediation, "remediation")
    when = compile_condition(data["when"], "when")
    evidence = data.get("evidence", [])
    if evidence is None:
        evidence = []
    if not isinstance(evidence, list):
        raise RuleSyntaxError("evidence", f"expected a list of fact paths, got {_type_name(evidence)}")
    evidence_paths = tuple(_check_path(p, f"evidence[{i}]") for i, p in enumerate(evidence))
    subject = data.get("subject") or {}
    if not isinstance(subject, dict):
        raise RuleSyntaxError("subject", f"expected a mapping like {{hosts: findings.hang_hosts}}, got "
                                         f"{_type_name(subject)}")
    for key in subject:
        if key not in SUBJECT_KEYS:
            raise RuleSyntaxError(f"subject.{key}", f"unknown key (known: {', '.join(sorted(SUBJECT_KEYS))})")
    subject_paths = tuple((k, _check_path(v, f"subject.{k}")) for k, v in subject.items())
    enabled = data.get("enabled", True)
    if not isinstance(enabled, bool):
        raise RuleSyntaxError("enabled", f"expected true or false, got {enabled!r}")
    return Rule(id=rid, title=title, severity=severity, when=when, message=message, remediation=remediation,
                evidence=evidence_paths, subject=subject_paths, enabled=enabled, source=source)


@dataclass
class ParsedFile:
    """What one rule file gave: its good rules and the problems with the rest."""

    source: str
    rules: list[Rule] = field(default_factory=list)
    problems: list[RuleProblem] = field(default_factory=list)


def parse_rules_text(text: str, source: str) -> ParsedFile:
    """Parse the text of one rule file. Never raises: problems are collected, good rules kept.

    Accepted shapes: a mapping ``{rules: [...]}`` (optionally with ``version: 1``), a list of
    rules, or a single rule mapping.
    """
    out = ParsedFile(source)
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        out.problems.append(RuleProblem(source, None, None, f"not valid YAML{where}: {problem}"))
        return out
    if data is None:
        return out  # an empty file (or only comments) holds no rules
    if isinstance(data, dict) and "id" not in data:
        for key in data:
            if key not in FILE_KEYS:
                out.problems.append(RuleProblem(source, None, str(key), "unknown top-level key (expected 'rules', "
                                                "optionally 'version')"))
                return out
        if data.get("version", FILE_VERSION) != FILE_VERSION:
            out.problems.append(RuleProblem(source, None, "version", f"unsupported rule file version "
                                            f"{data.get('version')!r} (this megatrace reads version {FILE_VERSION})"))
            return out
        items = data.get("rules")
        if not isinstance(items, list):
            out.problems.append(RuleProblem(source, None, "rules", f"expected a list of rules, got "
                                            f"{_type_name(items)}"))
            return out
    elif isinstance(data, dict):
        items = [data]
    elif isinstance(data, list):
        items = data
    else:
        out.problems.append(RuleProblem(source, None, None, f"expected a list of rules or a mapping with 'rules', "
                                        f"got {_type_name(data)}"))
        return out
    seen: set[str] = set()
    for i, item in enumerate(items):
        rid = item.get("id") if isinstance(item, dict) and isinstance(item.get("id"), str) else None
        label = rid if rid is not None else f"#{i + 1}"
        try:
            rule = parse_rule(item, source)
        except RuleSyntaxError as exc:
            out.problems.append(RuleProblem(source, label, exc.field or None, exc.message))
            continue
        if rule.id in seen:
            out.problems.append(RuleProblem(source, rule.id, "id", "duplicate rule id in this file; the later one "
                                            "is ignored"))
            continue
        seen.add(rule.id)
        out.rules.append(rule)
    return out
