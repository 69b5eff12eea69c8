"""A job's output log -> :class:`TraceSet`: where each rank stood in each process group when the job hung.

PyTorch's NCCL watchdog prints, on every rank whose collective timed out, the work that timed out and
the rank's last enqueued and last completed sequence numbers in that group; with the dump signal, the
other ranks print theirs too (:mod:`job_log_lines` reads them). Per rank and group this gives calls
``completed`` (done) and ``completed+1 .. enqueued`` (in flight), which become records, so the hang
analysis finds, as on rings, the group's instance that some members entered and one never did.

What a log cannot tell: times (the records carry the order only; no timing analysis runs), the members of
a group other than the default one (the ranks that printed lines about it; others are unknown), calls older
than the last completed one, and point-to-point calls (torch numbers collectives only, in 2.4 and later).
A rank that printed nothing is missing (the finding says so); a rank whose exception or Slurm task exit
comes before any timeout in the log is a crash (``ProcFact``), and so is one that torchrun's failure summary
says ended by a signal other than its own SIGTERM (or non-zero) without a failed collective of its own; every
rank at ``-1`` (nothing enqueued) means no collective was in flight: a stop outside communication. Without any
watchdog position (gloo), the ranks whose collective failed wait in one call of the default group.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatrace.config import Layout
from megatrace.load.importers.common import (MAX_RANKS, ImportedRank, ImportFormatError, build_traceset,
                                                group_id, new_columns)
from megatrace.load.importers.job_log_lines import (SIGNAL_NAMES, GroupState, JobLog, RankLog, TaskExit,
                                                       read_job_log)
from megatrace.load.traceset import LoadProblem, NodeFacts, ProcFact, TraceSet, plural, rank_list
from megatrace.trace.ring_format import Flag, Op, State

NAME = "job-log"
MAX_IN_FLIGHT = 1024  # calls in flight kept per rank and group (the newest): a log can claim any gap
OPS = {"ALLREDUCE": Op.ALL_REDUCE, "ALLGATHER": Op.ALL_GATHER, "_ALLGATHER_BASE": Op.ALL_GATHER,
       "ALLGATHER_COALESCED": Op.ALL_GATHER, "ALLGATHER_INTO_TENSOR_COALESCED": Op.ALL_GATHER,
       "REDUCE_SCATTER": Op.REDUCE_SCATTER, "_REDUCE_SCATTER_BASE": Op.REDUCE_SCATTER,
       "REDUCE_SCATTER_TENSOR_COALESCED": Op.REDUCE_SCATTER, "BROADCAST": Op.BROADCAST, "REDUCE": Op.REDUCE,
       "ALLTOALL": Op.ALL_TO_ALL, "ALLTOALL_BASE": Op.ALL_TO_ALL, "BARRIER": Op.BARRIER, "GATHER": Op.GATHER,
       "SCATTER": Op.SCATTER, "ALLREDUCE_COALESCED": Op.ALL_REDUCE, "COALESCED": Op.UNKNOWN,
       "SEND": Op.SEND, "RECV": Op.RECV, "RECVANYSOURCE": Op.RECV}
LOG_NAME = re.compile(r"(?:^slurm-\d+(?:_\d+)?\.out$|\.(?:out|err|log|txt)$)")
RANK_IN_NAME = re.compile(r"(?:rank|task|proc)[_-]?(\d+)|[._-](\d+)\.(?:out|err|log|txt)$", re.I)
DEFAULT_DESCS = ("default_pg", "")
SLURM_STOPS = ("SIGTERM", "SIGKILL")  # what Slurm ends a step's other tasks with
GLOO_KEY = "0"  # the default group, where a failure without a position is placed (_positions_from_failures)


def log_files(path: Path) -> list[Path]:
    """The output files to read: ``path`` itself, or the files of a directory named like job output."""
    if path.is_file():
        return [path]
    try:
        return sorted(p for p in path.iterdir() if p.is_file() and LOG_NAME.search(p.name))
    except OSError as exc:
        raise ImportFormatError(f"{path}: cannot list it: {exc.strerror}") from None


def _file_rank(path: Path, several: bool) -> int | None:
    """The rank a per-rank file's name gives (``rank_3.log``, ``job-3.out``); None for a whole-job file."""
    if not several:
        return None
    m = RANK_IN_NAME.search(path.name)
    return int(m.group(1) or m.group(2)) if m else None


