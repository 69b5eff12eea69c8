"""Turn analysis facts into findings: hang root causes, mismatches, partial stops, input problems, clocks.

Each function reads the result of one analyzer and returns :class:`Finding`
objects; wording helpers live in :mod:`megatrace.analyze.words`.
"""

from __future__ import annotations

import numpy as np

from megatrace.analyze.clock import ClockAlignment
from megatrace.analyze.findings import Finding, Kind, Severity, Subject
from megatrace.analyze.hang import STALL_MIN_NS, HangAnalysis
from megatrace.analyze.hang_roots import RUNNING_OUTCOMES, STALLED_OUTCOMES, RankStatus, RootCause, Wait
from megatrace.analyze.match import MatchResult
from megatrace.analyze.words import collective_label, duration, rank_label, rank_list, rank_subject, record_label
from megatrace.load.traceset import TraceSet, plural
from megatrace.trace.ring_format import Op, Phase

CLOCK_NOTE_NS = 1_000_000  # host clock corrections above 1 ms are reported (info)
MAX_EVIDENCE = 12  # waiters listed one by one in a finding's evidence

REMEDIATION = {
    Kind.COMPUTE_HANG: "Inspect this rank's process while it hangs (py-spy dump --pid PID, or gdb/cuda-gdb for "
                       "a GPU kernel): it is stuck outside communication (data loading, a deadlock in the "
                       "training code, a wedged GPU). Check its log and the node's dmesg / GPU XID errors; "
                       "drain the node if the GPU or host is faulty.",
    Kind.COMM_HANG: "The collective itself is stuck: check the network between these hosts (NCCL_DEBUG=INFO, "
                    "link and switch errors, IB/RoCE counters), run nccl-tests on these nodes, and check the "
                    "GPUs for XID errors. Drain the nodes if a test fails.",
    Kind.CRASHED_PROCESS: "Read this rank's log for the error that ended it (OOM, a Python exception, a "
                          "signal); check dmesg on its node for OOM kills and GPU XID errors.",
    Kind.EXITED_EARLY: "This rank left the training loop earlier than its peers: it issued fewer collectives "
                       "(an early return, an uneven dataset shard, a rank-dependent condition). Compare the "
                       "number of iterations per rank.",
    Kind.NO_TRACE: "Collect this rank's ring file (node-local storage of its host) and its log; without it "
                   "the cause of its stop is unknown.",
    Kind.DEADLOCK: "The ranks issue communication in different orders: make every member of each group issue "
                   "the same collectives and point-to-point operations in the same order.",
    Kind.COLLECTIVE_MISMATCH: "Members of one group called different operations, sizes or dtypes for the same "
                              "collective: a program bug (rank-dependent code path, uneven tensor shapes). "
                              "Compare the code paths of the listed ranks.",
    Kind.STALL: "Every rank is alive but none has communicated for far longer than usual: dump every rank's "
                "stacks (py-spy dump --pid PID) to see where they are (a checkpoint, evaluation, data loading, "
                "a barrier outside torch.distributed); if it lasts, the job is hung outside traced communication.",
}
SILENT_IN_LOG_REMEDIATION = ("The others failed waiting for this rank in a collective and it printed nothing: it "
                             "was stuck outside communication (stopped, a deadlock, I/O, a GPU) or its output was "
                             "lost. Look at its node (dmesg, the process's state) and rerun with --megatrace, whose "
                             "rings and node agents show where such a rank stops.")
FROZEN_REMEDIATION = ("Its process stopped running: if it was stopped on purpose (kill -STOP, a debugger) resume it "
                      "(kill -CONT PID); otherwise dump its stacks (py-spy dump --pid PID) for the thread that holds "
                      "the interpreter, and check the node (dmesg, memory pressure, GPU XID errors).")


def _last_op_text(trace: TraceSet, hang: HangAnalysis, rank: int) -> str:
    row = hang.last_row.get(rank)
    if row is None:
        return "it recorded no operation at all"
    rec = trace.records
    label = record_label(trace, row)
    state = int(rec.state[row])
    ago = hang.end_ns - hang.last_activity.get(rank, hang.end_ns)
    verb = "completed" if state == 2 else "failed" if state == 3 else "was entered"
    if not timed(trace):
        return f"its last op, {label}, {verb}"
    return f"its last op, {label}, {verb} {duration(ago)} before the end of the trace"


