"""Whether each rank's process still runs: its heartbeat, and, on the analysing host, ``/proc``.

Rings are read while jobs run (``megatrace analyze`` on a hung job's node-local rings, the node
agent) and after they end. Two sources say which processes were alive and when the trace was
observed, neither of them a guess:

* the **heartbeat** each torch tracer writes into its ring header ten times a second from a Python
  thread (``RankInfo.heartbeat_ns``), and the **pulse** its C writer's native thread writes every
  10 ms (``RankInfo.pulse_ns``): the newest of them is the moment the job was last seen; a rank whose
  beats stopped long before the others' was stopped, killed or wedged, and one whose pulse goes on
  while its heartbeat stopped has a wedged interpreter;
* the **signal mark** the C writer leaves in the header when a SIGTERM ends the process
  (``RankInfo.signal_ns``): that process was ended from outside (a launcher ending the rest of a job
  after one rank died, a time limit, a cancel); a SIGKILL or a crash leaves none;
* the **process table** of this host, for rings still open that a process of this host writes:
  running, stopped (``T``: SIGSTOP, a debugger), or gone. A pid is trusted only if its process
  started before its ring was created (a recycled pid is not the writer); a process already
  exiting, or with SIGKILL pending, is gone (a launcher's kill still tearing down a big process).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatrace.load.probe import ENDING, GONE, RUNNING, STOPPED
from megatrace.load.traceset import ProcessProbe, RankInfo

# -- assessment ---------------------------------------------------------------------------------
FROZEN_NS = 3_000_000_000  # a heartbeat this far behind the job's newest one: the process stopped beating
#                            (30 missed beats; a loaded host delays a beat by far less)
DEATH_TIE_PULSE_NS = 30_000_000  # processes gone within this of the first went with it (three 10 ms pulses) ...
DEATH_TIE_NS = 200_000_000  # ... or within this without a pulse (two 100 ms heartbeats)


@dataclass
class Liveness:
    """Per rank, whether its process was alive at the end of the trace, and the time the job was observed.

    Times are aligned (the clock alignment's timeline). ``frozen``: the process stopped running (stopped,
    or wedged so that its heartbeat thread cannot run) while others went on; it waits for nothing, others
    wait for it. ``crashed``: it is gone without closing its ring while others outlived it.
    ``ended_together``: every process is gone, none closed its ring, and they went within moments of each
    other: the job was ended as a whole (a time limit, a cancel), which names no culprit.
    """

    observed_ns: int | None = None  # the last moment any source saw the job (a heartbeat, this host's probe)
    seen_ns: dict[int, int] = field(default_factory=dict)  # per rank: its last record or heartbeat, whichever later
    frozen: dict[int, str] = field(default_factory=dict)  # rank -> evidence
    crashed: dict[int, str] = field(default_factory=dict)  # rank -> evidence
    ended_together: bool = False
    followers: list[int] = field(default_factory=list)  # closed their tracer after the job was being ended
    alive: bool = False  # some process still ran when the trace was observed

    def culprits(self) -> set[int]:
        return set(self.frozen) | set(self.crashed)


def _first_gone(ranks: list[int], seen: dict[int, int], tie: int) -> list[int]:
    """Of ``ranks`` gone, those last seen within ``tie`` of the first of them."""
    first = min((seen[r] for r in ranks), default=0)
    return [r for r in ranks if seen[r] - first <= tie]


def _duration(ns: int) -> str:
    from megatrace.analyze.words import duration

    return duration(ns)


def assess(infos: list[RankInfo], rank_offset_ns: list[int], host_offset_ns: dict[str, int],
           last_activity: dict[int, int], probe: ProcessProbe | None) -> Liveness:
    """Judge each rank from its heartbeat and pulse, this host's probe, and its ring's state (see
    :class:`Liveness`). ``rank_offset_ns`` aligns each rank's monotonic clock (``infos`` order);
    ``last_activity`` is the aligned time of each rank's last record.

    Of several processes gone, those last seen within ``DEATH_TIE_PULSE_NS`` of the first (``DEATH_TIE_NS``
    without a native pulse to date them) crashed; the others went after them (a launcher killing the rest).
    A signal mark settles what timing cannot: processes that died unmarked (with a pulse, so they would
    have been marked) before the first SIGTERM reached any rank crashed, and the marked ones were ended
    after them, however close together; a job whose processes all ended by SIGTERM ended as a whole.
    """
    out = Liveness()
    beats: dict[int, int] = {}
    pulses: dict[int, int] = {}
    signals: dict[int, int] = {}
    for info, off in zip(infos, rank_offset_ns, strict=True):
        if info.signal_ns > 0 and not info.closed_cleanly:
            signals[info.rank] = info.signal_ns + int(off)
        if info.heartbeat_ns > 0:
            beats[info.rank] = info.heartbeat_ns + int(off)
        if info.pulse_ns > 0:
            pulses[info.rank] = info.pulse_ns + int(off)
        seen = max(last_activity.get(info.rank, 0), beats.get(info.rank, 0), pulses.get(info.rank, 0))
        if seen:
            out.seen_ns[info.rank] = seen
    states = probe.states if probe is not None else {}
    probe_ns = (probe.mono_ns + host_offset_ns[probe.host] if probe is not None and probe.host in host_offset_ns
                else None)
    out.alive = any(s in (RUNNING, STOPPED) for s in states.values()) \
        or any(not i.closed_cleanly and i.rank not in states and (i.rank in beats or i.rank in pulses) for i in infos)
    candidates = list(out.seen_ns.values()) + ([probe_ns] if probe_ns is not None and out.alive else [])
    out.observed_ns = max(candidates) if candidates else None
    if out.observed_ns is None:
        return out
    for rank, state in states.items():  # asked to end (SIGTERM pending): marked by the probe's time at the latest
        if state == ENDING and rank not in signals and probe_ns is not None:
            signals[rank] = probe_ns
    now = out.observed_ns
    newest = max(list(beats.values()) + list(pulses.values()), default=None)  # the liveliest rank's last sign
    by_rank = {i.rank: i for i in infos}
    gone = []
    for rank, info in by_rank.items():
        if info.closed_cleanly:
            continue
        state, beat, pulse = states.get(rank), beats.get(rank), pulses.get(rank)
        beat_stale = beat is not None and newest is not None and newest - beat > FROZEN_NS
        pulse_live = pulse is not None and newest is not None and newest - pulse <= FROZEN_NS
        if state == STOPPED:
            out.frozen[rank] = f"its process (pid {info.pid}) is stopped (state T: SIGSTOP or a debugger)" + (
                f"; its last heartbeat was {_duration(now - beat)} before the trace was read" if beat else "")
        elif state in (GONE, ENDING):
            gone.append(rank)
        elif beat_stale and (state == RUNNING or pulse_live):
            out.frozen[rank] = (f"its tracer's heartbeat stopped {_duration(now - beat)} before the trace was read "
                                "while its process still runs: the Python interpreter is wedged (a thread holds "
                                "the GIL and does not let it go)")
        elif beat_stale:
            out.frozen[rank] = (f"its tracer's heartbeat stopped {_duration(now - beat)} before the trace was read "
                                "while the other ranks' went on: its process stopped running (stopped or killed)")
    if gone:
        _judge_gone(out, gone, now, signals, pulses, states, by_rank)
    return out


def _judge_gone(out: Liveness, gone: list[int], now: int, signals: dict[int, int], pulses: dict[int, int],
                states: dict[int, str], by_rank: dict[int, RankInfo]) -> None:
    """Of the processes ``gone``, those that crashed, or else whether the job was ended as a whole (fills
    ``out.crashed``, ``out.ended_together`` and ``out.followers``; see :func:`assess`)."""
    seen = {r: out.seen_ns.get(r, now) for r in gone}
    ended = {r: signals[r] for r in gone if r in signals}  # ended from outside, at these times
    first_signal = min(ended.values(), default=None)
    # A rank that closed its tracer after the first SIGTERM reached the job left because the others were
    # being ended (its collective failed, it unwound): it went with the job, it did not outlive a crash.
    followers = {r for r, i in by_rank.items() if i.closed_cleanly and first_signal is not None
                 and out.seen_ns.get(r, 0) >= first_signal}
    survivors = [r for r, i in by_rank.items()
                 if (i.closed_cleanly and r not in followers) or states.get(r) in (RUNNING, STOPPED)]
    everyone = not survivors and len(gone) + len(followers) == len(by_rank)
    out.followers = sorted(followers) if everyone else []
    died = [r for r in gone if r not in ended and r in pulses and (first_signal is None or seen[r] < first_signal)]
    if first_signal is not None and (died or everyone):
        out.ended_together = everyone and not died  # a time limit or a cancel: every process ended from outside
        crashed = _first_gone(died, seen, DEATH_TIE_PULSE_NS)
    elif everyone and max(seen.values()) - min(seen.values()) <= FROZEN_NS:
        out.ended_together, crashed = True, []
    else:  # (a process with a signal mark was ended from outside: never a crash)
        unmarked = [r for r in gone if r not in ended]
        crashed = _first_gone(unmarked, seen, DEATH_TIE_PULSE_NS if all(r in pulses for r in unmarked)
                              else DEATH_TIE_NS)
    for r in crashed:
        after = sorted(r2 for r2 in ended if ended[r2] >= seen[r] and r2 not in crashed)
        out.crashed[r] = (f"its process (pid {by_rank[r].pid}) is gone and its ring was never closed "
                          "(killed, or died without unwinding)"
                          + (f", while ranks {sorted(survivors)[:8]} outlived it" if survivors else "")
                          + (f"; ranks {after[:8]} were ended by SIGTERM after it (the launcher ending the "
                             "rest of the job)" if after else ""))
