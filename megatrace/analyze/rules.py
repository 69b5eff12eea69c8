"""The rules engine: YAML rules over analysis facts become findings (format and language: docs/rules.md).

Rules come from layers, later ones replacing earlier rules of the same id:

1. the shipped defaults, ``megatrace/analyze/rules_default/*.yaml`` (package data, so they are
   there in a checkout, an editable install and a wheel alike);
2. site directories: the ``site_dir`` argument, else ``$MEGATRACE_RULES_DIR`` (several separated
   by ``os.pathsep``), each read in file-name order;
3. explicit rule files or directories (``paths``).

A site rule with a default's id replaces it (``enabled: false`` switches it off). A broken file
or rule becomes a ``rule-error`` finding naming the file, rule id and field; the other rules run.

The engine's entry point is :func:`rules_stage`, a stage for :mod:`megatrace.analyze.engine`;
:func:`run_rules` evaluates rules on a fact dictionary built by :mod:`megatrace.analyze.facts`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatrace.analyze.context import AnalysisContext
from megatrace.analyze.facts import build_facts, facts_from_context
from megatrace.analyze.findings import Finding
from megatrace.analyze.rules_eval import MISSING, RuleResult, evaluate_rule, lookup, problem_finding, render_value
from megatrace.analyze.rules_parse import MAX_FILE_BYTES, ParsedFile, Rule, RuleProblem, parse_rules_text

RULES_DIR_ENV = "MEGATRACE_RULES_DIR"
DEFAULT_RULES_DIR = Path(__file__).resolve().with_name("rules_default")
RULE_SUFFIXES = (".yaml", ".yml")

PathLike = str | os.PathLike[str]


def default_rules_dir() -> Path:
    """Where the shipped rules live (inside the package)."""
    return DEFAULT_RULES_DIR


def site_rules_dirs(site_dir: PathLike | Sequence[PathLike] | None = None,
                    environ: Mapping[str, str] | None = None) -> list[Path]:
    """The site rule directories: ``site_dir`` when given, else ``$MEGATRACE_RULES_DIR`` (os.pathsep-separated)."""
    if site_dir is not None:
        items = [site_dir] if isinstance(site_dir, (str, os.PathLike)) else list(site_dir)
        return [Path(p) for p in items if str(p)]
    value = (os.environ if environ is None else environ).get(RULES_DIR_ENV, "")
    return [Path(p) for p in value.split(os.pathsep) if p.strip()]


def load_rule_file(path: PathLike) -> ParsedFile:
    """Read and parse one rule file; unreadable files are a problem, never an exception."""
    source = str(path)
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            return ParsedFile(source, problems=[RuleProblem(source, None, None, f"file is {size} bytes; rule files "
                                                            f"are limited to {MAX_FILE_BYTES}")])
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        return ParsedFile(source, problems=[RuleProblem(source, None, None, f"not UTF-8 text: {exc.reason}")])
    except OSError as exc:
        return ParsedFile(source, problems=[RuleProblem(source, None, None, f"cannot read: {exc.strerror or exc}")])
    return parse_rules_text(text, source)


def _layer_files(path: Path) -> tuple[list[Path], list[RuleProblem]]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in RULE_SUFFIXES and p.is_file()), []
    if path.is_file():
        return [path], []
    return [], [RuleProblem(str(path), None, None, "rules directory or file not found")]


@dataclass
class RuleSet:
    """The rules to run and the problems met loading them."""

    rules: list[Rule] = field(default_factory=list)
    problems: list[RuleProblem] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)  # "<id>: <file> replaces <file>"

    def get(self, rule_id: str) -> Rule | None:
        return next((r for r in self.rules if r.id == rule_id), None)


def load_rules(*, site_dir: PathLike | Sequence[PathLike] | None = None, paths: Sequence[PathLike] = (),
               include_defaults: bool = True, environ: Mapping[str, str] | None = None) -> RuleSet:
    """Load the layered rule set (see the module docstring). Never raises."""
    layers: list[list[Path]] = []
    out = RuleSet()
    if include_defaults:
        layers.append([default_rules_dir()])
    layers += [[d] for d in site_rules_dirs(site_dir, environ)]
    if paths:
        layers.append([Path(p) for p in paths])
    by_id: dict[str, Rule] = {}
    for layer in layers:
        seen_here: dict[str, str] = {}
        for entry in layer:
            files, problems = _layer_files(entry)
            out.problems += problems
            for path in files:
                parsed = load_rule_file(path)
                out.files.append(parsed.source)
                out.problems += parsed.problems
                for rule in parsed.rules:
                    if rule.id in seen_here:
                        out.problems.append(RuleProblem(rule.source, rule.id, "id", f"already defined in "
                                                        f"{seen_here[rule.id]}; this one is ignored"))
                        continue
                    seen_here[rule.id] = rule.source
                    if rule.id in by_id:
                        out.overrides.append(f"{rule.id}: {rule.source} replaces {by_id[rule.id].source}")
                    by_id[rule.id] = rule
    out.rules = list(by_id.values())
    return out


@dataclass
class RuleReport:
    """The outcome of one evaluation: per-rule results, load problems, and the findings to report."""

    results: list[RuleResult]
    problems: list[RuleProblem]
    findings: list[Finding]
    overrides: list[str] = field(default_factory=list)

    def fired(self) -> list[str]:
        return [r.rule.id for r in self.results if r.status == "fired"]

    def summary(self) -> dict[str, Any]:
        """For findings.json's ``analysis`` section."""
        return {"rules": len(self.results), "fired": self.fired(),
                "disabled": [r.rule.id for r in self.results if r.status == "disabled"],
                "problems": [str(p) for p in self.problems] + [f"{r.rule.source}: rule {r.rule.id!r}: {r.error}"
                                                                 for r in self.results if r.status == "error"]}

    def debug_lines(self) -> list[str]:
        """A listing for ``--debug``: every rule, what it did, and which facts it found missing."""
        lines = []
        for r in self.results:
            line = f"{r.status:8} {r.rule.id} ({r.rule.source})"
            if r.missing:
                line += f"; missing facts: {', '.join(r.missing)}"
            if r.error:
                line += f"; {r.error}"
            lines.append(line)
        lines += [f"override {o}" for o in self.overrides]
        lines += [f"problem  {p}" for p in self.problems]
        return lines