def timed(trace: TraceSet) -> bool:
    """The trace has times (a job log gives the order of calls only: nothing is said of how long ago)."""
    return trace.completion_times != "order"


def _phase_text(trace: TraceSet, rank: int) -> str:
    """The last phase marker of a rank, when the job recorded markers."""
    rows = trace.rows(rank)
    ops = trace.records.op[rows]
    hits = np.flatnonzero(ops == Op.MARK_PHASE)
    if not len(hits):
        return ""
    row = rows.start + int(hits[-1])
    rec = trace.records
    try:
        phase = Phase(int(rec.dtype[row])).name.lower()
    except ValueError:
        phase = "unknown phase"
    mb = int(rec.peer[row])
    return f"last marker: step {int(rec.group_seq[row])}, {phase}" + (f" of microbatch {mb}" if mb >= 0 else "")


def _root_sentence(trace: TraceSet, hang: HangAnalysis, root: RootCause) -> str:
    w = root.chain_wait or root.first_wait
    if root.kind == "instance":
        d = root.detail
        assert d is not None
        if d.completed:
            return (f"every member entered it; ranks {rank_list(list(d.stuck))} never completed it "
                    f"(ranks {rank_list(list(d.completed))} did)")
        return "every member entered it and none completed"
    if root.kind == "link":
        return f"rank {root.ranks[1] if w and w.rank == root.ranks[0] else root.ranks[0]} entered the matching " \
               f"operation and neither side completed"
    if root.kind == "cycle":
        return f"ranks {rank_list(list(root.ranks))} wait on each other in a cycle"
    if root.kind == "blocked-unknown":
        return f"rank {root.ranks[0]} waits in {w.label if w else 'an operation'} whose partners are unknown"
    who = f"rank {root.ranks[0]}" if len(root.ranks) == 1 else f"ranks {rank_list(list(root.ranks))}"
    if w is not None and trace.records.op[w.row] in (Op.SEND, Op.RECV):
        other = "recv" if trace.records.op[w.row] == Op.SEND else "send"
        head = f"{who} never posted the matching {other}"
    else:
        head = f"{who} never entered it"
    if len(root.ranks) == 1 and w is not None and root.ranks[0] in _members_stuck_in(hang, w):
        head = f"{who} entered it and then stopped running"  # frozen inside: it waits for nothing, others for it
    if len(root.ranks) == 1:
        return f"{head}; {_stop_text(trace, hang, root.ranks[0])}"
    return f"{head}; " + "; ".join(f"rank {r}: {_stop_text(trace, hang, r)}" for r in root.ranks)


def _stop_text(trace: TraceSet, hang: HangAnalysis, rank: int) -> str:
    """What is known of a stopped rank: its last op, its process, what the input says of its stop."""
    status = hang.status.get(rank)
    if status == RankStatus.MISSING:
        note = trace.facts.notes.get(rank)
        return note if note else "it has no trace (its ring file is missing), so why is unknown"
    live = hang.liveness.frozen.get(rank) or hang.liveness.crashed.get(rank)
    if live:  # what its process says: stopped, wedged or gone
        return f"{live}; {_last_op_text(trace, hang, rank)}"
    note = trace.facts.notes.get(rank)
    tail = note if note and hang.last_row.get(rank) is None else _last_op_text(trace, hang, rank)
    if note and tail != note:
        tail += f"; {note}"
    proc = trace.facts.procs.get(rank)
    if proc is not None and proc.crashed:
        tail += f"; its process {proc.describe()}"
    elif status == RankStatus.FINISHED:
        tail += "; its process then exited (its tracer closed cleanly)"
    phase = _phase_text(trace, rank)
    return tail + (f" ({phase})" if phase else "")


def _members_stuck_in(hang: HangAnalysis, w: Wait) -> tuple[int, ...]:
    """The members of the instance a wait points at that entered it and never completed it."""
    target = w.target
    if isinstance(target, tuple) and target[0] == "inst" and target[1] in hang.details:
        return hang.details[target[1]].stuck
    return ()