def load_job_log(path: Path, layout: Layout | None = None, more: Sequence[Path] = ()) -> TraceSet:
    """The job output file ``path`` (or the output files in directory ``path``) as a :class:`TraceSet`; ``more``:
    other files of the same job's output (its StdErr beside its StdOut), whose names give no rank."""
    files = log_files(path)
    if not files:
        raise ImportFormatError(f"{path}: no job output files in it (slurm-<id>.out, or files ending .out, .err, "
                                f".log or .txt)")
    per_rank = len(files) > 1
    files += [Path(p) for p in more if Path(p) not in files]
    logs: list[JobLog] = []
    for f in files:
        try:
            logs.append(read_job_log(f, _file_rank(f, per_rank) if f.parent == path else None))
        except OSError as exc:
            raise ImportFormatError(f"{f}: cannot read it: {exc.strerror}") from None
    ranks = _by_rank(logs)
    said = {r for r, (rl, _) in ranks.items() if rl.groups}
    problems: list[LoadProblem] = []
    if not said and (said := _positions_from_failures(ranks)):
        problems.append(LoadProblem("info", "failures-only", f"no watchdog position in the log: the "
                                    f"{plural(len(said), 'rank')} whose collective failed (gloo's errors, or NCCL's "
                                    f"without the watchdog's dump) are placed in one call of the default group, "
                                    f"shown as #0: its number is not in the log", ranks=tuple(sorted(said))))
    if not said:
        crash = _crash_only(path, logs, ranks, layout, problems)
        if crash is None:
            raise ImportFormatError(_nothing_said(files, logs))
        return crash
    world = _world(logs, ranks, layout)
    imported = [_records(rl, p, world) for r, (rl, p) in sorted(ranks.items()) if rl.groups]
    _share_ops(imported)
    names = {group_id(NAME, g.key): (g.key, g.desc or "") for rl, _ in ranks.values() for g in rl.groups.values()}
    extra = _default_groups(ranks, world)
    problems.append(LoadProblem("info", "imported", f"read {plural(sum(lg.lines for lg in logs), 'line')} of "
                                f"{plural(len(files), 'job output file')}: the NCCL watchdog's positions of "
                                f"{plural(len(said), 'rank')} in {plural(len(names), 'process group')}"))
    trace = build_traceset(path if path.is_dir() else path.parent, NAME, imported, world, problems, layout,
                           extra_groups=extra, names=names,
                           inferred="a job log gives each rank's position in each group (last enqueued and last "
                                    "completed collective), not times", completions="order")
    trace.path = path
    _facts(trace, logs, ranks)
    return trace


def _crash_only(path: Path, logs: list[JobLog], ranks: dict[int, tuple[RankLog, Path]], layout: Layout | None,
                problems: list[LoadProblem]) -> TraceSet | None:
    """No watchdog position and no failed collective, but a rank that ended on its own (its exception, or a
    non-zero exit in srun's or torchrun's words) and the others ended by the launcher after it: a trace without
    records whose process facts name the crash. Where the others stood (in a collective or not) is not in the
    log, and the finding claims nothing of it. None when no rank crashed."""
    said = LogFacts()
    _facts(said, logs, ranks)
    crashed = sorted(r for r, p in said.facts.procs.items() if p.crashed)
    if not crashed:
        return None
    known = sorted(set(ranks) | set(said.facts.procs))
    world = max(known[-1] + 1, layout.world_size if layout is not None else 0)
    if world > MAX_RANKS:
        raise ImportFormatError(f"{logs[0].path}: rank {world - 1}: expected a rank below {MAX_RANKS}")
    imported = [ImportedRank(r, str(ranks[r][1] if r in ranks else logs[0].path), new_columns(0),
                             host=ranks[r][0].host if r in ranks else "") for r in known]
    problems.append(LoadProblem("info", "crash-only", f"no NCCL watchdog position and no failed collective in the "
                                f"log: it says how ranks ended (ranks {rank_list(crashed)} on their own), not where "
                                f"the others stood", ranks=tuple(crashed)))
    trace = build_traceset(path if path.is_dir() else path.parent, NAME, imported, world, problems, layout,
                           inferred="a job log without watchdog lines gives how ranks ended, no calls",
                           completions="order")
    trace.path = path
    _facts(trace, logs, ranks)
    return trace


