"""``job.yaml``: the job configuration written beside the traces, each field with its value and source.

Layout (schema ``megatrace.job``, version 1)::

    parallel: {tp: {value: 2, source: "groups: ..."}, ...}   # world_size, tp, pp, dp, cp, ep, vpp, order
    batch:    {micro_batch: ..., global_batch: ..., ...}
    features: {framework: ..., sequence_parallel: ..., ...}
    cluster:  {nodes: ..., tasks_per_node: ..., gpus_per_node: ..., launcher: ...}
    alternatives: {field: [{value, source}, ...]}          # other sources that disagreed
    environment: {nccl: {NAME: value | {differs, by_node}}, versions: {...}, slurm: {...}}
    groups:   what the process groups showed (dimensions, strides, names and why)
    issues:   [{code, severity, message, fields}]
    gpu_sources: {how the GPU was found: ranks}
    ranks:    {rank: {node, local_rank, gpu}}                # one line per rank
"""

from __future__ import annotations

import json
import os
from json.encoder import encode_basestring
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from megatrace.config import read_yaml
from megatrace.errors import MegatraceError
from megatrace.files import write_atomic
from megatrace.analyze.jobconfig.model import (BATCH_FIELDS, CLUSTER_FIELDS, FEATURE_FIELDS, PARALLEL_FIELDS, JobConfig)

SCHEMA = "megatrace.job"
VERSION = 1
SECTIONS = {"parallel": PARALLEL_FIELDS, "batch": BATCH_FIELDS, "features": FEATURE_FIELDS,
            "cluster": CLUSTER_FIELDS}


class JobFileError(MegatraceError, ValueError):
    """A job.yaml that cannot be read; the message names the file."""


def job_document(job: JobConfig) -> dict[str, Any]:
    """The job.yaml document as plain data."""
    doc: dict[str, Any] = {"schema": SCHEMA, "version": VERSION, "job_id": job.job_id}
    for section, names in SECTIONS.items():
        doc[section] = {n: job.chosen(n).to_dict() for n in names if job.chosen(n) is not None}
    alternatives = {n: [v.to_dict() for v in job.alternatives(n)] for n in job.offered if job.alternatives(n)}
    if alternatives:
        doc["alternatives"] = alternatives
    doc["environment"] = job.environment
    doc["groups"] = job.inference
    doc["issues"] = [i.to_dict() for i in job.issues]
    doc["gpu_sources"] = dict(Counter(p.get("gpu_source", "unknown") for p in job.ranks.values()))
    doc["ranks"] = {int(r): {k: p.get(k) for k in RANK_KEYS} for r, p in sorted(job.ranks.items())}
    return doc


RANK_KEYS = ("node", "local_rank", "gpu")


def write_job_yaml(job: JobConfig, path: str | os.PathLike[str]) -> Path:
    """Write ``job.yaml`` atomically (:func:`megatrace.files.write_atomic`).

    The rank table is written one flow mapping per line (JSON, which YAML reads): the YAML emitter
    takes seconds for the 16,384 ranks of a large job, this takes milliseconds.
    """
    doc = job_document(job)
    ranks = doc.pop("ranks")
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=110)
    lines = [f"  {r}: {_rank_line(p)}\n" for r, p in ranks.items()]
    return write_atomic(path, text + ("ranks:\n" + "".join(lines) if lines else "ranks: {}\n"))


_ENCODE = json.JSONEncoder(ensure_ascii=False).encode
_STRING = encode_basestring  # (json's own quoting of a string, ensure_ascii=False: C)


def _rank_line(facts: dict[str, Any]) -> str:
    """``json.dumps(facts, ensure_ascii=False)`` of a rank's row, built directly when every value is a string, an
    int or None (the usual row: 16,384 of them, four times faster); any other row through the encoder."""
    parts = []
    for key, value in facts.items():
        kind = type(value)
        if kind is str:
            parts.append(f"{_STRING(key)}: {_STRING(value)}")
        elif kind is int:
            parts.append(f"{_STRING(key)}: {value}")
        elif value is None:
            parts.append(f"{_STRING(key)}: null")
        else:
            return _ENCODE(facts)
    return "{" + ", ".join(parts) + "}"


def load_job_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``job.yaml``; raises :class:`JobFileError` naming the file when it is not one."""
    doc = read_yaml(path, JobFileError, "job configuration")
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise JobFileError(f"{path}: not a {SCHEMA} document")
    return doc


def field_values(doc: dict[str, Any]) -> dict[str, Any]:
    """{field: value} of every field of a job.yaml document."""
    return {n: entry["value"] for section in SECTIONS for n, entry in (doc.get(section) or {}).items()
            if isinstance(entry, dict) and "value" in entry}