def _classify(trace: TraceSet, hang: HangAnalysis, m: MatchResult, root: RootCause) -> Kind:
    if root.kind == "cycle":
        return Kind.DEADLOCK
    if root.kind == "instance":
        i = root.node[1]  # type: ignore[index]
        g = root.detail.group if root.detail is not None else None
        known = not (g is not None and g.assigned)  # (calls assigned to a group by inference prove no mismatch)
        return Kind.COLLECTIVE_MISMATCH if m.collectives.mismatch[i] and known else Kind.COMM_HANG
    if root.kind in ("link", "blocked-unknown"):
        return Kind.COMM_HANG
    rank = root.ranks[0]
    status = hang.status.get(rank)
    proc = trace.facts.procs.get(rank)
    if rank in hang.liveness.crashed:
        return Kind.CRASHED_PROCESS
    if rank in hang.liveness.frozen:
        return Kind.COMPUTE_HANG
    if status == RankStatus.MISSING:
        return Kind.CRASHED_PROCESS if proc is not None and proc.crashed else Kind.NO_TRACE
    if proc is not None and proc.crashed:
        return Kind.CRASHED_PROCESS
    if status == RankStatus.FINISHED:
        return Kind.EXITED_EARLY
    return Kind.COMPUTE_HANG


BASE_CONFIDENCE = {Kind.COMPUTE_HANG: 0.9, Kind.CRASHED_PROCESS: 0.95, Kind.EXITED_EARLY: 0.85,
                   Kind.COMM_HANG: 0.8, Kind.COLLECTIVE_MISMATCH: 0.9, Kind.DEADLOCK: 0.8, Kind.NO_TRACE: 0.5}


def _verdict(trace: TraceSet, kind: Kind, root: RootCause, n_wait: int, hosts: list[str],
             mismatches: list, hang: HangAnalysis) -> str:
    w = root.first_wait
    waiting = f"{n_wait} rank{'s' if n_wait != 1 else ''} wait{'s' if n_wait == 1 else ''}"
    what = f" in {w.label}" if w else ""
    if kind in (Kind.COMPUTE_HANG, Kind.CRASHED_PROCESS, Kind.EXITED_EARLY, Kind.NO_TRACE):
        what = f" (first rank {w.rank}, in {w.label})" if w else ""
        named = [rank_label(trace, r).removeprefix("rank ") for r in root.ranks[:MAX_EVIDENCE]]
        who = f"rank {named[0]}" if len(named) == 1 else "ranks " + ", ".join(named[:-1]) + " and " + named[-1] + \
            (f" (and {len(root.ranks) - len(named)} more)" if len(root.ranks) > len(named) else "")
        frozen = all(r in hang.liveness.frozen for r in root.ranks)
        head = {Kind.COMPUTE_HANG: f"{who} stopped running" if frozen else f"{who} stopped outside communication",
                Kind.CRASHED_PROCESS: f"{who} crashed",
                Kind.EXITED_EARLY: f"{who} exited early",
                Kind.NO_TRACE: f"{who} has no trace"}[kind]
        if root.silence_ns is not None and kind != Kind.NO_TRACE and timed(trace):
            head += f" {duration(root.silence_ns)} before the end of the trace"
        return f"{head}; {waiting} for {'it' if len(root.ranks) == 1 else 'them'}{what}" if n_wait else head
    if kind == Kind.DEADLOCK:
        return (f"deadlock: ranks {rank_list(list(root.ranks))} wait on each other in a cycle; "
                f"{n_wait} more wait on them")
    where = f" on host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)}" if hosts else ""
    if root.kind == "link":
        src, dst = root.ranks
        return (f"communication hang on the link rank {src} → rank {dst}{where}: both entered{what} and neither "
                f"completed")
    if root.kind == "blocked-unknown":
        return f"rank {root.ranks[0]} is blocked{what}; its partners are unknown"
    d = root.detail
    assert d is not None
    label = collective_label(trace, d.gid, int(trace.records.op[next(iter(d.rows.values()))]), d.seq)
    if kind == Kind.COLLECTIVE_MISMATCH:
        what = "; ".join(f"{mm.field}: " + ", ".join(f"{v} on ranks {rank_list(list(r))}" for v, r in mm.values.items())
                         for mm in mismatches if mm.gid == d.gid and mm.seq == d.seq and not mm.p2p)
        return (f"collective mismatch hangs {label}{where}: the members disagree ({what or 'op, size or dtype'})"
                + (f"; {n_wait} more ranks wait on it" if n_wait else ""))
    return (f"communication hang in {label}{where}: all {len(d.members)} members entered and none completed"
            + (f"; {n_wait} more ranks wait on it" if n_wait else ""))


