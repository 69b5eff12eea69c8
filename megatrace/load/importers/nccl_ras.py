"""An NCCL RAS report -> :class:`TraceSet`: NCCL's own view of a running job's communicators.

NCCL 2.24+ runs a RAS thread in every process; ``ncclras`` (or ``echo verbose status | nc localhost 28028``)
asks them for the state of the job: the processes that are dead (unreachable) or sent no data, and per
communicator the ranks whose collective operation counts, status or errors differ from the others'
(:mod:`nccl_ras_lines` reads both the text and the JSON report). Per communicator and rank this gives a count of
launched collectives, which becomes records as a job log's positions do (:mod:`job_log`): each member's last
common operation (done) and the operations after it up to its own count (in flight). The hang analysis then
names the rank that never launched the operation the others are in.

Ranks: a communicator's ranks are its own. One of the job's size (the default process group's) gives the job's
ranks; a smaller one's ranks are mapped through the process (node and pid) that holds them in it, when the report
names that process there (JSON: always; text: only the ranks it lists).

What a RAS report cannot tell: times (no timing analysis runs), why a process is dead (a crash, a killed or
frozen node: "unreachable via the RAS network"), p2p operations, and whether a count difference lasts (a running
job's ranks differ for a moment; query twice).
"""

from __future__ import annotations

from pathlib import Path

from megatrace.config import Layout
from megatrace.load.importers.common import ImportedRank, ImportFormatError, build_traceset, group_id, new_columns
from megatrace.load.importers.nccl_ras_lines import Comm, RasReport, read_report
from megatrace.load.importers.sniff import looks_like_nccl_ras
from megatrace.load.traceset import LoadProblem, ProcFact, TraceSet, plural, rank_list
from megatrace.trace.ring_format import Flag, Op, State

NAME = "nccl-ras"
MAX_IN_FLIGHT = 1024  # operations in flight kept per rank and communicator (the newest)
OPS = {"Broadcast": Op.BROADCAST, "Reduce": Op.REDUCE, "AllGather": Op.ALL_GATHER,
       "ReduceScatter": Op.REDUCE_SCATTER, "AllReduce": Op.ALL_REDUCE}


def report_files(path: Path) -> list[Path]:
    """The report to read: ``path`` itself, or the files of directory ``path`` that start like one."""
    if path.is_file():
        return [path]
    try:
        return sorted(p for p in path.iterdir() if p.is_file() and looks_like_nccl_ras(p))
    except OSError as exc:
        raise ImportFormatError(f"{path}: cannot list it: {exc.strerror}") from None


def load_nccl_ras(path: Path, layout: Layout | None = None) -> TraceSet:
    """The NCCL RAS report in file ``path`` (or the one report in directory ``path``) as a :class:`TraceSet`."""
    files = report_files(path)
    if not files:
        raise ImportFormatError(f"{path}: no NCCL RAS report in it (a file starting 'NCCL version V compiled with "
                                f"CUDA C', or a JSON object with nccl_version and communicators)")
    if len(files) > 1:
        names = ", ".join(f.name for f in files[:4])
        raise ImportFormatError(f"{path}: {plural(len(files), 'NCCL RAS report')} in it ({names}); give one file: "
                                f"megatrace analyze {files[-1]}")
    rep = read_report(files[0])
    world = max([c.size for c in rep.comms.values()] + list(rep.sizes.values()) + [rep.processes]
                + [layout.world_size if layout is not None else 0])
    if world == 0:
        raise ImportFormatError(f"{files[0]}: no communicator and no process count in it: the report says nothing "
                                f"of the job (did the RAS query time out before any process answered?)")
    procs = _process_ranks(rep, world)
    problems: list[LoadProblem] = [LoadProblem(
        "info", "imported", f"read the NCCL RAS report {files[0].name} ({rep.form}, NCCL {rep.version or '?'}): "
        f"{plural(len(rep.comms), 'communicator')} with errors or full counts, "
        f"{plural(rep.n_dead or len(rep.dead), 'dead process')}, "
        f"{rep.n_missing or len(rep.unreachable)} other processes without data")]
    gone: dict[int, tuple[bool, str, int | None, str | None]] = {}  # job rank -> (dead, what RAS says, pid, node)
    rows: dict[int, list[tuple[int, int, int, int]]] = {}  # rank -> (gid, seq, op, state)
    groups, unmapped = [], []
    for c in rep.comms.values():
        members = _members(c, world, procs)
        if members is None:
            unmapped.append(c)
            continue
        gid = group_id(NAME, c.hash)
        groups.append({"kind": "group", "gid": gid, "name": f"comm {c.hash}", "desc": "world" if c.size == world
                       else "", "ranks": sorted(set(members.values())), "backend": "nccl"})
        for r, cr in c.ranks.items():
            g = members.get(r)
            if g is not None and cr.missing:
                how = "considered dead (unreachable via the RAS network)" if cr.dead else "sent no data to RAS"
                gone.setdefault(g, (cr.dead, f"NCCL RAS ({files[0].name}:{cr.line or '?'}): rank {r} of communicator "
                                              f"{c.hash}{_who(cr.pid, cr.node)}: {how}", cr.pid, cr.node))
        _positions(c, members, gid, rows, gone)
    for p in rep.dead + rep.unreachable:
        g = procs.get((p.node, p.pid))
        dead = p in rep.dead
        what = (f"NCCL RAS ({files[0].name}:{p.line}): process {p.pid} on node {p.node} (GPU {p.gpus}): "
                + ("considered dead (unreachable via the RAS network)" if dead else "sent no communicator data"))
        if g is None:
            problems.append(LoadProblem("warning" if dead else "info", "ras-process", what + "; its rank is not in "
                                        "the report (text reports name ranks only of communicators in error)"))
        elif g not in gone or dead:
            gone[g] = (dead, what, p.pid, p.node)
    for c in unmapped:
        problems.append(LoadProblem("warning", "ras-unmapped", _unmapped_text(c, files[0].name)))
    for r in gone:
        rows.pop(r, None)
    imported = [_rank_records(r, rr, str(files[0]), procs) for r, rr in sorted(rows.items()) if rr]
    if not imported:
        raise ImportFormatError(_nothing(rep, files[0], gone, unmapped))
    trace = build_traceset(path if path.is_dir() else path.parent, NAME, imported, world, problems, layout,
                           extra_groups=groups, names={g["gid"]: (g["name"], g["desc"]) for g in groups},
                           inferred="a RAS report gives each rank's count of launched collectives per communicator, "
                                    "not times", completions="order")
    trace.path = path
    _facts(trace, rep, gone, files[0])
    return trace


