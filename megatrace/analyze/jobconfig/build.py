"""The job configuration of a loaded trace, and its issues as findings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from megatrace.analyze.facts import facts_from_meta
from megatrace.analyze.findings import Finding, Kind, Severity, Subject
from megatrace.analyze.jobconfig.checks import check, derive
from megatrace.analyze.jobconfig.frameworks import read_trainer
from megatrace.analyze.jobconfig.groups import GroupUse, data_parallel_world, infer_from_groups
from megatrace.analyze.jobconfig.model import FIELDS, JobConfig
from megatrace.analyze.jobconfig.runtime import read_runtime
from megatrace.config import Layout
from megatrace.load.traceset import TraceSet
from megatrace.trace import ring_format as fmt

try:
    from megatrace.analyze._kernels import group_counts  # type: ignore[import-not-found]
except ImportError:  # not built (no C compiler at install): numpy counts by sorting
    group_counts = None

REMEDIATION = {
    "world-size": "Make the parallel sizes multiply to the number of ranks (the launcher's task count), or "
                  "correct the layout that says otherwise.",
    "groups-disagree": "The process groups are what the job really did: check that the layout or arguments "
                       "belong to this run; analysis names groups from the source shown as used.",
    "batch": "Choose a global batch that is a multiple of micro batch x DP (Megatron-LM and DeepSpeed refuse "
             "or silently change sizes that do not divide).",
    "sources-disagree": "Two sources give different values; job.yaml lists both. Fix the one that is stale.",
    "unparseable-config": "Fix or re-capture the trainer's config file; the other sources were used.",
    "version-skew": "Start every rank from the same software stack (container image, driver); NCCL must match "
                    "across the ranks of a communicator.",
    "layout-unknown": "Pass --layout or --tp/--pp/--dp, or trace a trainer whose arguments megatrace reads.",
}


def group_uses(trace: Any) -> list[GroupUse]:
    """The trace's groups with the number of collective and point-to-point records each carried (one pass of C
    when the extension is built, else numpy's sorts)."""
    rec = trace.records
    if group_counts is not None:
        gids = np.array(sorted(trace.groups), np.uint32)
        coll_n, p2p_n = np.zeros(len(gids), np.int64), np.zeros(len(gids), np.int64)
        group_counts(rec.group_id, rec.op, gids, int(fmt.Op.MARK_STEP), int(fmt.Op.SEND), int(fmt.Op.RECV), coll_n,
                     p2p_n)
        at = {gid: k for k, gid in enumerate(gids.tolist())}
        return [GroupUse(tuple(g.ranks), g.desc, int(coll_n[at[gid]]), int(p2p_n[at[gid]]))
                for gid, g in trace.groups.items()]
    keyed = rec.op < int(fmt.Op.MARK_STEP)
    is_p2p = (rec.op == int(fmt.Op.SEND)) | (rec.op == int(fmt.Op.RECV))
    coll = dict(zip(*(a.tolist() for a in np.unique(rec.group_id[keyed & ~is_p2p], return_counts=True)), strict=True))
    p2p = dict(zip(*(a.tolist() for a in np.unique(rec.group_id[keyed & is_p2p], return_counts=True)), strict=True))
    # Groups known only from the records (no meta line) count too: their members are the ranks that used
    # them, and a partial one does not partition the world, so inference ignores it.
    return [GroupUse(tuple(g.ranks), g.desc, coll.get(gid, 0), p2p.get(gid, 0)) for gid, g in trace.groups.items()]


def _job_inputs(meta: Mapping[int, list[dict]], process: Mapping[int, Mapping[str, Any]]
                ) -> tuple[list[str], list[dict]]:
    """The trainer's argv and captured config files (the lowest rank that recorded them)."""
    for rank in sorted(meta):
        for entry in reversed(meta[rank] or []):
            if isinstance(entry, dict) and entry.get("kind") == "job_inputs" and isinstance(entry.get("argv"), list):
                files = entry.get("files") if isinstance(entry.get("files"), list) else []
                return [str(a) for a in entry["argv"]], files
    for rank in sorted(process):  # traces from before job_inputs lines: the process line's argv
        argv = process[rank].get("argv")
        if isinstance(argv, list):
            return [str(a) for a in argv], []
    return [], []