def hang_findings(trace: TraceSet, m: MatchResult, hang: HangAnalysis) -> list[Finding]:
    """One finding per root cause, plus partial stops and crashed ranks no hang explains."""
    out: list[Finding] = []
    coverage = trace.coverage
    explained: set[int] = set()
    for root in hang.roots:
        kind = _classify(trace, hang, m, root)
        hosts = sorted({h for h in (trace.host_of(r) for r in root.ranks) if h})
        n_wait = len([r for r in root.waiters if r not in root.ranks])
        chain = " → ".join(root.chain + [_root_sentence(trace, hang, root)])
        evidence: list = [f"wait chain: {chain}"]
        if root.kind == "instance" and root.detail is not None:
            evidence += _instance_evidence(trace, hang, root)
        for r in root.waiters[:MAX_EVIDENCE]:
            waits = "; ".join(_wait_text(hang, w, timed(trace)) for w in hang.waits.get(r, ()))
            if waits:
                evidence.append(f"rank {r} waits in {waits}")
        if len(root.waiters) > MAX_EVIDENCE:
            evidence.append(f"… and {len(root.waiters) - MAX_EVIDENCE} more waiting ranks")
        victims = [r for r in root.waiters if (p := trace.facts.procs.get(r)) is not None and p.crashed]
        if victims:
            evidence.append(f"ranks {rank_list(victims)} then exited with errors too: their calls failed once "
                            "the culprit stopped (consequences, not causes)")
        if root.usual_gap_ns and root.silence_ns is not None and timed(trace):
            evidence.append(f"stopped {duration(root.silence_ns)} before the end of the trace; its usual gap "
                            f"between calls is {duration(root.usual_gap_ns)} (p95)")
        confidence = BASE_CONFIDENCE.get(kind, 0.7) * (0.5 + 0.5 * coverage) * (1.0 if root.confirmed else 0.5)
        verdict = _verdict(trace, kind, root, n_wait, hosts, m.mismatches, hang)
        if not root.confirmed:
            short = root.silence_ns is None or root.silence_ns < STALL_MIN_NS
            verdict = ("possible hang (short stop, maybe in flight when the trace ended): " if short else
                       "possible hang (not confirmed: its usual gap between calls is as long): ") + verdict
        subject, ident = _root_subject(trace, kind, root, hosts)
        explained.update(root.ranks)
        frozen = root.kind == "rank" and root.ranks[0] in hang.liveness.frozen
        out.append(Finding(
            id=ident, severity=Severity.CRITICAL if root.confirmed else Severity.WARNING, kind=kind,
            subject=subject, verdict=verdict, evidence=evidence,
            remediation=FROZEN_REMEDIATION if frozen else SILENT_IN_LOG_REMEDIATION
            if kind == Kind.NO_TRACE and trace.source_format == "job-log" else REMEDIATION.get(kind, ""),
            confidence=confidence, impact=len(set(root.waiters) | set(root.ranks)),
            data={"chain": root.chain + [_root_sentence(trace, hang, root)], "waiters": list(root.waiters),
                  "stop_ns": root.stop_ns, "silence_ns": root.silence_ns, "usual_gap_ns": root.usual_gap_ns,
                  "confirmed": root.confirmed}))
    if hang.progressing:
        out.append(Finding(
            id="partial-stop", severity=Severity.WARNING, kind=Kind.PARTIAL_STOP,
            subject=Subject(ranks=tuple(hang.progressing)),
            verdict=f"only part of the job stopped: {plural(len(hang.progressing), 'rank')} still progressing at "
                    f"the end of the trace while {len(hang.blocked)} were blocked",
            evidence=[f"still progressing: ranks {rank_list(hang.progressing)}"],
            remediation="Those ranks will block as soon as they need a stuck rank; the root cause above applies.",
            confidence=0.8, impact=len(hang.progressing)))
    for rank, why in sorted(hang.liveness.crashed.items()):
        if rank not in explained:
            explained.add(rank)
            out.append(Finding(
                id=f"crashed-process:rank-{rank}", severity=Severity.CRITICAL, kind=Kind.CRASHED_PROCESS,
                subject=rank_subject(trace, rank), verdict=f"{rank_label(trace, rank)} crashed: {why}",
                evidence=[_last_op_text(trace, hang, rank)], remediation=REMEDIATION[Kind.CRASHED_PROCESS],
                confidence=0.9, impact=1))
    for rank, proc in sorted((r, p) for r, p in trace.facts.procs.items() if p.crashed):
        if rank not in explained and hang.status.get(rank) != RankStatus.BLOCKED:
            out.append(Finding(
                id=f"crashed-process:rank-{rank}",  # (a trace of no calls, a job log's crash alone: the job's end)
                severity=Severity.CRITICAL if not hang.finished or not len(trace.records) else Severity.ERROR,
                kind=Kind.CRASHED_PROCESS, subject=rank_subject(trace, rank),
                verdict=f"{rank_label(trace, rank)} {proc.describe()}",
                evidence=[trace.facts.notes.get(rank)
                          or f"procs.json: pid {proc.pid}, exit code {proc.exit_code}, signal {proc.signal}"],
                remediation=REMEDIATION[Kind.CRASHED_PROCESS], confidence=0.95, impact=1))
    return out