def _process_ranks(rep: RasReport, world: int) -> dict[tuple[str | None, int | None], int]:
    """(node, pid) -> job rank, from the communicators of the job's size (their ranks are the job's)."""
    out: dict[tuple[str | None, int | None], int] = {}
    for c in rep.comms.values():
        if c.size == world:
            for r, cr in c.ranks.items():
                if cr.pid is not None:
                    out.setdefault((cr.node, cr.pid), r)
    return out


def _members(c: Comm, world: int, procs: dict) -> dict[int, int] | None:
    """Communicator rank -> job rank; None where a listed rank's process is not known."""
    if c.size == world:
        return {r: r for r in range(world)}
    out = {}
    for r, cr in c.ranks.items():
        g = procs.get((cr.node, cr.pid))
        if g is None:
            return None
        out[r] = g
    return out if c.complete or not c.majority else None  # (text: unlisted members of a mismatch are unknown)


def _positions(c: Comm, members: dict[int, int], gid: int, rows: dict, gone: dict) -> None:
    """Records of one communicator: its last common operation (done), then each rank's own up to its count."""
    counted = [f for f in c.majority] if not c.complete else None
    pos: dict[int, tuple[int, dict[str, int]]] = {}
    for r, g in members.items():
        cr = c.ranks.get(r)
        if cr is not None and (cr.missing or cr.status == "NOCOMM") or g in gone:
            continue
        if c.complete:
            if cr is None:
                continue
            counts = cr.counts
        elif counted:
            counts = {f: (cr.counts.get(f, c.majority[f]) if cr is not None else c.majority[f]) for f in counted}
        else:
            counts = {}
        pos[g] = (sum(counts.values()), counts)
    if not pos:
        return
    low, high = min(p for p, _ in pos.values()), max(p for p, _ in pos.values())
    if high == 0 and (c.complete or counted):
        return  # nothing launched on any rank
    if not c.complete and not counted:  # text, no count difference: consistent, position unknown
        for g in pos:
            rows.setdefault(g, []).append((gid, 1, int(Op.UNKNOWN), int(State.COMPLETED)))
        return
    lows = [counts for p, counts in pos.values() if p == low]
    for g, (p, counts) in pos.items():
        ahead = [f for f in counts if any(counts[f] > lc.get(f, 0) for lc in lows)]
        op = OPS.get(ahead[0], Op.UNKNOWN) if len(ahead) == 1 else Op.UNKNOWN
        if low > 0:
            rows.setdefault(g, []).append((gid, low, int(Op.UNKNOWN), int(State.COMPLETED)))
        for seq in range(max(low + 1, p - MAX_IN_FLIGHT + 1), p + 1):
            rows.setdefault(g, []).append((gid, seq, int(op), int(State.ENQUEUED)))


