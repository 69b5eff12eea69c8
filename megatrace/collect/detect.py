"""Hang detection: pure functions over ring snapshots and the agents' states, no I/O (the node agent,
:mod:`megatrace.collect.agent`, reads the rings, keeps the state and acts).

Detection is a set of pure functions over ring snapshots, so that tests can
drive them with synthetic clocks:

* :func:`observe` turns the newest records of one ring (``read_ring(path, last=K)``)
  into a :class:`RankObservation`: last activity (newest enqueue or completion;
  the ring's creation for an empty ring), the oldest operation still outstanding,
  whether the writer closed the ring;
* :func:`assess_rank` says, at monotonic time ``now``, whether the rank is
  *progressing*, *finished* (closed its ring), *exited* (its process is gone but
  the ring is open: crashed or killed) or *stalled*: no new record and no
  completion for longer than ``hang_timeout``, or a blocking or device operation
  outstanding for longer than that;
* :func:`node_state` is *suspect* when every unfinished rank of the node is
  stalled or exited, *healthy* when one still progresses (the agent counts a rank
  as exited only once it has seen it gone for ``EXIT_GRACE_S``, so that the
  moment of a ``scancel``, when trainers die just before their agents, is no hang);
* :func:`job_confirmed` is true when every live agent of the job that watches
  unfinished ranks says *suspect*.

Ring times are ``CLOCK_MONOTONIC`` of the node, the same clock as ``time.monotonic_ns()`` in the agent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from megatrace.names import unknown_op_name
from megatrace.trace import ring_format as fmt
from megatrace.trace.init_marker import InitMarker

PROGRESSING, FINISHED, EXITED, STALLED = "progressing", "finished", "exited", "stalled"
EXITING = "exiting"  # exited, seen for less than the grace period: not (yet) a stall
HEALTHY, SUSPECT, DONE, NO_RANKS = "healthy", "suspect", "finished", "no-ranks"


@dataclass(frozen=True)
class RankObservation:
    """What one ring says about its rank right now."""

    rank: int
    pid: int
    file: str
    closed: bool
    records: int  # write counter
    last_activity_ns: int  # newest t_enqueue or t_complete in the tail; ring creation when empty
    outstanding_since_ns: int | None = None  # t_enqueue of the oldest blocking/device op not completed
    outstanding_op: str | None = None
    anchor_wall_ns: int = 0
    anchor_mono_ns: int = 0
    host: str = ""
    job_id: str = ""

    def to_wall_ns(self, mono_ns: int) -> int:
        return self.anchor_wall_ns + (mono_ns - self.anchor_mono_ns)


@dataclass(frozen=True)
class RankVerdict:
    rank: int
    state: str  # PROGRESSING / FINISHED / EXITED / STALLED
    reason: str
    idle_s: float


def _op_name(op: int) -> str:
    try:
        return fmt.Op(op).name.lower()
    except ValueError:
        return unknown_op_name(op)


def observe(snap: Any, name: str | None = None) -> RankObservation:
    """A :class:`RankObservation` of a ``RingSnapshot`` (the newest records are enough); ``name``: the file's."""
    h, recs = snap.header, snap.records
    last = h.anchor_mono_ns
    since = op = None
    if len(recs):
        last = max(last, int(recs["t_enqueue"].max()), int(recs["t_complete"].max()))
        comm = recs[(recs["op"] < fmt.Op.MARK_STEP) & (recs["state"] == fmt.State.ENQUEUED)
                    & ((recs["flags"] & fmt.Flag.NO_COMPLETION) == 0)
                    & (((recs["flags"] & fmt.Flag.ASYNC) == 0) | ((recs["flags"] & fmt.Flag.DEVICE) != 0))]
        if len(comm):
            first = comm[0]
            since, op = int(first["t_enqueue"]), _op_name(int(first["op"]))
    return RankObservation(h.rank, h.pid, name or os.path.basename(h.path), h.closed_cleanly, h.write_counter, last,
                           since, op, h.anchor_wall_ns, h.anchor_mono_ns, h.host, h.job_id)