def _by_rank(logs: list[JobLog]) -> dict[int, tuple[RankLog, Path]]:
    """Each rank's lines over every file (its own file and the job's), with the file that first named it."""
    ranks: dict[int, tuple[RankLog, Path]] = {}
    for log in logs:
        for r, rl in log.ranks.items():
            _fold_unnamed(rl)
            if r in ranks:
                _merge(ranks[r][0], rl)
            else:
                ranks[r] = (rl, log.path)
    return ranks


@dataclass
class LogFacts:
    """What output logs say of how ranks stopped, gathered apart from any trace (:func:`merge_job_logs`)."""

    facts: NodeFacts = field(default_factory=NodeFacts)
    problems: list[LoadProblem] = field(default_factory=list)
    missing_ranks: tuple[int, ...] = ()


def merge_job_logs(trace: TraceSet, paths: Sequence[Path]) -> None:
    """Add to a ring trace what the job's output files (``slurm-<id>.out``) say of the ranks that have no ring:
    their exception, Slurm's or torchrun's word on how their task ended, their watchdog position (as notes and
    process facts, which the hang analysis names them by). Facts the trace already holds (``procs.json``) win;
    ranks with rings get only process facts they lack. Not read when every rank has a ring; a file that cannot
    be read is a ``job-log`` problem, never an error."""
    if trace.source_format == NAME:
        return
    names = ", ".join(p.name for p in paths)
    if not trace.missing_ranks:
        trace.problems.append(LoadProblem("info", "job-log", f"job output not read ({names}): every rank of the job "
                                                             f"has a ring", paths=tuple(map(str, paths))))
        return
    logs: list[JobLog] = []
    for path in paths:
        try:
            logs.append(read_job_log(path, None))
        except OSError as exc:
            trace.problems.append(LoadProblem("warning", "job-log", f"{path}: cannot read the job's output: "
                                                                    f"{exc.strerror or exc}", paths=(str(path),)))
    if not logs:
        return
    said = LogFacts()
    _facts(said, logs, _by_rank(logs))
    no_ring = set(trace.missing_ranks)
    for r, proc in said.facts.procs.items():
        trace.facts.procs.setdefault(r, proc)
    told = sorted(r for r in no_ring if r in said.facts.notes)
    for r in told:
        trace.facts.notes[r] = f"no ring; {said.facts.notes[r]}"
    if trace.facts.outcome is None and said.facts.outcome is not None:
        trace.facts.outcome, trace.facts.message = said.facts.outcome, said.facts.message
    trace.problems.extend(p for p in said.problems if p.code == "slurm-lines")
    lines = sum(lg.lines for lg in logs)
    silent = sorted(no_ring - set(told))
    trace.problems.append(LoadProblem(
        "info", "job-log", f"read the job's output ({names}, {plural(lines, 'line')}) for the "
        f"{plural(len(no_ring), 'rank')} without a ring: "
        + (f"it tells how ranks {rank_list(told)} stopped" if told else "it says nothing of them")
        + (f"; nothing of ranks {rank_list(silent)}" if told and silent else ""),
        ranks=tuple(told), paths=tuple(str(lg.path) for lg in logs)))


def _positions_from_failures(ranks: dict[int, tuple[RankLog, Path]]) -> set[int]:
    """Without any watchdog position (gloo, or NCCL without the dump): each rank whose collective failed (its
    exception: gloo's "Timed out waiting ...", "Connection closed by peer") was inside one call of the job's
    default group, which the ranks that printed no such failure never entered. Its number is unknown: every
    failed rank gets the same one (the default group's calls are made in the same order on every rank)."""
    failed = {r for r, (rl, _) in ranks.items() if rl.comm_error is not None}
    for r in failed:
        rl = ranks[r][0]
        rl.groups[GLOO_KEY] = GroupState(GLOO_KEY, "default_pg", enqueued=0, timed_out=0, line=rl.comm_error[0])
    return failed


def _merge(into: RankLog, other: RankLog) -> None:
    """One rank's lines from two files (its own file and the job's): the group positions and events of both."""
    for key, g in other.groups.items():
        mine = into.groups.get(key)
        if mine is None or g.enqueued > mine.enqueued or (g.timed_out >= 0 and mine.timed_out < 0):
            into.groups[key] = g
    into.events += other.events
    into.exception = into.exception or other.exception
    into.host = into.host or other.host