def evaluate_rules(ruleset: RuleSet, facts: Mapping[str, Any]) -> RuleReport:
    """Evaluate every rule of ``ruleset`` on ``facts``; problems become ``rule-error`` findings."""
    results = [evaluate_rule(rule, facts) for rule in ruleset.rules]
    problems = list(ruleset.problems)
    problems += [RuleProblem(r.rule.source, r.rule.id, "when", r.error) for r in results if r.status == "error"]
    findings = [r.finding for r in results if r.finding is not None]
    seen: dict[str, int] = {}
    for p in problems:
        f = problem_finding(p)
        n = seen.get(f.id, 0)
        seen[f.id] = n + 1
        findings.append(problem_finding(p, n) if n else f)
    return RuleReport(results, problems, findings, list(ruleset.overrides))


def run_rules(facts: Mapping[str, Any], *, site_dir: PathLike | Sequence[PathLike] | None = None,
              paths: Sequence[PathLike] = (), include_defaults: bool = True,
              environ: Mapping[str, str] | None = None) -> RuleReport:
    """Load the rule set and evaluate it on ``facts`` in one call."""
    ruleset = load_rules(site_dir=site_dir, paths=paths, include_defaults=include_defaults, environ=environ)
    return evaluate_rules(ruleset, facts)


def make_rules_stage(*, site_dir: PathLike | Sequence[PathLike] | None = None, paths: Sequence[PathLike] = (),
                     include_defaults: bool = True, env: Mapping[str, Any] | None = None,
                     batch: Mapping[str, Any] | None = None) -> Callable[[Any], list[Finding]]:
    """A rules stage with its options bound (e.g. from ``--rules-dir``), for ``engine.STAGES``.

    It leaves the :class:`RuleReport` in ``ctx.results["rules"]`` and the facts in ``ctx.results["facts"]``.
    """
    def stage(ctx: AnalysisContext) -> list[Finding]:
        problems: list[RuleProblem] = []
        try:
            facts = facts_from_context(ctx, env=env, batch=batch)
        except Exception as exc:  # noqa: BLE001 - odd trace metadata must not stop the analysis
            problems.append(RuleProblem("<facts>", None, None, f"could not gather all facts ({exc!r}); rules ran "
                                        "on the findings alone"))
            facts = build_facts(findings=list(getattr(ctx, "findings", [])))
        ruleset = load_rules(site_dir=site_dir, paths=paths, include_defaults=include_defaults)
        ruleset.problems[:0] = problems
        report = evaluate_rules(ruleset, facts)
        ctx.results["rules"] = report
        ctx.results["facts"] = facts
        return report.findings
    return stage


def rules_stage(ctx: AnalysisContext) -> list[Finding]:
    """The rules stage with default options: shipped rules plus ``$MEGATRACE_RULES_DIR``. Run it last."""
    return make_rules_stage()(ctx)


def describe_fact(facts: Mapping[str, Any], path: str) -> str:
    """``path = value`` (or ``path: not known``), as rule evidence shows it."""
    value = lookup(facts, path)
    return f"{path}: not known" if value is MISSING else f"{path} = {render_value(value)}"
