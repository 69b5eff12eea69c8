"""The fact dictionary the rules engine reads: plain nested dicts built from what analysis has.

:func:`build_facts` takes plain values (findings, layout, hosts, process
facts, environment) so it is testable without a trace;
:func:`facts_from_context` gathers those values from an analysis context.
The top-level keys, documented in docs/rules.md:

``findings``   kinds, severities and subjects of the findings of earlier stages
``layout``     world_size, tp, pp, dp, microbatches, product, world_matches, batch sizes
``trace``      world size, hosts, host_count, multi_node, missing ranks
``env``        the job's NCCL_*, TORCH_* and other launcher/runtime settings, when captured
``env_differs`` {NAME: {rank: value}} for communication settings whose values differ across ranks
``ranks``      per-rank maps {rank: value}: host, torch, backend, local_rank, ..., and env.<NAME>
``preflight``, ``nvml``  results of node checks (empty until those stages feed them)
``sources``    which of the above were actually available (true/false)

A value that is not known is absent (never None), so a rule's comparison on it
is false rather than wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from megatrace.analyze.context import AnalysisContext
from megatrace.analyze.findings import Finding, order_findings
from megatrace.redact import redact_argv
from megatrace.trace.environment import filter_env

# Finding kinds that mean the job is stopped (a root cause of a hang).
HANG_KINDS = ("compute-hang", "comm-hang", "crashed-process", "exited-early", "deadlock", "no-trace", "startup-hang")
# Finding kinds produced by the rules engine itself; not facts for rules.
RULE_KINDS = ("rule", "rule-error")
from megatrace.names import SEVERITIES  # noqa: E402  (one home: megatrace/names.py)
MAX_FINDING_ITEMS = 50  # findings listed one by one under findings.items

# Settings every rank of one job should share; env_differs lists those that do not (launcher variables such as
# RANK or SLURM_PROCID differ by design and are left out).
CONSISTENT_PREFIXES = ("NCCL_", "TORCH_", "PYTORCH_", "GLOO_", "UCX_", "FI_")

# Fields of the tracer's meta "process" line kept per rank (ranks.<field>).
PROCESS_FIELDS = ("host", "torch", "backend", "local_rank", "world_size", "pid", "argv", "nccl", "cuda", "driver")


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def _finding_dict(f: Finding | Mapping[str, Any]) -> dict[str, Any]:
    """A finding as the plain dict of findings.json (Finding objects or already-plain dicts)."""
    if isinstance(f, Finding):
        return f.to_dict()
    return dict(f) if isinstance(f, Mapping) else {}


def _findings_facts(findings: Iterable[Finding | Mapping[str, Any]], host_of: Mapping[int, str]) -> dict[str, Any]:
    given = list(findings)
    objects = [f for f in given if isinstance(f, Finding)]
    if len(objects) == len(given):
        given = order_findings(objects)  # most important first, like findings.json
    items = [d for d in (_finding_dict(f) for f in given) if str(d.get("kind", "")) not in RULE_KINDS]
    by_kind: dict[str, int] = {}
    by_severity = dict.fromkeys(SEVERITIES, 0)
    ranks: set[int] = set()
    hosts: set[str] = set()
    hang_ranks: set[int] = set()
    hang_hosts: set[str] = set()
    listed = []
    for d in items:
        kind, sev = str(d.get("kind", "")), str(d.get("severity", ""))
        by_kind[kind] = by_kind.get(kind, 0) + 1
        if sev in by_severity:
            by_severity[sev] += 1
        subject = d.get("subject") or {}
        f_ranks = {r for r in (_int(x) for x in [subject.get("rank"), *(subject.get("ranks") or [])]) if r is not None}
        f_hosts = {str(h) for h in [subject.get("host"), *(subject.get("hosts") or [])] if h}
        f_hosts |= {host_of[r] for r in f_ranks if r in host_of}
        ranks |= f_ranks
        hosts |= f_hosts
        if kind in HANG_KINDS:
            hang_ranks |= f_ranks
            hang_hosts |= f_hosts
        if len(listed) < MAX_FINDING_ITEMS:
            listed.append({"id": d.get("id"), "kind": kind, "severity": sev, "verdict": d.get("verdict"),
                           "ranks": sorted(f_ranks), "hosts": sorted(f_hosts)})
    out: dict[str, Any] = {
        "count": len(items), "kinds": sorted(by_kind), "severities": [s for s in SEVERITIES if by_severity[s]],
        "by_kind": by_kind, "by_severity": by_severity, "ranks": sorted(ranks), "hosts": sorted(hosts),
        "hang": any(k in HANG_KINDS for k in by_kind), "hang_kinds": [k for k in HANG_KINDS if k in by_kind],
        "hang_ranks": sorted(hang_ranks), "hang_hosts": sorted(hang_hosts), "hang_host_count": len(hang_hosts),
        "items": listed,
    }
    if listed:
        out["first"] = listed[0]
        out["worst"] = next(s for s in SEVERITIES if by_severity[s]) if any(by_severity.values()) else None
    return {k: v for k, v in out.items() if v is not None}


def _layout_facts(layout: Any, world_size: int | None, batch: Mapping[str, Any] | None) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    if layout is not None:
        for key in ("world_size", "tp", "pp", "dp", "microbatches", "schedule", "order"):
            value = layout.get(key) if isinstance(layout, Mapping) else getattr(layout, key, None)
            if value is not None:
                raw[key] = value
    out: dict[str, Any] = {}
    for key in ("tp", "pp", "dp", "microbatches"):
        value = _int(raw.get(key))
        if value is not None and value > 0:
            out[key] = value
    for key in ("schedule", "order"):
        if isinstance(raw.get(key), str):
            out[key] = raw[key]
    layout_world = _int(raw.get("world_size"))
    if layout_world is not None:
        out["layout_world_size"] = layout_world
    world = world_size if world_size is not None else layout_world
    if world is not None:
        out["world_size"] = world
    if all(k in out for k in ("tp", "pp", "dp")):
        out["product"] = out["tp"] * out["pp"] * out["dp"]
        if world is not None:
            out["world_matches"] = out["product"] == world
    batch = batch or {}
    gb = _int(batch.get("global_batch", batch.get("global_batch_size")))
    mb = _int(batch.get("micro_batch", batch.get("micro_batch_size")))
    if gb is not None and gb > 0:
        out["global_batch"] = gb
    if mb is not None and mb > 0:
        out["micro_batch"] = mb
    if "global_batch" in out and "micro_batch" in out and "dp" in out:
        per_step = out["micro_batch"] * out["dp"]
        out["batch_per_microbatch_step"] = per_step
        out["batch_divisible"] = out["global_batch"] % per_step == 0
        if out["batch_divisible"]:
            out["implied_microbatches"] = out["global_batch"] // per_step
    return out


def _per_rank(process: Mapping[int, Mapping[str, Any]] | None, hosts: Mapping[int, str]) -> dict[str, Any]:
    out: dict[str, dict[int, Any]] = {}
    redacted: dict[tuple, str] = {}
    for rank, facts in (process or {}).items():
        r = _int(rank)
        if r is None or not isinstance(facts, Mapping):
            continue
        for key in PROCESS_FIELDS:
            value = facts.get(key)
            if value is None or value == "":
                continue
            if key == "argv" and isinstance(value, list):
                value = _argv_line(value, redacted)
            if isinstance(value, (dict, list)):
                continue
            out.setdefault(key, {})[r] = value
    for rank, host in hosts.items():
        out.setdefault("host", {}).setdefault(rank, host)
    return out


def _argv_line(argv: list, seen: dict[tuple, str]) -> str:
    """``argv`` redacted and joined: no credential from a command line in any output. The ranks of a job share
    one command line, so each distinct one is redacted once (``seen``)."""
    if not all(type(a) is str for a in argv):  # (a hand-written meta file's odd argument)
        return " ".join(redact_argv(argv))
    key = tuple(argv)
    line = seen.get(key)
    if line is None:
        line = seen[key] = " ".join(redact_argv(argv))
    return line


UNSET = "(unset)"  # how env_differs shows a rank that recorded its environment without the variable


def _env_facts(env: Mapping[str, Any] | None, rank_env: Mapping[int, Mapping[str, Any]] | None
               ) -> tuple[dict[str, str], dict[str, dict[int, str]], dict[str, dict[int, str]]]:
    """(job env, per-rank env maps, per-rank maps of the consistent settings whose values differ).

    Without an explicit job ``env``, each variable's job value is the one most ranks recorded
    (ties: the lowest rank's; ranks without it vote "unset"), so ``env.X`` reflects the job even
    when a few ranks differ; ``env_differs`` names those.
    """
    per_rank: dict[str, dict[int, str]] = {}
    captured: list[int] = []
    for rank, values in (rank_env or {}).items():
        r = _int(rank)
        if r is None or not isinstance(values, Mapping):
            continue
        captured.append(r)
        for name, value in filter_env(values).items():
            per_rank.setdefault(name, {})[r] = value
    captured.sort()
    differs: dict[str, dict[int, str]] = {}
    for name in sorted(per_rank):
        by_rank = per_rank[name]
        if name.startswith(CONSISTENT_PREFIXES) and (len(set(by_rank.values())) > 1 or len(by_rank) < len(captured)):
            differs[name] = {r: by_rank.get(r, UNSET) for r in captured}
    if env is not None:
        return filter_env(env), per_rank, differs
    job: dict[str, str] = {}
    for name, by_rank in per_rank.items():
        counts: dict[str, list[int]] = {}
        for r in captured:
            counts.setdefault(by_rank.get(r, UNSET), []).append(r)
        value = max(counts.items(), key=lambda kv: (len(kv[1]), -kv[1][0]))[0]
        if value != UNSET:
            job[name] = value
    return job, per_rank, differs


def build_facts(*, findings: Iterable[Finding | Mapping[str, Any]] = (), world_size: int | None = None,
                layout: Any = None, hosts: Mapping[int, str] | None = None,
                process: Mapping[int, Mapping[str, Any]] | None = None, env: Mapping[str, Any] | None = None,
                rank_env: Mapping[int, Mapping[str, Any]] | None = None, batch: Mapping[str, Any] | None = None,
                missing_ranks: Iterable[int] = (), job_id: str | None = None, problems: Iterable[Any] = (),
                preflight: Mapping[str, Any] | None = None, nvml: Mapping[str, Any] | None = None
                ) -> dict[str, Any]:
    """The fact dictionary, from plain values.

    ``findings``: Finding objects or findings.json dicts from earlier stages. ``layout``: a
    :class:`megatrace.config.Layout` or a mapping with tp/pp/dp/... (not validated: a layout that
    does not fit is exactly what rules look for). ``hosts``: rank -> host. ``process``: rank -> the
    tracer's meta "process" fields (host, torch, backend, ...). ``env``: the job's environment, when
    one set is known for all ranks; ``rank_env``: rank -> that rank's environment (``env`` then
    defaults to the value most ranks had). ``batch``: {global_batch, micro_batch}. ``problems``: the
    loader's input problems (objects with a ``code``, or code strings).
    """
    host_map: dict[int, str] = {}
    for rank, host in (hosts or {}).items():
        r = _int(rank)
        if r is not None and host:
            host_map[r] = str(host)
    for rank, facts in (process or {}).items():
        r = _int(rank)
        if r is not None and isinstance(facts, Mapping) and facts.get("host") and r not in host_map:
            host_map[r] = str(facts["host"])
    job_env, env_by_rank, differs = _env_facts(env, rank_env)
    ranks = _per_rank(process, host_map)
    if env_by_rank:
        ranks["env"] = env_by_rank
    host_names = sorted(set(host_map.values()))
    missing = sorted({r for r in (_int(x) for x in missing_ranks) if r is not None})
    trace: dict[str, Any] = {"missing_ranks": missing, "missing_count": len(missing)}
    if world_size is not None:
        trace["world_size"] = world_size
    if host_map:
        trace.update(hosts=host_names, host_count=len(host_names), multi_node=len(host_names) > 1,
                     ranks_loaded=len(host_map))
    if job_id:
        trace["job_id"] = job_id
    codes = sorted({str(getattr(p, "code", p)) for p in problems})
    trace["problem_codes"] = codes
    backends = sorted({str(v) for v in ranks.get("backend", {}).values()})
    if backends:
        trace["backends"] = backends
        trace["uses_nccl"] = any("nccl" in b.lower() for b in backends)
    layout_facts = _layout_facts(layout, world_size, batch)
    return {
        "findings": _findings_facts(findings, host_map),
        "layout": layout_facts,
        "trace": trace,
        "env": job_env,
        "env_differs": differs,
        "env_differs_count": len(differs),
        "ranks": ranks,
        "preflight": dict(preflight or {}),
        "nvml": dict(nvml or {}),
        "sources": {"env": env is not None or bool(rank_env), "process": bool(process),
                    "layout": bool(layout_facts.keys() & {"tp", "pp", "dp"}), "batch": "global_batch" in layout_facts,
                    "hosts": bool(host_map), "preflight": bool(preflight), "nvml": bool(nvml)},
    }


# -- from a trace ---------------------------------------------------------------

def facts_from_meta(meta: Mapping[int, Iterable[Mapping[str, Any]]]
                    ) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """(process facts, env) per rank from meta entries: the last ``process`` line, and ``env`` lines.

    An ``env`` line holds its variables under ``vars`` (or ``env``); the tracer may not write one yet. The job
    stage and the rules both ask for the same trace's facts: the last answer is kept for the very same ``meta``
    object (meta entries are read-only once loaded; 16,384 ranks' take 0.1 s).
    """
    if _LAST_META and _LAST_META[0] is meta:
        return _LAST_META[1]
    process: dict[int, dict[str, Any]] = {}
    env: dict[int, dict[str, Any]] = {}
    for key, entries in meta.items():
        rank = _int(key)
        if rank is None:
            continue
        for entry in entries or ():
            if not isinstance(entry, Mapping):
                continue
            if entry.get("kind") == "process":
                process[rank] = {k: v for k, v in entry.items() if k not in ("kind", "t_mono_ns")}
            elif entry.get("kind") == "env":
                values = entry.get("vars", entry.get("env"))
                if isinstance(values, Mapping):
                    env.setdefault(rank, {}).update(values)
    _LAST_META[:] = [meta, (process, env)]
    return process, env


_LAST_META: list[Any] = []  # [meta, facts_from_meta(meta)] of the last call


def facts_from_context(ctx: AnalysisContext, *, env: Mapping[str, Any] | None = None,
                       batch: Mapping[str, Any] | None = None, preflight: Mapping[str, Any] | None = None,
                       nvml: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The facts for an :class:`megatrace.analyze.context.AnalysisContext`.

    Meta entries come from ``ctx.results["meta"]``, else ``ctx.trace.meta`` (rank -> entries, as the loader
    read them: analyzers open no file). ``env``, ``batch``, ``preflight``
    and ``nvml`` default to ``ctx.results`` entries of those names; ``ctx.results["layout"]``, when
    set, replaces the trace's layout (the loader drops a layout that does not fit the world size).
    """
    trace = ctx.trace
    results = getattr(ctx, "results", {}) or {}
    meta = results.get("meta") or trace.meta
    process, rank_env = facts_from_meta(meta)
    hosts = {info.rank: info.host for info in trace.rank_info if info.host}
    layout = results.get("layout") or trace.layout  # a stage may leave the layout as given, even one that did not fit
    return build_facts(findings=list(ctx.findings), world_size=trace.world_size, layout=layout, hosts=hosts,
                       process=process, env=env if env is not None else results.get("env"), rank_env=rank_env,
                       batch=batch if batch is not None else results.get("batch"),
                       missing_ranks=trace.missing_ranks, job_id=trace.job_id or None, problems=trace.problems,
                       preflight=preflight if preflight is not None else results.get("preflight"),
                       nvml=nvml if nvml is not None else results.get("nvml"))
