"""Load a trace directory into one columnar :class:`TraceSet`: every rank's records, groups, layout, node facts.

A trace directory holds ``rings/rank-NNNNN.ring`` (or the rings directly),
their ``rank-NNNNN.meta.jsonl`` files, and optionally ``layout.yaml`` and
``procs.json``. Records of all ranks are concatenated column by column
(numpy), rank after rank, each rank's rows in ``seq`` order: no Python object
per record, so 16,384 ranks × 2,000 records fit in memory and in seconds.

``load_trace(DIR, tail=K)`` loads only each rank's newest ``K`` records (what
hang localisation needs: ``megatrace analyze --quick``), reading all the tails
with one vectorised validation pass (:func:`ring_reader.read_tails`).
:func:`megatrace.analyze.tails.tail_gaps` finds the few ranks whose tail turns out too short and
:func:`megatrace.load.rings.extend_tails` reads further back for them.

Bad input never raises a traceback: missing, duplicated, empty or foreign
(other job) ring files and a layout that does not fit become
:class:`LoadProblem` entries; only a directory that holds no readable ring at
all raises :class:`TraceLoadError`. ``fault.json`` (demo ground truth) is
never read here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megatrace.config import Layout
from megatrace.load import probe as process_probe
from megatrace.load.discovery import TraceFiles, foreign_owner, read_header, select_rings, trace_files
from megatrace.load.rings import RecordColumns, TailColumns, Tally, load_all, load_tails, read_tail_columns
from megatrace.load.side_files import merge_groups, node_facts, resolve_layout
from megatrace.load.traceset import LoadProblem, TraceLoadError, TraceSet, name_list, rank_list
from megatrace.trace import ring_format as fmt
from megatrace.trace.ring_reader import RingFormatError, RingHeader
from megatrace.trace.tail_pack import PACK_TAIL, read_pack

# Records per rank that a quick (hang-only) load reads. The hang analysis looks at each rank's newest
# 64 (hang.TAIL); the other 64 are margin: the op a rank waits in may be a little older than the newest
# records of its partners (they may have made a few calls since, in other groups or async ones), and
# the usual gap between calls is measured over what is there. A rank that stopped long before the
# others still gets its own newest records, however old. Where this is not enough (a partner's record
# of an op someone waits in lies before its tail) tail_gaps() finds it and extend_tails() reads further
# back, so the margin buys speed, not correctness: at 4,096 ranks 256 measured 0.2 s slower than 128.
QUICK_TAIL = PACK_TAIL  # 128 (a collection packs each ring's newest 128 records: trace/tail_pack.py)


def load_trace(directory: str | Path, layout: Layout | None = None, tail: int | None = None,
               format: str = "auto", job_logs: Sequence[str | Path] = ()) -> TraceSet:  # noqa: A002 - the CLI's
    """Load a trace directory; see the module docstring. ``layout`` overrides ``layout.yaml``.

    ``format``: ``auto`` (ring files, else a detected foreign format), ``rings``, or an importer's
    format (:data:`megatrace.load.importers.FORMATS`; those load every record, whatever ``tail``).

    ``tail=K`` loads only each rank's newest ``K`` records (``TraceSet.tail``; ``RankInfo.unread``
    counts the older ones left in the ring).

    ``job_logs``: the job's output files (``--with-log``). Beside one job log they are more of the same job's
    output; beside rings they speak for the ranks that left none (:func:`~.importers.job_log.merge_job_logs`).
    """
    logs = [Path(p) for p in job_logs]
    if logs:  # (the importers are imported only for another tool's files: a ring trace's load does without them)
        from megatrace.load.importers.job_log import load_job_log, merge_job_logs
    if logs and _one_job_log(Path(directory), format):  # the job's output in several files (StdOut, StdErr)
        return load_job_log(Path(directory), layout, more=logs)
    trace = _load_path(Path(directory), layout, tail, format)
    if logs:
        merge_job_logs(trace, logs)
    return trace


def _one_job_log(path: Path, format: str) -> bool:  # noqa: A002 - load_trace's format
    """Whether ``path`` is read as a job output log (one file, not an NCCL RAS report)."""
    from megatrace.load.importers.sniff import looks_like_nccl_ras

    if format not in ("auto", "job-log") or not path.is_file():
        return False
    return format == "job-log" or not looks_like_nccl_ras(path)


def _load_path(directory: Path, layout: Layout | None, tail: int | None, format: str) -> TraceSet:  # noqa: A002
    """:func:`load_trace` of one directory or file, without job logs."""
    if not directory.exists():
        raise TraceLoadError(f"{directory}: no such directory")
    if not directory.is_dir():
        return _load_file(directory, layout, format)
    listing = trace_files(directory) if format in ("auto", "rings") else TraceFiles([], [], directory, [])
    files, earlier, where, marker_names = listing.rings, listing.earlier, listing.marker_dir, listing.markers
    if not files:
        return _load_without_rings(directory, where, marker_names, layout, format)
    problems: list[LoadProblem] = []
    foreign_owner(directory, problems)
    if earlier:
        problems.append(LoadProblem(
            "info", "earlier-attempts",
            f"{len(earlier)} ring files of earlier attempts of restarted ranks ignored: "
            f"{name_list([os.path.basename(p) for p in earlier])}", paths=tuple(earlier)))
    unreadable: list[str] = []
    headers, tails = _read_headers(files, tail, unreadable)
    if not headers:
        raise TraceLoadError(f"{directory}: none of the {len(files)} ring files is readable: "
                             f"{name_list(unreadable, 3)}")
    job, world, chosen = select_rings(headers, problems)

    tally = Tally(unreadable=unreadable)
    if tail is None:
        records, infos, metas, used = load_all(chosen, headers, tally)
    else:
        records, infos, metas, used = load_tails(chosen, tails, tally)
    if not infos:
        raise TraceLoadError(f"{directory}: none of the {len(files)} ring files is readable: "
                             f"{name_list(unreadable, 3)}")
    tally.report(problems)
    present = [i.rank for i in infos]
    missing = tuple(np.setdiff1d(np.arange(world, dtype=np.int64), present).tolist())  # world <= MAX_WORLD_SIZE
    if missing:
        problems.append(LoadProblem(
            "warning", "missing-ranks",
            f"no readable ring for {len(missing)} of {world} ranks: {rank_list(list(missing))}; analysed the "
            f"other {len(present)}, with lower confidence", ranks=missing))

    starts = np.concatenate([[0], np.cumsum([i.n_records for i in infos])]).astype(np.int64)
    groups = merge_groups(metas, used, problems)
    facts = node_facts(directory, problems)
    facts.probe = process_probe.probe(infos)
    markers = {}
    if missing:  # (start markers matter only for ranks without a ring: their module is imported only then)
        from megatrace.load.markers import read_markers, rendezvous_facts

        markers = read_markers(where, marker_names, problems)
    waiting = {r: m for r, m in markers.items() if r in missing}
    if waiting:
        facts.rendezvous = rendezvous_facts(directory, problems)
    return TraceSet(path=directory, job_id=job, world_size=world, ranks=np.array(present, dtype=np.int64),
                    rank_info=infos, starts=starts, records=records, groups=groups,
                    layout=resolve_layout(directory, layout, world, problems), facts=facts,
                    problems=problems, missing_ranks=missing, tail=tail, meta=metas,
                    init_markers=waiting)


def _load_file(path: Path, layout: Layout | None, format: str) -> TraceSet:  # noqa: A002
    """A trace given as one file: an NCCL RAS report or a job's output log (else an error)."""
    from megatrace.load.importers import import_trace
    from megatrace.load.importers.sniff import looks_like_nccl_ras

    if not path.is_file():
        raise TraceLoadError(f"{path}: neither a directory nor a regular file (a FIFO, device or socket is "
                             f"never read)")
    if format in ("auto", "nccl-ras"):  # one file: an NCCL RAS report, when it starts like one
        if format == "nccl-ras" or looks_like_nccl_ras(path):
            return import_trace(path, "nccl-ras", layout)
    if format in ("auto", "job-log"):  # one file: a job's output log (docs/importers.md)
        return import_trace(path, "job-log", layout)
    raise TraceLoadError(f"{path}: not a directory: a trace of format {format} is a directory (one file is "
                         f"read only as a job output log, --format job-log, or an NCCL RAS report, "
                         f"--format nccl-ras)")