def assess_rank(obs: RankObservation, now_ns: int, hang_timeout_s: float, alive: bool | None = None) -> RankVerdict:
    """Is the rank progressing, finished, exited or stalled at monotonic time ``now_ns``? (pure)

    ``alive``: whether its process exists (None: unknown, e.g. another pid namespace).
    """
    idle = max(0, now_ns - obs.last_activity_ns) / 1e9
    if obs.closed:
        return RankVerdict(obs.rank, FINISHED, "closed its ring (finished)", idle)
    if alive is False:
        return RankVerdict(obs.rank, EXITED, f"process {obs.pid} is gone but its ring is open (crashed or killed)",
                           idle)
    if obs.outstanding_since_ns is not None:
        waited = max(0, now_ns - obs.outstanding_since_ns) / 1e9
        if waited > hang_timeout_s:
            return RankVerdict(obs.rank, STALLED, f"{obs.outstanding_op} outstanding for {waited:.0f} s", idle)
    if idle > hang_timeout_s:
        what = "no traced call since its ring was created" if obs.records == 0 else "no new record or completion"
        return RankVerdict(obs.rank, STALLED, f"{what} for {idle:.0f} s", idle)
    return RankVerdict(obs.rank, PROGRESSING, f"last activity {idle:.1f} s ago", idle)


def assess_marker(mk: InitMarker, now_ns: int, hang_timeout_s: float, alive: bool | None = None) -> RankVerdict:
    """A rank with a start marker and no ring: in ``init_process_group`` since the marker (pure).

    Stuck there longer than ``hang_timeout_s`` is a stall like any other: the job cannot have started."""
    waited = max(0, now_ns - mk.t_mono_ns) / 1e9
    if alive is False:
        return RankVerdict(mk.rank, EXITED, f"process {mk.pid} is gone, inside init_process_group (crashed or "
                                            f"killed)", waited)
    if waited > hang_timeout_s:
        return RankVerdict(mk.rank, STALLED, f"in init_process_group for {waited:.0f} s: the rendezvous at "
                                             f"{mk.endpoint} has not completed (stuck before communication "
                                             f"started)", waited)
    return RankVerdict(mk.rank, PROGRESSING, f"in init_process_group for {waited:.0f} s", waited)


def marker_observation(mk: InitMarker, name: str) -> RankObservation:
    """The :class:`RankObservation` of a marker: no record yet, last activity at its writing."""
    return RankObservation(mk.rank, mk.pid, name, False, 0, mk.t_mono_ns, anchor_wall_ns=mk.t_wall_ns,
                           anchor_mono_ns=mk.t_mono_ns, host=mk.host, job_id=mk.job_id)


def node_state(verdicts: list[RankVerdict]) -> str:
    """SUSPECT when every unfinished rank is stalled or exited; HEALTHY when one progresses (pure)."""
    if not verdicts:
        return NO_RANKS
    active = [v for v in verdicts if v.state != FINISHED]
    if not active:
        return DONE
    if all(v.state in (STALLED, EXITED) for v in active):
        return SUSPECT
    return HEALTHY


@dataclass
class AgentStatus:
    """One agent's state as written to ``agents/<node>.json``."""

    node: str
    state: str
    updated_wall_ns: int
    pid: int = 0
    suspect_since_wall_ns: int | None = None
    onset_wall_ns: int | None = None  # the stalled ranks' last activity, in wall time: the hang's onset
    ranks: list[dict[str, Any]] = field(default_factory=list)


def job_confirmed(statuses: list[AgentStatus], now_wall_ns: int, stale_s: float, expected: list[str] | None = None,
                  watched_s: float = float("inf")) -> tuple[bool, dict[str, Any]]:
    """(confirmed, evidence): all live agents that watch unfinished ranks are SUSPECT (pure).

    Agents silent for more than ``stale_s`` do not vote (their node may be down: that must not
    block the confirmation); they are named in the evidence. ``expected``: the job's nodes; one whose
    agent has not reported yet blocks the confirmation until this agent has watched for ``stale_s``
    (``watched_s``), then counts as silent.
    """
    fresh = [s for s in statuses if now_wall_ns - s.updated_wall_ns <= stale_s * 1e9]
    stale = sorted(s.node for s in statuses if s not in fresh)
    unseen = sorted(set(expected or ()) - {s.node for s in statuses})
    if unseen and watched_s < stale_s:
        return False, {"waiting_for_agents": unseen}
    stale += unseen
    voters = [s for s in fresh if s.state in (HEALTHY, SUSPECT)]
    suspects = [s for s in voters if s.state == SUSPECT]
    evidence = {"nodes": sorted(s.node for s in voters), "suspect": sorted(s.node for s in suspects),
                "healthy": sorted(s.node for s in voters if s.state == HEALTHY), "silent_agents": stale,
                "finished": sorted(s.node for s in fresh if s.state == DONE)}
    evidence["exited_ranks"] = sorted({r.get("rank") for s in suspects for r in (s.ranks or [])
                                       if isinstance(r, dict) and r.get("state") == EXITED})
    onsets = [s.onset_wall_ns for s in suspects if s.onset_wall_ns]
    if onsets:
        evidence["onset_wall_ns"] = min(onsets)
    return bool(voters) and len(suspects) == len(voters), evidence