def _root_subject(trace: TraceSet, kind: Kind, root: RootCause, hosts: list[str]) -> tuple[Subject, str]:
    """The subject of a root cause's finding, and the finding's id."""
    if kind in (Kind.COMPUTE_HANG, Kind.CRASHED_PROCESS, Kind.EXITED_EARLY, Kind.NO_TRACE):
        group = trace.groups.get(int(trace.records.group_id[root.first_wait.row])) if root.first_wait else None
        subject = rank_subject(trace, root.ranks[0], group) if len(root.ranks) == 1 else \
            Subject(ranks=root.ranks, hosts=tuple(hosts), group=group.to_dict() if group else None)
        ident = f"{kind.value}:rank-{root.ranks[0]}" if len(root.ranks) == 1 else \
            f"{kind.value}:ranks-{'-'.join(map(str, root.ranks[:8]))}"
    elif root.kind == "instance" and root.detail is not None:
        g = root.detail.group
        subject = Subject(ranks=tuple(root.detail.members), hosts=tuple(hosts), group=g.to_dict() if g else None)
        ident = f"{kind.value}:group-{root.detail.gid}-seq-{root.detail.seq}"
    elif root.kind == "link":
        subject = Subject(ranks=root.ranks, hosts=tuple(hosts), link=(root.ranks[0], root.ranks[1]))
        ident = f"{kind.value}:link-{root.ranks[0]}-{root.ranks[1]}"
    else:
        subject = Subject(ranks=root.ranks, hosts=tuple(hosts))
        ident = f"{kind.value}:ranks-{'-'.join(map(str, root.ranks[:8]))}"
    return subject, ident


def _instance_evidence(trace: TraceSet, hang: HangAnalysis, root: RootCause) -> list[str]:
    """Members by host and their arrival order in a stuck collective (the last arrival is a suspect)."""
    d = root.detail
    assert d is not None
    by_host: dict[str, list[int]] = {}
    for r in d.members:
        by_host.setdefault(trace.host_of(r) or "unknown host", []).append(r)
    te = hang.t_enqueue
    arrivals = sorted((int(te[row]), r) for r, row in d.rows.items())
    first = arrivals[0][0] if arrivals else 0
    order = ", ".join(f"rank {r} +{duration(t - first)}" for t, r in arrivals[:MAX_EVIDENCE])
    hosts = "members by host: " + "; ".join(f"{h}: {rank_list(rs)}" for h, rs in sorted(by_host.items()))
    if not timed(trace):
        return [hosts]
    return [hosts, f"arrival order: {order}" + (" …" if len(arrivals) > MAX_EVIDENCE else "")]


def _wait_text(hang: HangAnalysis, w: Wait, timed: bool = True) -> str:
    text = w.label + (f" since {duration(hang.end_ns - w.since_ns)} before the end" if timed else "")
    if w.failed:
        text += " (failed)"
    if w.outstanding_async:
        text += " (outstanding async op)"
    return text