def _load_without_rings(directory: Path, where: Path, marker_names: list[str], layout: Layout | None,
                        format: str) -> TraceSet:  # noqa: A002
    """A directory without ring files: start markers only, a foreign format, or an error saying what was looked
    for."""
    from megatrace.load.importers import detect_format, import_trace, not_a_trace

    if marker_names:  # ranks in init_process_group and none past it: stuck before communication
        return _startup_trace(directory, where, marker_names, layout)
    if format != "rings":  # foreign formats: Flight Recorder, NCCL logs, Inspector (docs/importers.md)
        found = detect_format(directory) if format == "auto" else format
        if found is not None:
            return import_trace(directory, found, layout)
    if format == "auto":  # nothing recognised: say what was looked for, in every format
        raise TraceLoadError(not_a_trace(directory))
    raise TraceLoadError(f"{directory}: not a MegaTrace trace directory: no ring files "
                         f"(rank-NNNNN.ring) in it or in its rings/ subdirectory")


def _read_headers(files: list[str], tail: int | None,
                  unreadable: list[str]) -> tuple[dict[str, RingHeader], TailColumns | None]:
    """Every readable file's header and, with ``tail``, its newest records (else None); the others are said in
    ``unreadable``."""
    if tail is not None:  # header and tail of every file at once (a file of another job or a duplicate is read
        #                   for nothing); from the bundle's tails pack when it has one (trace/tail_pack.py)
        rings = Path(os.path.dirname(files[0]))
        pack = read_pack(rings.parent, rings, len(files))
        try:
            tails = read_tail_columns(files, tail, unreadable, pack)
        finally:
            if pack is not None:
                pack.close()
        return {path: snap.header for path, snap in tails.snaps.items()}, tails
    headers: dict[str, RingHeader] = {}
    for path in files:
        try:
            headers[path] = read_header(path)
        except (RingFormatError, OSError) as exc:
            unreadable.append(str(exc))
    return headers, None