def _fold_unnamed(rl: RankLog) -> None:
    """A timeout line without the group's tag (``[Rank N]`` only) belongs to the named group that timed out at
    the same sequence number (its ``Timeout at NCCL work: S`` line)."""
    loose = rl.groups.get("?")
    if loose is None or len(rl.groups) < 2:
        return
    same = [g for k, g in rl.groups.items() if k != "?" and g.timed_out == loose.timed_out >= 0]
    if len(same) == 1:
        g = same[0]
        g.op = g.op or loose.op
        g.numel_in, g.numel_out = max(g.numel_in, loose.numel_in), max(g.numel_out, loose.numel_out)
        g.timeout_ms, g.ran_ms = max(g.timeout_ms, loose.timeout_ms), max(g.ran_ms, loose.ran_ms)
        g.enqueued, g.completed = max(g.enqueued, loose.enqueued), max(g.completed, loose.completed)
        del rl.groups["?"]


def _nothing_said(files: list[Path], logs: list[JobLog]) -> str:
    where = files[0] if len(files) == 1 else f"{files[0].parent} ({plural(len(files), 'file')})"
    seen = sum(len(lg.ranks) for lg in logs)
    if not any(lg.lines for lg in logs):
        return (f"{where}: empty: a job log gives a verdict from what ranks print when they fail (the NCCL watchdog's "
                f"timeouts, failed collectives); a job that printed nothing, or a slow one, needs its rings "
                f"(--megatrace) or profiler traces")
    return (f"{where}: no NCCL watchdog position in it (no 'last enqueued NCCL work: E, last completed NCCL work: C' "
            f"or 'WorkNCCL(SeqNum=S, OpType=...)' line of a rank): a job log gives a verdict only when PyTorch's "
            f"NCCL watchdog reported a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT / the dump signal make every rank report)"
            + (f"; lines of {plural(seen, 'rank')} were read" if seen else ""))


def _elastic_exit(trace: TraceSet | LogFacts, log: JobLog, e: TaskExit, ranks: dict[int, tuple[RankLog, Path]]) -> None:
    """torchrun's summary of a failed rank. Printed at the end (not in time order), so it counts as a cause only
    for a rank that printed no failed collective: SIGTERM is torchrun ending the rest of the job, and a rank
    whose collective failed exited because another rank stopped (torchrun's own "Root Cause" is merely the
    first rank to exit, often one of those)."""
    rank = e.tasks[0]
    said = ranks.get(rank)
    if e.code == -15:  # torchrun ending the rest of the job once one rank failed
        trace.facts.procs.setdefault(rank, ProcFact(rank, signal="SIGTERM", killed_by_launcher=True))
        trace.facts.notes.setdefault(rank, f"torchrun ({log.path.name}:{e.line}): rank {rank} on {e.node} was ended "
                                           f"by SIGTERM (torchrun stopping the job after another rank failed)")
    if e.code in (0, -15) or (said is not None and said[0].timed_out_at):
        return
    signal = e.what if e.code is not None and e.code < 0 else None
    said_before = trace.facts.procs.get(rank) is not None and trace.facts.notes.get(rank)  # its own exception
    trace.facts.procs.setdefault(rank, ProcFact(rank, exit_code=e.code if signal is None else None, signal=signal))
    text = f"torchrun ({log.path.name}:{e.line}): rank {rank} on {e.node} ended with {e.what}"
    trace.facts.notes[rank] = f"{said_before}; {text}" if said_before else text


def _srun_exits(trace: TraceSet | LogFacts, log: JobLog, first_timeout: int, failed: set[int]) -> None:
    """srun's ``task N: Exited with exit code C`` / ``Terminated`` / ``Killed`` lines, in the order srun saw the
    tasks end. The first task to end on its own (a non-zero exit, or a signal, before Slurm said it ends the step)
    is a crash; tasks ``Terminated`` or ``Killed`` after it, or after Slurm said it ends the step or job, were
    ended by Slurm (``--kill-on-bad-exit``, a cancel, the time limit), as procs_document reads the SPANK plugin's
    exit statuses. Not causes: tasks whose own collective failed or timed out (``failed``: they ended because of
    another; srun may report them after that one, its lines lag the ranks' own), and every task ending after the
    log's first NCCL watchdog timeout (its abort)."""
    culprit_seen = False
    for e in log.exits:
        if e.launcher != "srun" or (first_timeout and e.line > first_timeout) or set(e.tasks) <= failed:
            continue
        signal = None if e.code is not None else next((name for w, name in SIGNAL_NAMES.items()
                                                       if e.what.startswith(w)), None)
        if not e.code and signal is None:
            continue
        ended_by_slurm = signal in SLURM_STOPS and (culprit_seen or (log.stepping or e.line + 1) < e.line)
        culprit_seen = culprit_seen or not ended_by_slurm
        for t in e.tasks:
            trace.facts.procs.setdefault(t, ProcFact(t, exit_code=e.code, signal=signal,
                                                     killed_by_launcher=ended_by_slurm))
            trace.facts.notes.setdefault(t, f"Slurm ({log.path.name}:{e.line}): task {t} on {e.node}: {e.what}"
                                            + (" (Slurm ending the step)" if ended_by_slurm else ""))