def mismatch_findings(trace: TraceSet, m: MatchResult) -> list[Finding]:
    """One finding per group and field whose members disagree (a program bug, not a hardware fault)."""
    by_key: dict[tuple[int, str, bool], list] = {}
    for mm in m.mismatches:
        by_key.setdefault((mm.gid, mm.field, mm.p2p), []).append(mm)
    out = []
    assigned = {k: v for k, v in by_key.items() if (g := trace.groups.get(k[0])) is not None and g.assigned}
    for key in assigned:
        by_key.pop(key)
    if assigned:
        items = [mm for v in assigned.values() for mm in v]
        out.append(Finding(
            id="trace-problem:inferred-communicator-disagrees", severity=Severity.WARNING, kind=Kind.TRACE_PROBLEM,
            subject=Subject(ranks=tuple(sorted({r for mm in items for rs in mm.values.values() for r in rs}))),
            verdict=f"calls that inference put in one communicator disagree ({len(items)} of them, first: "
                    f"{items[0].describe()}): the input names no communicator (no groupHash), so they may be calls "
                    f"of different ones; no mismatch is claimed",
            evidence=[mm.describe() for mm in items[:MAX_EVIDENCE]], confidence=1.0,
            impact=len({k[0] for k in assigned})))
    for (gid, field_name, p2p), items in sorted(by_key.items()):
        g = trace.groups.get(gid)
        first = items[0]
        ranks = sorted({r for mm in items for rs in mm.values.values() for r in rs})
        odd = _odd_ones(items)
        out.append(Finding(
            id=f"collective-mismatch:group-{gid}-{field_name}{'-p2p' if p2p else ''}", severity=Severity.ERROR,
            kind=Kind.COLLECTIVE_MISMATCH,
            subject=Subject(ranks=odd or tuple(ranks), group=g.to_dict() if g else None),
            verdict=(f"{_ranks_words(odd)} the odd one out (every other member agrees): " if odd else "") +
                    f"{len(items)} {'send/recv pair' if p2p else 'collective'}{'s' if len(items) > 1 else ''} of "
                    f"{trace.group_label(gid)} disagree{'' if len(items) > 1 else 's'} on {field_name}: "
                    f"{'first ' if len(items) > 1 else ''}{first.describe()}",
            evidence=[mm.describe() for mm in items[:MAX_EVIDENCE]], remediation=REMEDIATION[Kind.COLLECTIVE_MISMATCH],
            confidence=0.95, impact=len(ranks)))
    return out


def _odd_ones(items: list) -> tuple[int, ...]:
    """The ranks that hold a value every other member of their collective disagrees with (a strict minority
    against one shared majority value, in every mismatch of the group); () when no such minority exists.
    A mismatch is a program bug on some rank: naming the minority, not the whole group, points at it."""
    odd: set[int] = set()
    for mm in items:
        if mm.p2p or len(mm.values) != 2:
            return ()
        few, many = sorted(mm.values.values(), key=len)
        if len(few) >= len(many):
            return ()
        odd.update(few)
    return tuple(sorted(odd))


def _ranks_words(ranks: tuple[int, ...]) -> str:
    return f"rank {ranks[0]} is" if len(ranks) == 1 else f"ranks {rank_list(list(ranks))} are"


def trace_findings(trace: TraceSet, clock: ClockAlignment) -> list[Finding]:
    """Input problems and clock facts, as findings (the analysis went on with what was usable)."""
    sev = {"error": Severity.ERROR, "warning": Severity.WARNING, "info": Severity.INFO}
    out: list[Finding] = []
    seen: dict[str, int] = {}
    for p in trace.problems:
        seen[p.code] = seen.get(p.code, 0) + 1
        ident = f"trace-problem:{p.code}" + (f"-{seen[p.code]}" if seen[p.code] > 1 else "")
        out.append(Finding(id=ident, severity=sev.get(p.severity, Severity.WARNING), kind=Kind.TRACE_PROBLEM,
                           subject=Subject(ranks=p.ranks), verdict=p.message, evidence=list(p.paths[:MAX_EVIDENCE]),
                           confidence=1.0, impact=len(p.ranks)))
    big = {h: c for h, c in clock.correction_ns.items() if abs(c) >= CLOCK_NOTE_NS}
    if big or clock.notes:
        out.append(Finding(
            id="clock:alignment", severity=Severity.INFO, kind=Kind.CLOCK, subject=Subject(hosts=tuple(sorted(big))),
            verdict=(f"host clocks disagreed by up to {duration(max(map(abs, big.values())))}; corrected from "
                     f"collective completion times" if big else clock.notes[0]),
            evidence=[f"{h}: {c / 1e6:+.3f} ms" for h, c in sorted(big.items())] + clock.notes,
            confidence=0.9, data=clock.summary()))
    return out