def _startup_trace(directory: Path, where: Path, names: list[str], layout: Layout | None) -> TraceSet:
    """A trace of start markers only: every rank stuck in (or before) init_process_group, no record."""
    from megatrace.load.markers import read_markers, rendezvous_facts

    problems: list[LoadProblem] = []
    foreign_owner(directory, problems)
    markers = read_markers(where, names, problems)
    if not markers:
        raise TraceLoadError(f"{where}: no ring files, and none of its {len(names)} start markers "
                             f"(rank-NNNNN.init) is readable: {name_list(names, 3)}")
    world = max(max((m.world_size or 0) for m in markers.values()), max(markers) + 1)
    if world > fmt.MAX_WORLD_SIZE:
        raise TraceLoadError(f"{where}: a start marker names a world of {world} ranks (at most {fmt.MAX_WORLD_SIZE})")
    jobs = sorted({m.job_id for m in markers.values()})
    facts = node_facts(directory, problems)
    facts.rendezvous = rendezvous_facts(directory, problems)
    return TraceSet(path=directory, job_id=jobs[0] if len(jobs) == 1 else ",".join(jobs[:4]), world_size=world,
                    ranks=np.zeros(0, np.int64), rank_info=[], starts=np.zeros(1, np.int64),
                    records=RecordColumns(0).finish(), groups={},
                    layout=resolve_layout(directory, layout, world, problems),
                    facts=facts, problems=problems,
                    missing_ranks=tuple(range(world)), meta={}, init_markers=markers,
                    world_source="start markers (the world size init_process_group was called with)")