def _world(logs: list[JobLog], ranks: dict[int, tuple[RankLog, Path]], layout: Layout | None) -> int:
    top = max(ranks)
    for log in logs:
        for e in log.exits:
            if e.tasks:
                top = max(top, max(e.tasks))
    world = max(top + 1, layout.world_size if layout is not None else 0)
    if world > MAX_RANKS:
        raise ImportFormatError(f"{logs[0].path}: rank {world - 1}: expected a rank below {MAX_RANKS}")
    return world


def _is_default(key: str, desc: str) -> bool:
    return desc == "default_pg" or (key == "0" and desc in DEFAULT_DESCS)


def _default_groups(ranks: dict[int, tuple[RankLog, Path]], world: int) -> list[dict]:
    """The default process group holds every rank of the job (members of other groups are not in a log)."""
    keys = {(g.key, g.desc) for rl, _ in ranks.values() for g in rl.groups.values() if _is_default(g.key, g.desc)}
    return [{"kind": "group", "gid": group_id(NAME, k), "name": k, "desc": "world", "ranks": list(range(world)),
             "backend": "nccl"} for k, _ in sorted(keys)]


def _records(rl: RankLog, path: Path, world: int) -> ImportedRank:
    """Per group: the last completed call (done) and the calls after it up to the last enqueued (in flight)."""
    rows: list[tuple[int, int, int, int, int]] = []  # (gid, seq, op, state, line)
    for g in rl.groups.values():
        gid = group_id(NAME, g.key)
        enqueued = max(g.enqueued, g.timed_out)
        completed = g.completed if g.completed >= 0 or g.enqueued >= 0 else g.timed_out - 1
        if completed >= 0:
            rows.append((gid, completed, int(Op.UNKNOWN), int(State.COMPLETED), g.line))
        for seq in range(max(completed + 1, enqueued - MAX_IN_FLIGHT + 1, 0), enqueued + 1):
            op = OPS.get(g.op, Op.UNKNOWN) if seq == g.timed_out else Op.UNKNOWN
            rows.append((gid, seq, int(op), int(State.ENQUEUED), g.line))
    rows.sort(key=lambda x: (x[4], x[0], x[1]))
    cols = new_columns(len(rows))
    for i, (gid, seq, op, state, line) in enumerate(rows):
        cols["group_id"][i], cols["group_seq"][i], cols["op"][i], cols["state"][i] = gid, seq, op, state
        cols["t_enqueue"][i] = i + 1  # the order only: a log gives no times
        cols["flags"][i] = Flag.ASYNC
        if state == State.COMPLETED:
            cols["t_complete"][i] = i + 1
    lines = [{"kind": "group", "gid": group_id(NAME, g.key), "name": g.key, "desc": "world",
              "ranks": list(range(world)), "backend": "nccl"} for g in rl.groups.values() if _is_default(g.key, g.desc)]
    return ImportedRank(rl.rank, str(path), cols, host=rl.host, groups=lines)


def _share_ops(ranks: list[ImportedRank]) -> None:
    """A call's op printed by one member (the one whose watchdog timed out on it) is every member's: the others
    printed only their positions. Where members printed different ops, each keeps its own (a mismatch)."""
    known: dict[tuple[int, int], set[int]] = {}
    for r in ranks:
        c = r.columns
        for gid, seq, op in zip(c["group_id"].tolist(), c["group_seq"].tolist(), c["op"].tolist()):
            if op != Op.UNKNOWN:
                known.setdefault((gid, seq), set()).add(op)
    for r in ranks:
        c = r.columns
        for i in np.flatnonzero(c["op"] == Op.UNKNOWN).tolist():
            ops = known.get((int(c["group_id"][i]), int(c["group_seq"][i])))
            if ops is not None and len(ops) == 1:
                c["op"][i] = next(iter(ops))


