"""The rules engine: rule files, the condition language, facts, shipped defaults, and the engine stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.analysis_factory import TraceBuilder

from megatrace.analyze.engine import STAGES, analyze
from megatrace.analyze.facts import build_facts, facts_from_meta
from megatrace.analyze.findings import Finding, Kind, Severity, Subject
from megatrace.analyze.rules import (RULES_DIR_ENV, RuleSet, default_rules_dir, evaluate_rules, load_rules,
                                     make_rules_stage, run_rules)
from megatrace.analyze.rules_eval import MISSING, evaluate, evaluate_rule, lookup, render, render_value
from megatrace.analyze.rules_parse import FACT_PATH_RE, compile_condition, parse_rules_text, template_paths
from megatrace.config import Layout
from megatrace.trace.environment import filter_env

# -- helpers ---------------------------------------------------------------------------------------

FACTS: dict[str, Any] = {
    "env": {"NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "INFO", "NCCL_BUFFSIZE": "4194304"},
    "layout": {"tp": 2, "pp": 2, "dp": 2, "world_size": 8, "product": 8, "world_matches": True},
    "trace": {"hosts": ["n1", "n2"], "multi_node": True, "backends": ["nccl"]},
    "ranks": {"torch": {0: "2.3.0", 1: "2.3.0", 2: "2.4.0"}, "host": {0: "n1", 1: "n1", 2: "n2"},
              "backend": {0: "nccl", 1: "nccl", 2: "nccl"}},
    "findings": {"hang": True, "by_kind": {"comm-hang": 1}, "kinds": ["comm-hang"]},
    "flag": False,
    "ratio": 0.5,
}


def holds(cond: dict, facts: dict | None = None) -> bool:
    return evaluate(compile_condition(cond), FACTS if facts is None else facts, [])


def one_rule(when: dict, **extra: Any) -> str:
    rule = {"id": "r1", "title": "t", "severity": "warning", "when": when, "message": "m", **extra}
    return json.dumps({"rules": [rule]})  # JSON is YAML


def problems_of(text: str, source: str = "site.yaml") -> list:
    return parse_rules_text(text, source).problems


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


GOOD = """
rules:
  - id: ib-off
    title: IB off
    severity: warning
    when: {fact: env.NCCL_IB_DISABLE, eq: "1"}
    message: "IB is off on {trace.host_count} hosts"
    remediation: "unset it"
    evidence: [env.NCCL_IB_DISABLE]