def stall_finding(trace: TraceSet, hang: HangAnalysis) -> Finding:
    """Every rank alive and silent far longer than usual, and no rank to blame: the job is stalled."""
    st = hang.stall
    assert st is not None
    quiet = min(st.silence_ns.values())
    n = len(st.silence_ns)
    where = (f"{plural(len(st.blocked), 'rank')} wait inside communication ({rank_list(list(st.blocked))}), the "
             f"others outside it" if st.blocked else "none of them is inside a traced collective")
    return Finding(
        id="stall", severity=Severity.WARNING, kind=Kind.STALL, subject=Subject(ranks=tuple(sorted(st.silence_ns))),
        verdict=f"the job is stalled: all {plural(n, 'rank')} silent for at least {duration(quiet)} (their usual gap "
                f"between calls is {duration(st.usual_gap_ns)}) while their processes are alive; {where}",
        evidence=[f"rank {r}: last call {duration(t)} before the trace was read" for r, t in
                  sorted(st.silence_ns.items())[:MAX_EVIDENCE]],
        remediation=REMEDIATION[Kind.STALL], confidence=0.7 * trace.coverage, impact=n,
        data={"silence_ns": {str(r): t for r, t in st.silence_ns.items()}, "usual_gap_ns": st.usual_gap_ns})


def healthy_finding(trace: TraceSet, m: MatchResult, hang: HangAnalysis) -> Finding:
    """The finding when no rank waits on anything: a clean run, or a stop outside traced communication."""
    s = m.summary()
    if hang.liveness.ended_together:
        followers = hang.liveness.followers
        how = ("within moments of each other, from outside or failing as the others went" if followers else
               "at the same moment without closing its tracer")
        return Finding(id="healthy", severity=Severity.INFO, kind=Kind.HEALTHY, subject=Subject(),
                       verdict=f"no hang: every process ended {how} (the job was ended as a whole: a time limit, a "
                               f"cancel) and no rank had stopped before ({s['collective_instances']} collectives, "
                               f"{s['p2p_pairs']} point-to-point pairs)",
                       evidence=[f"{'rank' if len(followers) == 1 else 'ranks'} {', '.join(map(str, followers[:8]))} "
                                 f"closed the tracer after the others were ended from outside (SIGTERM): "
                                 f"communication failed as they went"] if followers else [],
                       confidence=0.8 * trace.coverage, impact=len(trace.ranks))
    if hang.finished:
        evidence = []
        if hang.leftover_pending:
            evidence.append(f"{hang.leftover_pending} operations never recorded a completion although every rank "
                            "exited cleanly (completion not observable, e.g. async work never waited on)")
        return Finding(id="healthy", severity=Severity.INFO, kind=Kind.HEALTHY, subject=Subject(),
                       verdict=f"no hang: all {plural(len(trace.ranks), 'traced rank')} completed every operation "
                               f"({s['collective_instances']} collectives, {s['p2p_pairs']} point-to-point pairs)",
                       evidence=evidence, confidence=0.9 * trace.coverage,
                       impact=len(trace.ranks))  # the verdict of a clean run, ahead of facts like the clocks'
    if trace.facts.outcome in RUNNING_OUTCOMES:
        return Finding(id="healthy", severity=Severity.INFO, kind=Kind.HEALTHY, subject=Subject(),
                       verdict=f"no hang: the job was still running when it was collected, and no rank had stopped "
                               f"for long ({s['collective_instances']} collectives, {s['p2p_pairs']} point-to-point "
                               f"pairs)",
                       evidence=[trace.facts.message] if trace.facts.message else [],
                       confidence=0.8 * trace.coverage, impact=len(trace.ranks))
    stalled = trace.facts.outcome in STALLED_OUTCOMES
    running = sorted(r for r, st in hang.status.items() if st == RankStatus.STOPPED)
    evidence = [f"ranks whose tracer did not close (still running, or killed): {rank_list(running)}"] if running else []
    if stalled:
        evidence.append(f"the launcher reported: {trace.facts.message or trace.facts.outcome}")
    return Finding(
        id="possible-hang:outside-communication", severity=Severity.WARNING if stalled else Severity.INFO,
        kind=Kind.POSSIBLE_HANG, subject=Subject(ranks=tuple(running)),
        verdict=("the job stalled, but no rank is blocked in traced communication: every rank stopped outside it "
                 "(data loading, untraced calls, or before its first collective)" if stalled else
                 f"no rank is blocked in communication at the end of the trace ({plural(len(trace.ranks), 'rank')}, "
                 f"{s['collective_instances']} collectives); the job had not finished when it was traced"),
        evidence=evidence, confidence=0.6 * trace.coverage)
