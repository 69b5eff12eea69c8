"""A job stuck before communication started: ranks in ``init_process_group`` (start markers, no ring).

A rank's ring appears once ``init_process_group`` has returned; as it enters the call the tracer writes
a start marker (``rank-NNNNN.init``, :mod:`megatrace.trace.init_marker`). Markers without rings mean
the job never got through its rendezvous. The verdict names, most specific first:

* a rendezvous address that does not resolve on a node (the collector looked it up there:
  ``nodes/<node>.json`` "rendezvous");
* ranks that never reached ``init_process_group`` (no marker, no ring) while the others wait for them;
* a rank whose process died inside the call;
* an address that resolves but where nothing accepts connections (the store's host rank is not running);
* otherwise, every rank waiting in the call, cause unknown.
"""

from __future__ import annotations

from typing import Any

from megatrace.analyze.findings import Finding, Kind, Severity, Subject
from megatrace.load.traceset import TraceSet, plural, rank_list

MAX_LISTED = 8

REMEDIATION = ("Nothing was communicated yet, so no collective is to blame. Check the rendezvous first: "
               "MASTER_ADDR must resolve on every node (getent hosts ADDR) and MASTER_PORT must be free and "
               "reachable on the node of rank 0; a rank that never reached init_process_group is stuck in its "
               "own start-up (data or checkpoint loading, a lock, a failing import): look at its stack (py-spy "
               "dump --pid PID) and its output.")


def startup_findings(trace: TraceSet) -> list[Finding]:
    """The verdict of a job stuck before communication started (markers, and no ring for those ranks)."""
    markers = trace.init_markers
    waiting = sorted(r for r in markers if not trace.has(r))
    if not waiting:
        return []
    rdv = trace.facts.rendezvous
    never = sorted(set(range(trace.world_size)) - set(markers) - {int(r) for r in trace.ranks})
    endpoints = sorted({markers[r].endpoint for r in waiting})
    where = " / ".join(endpoints)
    dead = [r for r in waiting if (p := trace.facts.procs.get(r)) is not None and p.alive is False]
    unresolved = {ep: {n: str(res.get("error") or "does not resolve") for n, res in by_node.items()
                       if res.get("resolves") is False} for ep, by_node in rdv.items()}
    unresolved = {ep: nodes for ep, nodes in unresolved.items() if nodes}
    refused = {ep: {n: str(res.get("connect_error") or "refused") for n, res in by_node.items()
                    if res.get("connects") is False} for ep, by_node in rdv.items()}
    refused = {ep: nodes for ep, nodes in refused.items() if nodes}
    evidence: list[str | dict[str, Any]] = [
        f"{plural(len(waiting), 'rank')} entered init_process_group and never left it ({rank_list(waiting)}): each "
        f"wrote its start marker, none its ring (a ring is made when the call returns)"]
    for ep, by_node in sorted(rdv.items()):
        evidence.append(f"rendezvous {ep}, as each node saw it: " + "; ".join(
            f"{n}: {_reach_text(res)}" for n, res in sorted(by_node.items())[:MAX_LISTED]))
    evidence += [f"rank {r} (host {markers[r].host}): {_proc_text(trace, r)}" for r in waiting[:MAX_LISTED]]
    subject = Subject(ranks=tuple(waiting), hosts=tuple(sorted({markers[r].host for r in waiting if markers[r].host})))
    if unresolved:
        ep, nodes = next(iter(sorted(unresolved.items())))
        addr = ep.rsplit(":", 1)[0]
        verdict = (f"stuck before communication started: the rendezvous address {addr} does not resolve on "
                   f"{plural(len(nodes), 'node')} ({', '.join(sorted(nodes)[:MAX_LISTED])}: "
                   f"{next(iter(nodes.values()))}); {plural(len(waiting), 'rank')} wait in init_process_group")
        kind_id = "unresolved-address"
    elif never:
        who = f"rank {never[0]}" if len(never) == 1 else f"ranks {rank_list(never)}"
        verdict = (f"stuck before communication started: {who} never reached init_process_group; "
                   f"{plural(len(waiting), 'rank')} wait there for {'it' if len(never) == 1 else 'them'} "
                   f"(rendezvous at {where})")
        subject = Subject(ranks=tuple(never), rank=never[0] if len(never) == 1 else None)
        evidence[:0] = [f"{who} wrote no start marker and no ring: {'its' if len(never) == 1 else 'their'} "
                        f"program did not call init_process_group (still starting up, stuck before it, or not a "
                        f"traced process)"] + [f"rank {r}: {_proc_text(trace, r, 'before init_process_group')}"
                                               for r in never[:MAX_LISTED] if r in trace.facts.procs]
        kind_id = "never-reached"
    elif dead:
        verdict = (f"stuck before communication started: the process of {plural(len(dead), 'rank')} "
                   f"({rank_list(dead)}) died inside init_process_group; the others wait for it there")
        kind_id = "died-in-init"
    elif refused:
        ep, nodes = next(iter(sorted(refused.items())))
        verdict = (f"stuck before communication started: nothing accepts connections at the rendezvous {ep} "
                   f"({', '.join(sorted(nodes)[:MAX_LISTED])}: {next(iter(nodes.values()))}); the store is "
                   f"served by rank 0's process: is it running, on that address and port?")
        kind_id = "refused"
    else:
        verdict = (f"stuck before communication started: all {plural(len(waiting), 'rank')} wait in "
                   f"init_process_group and the rendezvous at {where} has not completed")
        kind_id = "waiting"
    return [Finding(id=f"startup-hang:{kind_id}", severity=Severity.CRITICAL, kind=Kind.STARTUP_HANG,
                    subject=subject, verdict=verdict, evidence=evidence, remediation=REMEDIATION,
                    confidence=0.9 if kind_id != "waiting" else 0.7, impact=trace.world_size,
                    data={"in_init": waiting, "never_reached": never, "endpoints": endpoints})]


def _proc_text(trace: TraceSet, rank: int, where: str = "inside init_process_group") -> str:
    proc = trace.facts.procs.get(rank)
    if proc is None or proc.alive is None:
        return f"{where.removeprefix('inside ')} (its process was not looked at)"
    node = f" on {proc.node}" if proc.node else ""
    if proc.alive is False:
        return f"its process{node} is gone (it died {where})"
    state = f", {proc.state}" if proc.state else ""
    return (f"its process{node} (pid {proc.pid}) still runs{state}"
            + (f", waiting in {proc.wchan}" if proc.wchan else "")
            + (f"; its main thread (py-spy, innermost first): {' < '.join(proc.stack)}" if proc.stack else ""))


def _reach_text(res: dict[str, Any]) -> str:
    if res.get("resolves") is False:
        return f"does not resolve ({res.get('error') or 'unknown error'})"
    addrs = res.get("addresses")
    text = f"resolves to {', '.join(map(str, addrs[:3]))}" if isinstance(addrs, list) and addrs else "resolves"
    if res.get("connects") is True:
        text += ", accepts connections"
    elif res.get("connects") is False:
        text += f", refuses connections ({res.get('connect_error') or 'refused'})"
    return text