"""


# -- operators -------------------------------------------------------------------------------------

@pytest.mark.parametrize("cond, expected", [
    ({"fact": "env.NCCL_IB_DISABLE", "eq": "1"}, True),
    ({"fact": "env.NCCL_IB_DISABLE", "eq": 1}, True),  # a number and a numeric string compare as numbers
    ({"fact": "env.NCCL_IB_DISABLE", "eq": "0"}, False),
    ({"fact": "env.NCCL_DEBUG", "eq": "info"}, False),  # case matters; use matches: "(?i)^info$"
    ({"fact": "flag", "eq": False}, True),
    ({"fact": "flag", "eq": 0}, False),  # booleans only equal booleans
    ({"fact": "env.NCCL_IB_DISABLE", "ne": "0"}, True),
    ({"fact": "env.NCCL_IB_DISABLE", "ne": "1"}, False),
    ({"fact": "layout.tp", "lt": 3}, True),
    ({"fact": "layout.tp", "lt": 2}, False),
    ({"fact": "layout.tp", "le": 2}, True),
    ({"fact": "layout.tp", "gt": 1}, True),
    ({"fact": "layout.tp", "gt": 2}, False),
    ({"fact": "layout.tp", "ge": 2}, True),
    ({"fact": "ratio", "lt": 0.75}, True),
    ({"fact": "env.NCCL_BUFFSIZE", "gt": 1048576}, True),  # "4194304" read as a number
    ({"fact": "env.NCCL_DEBUG", "gt": 5}, False),  # "INFO" is not a number: no order
    ({"fact": "env.NCCL_DEBUG", "gt": "A"}, True),  # strings order as strings
    ({"fact": "env.NCCL_DEBUG", "in": ["WARN", "INFO"]}, True),
    ({"fact": "env.NCCL_DEBUG", "in": ["WARN", "TRACE"]}, False),
    ({"fact": "layout.tp", "in": [1, "2"]}, True),
    ({"fact": "trace.hosts", "contains": "n2"}, True),
    ({"fact": "trace.hosts", "contains": "n3"}, False),
    ({"fact": "env.NCCL_DEBUG", "contains": "NF"}, True),
    ({"fact": "env", "contains": "NCCL_DEBUG"}, True),  # a mapping contains its keys
    ({"fact": "env.NCCL_DEBUG", "exists": True}, True),
    ({"fact": "env.NCCL_SOCKET_IFNAME", "exists": False}, True),
    ({"fact": "env.NCCL_SOCKET_IFNAME", "exists": True}, False),
    ({"fact": "env.NCCL_DEBUG", "matches": "(?i)^info$"}, True),
    ({"fact": "env.NCCL_DEBUG", "matches": "^WARN"}, False),
    ({"fact": "layout.tp", "matches": "^2$"}, True),  # numbers are matched as text
    ({"fact": "env", "matches": "NCCL"}, False),  # mappings are never matched
    ({"fact": "ranks.torch", "differs_across": "ranks"}, True),
    ({"fact": "ranks.backend", "differs_across": "ranks"}, False),
    ({"fact": "trace.hosts", "differs_across": "hosts"}, True),  # a list of values works too
    ({"fact": "layout.tp", "differs_across": "ranks"}, False),  # a scalar never differs
    ({"fact": "layout.world_size", "eq_fact": "layout.product"}, True),
    ({"fact": "layout.world_size", "ne_fact": "layout.product"}, False),
    ({"fact": "layout.tp", "lt_fact": "layout.world_size"}, True),
    ({"fact": "layout.tp", "le_fact": "layout.pp"}, True),
    ({"fact": "layout.tp", "gt_fact": "layout.pp"}, False),
    ({"fact": "layout.world_size", "ge_fact": "layout.product"}, True),
    ({"fact": "layout.tp", "ge": 2, "le": 2}, True),  # several operators must all hold
    ({"fact": "layout.tp", "ge": 2, "lt": 2}, False),
    ({"fact": "ranks.torch.2", "eq": "2.4.0"}, True),  # a digit segment finds an integer (rank) key
    ({"fact": "trace.hosts.1", "eq": "n2"}, True),  # ... or a list index
    ({"fact": "findings.by_kind.comm-hang", "ge": 1}, True),  # '-' is allowed in a path segment
])
def test_each_operator_compares_as_documented(cond: dict, expected: bool) -> None:
    assert holds(cond) is expected


def test_all_any_and_not_nest() -> None:
    ib = {"fact": "env.NCCL_IB_DISABLE", "eq": "1"}
    no = {"fact": "env.NCCL_IB_DISABLE", "eq": "0"}
    assert holds({"all": [ib, {"fact": "trace.multi_node", "eq": True}]})
    assert not holds({"all": [ib, no]})
    assert holds({"any": [no, ib]})
    assert not holds({"any": [no, {"not": ib}]})
    assert holds({"not": no})
    assert holds({"all": [{"any": [no, {"not": {"not": ib}}]}, {"not": {"all": [ib, no]}}]})


# -- missing facts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("op, operand", [
    ("eq", "1"), ("ne", "1"), ("lt", 5), ("le", 5), ("gt", 5), ("ge", 5), ("in", ["1"]), ("contains", "x"),
    ("matches", "."), ("differs_across", "ranks"), ("eq_fact", "layout.tp"), ("exists", True),
])
def test_a_comparison_on_a_missing_fact_is_false_not_an_error(op: str, operand: Any) -> None:
    missing: list[str] = []
    assert evaluate(compile_condition({"fact": "env.NOT_SET", op: operand}), FACTS, missing) is False
    assert missing == ["env.NOT_SET"]


def test_missing_facts_anywhere_in_the_path_and_null_values_count_as_missing() -> None:
    for path in ("nope.deeper", "env.NCCL_DEBUG.more", "trace.hosts.7", "trace.hosts.x"):
        assert lookup(FACTS, path) is MISSING
    assert lookup({"a": None}, "a") is MISSING
    assert holds({"fact": "a", "exists": False}, {"a": None})


def test_a_missing_second_fact_makes_a_fact_comparison_false_and_is_listed() -> None:
    missing: list[str] = []
    assert not evaluate(compile_condition({"fact": "layout.tp", "ne_fact": "layout.cp"}), FACTS, missing)
    assert missing == ["layout.cp"]


def test_missing_facts_are_listed_in_the_debug_listing_not_as_findings(tmp_path: Path) -> None:
    write(tmp_path / "r.yaml", GOOD.replace("env.NCCL_IB_DISABLE, eq", "env.NCCL_NET, eq"))
    report = run_rules({"env": {}}, site_dir=tmp_path, include_defaults=False)
    assert report.findings == [] and report.fired() == []
    assert report.results[0].missing == ["env.NCCL_NET"]
    assert any("missing facts: env.NCCL_NET" in line for line in report.debug_lines())


def test_an_empty_fact_dictionary_fires_no_default_rule() -> None:
    report = run_rules({}, environ={})
    assert report.findings == [] and report.problems == []
    report = run_rules(build_facts(), environ={})
    assert report.findings == []


# -- templates -------------------------------------------------------------------------------------

def test_templates_fill_fact_paths_and_keep_escaped_braces() -> None:
    missing: list[str] = []
    text = render("TP {layout.tp} x PP { layout.pp } on {trace.hosts}; {{literal}} {nope.here}", FACTS, missing)
    assert text == "TP 2 x PP 2 on n1, n2; {literal} ?"
    assert missing == ["nope.here"]


def test_per_rank_values_render_grouped_by_value() -> None:
    assert render_value(FACTS["ranks"]["torch"]) == "2.3.0 on ranks [0, 1]; 2.4.0 on ranks [2]"
    assert render_value(FACTS["ranks"]["backend"]) == "nccl"
    assert render_value(True) == "true" and render_value(0.25) == "0.25" and render_value(MISSING) == "?"
    assert render_value(list(range(20))).endswith("and 8 more")
    assert render_value({"A": {0: "1", 1: "0"}}) == "A: 1 on ranks [0]; 0 on ranks [1]"


@pytest.mark.parametrize("template", ["a {b", "a } b", "{not a path!}", "{}"])
def test_a_malformed_placeholder_is_refused(template: str) -> None:
    with pytest.raises(ValueError):
        template_paths(template, "message")


def test_a_fired_rule_makes_a_finding_with_verdict_evidence_remediation_and_subject(tmp_path: Path) -> None:
    write(tmp_path / "r.yaml", GOOD.replace('evidence: [env.NCCL_IB_DISABLE]',
                                            'evidence: [env.NCCL_IB_DISABLE, env.NCCL_NET]\n'
                                            '    subject: {hosts: trace.hosts, ranks: ranks.host}'))
    facts = {"env": {"NCCL_IB_DISABLE": "1"}, "trace": {"host_count": 2, "hosts": ["a", "b"]},
             "ranks": {"host": {0: "a", 1: "b"}}}
    report = run_rules(facts, site_dir=tmp_path, include_defaults=False)
    [f] = report.findings
    assert f.id == "rule:ib-off" and f.kind == Kind.RULE and f.severity == Severity.WARNING
    assert f.verdict == "IB is off on 2 hosts" and f.remediation == "unset it"
    assert f.evidence == ["env.NCCL_IB_DISABLE = 1", "env.NCCL_NET: not known"]
    assert f.subject.hosts == ("a", "b") and f.subject.ranks == (0, 1)
    assert f.data["rule"] == "ib-off" and f.data["facts"] == {"env.NCCL_IB_DISABLE": "1"}
    assert f.data["source"].endswith("r.yaml")
    json.dumps(f.to_dict())  # findings.json can hold it


# -- strict parsing: errors name the file, the rule and the field ------------------------------------

@pytest.mark.parametrize("text, rule_id, field, words", [
    (one_rule({"fact": "a", "eq": 1}, colour="red"), "r1", "colour", "unknown key"),
    (one_rule({"fact": "a", "eqq": 1}), "r1", "when.eqq", "unknown operator"),
    (one_rule({"all": [{"fact": "a", "eq": 1}, {"fact": "b", "gtt": 2}]}), "r1", "when.all[1].gtt",
     "unknown operator"),
    (one_rule({"any": []}), "r1", "when.any", "non-empty list"),
    (one_rule({"not": {"fact": "a"}}), "r1", "when.not", "no operator"),
    (one_rule({"all": [{"fact": "a", "eq": 1}], "fact": "b"}), "r1", "when.fact", "must stand alone"),
    (one_rule({"colour": "a"}), "r1", "when.colour", "unknown key"),
    (one_rule({"fact": "a b", "eq": 1}), "r1", "when.fact", "fact path"),
    (one_rule({"fact": "a", "eq": [1]}), "r1", "when.eq", "expected a string"),
    (one_rule({"fact": "a", "lt": True}), "r1", "when.lt", "expected a number"),
    (one_rule({"fact": "a", "in": "x"}), "r1", "when.in", "list"),
    (one_rule({"fact": "a", "exists": "yes"}), "r1", "when.exists", "true or false"),
    (one_rule({"fact": "a", "matches": "(unclosed"}), "r1", "when.matches", "bad regular expression"),
    (one_rule({"fact": "a", "matches": "^(?!WARN$)"}), "r1", "when.matches", "no look-around"),
    (one_rule({"fact": "a", "matches": "x" * 201}), "r1", "when.matches", "limit is 200"),
    (one_rule({"fact": "a", "differs_across": "planets"}), "r1", "when.differs_across", "ranks, hosts"),
    (one_rule({"fact": "a", "gt_fact": 3}), "r1", "when.gt_fact", "fact path"),
    (one_rule({"fact": "a", "eq": 1}, severity="fatal"), "r1", "severity", "unknown severity"),
    (one_rule({"fact": "a", "eq": 1}, message="{a"), "r1", "message", "unbalanced"),
    (one_rule({"fact": "a", "eq": 1}, evidence="a.b"), "r1", "evidence", "list of fact paths"),
    (one_rule({"fact": "a", "eq": 1}, evidence=["ok", "not ok"]), "r1", "evidence[1]", "fact path"),
    (one_rule({"fact": "a", "eq": 1}, subject={"gpu": "a"}), "r1", "subject.gpu", "unknown key"),
    (one_rule({"fact": "a", "eq": 1}, enabled="no"), "r1", "enabled", "true or false"),
    (one_rule({"fact": "a", "eq": 1}, id="Bad Id"), "Bad Id", "id", "lower-case"),
    (json.dumps({"rules": [{"id": "r1", "title": "t", "severity": "info", "message": "m"}]}), "r1", "when",
     "missing"),
    (json.dumps({"rules": [{"title": "t"}]}), "#1", "id", "missing"),
])
def test_a_bad_rule_is_reported_with_file_rule_id_and_field(text: str, rule_id: str, field: str,
                                                            words: str) -> None:
    [p] = problems_of(text)
    assert (p.file, p.rule_id, p.field) == ("site.yaml", rule_id, field)
    assert words in p.message
    assert str(p).startswith(f"site.yaml: rule {rule_id!r}: field {field!r}: ")


def test_deeply_nested_or_huge_conditions_are_refused() -> None:
    cond: dict = {"fact": "a", "eq": 1}
    for _ in range(20):
        cond = {"not": cond}
    [p] = problems_of(one_rule(cond))
    assert "deeper than" in p.message
    [p] = problems_of(one_rule({"any": [{"fact": "a", "eq": i} for i in range(300)]}))
    assert "more than" in p.message


@pytest.mark.parametrize("text, field, words", [
    ("rules: [\n  {id: a, title: t\n", None, "not valid YAML (line"),
    ("rules:\n  - id: a\n    id: b\n", None, "duplicate key 'id'"),
    ("ruless: []\n", "ruless", "unknown top-level key"),
    ("rules: {}\n", "rules", "expected a list"),
    ("version: 2\nrules: []\n", "version", "unsupported"),
    ("42\n", None, "expected a list of rules"),
])
def test_a_broken_file_is_one_problem_naming_the_file(text: str, field: str | None, words: str) -> None:
    [p] = problems_of(text)
    assert p.file == "site.yaml" and p.rule_id is None and p.field == field and words in p.message


def test_file_shapes_list_single_mapping_and_empty() -> None:
    rule = {"id": "a", "title": "t", "severity": "info", "when": {"fact": "x", "exists": True}, "message": "m"}
    assert [r.id for r in parse_rules_text(json.dumps([rule, {**rule, "id": "b"}]), "f").rules] == ["a", "b"]
    assert [r.id for r in parse_rules_text(json.dumps(rule), "f").rules] == ["a"]
    assert parse_rules_text("# nothing yet\n", "f").rules == []
    dup = parse_rules_text(json.dumps([rule, rule]), "f")
    assert [r.id for r in dup.rules] == ["a"] and dup.problems[0].field == "id"


def test_one_bad_rule_does_not_drop_the_good_rules_of_its_file() -> None:
    good = {"id": "good", "title": "t", "severity": "info", "when": {"fact": "x", "exists": True}, "message": "m"}
    bad = {**good, "id": "bad", "when": {"fact": "x", "gtt": 1}}
    parsed = parse_rules_text(json.dumps({"rules": [bad, good]}), "f")
    assert [r.id for r in parsed.rules] == ["good"] and [p.rule_id for p in parsed.problems] == ["bad"]


# -- loading: layers, site directory, broken files --------------------------------------------------

def test_a_broken_file_next_to_a_good_one_is_a_rule_error_and_the_good_rule_still_fires(tmp_path: Path) -> None:
    write(tmp_path / "a-good.yaml", GOOD)
    write(tmp_path / "b-broken.yaml", "rules:\n  - id: x\n    title: [unclosed\n")
    write(tmp_path / "c-badrule.yml", one_rule({"fact": "env.NCCL_IB_DISABLE", "eq": "1"}, severity="loud"))
    write(tmp_path / "notes.txt", "not a rule file")
    report = run_rules({"env": {"NCCL_IB_DISABLE": "1"}, "trace": {"host_count": 3}}, site_dir=tmp_path,
                       include_defaults=False)
    assert report.fired() == ["ib-off"]
    errors = [f for f in report.findings if f.kind == Kind.RULE_ERROR]
    assert len(errors) == 2 and all(f.severity == Severity.WARNING for f in errors)
    broken, badrule = sorted(errors, key=lambda f: f.id)
    assert broken.id == "rule-error:b-broken.yaml:-:-" and "not valid YAML" in broken.verdict
    assert badrule.id == "rule-error:c-badrule.yml:r1:severity"
    assert "c-badrule.yml: rule 'r1': field 'severity'" in badrule.verdict and badrule.data["field"] == "severity"


def test_the_site_directory_comes_from_the_environment_and_overrides_defaults_by_id(tmp_path: Path) -> None:
    site = tmp_path / "site"
    write(site / "override.yaml", """