def _facts(trace: TraceSet | LogFacts, logs: list[JobLog], ranks: dict[int, tuple[RankLog, Path]]) -> None:
    """What the log says of how each rank stopped: notes, crashes before the first timeout, the job's outcome.

    Line order within one file is time order: an exception or a task's exit before the file's first timeout
    line is a cause; after it, the watchdog's abort (every rank exits once a collective times out)."""
    first = {lg.path: min((rl.timed_out_at for rl in lg.ranks.values() if rl.timed_out_at), default=0) for lg in logs}
    for r, (rl, path) in ranks.items():
        timed = [g for g in rl.groups.values() if g.timed_out >= 0 and g.ran_ms >= 0]
        if timed:
            g = timed[0]
            trace.facts.notes[r] = (f"its log ({path.name}:{g.line}): the NCCL watchdog timed out on "
                                    f"{g.op.lower() or 'a call'} {g.timed_out} of group {g.desc or g.key} after "
                                    f"{g.ran_ms / 1000:.0f} s")
        elif rl.comm_error is not None and not any(g.enqueued > 0 or g.completed >= 0 for g in rl.groups.values()):
            trace.facts.notes[r] = (f"its log ({path.name}:{rl.comm_error[0]}): its collective failed: "
                                    f"{rl.comm_error[1]}")
        elif rl.groups:
            g = max(rl.groups.values(), key=lambda g: g.line)
            trace.facts.notes[r] = (f"its log ({path.name}:{g.line}): last enqueued {g.enqueued}, last completed "
                                    f"{g.completed} in group {g.desc or g.key}")
        else:
            trace.facts.notes[r] = (f"its log ({path.name}:{rl.first_line}) has lines of it but no NCCL watchdog "
                                    f"position")
        if rl.exception is not None and not rl.timed_out_at and (not first[path] or rl.exception[0] < first[path]):
            trace.facts.procs[r] = ProcFact(r, exit_code=1)
            trace.facts.notes[r] = f"its log ({path.name}:{rl.exception[0]}): {rl.exception[1]}"
    for log in logs:
        for e in log.exits:
            if e.launcher == "torchrun":
                _elastic_exit(trace, log, e, ranks)
        watchdog = min((rl.watchdog_at for rl in log.ranks.values() if rl.watchdog_at), default=0)
        _srun_exits(trace, log, watchdog, {r for r, (rl, _) in ranks.items() if rl.timed_out_at})
    missing = [r for r in trace.missing_ranks if r not in ranks]
    timed_out = [r for r, (rl, _) in ranks.items() if rl.timed_out_at]
    if timed_out:
        trace.facts.outcome = "stalled"
        trace.facts.message = (f"the NCCL watchdog timed out on {plural(len(timed_out), 'rank')} "
                               f"({rank_list(sorted(timed_out))})"
                               + (f"; {plural(len(missing), 'rank')} printed nothing ({rank_list(missing)})"
                                  if missing else ""))
    for log in logs:
        said = [f"{log.path.name}:{n}: {text}" for n, text in log.oom]
        if log.cancelled is not None:
            said.append(f"{log.path.name}:{log.cancelled[0]}: Slurm cancelled the job ({log.cancelled[1]})")
        if said:
            trace.problems.append(LoadProblem("info", "slurm-lines", "what Slurm said of the job: "
                                              + "; ".join(said[:4]), paths=(str(log.path),)))
    idle = sorted(r for r, (rl, _) in ranks.items() if rl.groups and all(
        g.enqueued == -1 and g.completed == -1 and g.timed_out < 0 for g in rl.groups.values()))
    trace.problems[:] = [p for p in trace.problems if p.code != "empty-ring"]  # (said below, in a log's words)
    if idle and len(idle) == len([r for r, (rl, _) in ranks.items() if rl.groups]):
        trace.facts.outcome = "stalled"
        trace.facts.message = ("every rank's NCCL watchdog printed 'last enqueued NCCL work: -1': no collective was "
                               "in flight on any rank, so the job stopped outside communication (a frozen process, "
                               "data loading or the file system, a deadlock in Python), not in a collective")
    elif idle:
        trace.problems.append(LoadProblem("info", "nothing-enqueued", f"{plural(len(idle), 'rank')} had enqueued no "
                                          f"collective (-1) in the groups the log names: ranks {rank_list(idle)}",
                                          ranks=tuple(idle)))
    for r in trace.missing_ranks:
        trace.facts.notes.setdefault(r, "the job log has no line of it: neither a watchdog timeout nor its position "
                                        "(it printed nothing: stopped, or its output was lost)")