def build_job_config(trace: TraceSet, explicit: tuple[Layout, str, bool] | None = None) -> JobConfig:
    """The job configuration of a loaded :class:`~megatrace.load.traceset.TraceSet`.

    ``explicit``: (layout, where it came from, whether it is a full layout file) for a layout the user
    gave; its sizes take precedence over every other source. Never raises on bad input: what cannot
    be read becomes an issue.
    """
    job = JobConfig(job_id=str(trace.job_id or ""))
    meta = trace.meta
    process, env = facts_from_meta(meta)
    if explicit is not None:
        layout, where, full = explicit
        for name in ("tp", "pp", "dp", "order") + (("microbatches", "schedule") if full else ()):
            job.offer(name, getattr(layout, name), "explicit", where)
    argv, files = _job_inputs(meta, process)
    read_trainer(job, argv, files)
    hosts = {i.rank: i.host for i in trace.rank_info if i.host}
    local = {i.rank: i.local_rank for i in trace.rank_info}
    imported = getattr(trace, "imported", "")
    read_runtime(job, trace.world_size, hosts, local, process, env,
                 getattr(trace, "world_source", "ring headers (torch.distributed world size)"),
                 f"{imported} input" if imported else "ring headers")
    uses = group_uses(trace)
    inference = infer_from_groups(uses, trace.world_size)
    job.inference = inference.to_dict()
    for dim in inference.dims:
        if dim.name and dim.seen and dim.name in FIELDS:
            job.offer(dim.name, dim.size, "groups", f"process groups: size {dim.size}, stride {dim.stride} "
                      f"({dim.how})")
    got = inference.layout_sizes()
    if got is not None:
        for name, size in got[0].items():
            if not job.has(name, kinds=("groups",)):
                job.offer(name, size, "groups", "process groups: no group of this dimension (size 1)")
        job.offer("order", got[1], "groups", "process groups: dimensions by rank stride")
    if not any(job.has(n) for n in ("tp", "pp", "dp")) and data_parallel_world(uses, trace.world_size):
        why = ("process groups: only the world group carries collectives and nothing is point-to-point, so every "
               "rank does the same work (data parallel)")
        for name, size in (("dp", trace.world_size), ("tp", 1), ("pp", 1)):
            job.offer(name, size, "groups", why)
    derive(job)
    check(job, inference)
    return job


def config_findings(job: JobConfig) -> list[Finding]:
    """The job configuration's issues as findings of kind ``config``."""
    out = []
    for k, issue in enumerate(job.issues):
        evidence: list[Any] = []
        for name in issue.fields:
            v = job.chosen(name)
            if v is not None:
                evidence.append(f"{name} = {v.value!r} from {v.source} ({v.kind})")
            evidence += [f"{name} = {a.value!r} from {a.source} ({a.kind})" for a in job.alternatives(name)]
        out.append(Finding(id=f"config:{issue.code}:{'-'.join(issue.fields) or k}", severity=Severity(issue.severity),
                           kind=Kind.CONFIG, subject=Subject(), verdict=issue.message, evidence=evidence,
                           remediation=REMEDIATION.get(issue.code, ""), confidence=0.9,
                           data={"code": issue.code, "fields": list(issue.fields)}))
    return out


def job_facts(job: JobConfig) -> dict[str, Any]:
    """The short form for findings.json and the summary: sizes, and each known field with its source."""
    fields = {n: {"value": v.value, "source": f"{v.kind}: {v.source}"} for n in FIELDS
              if (v := job.chosen(n)) is not None}
    return {"sizes": job.sizes_label(), "fields": fields, "issues": len(job.issues)}


def describe(job: JobConfig) -> str:
    """One line for the terminal summary: sizes, order, where they came from, framework and batch."""
    sources = sorted({v.kind for n in ("tp", "pp", "dp") if (v := job.chosen(n)) is not None})
    parts = [job.sizes_label()]
    if job.get("order"):
        parts.append(f"order {job.get('order')}")
    if sources:
        parts.append("sizes from " + " and ".join(sources))
    if job.get("framework"):
        parts.append(str(job.get("framework")))
    batch = [f"{label} {job.get(n)}" for n, label in (("micro_batch", "micro batch"), ("global_batch", "global batch"))
             if job.get(n) is not None]
    if batch:
        parts.append(", ".join(batch))
    return "; ".join(parts)