rules:
  - id: nccl-p2p-disabled
    title: P2P off is fine here
    severity: info
    when: {fact: env.NCCL_P2P_DISABLE, eq: "1"}
    message: "P2P disabled (site policy)"
  - id: torch-version-skew
    title: skew is allowed here
    severity: error
    enabled: false
    when: {fact: ranks.torch, differs_across: ranks}
    message: m
""")
    facts = build_facts(process={0: {"torch": "2.3"}, 1: {"torch": "2.4"}}, env={"NCCL_P2P_DISABLE": "1"})
    report = run_rules(facts, environ={RULES_DIR_ENV: str(site)})
    assert report.problems == []
    p2p = next(f for f in report.findings if f.id == "rule:nccl-p2p-disabled")
    assert p2p.severity == Severity.INFO and p2p.verdict == "P2P disabled (site policy)"
    assert "torch-version-skew" not in report.fired()
    assert any(r.status == "disabled" and r.rule.id == "torch-version-skew" for r in report.results)
    assert any(line.startswith("override nccl-p2p-disabled") for line in report.debug_lines())
    without = run_rules(facts, environ={})
    assert "torch-version-skew" in without.fired()


def test_a_missing_site_directory_and_duplicate_ids_across_files_are_problems(tmp_path: Path) -> None:
    write(tmp_path / "one.yaml", GOOD)
    write(tmp_path / "two.yaml", GOOD)
    rules = load_rules(site_dir=[tmp_path, tmp_path / "absent"], include_defaults=False)
    assert [r.id for r in rules.rules] == ["ib-off"]
    messages = [str(p) for p in rules.problems]
    assert any("two.yaml: rule 'ib-off': field 'id': already defined in" in m for m in messages)
    assert any("absent: rules directory or file not found" in m for m in messages)


def test_unreadable_files_are_problems_not_exceptions(tmp_path: Path) -> None:
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00rules")
    (tmp_path / "big.yaml").write_text("#" * (1 << 20 + 1))
    rules = load_rules(site_dir=tmp_path, include_defaults=False)
    assert rules.rules == [] and {p.file.rsplit("/", 1)[-1] for p in rules.problems} == {"bin.yaml", "big.yaml"}


def test_a_rule_that_fails_while_evaluating_is_an_error_and_the_others_still_fire(tmp_path: Path) -> None:
    class Exploding(dict):
        def __contains__(self, key: object) -> bool:
            raise RuntimeError("odd facts")

    write(tmp_path / "r.yaml", GOOD + """
  - id: boom
    title: t
    severity: error
    when: {fact: odd.x, exists: true}
    message: m