def _rank_records(rank: int, rr: list[tuple[int, int, int, int]], path: str, procs: dict) -> ImportedRank:
    cols = new_columns(len(rr))
    for i, (gid, seq, op, state) in enumerate(rr):
        cols["group_id"][i], cols["group_seq"][i], cols["op"][i], cols["state"][i] = gid, seq, op, state
        cols["t_enqueue"][i] = i + 1  # the order only: RAS gives no times
        cols["flags"][i] = Flag.ASYNC
        if state == State.COMPLETED:
            cols["t_complete"][i] = i + 1
    node, pid = next(((n, p) for (n, p), r in procs.items() if r == rank), (None, None))
    return ImportedRank(rank, path, cols, host=node or "", pid=pid or 0)


def _who(pid: int | None, node: str | None) -> str:
    return f" (process {pid} on node {node})" if pid is not None else ""


def _unmapped_text(c: Comm, name: str) -> str:
    said = []
    for r, cr in sorted(c.ranks.items())[:6]:
        counts = ", ".join(f"{f} {n}" for f, n in cr.counts.items())
        said.append(f"rank {r}{_who(cr.pid, cr.node)}" + (f": launched up to {counts}" if counts else "")
                    + (f", {cr.error}" if cr.error else "") + (" (no data)" if cr.missing else ""))
    others = ", ".join(f"{f} {n}" for f, n in c.majority.items())
    return (f"NCCL RAS ({name}:{c.line or '?'}): communicator {c.hash} ({c.size} ranks, {'/'.join(sorted(c.errors))}) "
            f"is not analysed: its ranks are its own and their job ranks are not in the report; it says: "
            + "; ".join(said) + (f"; the other ranks launched up to {others}" if others else ""))


def _nothing(rep: RasReport, path: Path, gone: dict, unmapped: list[Comm]) -> str:
    if gone:
        return (f"{path}: NCCL RAS names {plural(len(gone), 'rank')} dead or without data "
                f"({rank_list(sorted(gone))}) and gives no position of any other rank")
    if unmapped:
        return f"{path}: {_unmapped_text(unmapped[0], path.name)}"
    return (f"{path}: NCCL RAS saw nothing wrong: no dead process, no communicator in error or mismatch"
            + (f" ({plural(len(rep.comms), 'communicator')})" if rep.comms else "")
            + "; nothing to analyse (RAS counts collectives, it does not time them: a slow job looks healthy)")


def _facts(trace: TraceSet, rep: RasReport, gone: dict[int, tuple[bool, str, int | None, str | None]],
           path: Path) -> None:
    """Notes per rank, the dead ranks, errors and status differences as the report gives them."""
    for r, (dead, what, pid, node) in gone.items():
        trace.facts.notes[r] = what
        if dead:  # gone; how (an exit, a signal, its node down) RAS cannot say
            trace.facts.procs[r] = ProcFact(r, pid=pid, node=node, alive=False, signal=(
                f"an unknown cause: NCCL RAS considers process {pid} on node {node} dead (unreachable via the RAS "
                f"network)" if pid is not None else "an unknown cause: NCCL RAS considers it dead"))
    said = []
    for c in rep.comms.values():
        for r, cr in sorted(c.ranks.items()):
            if cr.error and not cr.missing:
                said.append(f"rank {r} of communicator {c.hash}{_who(cr.pid, cr.node)} reported {cr.error}")
            elif cr.status in ("ABORT", "FINALIZE", "INIT", "NOCOMM") and not cr.missing:
                said.append(f"rank {r} of communicator {c.hash}{_who(cr.pid, cr.node)} has status {cr.status}")
    if said:
        trace.problems.append(LoadProblem("warning", "ras-errors", "NCCL RAS: " + "; ".join(said[:8])
                                          + (f" (and {len(said) - 8} more)" if len(said) > 8 else ""),
                                          paths=(str(path),)))
    if rep.timeouts:
        trace.problems.append(LoadProblem("warning", "ras-timeouts", f"NCCL RAS met {plural(rep.timeouts, 'timeout')} "
                                          f"while gathering the data: some processes did not answer in time"))
    if rep.ignored:
        trace.problems.append(LoadProblem("warning", "ras-lines", f"{path.name}: {plural(len(rep.ignored), 'line')} "
                                          f"not read (not the report's): " + "; ".join(rep.ignored[:5]),
                                          paths=(str(path),)))
    trace.problems.append(LoadProblem("info", "ras-snapshot", "a RAS report is one moment of a running job: a rank "
                                      "behind by an operation may be late, not stuck (query again: a hang keeps "
                                      "the same counts)"))