""")
    ruleset = load_rules(site_dir=tmp_path, include_defaults=False)
    facts = {"env": {"NCCL_IB_DISABLE": "1"}, "trace": {"host_count": 2}, "odd": Exploding()}
    assert evaluate_rule(ruleset.get("boom"), facts).status == "error"
    report = evaluate_rules(ruleset, facts)
    assert report.fired() == ["ib-off"]
    assert any(f.id == "rule-error:r.yaml:boom:when" for f in report.findings)


# -- shipped defaults ------------------------------------------------------------------------------

def test_the_shipped_rules_all_parse_and_are_documented() -> None:
    rules = load_rules(environ={})
    assert rules.problems == []
    assert 10 <= len(rules.rules) <= 15
    assert all(Path(f).parent == default_rules_dir() for f in rules.files)
    docs = (Path(__file__).resolve().parents[1] / "docs" / "rules.md").read_text()
    known_roots = {"findings", "layout", "trace", "env", "env_differs", "env_differs_count", "ranks", "preflight",
                   "nvml", "sources"}
    for rule in rules.rules:
        assert rule.remediation and rule.evidence, rule.id
        assert f"`{rule.id}`" in docs, f"{rule.id} is not listed in docs/rules.md"
        for path in rule.when.paths() + list(rule.evidence) + template_paths(rule.message, "m"):
            assert FACT_PATH_RE.match(path) and path.split(".")[0] in known_roots, (rule.id, path)


def fired(facts: dict) -> dict[str, Finding]:
    report = run_rules(facts, environ={})
    assert report.problems == []
    return {f.data["rule"]: f for f in report.findings}


HANG = {"id": "compute-hang:rank-5", "kind": "compute-hang", "severity": "critical", "verdict": "rank 5 stopped",
        "subject": {"rank": 5, "host": "n3"}}
HOSTS8 = {r: f"n{r // 2 + 1}" for r in range(8)}


def test_default_layout_rules_fire_on_a_layout_that_does_not_fit() -> None:
    got = fired(build_facts(world_size=8, layout={"tp": 2, "pp": 2, "dp": 3, "microbatches": 4},
                            batch={"global_batch": 100, "micro_batch": 4}))
    assert got["layout-world-size-mismatch"].verdict == \
        "The layout's TP x PP x DP = 2 x 2 x 3 = 12 does not equal the job's world size 8."
    assert got["batch-not-divisible"].severity == Severity.ERROR
    assert "100 is not a multiple of micro batch x DP = 4 x 3 = 12" in got["batch-not-divisible"].verdict
    ok = fired(build_facts(world_size=8, layout=Layout(world_size=8, tp=2, pp=2, dp=2, microbatches=4),
                           batch={"global_batch": 64, "micro_batch": 4}))
    assert "layout-world-size-mismatch" not in ok and "batch-not-divisible" not in ok
    assert "implied_microbatches = 8" in ok["microbatches-disagree-with-batch"].evidence[1]


def test_default_nccl_rules_fire_on_a_multi_node_job_with_ib_and_p2p_disabled() -> None:
    env = {"NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "=eth0"}
    got = fired(build_facts(hosts=HOSTS8, env=env, findings=[]))
    assert {"nccl-ib-disabled-multinode", "nccl-p2p-disabled"} <= set(got)
    assert "spanning 4 hosts" in got["nccl-ib-disabled-multinode"].verdict
    single = fired(build_facts(hosts={0: "a", 1: "a"}, env=env))
    assert "nccl-ib-disabled-multinode" not in single and "nccl-p2p-disabled" in single


def test_default_hang_rules_recommend_nccl_debug_only_for_nccl_jobs_with_captured_env() -> None:
    nccl = {r: {"backend": "nccl", "torch": "2.5.0"} for r in range(8)}
    got = fired(build_facts(findings=[HANG], hosts=HOSTS8, process=nccl, env={"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}))
    assert {"nccl-debug-unset-on-hang", "nccl-socket-ifname-unset-multinode-hang",
            "torch-flight-recorder-off-on-hang", "hang-on-one-host"} <= set(got)
    assert "NCCL_DEBUG=WARN" in got["nccl-debug-unset-on-hang"].remediation
    one = got["hang-on-one-host"]
    assert one.subject.hosts == ("n3",) and one.subject.ranks == (5,)
    assert one.verdict == "Every root cause of the hang is on host n3 (the job ran on 4 hosts)."
    gloo = fired(build_facts(findings=[HANG], hosts=HOSTS8, env={},
                             process={r: {"backend": "gloo"} for r in range(8)}))
    assert "nccl-debug-unset-on-hang" not in gloo and "torch-flight-recorder-off-on-hang" not in gloo
    no_env = fired(build_facts(findings=[HANG], hosts=HOSTS8, process=nccl))
    assert "nccl-debug-unset-on-hang" not in no_env  # no captured environment: nothing to say about it


def test_a_hang_spanning_hosts_points_at_what_they_share() -> None:
    comm = {"id": "comm-hang:g", "kind": "comm-hang", "severity": "critical", "verdict": "v",
            "subject": {"ranks": [1, 2, 3]}}
    got = fired(build_facts(findings=[comm], hosts=HOSTS8))
    assert "hang-on-one-host" not in got
    assert got["hang-across-hosts"].verdict == "The hang's root causes involve 2 hosts: n1, n2."


def test_default_skew_and_torch_rules_fire() -> None:
    process = {r: {"torch": "2.3.0" if r < 6 else "2.4.0", "backend": "nccl"} for r in range(8)}
    rank_env = {r: {"NCCL_P2P_DISABLE": "1" if r else "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
                    "NCCL_BLOCKING_WAIT": "1", "RANK": str(r)} for r in range(8)}
    got = fired(build_facts(process=process, rank_env=rank_env, hosts=HOSTS8))
    assert got["torch-version-skew"].verdict == \
        "Ranks run different PyTorch versions: 2.3.0 on ranks [0, 1, 2, 3, 4, 5]; 2.4.0 on ranks [6, 7]."
    assert got["comm-env-differs-across-ranks"].verdict == \
        "Communication settings differ across ranks: NCCL_P2P_DISABLE: 1 on ranks [1, 2, 3, 4, 5, 6, 7]; " \
        "0 on ranks [0]."
    assert "nccl-p2p-disabled" in got  # the job value is what most ranks had
    assert {"torch-async-error-handling-off", "torch-blocking-wait"} <= set(got)
    assert "backend-skew" not in got


def test_a_healthy_fact_set_fires_nothing_above_info() -> None:
    healthy = {"id": "healthy", "kind": "healthy", "severity": "info", "verdict": "ok", "subject": {}}
    facts = build_facts(findings=[healthy], world_size=8, layout=Layout(world_size=8, tp=2, pp=2, dp=2),
                        hosts=HOSTS8, process={r: {"torch": "2.5.0", "backend": "nccl"} for r in range(8)},
                        env={"NCCL_DEBUG": "WARN"})
    assert [f.id for f in run_rules(facts, environ={}).findings] == []


# -- facts -----------------------------------------------------------------------------------------

def test_build_facts_from_plain_values() -> None:
    finding = Finding(id="compute-hang:rank-3", severity=Severity.CRITICAL, kind=Kind.COMPUTE_HANG,
                      subject=Subject(rank=3), verdict="rank 3 stopped")
    earlier_rule = {"id": "rule:x", "kind": "rule", "severity": "error", "verdict": "v", "subject": {}}
    facts = build_facts(findings=[finding, earlier_rule], world_size=4, hosts={0: "a", 1: "a", 2: "b", 3: "b"},
                        layout=Layout(world_size=4, tp=2, pp=2, dp=1), missing_ranks=[3], job_id="42",
                        problems=["missing-ranks"])
    f = facts["findings"]
    assert f["count"] == 1 and f["kinds"] == ["compute-hang"] and f["by_severity"]["critical"] == 1
    assert f["hang"] is True and f["hang_ranks"] == [3] and f["hang_hosts"] == ["b"] and f["worst"] == "critical"
    assert f["first"]["verdict"] == "rank 3 stopped"
    assert facts["layout"] == {"tp": 2, "pp": 2, "dp": 1, "microbatches": 1, "schedule": "1f1b",
                               "order": "tp-dp-pp", "layout_world_size": 4, "world_size": 4, "product": 4,
                               "world_matches": True}
    assert facts["trace"]["multi_node"] is True and facts["trace"]["missing_ranks"] == [3]
    assert facts["trace"]["problem_codes"] == ["missing-ranks"]
    assert facts["sources"] == {"env": False, "process": False, "layout": True, "batch": False, "hosts": True,
                                "preflight": False, "nvml": False}
    assert facts["env"] == {} and facts["preflight"] == {} and facts["nvml"] == {}
    json.dumps(facts)


def test_env_facts_keep_runtime_settings_and_drop_credentials() -> None:
    env = {"NCCL_DEBUG": "INFO", "TORCH_NCCL_BLOCKING_WAIT": 1, "HF_TOKEN": "x", "NCCL_IB_SECRET_KEY": "x",
           "AWS_SECRET_ACCESS_KEY": "x", "HOME": "/home/u", "MASTER_ADDR": "n1", "PATH": "/bin"}
    assert filter_env(env) == {"NCCL_DEBUG": "INFO", "TORCH_NCCL_BLOCKING_WAIT": "1", "MASTER_ADDR": "n1"}


def test_env_from_ranks_takes_the_majority_and_lists_differences() -> None:
    rank_env = {0: {"NCCL_DEBUG": "INFO"}, 1: {"NCCL_DEBUG": "WARN", "NCCL_ALGO": "Ring"}, 2: {"NCCL_DEBUG": "WARN"}}
    facts = build_facts(rank_env=rank_env)
    assert facts["env"] == {"NCCL_DEBUG": "WARN"}  # NCCL_ALGO: set on one rank of three, unset on most
    assert facts["env_differs"] == {"NCCL_ALGO": {0: "(unset)", 1: "Ring", 2: "(unset)"},
                                    "NCCL_DEBUG": {0: "INFO", 1: "WARN", 2: "WARN"}}
    assert facts["ranks"]["env"]["NCCL_DEBUG"] == {0: "INFO", 1: "WARN", 2: "WARN"}


def test_facts_from_meta_entries() -> None:
    meta = {0: [{"kind": "process", "t_mono_ns": 1, "host": "a", "torch": "2.5", "backend": "nccl",
                 "argv": ["train.py", "--lr", "1"]},
                {"kind": "group", "gid": 1}, {"kind": "env", "vars": {"NCCL_DEBUG": "INFO"}}],
            "1": [{"kind": "process", "host": "b"}], "junk": [{"kind": "process"}], 2: ["not a dict"]}
    process, env = facts_from_meta(meta)
    assert process == {0: {"host": "a", "torch": "2.5", "backend": "nccl", "argv": ["train.py", "--lr", "1"]},
                       1: {"host": "b"}}
    assert env == {0: {"NCCL_DEBUG": "INFO"}}
    facts = build_facts(process=process, rank_env=env)
    assert facts["ranks"]["argv"] == {0: "train.py --lr 1"} and facts["trace"]["uses_nccl"] is True


# -- the engine stage --------------------------------------------------------------------------------

def test_the_rules_stage_runs_after_the_hang_stage_on_a_real_trace(tmp_path: Path) -> None:
    b = TraceBuilder(world=4, hosts={0: "h0", 1: "h0", 2: "h1", 3: "h1"})
    tp01, tp23 = b.group("tp", [0, 1]), b.group("tp", [2, 3])
    b.healthy_steps([tp01, tp23, b.world_group], steps=5)
    b.collective(b.world_group, at=1500.0, skip=(3,), stuck=(0, 1, 2))
    b.write(tmp_path / "trace", layout=Layout(world_size=4, tp=2, pp=1, dp=2))
    rings = tmp_path / "trace" / "rings"
    for rank in range(4):  # what a newer tracer would record: versions and the environment
        with open(rings / f"rank-{rank:05d}.meta.jsonl", "a") as fh:
            fh.write(json.dumps({"kind": "process", "rank": rank, "host": "h0" if rank < 2 else "h1",
                                 "torch": "2.5.0" if rank != 2 else "2.4.1", "backend": "nccl"}) + "\n")
            fh.write(json.dumps({"kind": "env", "vars": {"NCCL_IB_DISABLE": "1", "HF_TOKEN": "secret"}}) + "\n")
    site = write(tmp_path / "site" / "broken.yaml", "rules: [")
    def given_layout(ctx) -> list:  # a stage may hand the rules a layout the loader rejected
        ctx.results["layout"] = {"world_size": 8, "tp": 2, "pp": 2, "dp": 2}
        return []

    stages = STAGES + [("given", given_layout), ("rules", make_rules_stage(site_dir=site.parent))]
    result = analyze(tmp_path / "trace", stages=stages)
    ids = {f.id for f in result.findings}
    assert {"rule:torch-version-skew", "rule:nccl-ib-disabled-multinode", "rule:hang-on-one-host",
            "rule:layout-world-size-mismatch"} <= ids
    assert "rule-error:broken.yaml:-:-" in ids
    assert result.findings[0].kind == Kind.COMPUTE_HANG  # rules never outrank the verdict they explain
    facts = result.results["facts"]
    assert facts["findings"]["hang_hosts"] == ["h1"] and facts["env"] == {"NCCL_IB_DISABLE": "1"}
    assert "secret" not in json.dumps(result.document(), default=str)
    assert result.results["rules"].summary()["fired"]


def test_the_default_rules_stage_is_quiet_on_a_healthy_trace(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(RULES_DIR_ENV, raising=False)
    b = TraceBuilder(world=2)
    b.healthy_steps([b.world_group], steps=3)
    b.write(tmp_path)
    from megatrace.analyze.rules import rules_stage
    result = analyze(tmp_path, stages=STAGES + [("rules", rules_stage)])
    assert not [f for f in result.findings if f.kind in (Kind.RULE, Kind.RULE_ERROR)]
    assert isinstance(result.results["rules"].results, list)


def test_a_context_without_readable_facts_still_runs_the_rules() -> None:
    class Ctx:
        trace = None  # facts_from_context fails on this
        findings = [Finding(id="h", severity=Severity.CRITICAL, kind=Kind.COMPUTE_HANG, subject=Subject(rank=1),
                            verdict="v")]
        results: dict = {}

    found = make_rules_stage(site_dir=[])(Ctx())
    assert [f.id for f in found] == ["rule-error:<facts>:-:-"]
    assert Ctx.results["facts"]["findings"]["hang"] is True


def test_ruleset_is_plain_data() -> None:
    assert RuleSet().rules == [] and RuleSet().get("x") is None


def test_the_example_site_file_and_the_docs_examples_parse() -> None:
    root = Path(__file__).resolve().parents[1]
    rules = load_rules(site_dir=root / "configs" / "rules", include_defaults=False)
    assert rules.problems == [] and rules.rules and not any(r.enabled for r in rules.rules)
    docs = (root / "docs" / "rules.md").read_text()
    blocks = [b.split("```", 1)[0] for b in docs.split("```yaml\n")[1:]]
    files = [b for b in blocks if "\nrules:" in "\n" + b]
    assert len(files) == 2
    for block in files:
        parsed = parse_rules_text(block, "docs/rules.md")
        assert parsed.problems == [] and parsed.rules
    [examples] = [b for b in blocks if b.startswith("# world size")]
    conditions = ["\n".join(ln for ln in part.splitlines() if not ln.startswith("#"))
                  for part in ("\n" + examples).split("\nwhen:")[1:]]
    assert len(conditions) == 6
    for text in conditions:
        compile_condition(yaml.safe_load(text))


@pytest.mark.parametrize("pattern", [r"^((a+))+$", r"(a+)+$", r"^(\w*x)*y$", r"^(a|aa)+$"])
def test_a_regex_that_backtracks_exponentially_in_python_matches_in_linear_time(pattern) -> None:
    """Issue 20, item 18: '^((a+))+$' passed the nested-quantifier guard and doubled its time per character.
    Run in a child with a timeout: with a backtracking engine it would never return."""
    import subprocess
    import sys

    assert not problems_of(one_rule({"fact": "env.X", "matches": pattern}))  # accepted: RE2 makes it harmless
    code = ("import time\nfrom megatrace.analyze.rules_eval import MAX_MATCH_TEXT, evaluate\n"
            "from megatrace.analyze.rules_parse import compile_condition\n"
            f"cond = compile_condition({{'fact': 'env.X', 'matches': {pattern!r}}})\n"
            "text = 'a' * (MAX_MATCH_TEXT - 1) + '!'  # a long run the pattern almost matches\n"
            "t = time.perf_counter()\nfired = evaluate(cond, {'env': {'X': text}}, [])\n"
            "print(fired, time.perf_counter() - t)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    fired, seconds = done.stdout.split()
    assert fired == "False" and float(seconds) < 0.5, done.stderr
