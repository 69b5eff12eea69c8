"""The node agent: watch this node's rings, suspect a hang, confirm it with the other nodes, trigger collection.

Detection (:mod:`megatrace.collect.detect`) is a set of pure functions over ring snapshots; this module
reads the rings, keeps the agents' shared state and acts on a confirmed hang.

Ring times are ``CLOCK_MONOTONIC`` of the node, the same clock as
``time.monotonic_ns()`` here. Agents share nothing but the job's state
directory (on the shared file system, by default ``<job-dir>/.megatrace-<job>/``)::

    agents/<node>.json        each agent's state, rewritten every poll (a heartbeat)
    triggers/<reason>         a request to collect now (timelimit, end, failure, manual)
    collect-<reason>.lock     created with O_EXCL by the one agent that runs that collection
    hang.json                 the confirmation: when, which nodes, why

The agent that wins the lock runs the collector (``srun --overlap ...`` under
Slurm, see :func:`megatrace.collect.slurm.collect_command`), then carries out
``--on-hang``. Timing: a hang is confirmed ``hang_timeout`` + at most one poll
interval (+ the other agents' poll) after its onset; the collection then takes
seconds, bounded by the collector's own timeout.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from megatrace.collect import safefs
from megatrace.collect.detect import (DONE, EXITED, EXITING, HEALTHY, NO_RANKS, STALLED, SUSPECT, AgentStatus,
                                      RankObservation, RankVerdict, assess_marker, assess_rank, job_confirmed,
                                      marker_observation, node_state, observe)
from megatrace.collect.node import TRACE_FILE_RE, foreign_files, process_facts, rank_prefix
from megatrace.names import TRIGGERS, attempt_suffix, job_dir_name, safe_name
from megatrace.trace.init_marker import MAX_MARKER_BYTES, InitMarker, marker_name, parse_marker

TAIL = 64  # newest records read per ring and poll: enough to see what is outstanding
DEFAULT_HANG_TIMEOUT_S = 300.0
DEFAULT_POLL_S = 5.0
STALE_FACTOR = 4  # an agent silent for this many poll intervals (at least STALE_MIN_S) no longer votes
STALE_MIN_S = 20.0
COLLECT_TIMEOUT_S = 600.0

TIMELIMIT_LEAD_S = 90.0  # the collection (45 s gather + analysis) must end before Slurm kills the job
END_TIME_REFRESH_S = 60.0  # the time limit can be changed while the job runs: re-read it this often
EXIT_GRACE_S = 30.0  # a rank seen exited counts only after this long (capped by the hang timeout): at a
#                     scancel every process dies at once, the agents a moment after their trainers


# -- the loop ----------------------------------------------------------------------------------

def _ring_names(dir_fd: int, kind: str = "ring") -> list[str]:
    """Current rings (rank-N.ring, not earlier attempts) of the directory; ``kind="init"``: start markers."""
    out = []
    for n in safefs.list_dir(dir_fd):
        m = TRACE_FILE_RE.match(n)
        if m and m.group(2) == kind and not m.group(3):
            out.append(n)
    return out


def _read_marker(dfd: int, name: str) -> InitMarker | None:
    try:
        mk = parse_marker(safefs.read_file(dfd, name, MAX_MARKER_BYTES))
    except OSError:
        return None
    return mk if mk is not None and name == marker_name(mk.rank) else None


def scan(ring_dir: str | None, now_ns: int, hang_timeout_s: float,
         liveness: Callable[..., bool | None] | None = None,
         node: str | None = None, job_id: str | None = None,
         uid: int | None = None) -> tuple[list[RankVerdict], list[RankObservation]]:
    """Read the tail of every ring of ``ring_dir`` and assess each rank; unreadable rings are skipped. A rank
    with a start marker and no ring (in ``init_process_group``) is assessed from its marker.

    ``node``: keep only the rings this node wrote when the directory also holds other nodes' (see
    :func:`megatrace.collect.node.foreign_files`). ``job_id``: keep only the rings whose header names
    this job. ``uid``: the job's user: a directory someone else owns is not read at all, and each ring
    writer's pid is checked to run as that user (``liveness(pid, anchor, uid)``).

    Each ring is opened without following links (the agent may run as root) and read through its
    descriptor (``/proc/self/fd/N``), so a file swapped for a link after the listing is not followed either.
    """
    from megatrace.trace.ring_reader import RingFormatError, read_ring

    verdicts: list[RankVerdict] = []
    observations: list[RankObservation] = []
    hosts: dict[str, str] = {}
    if not ring_dir:
        return verdicts, observations
    try:
        dfd = safefs.open_dir(ring_dir)
    except OSError:
        return verdicts, observations
    try:
        owner = os.fstat(dfd).st_uid
        if uid is not None and owner != uid:
            return verdicts, observations
        for name in _ring_names(dfd):
            try:
                fd = safefs.open_regular(dfd, name)
            except OSError:
                continue
            try:
                obs = observe(read_ring(f"/proc/self/fd/{fd}", last=TAIL), name)
            except (RingFormatError, OSError, ValueError):
                continue
            finally:
                os.close(fd)
            if job_id and obs.job_id != job_id:
                continue  # another job's ring (a stale or planted one): not this job's rank
            alive = liveness(obs.pid, obs.anchor_mono_ns, owner) if liveness else None
            observations.append(obs)
            verdicts.append(assess_rank(obs, now_ns, hang_timeout_s, alive))
            hosts[name] = obs.host
        with_ring = {o.rank for o in observations}
        for name in _ring_names(dfd, "init"):  # ranks in init_process_group: no ring yet
            mk = _read_marker(dfd, name)
            if mk is None or mk.rank in with_ring or (job_id and mk.job_id != job_id):
                continue
            alive = liveness(mk.pid, mk.t_mono_ns, owner) if liveness else None
            observations.append(marker_observation(mk, name))
            verdicts.append(assess_marker(mk, now_ns, hang_timeout_s, alive))
            hosts[name] = mk.host
    finally:
        os.close(dfd)
    if node:  # a directory shared by several virtual nodes: watch only this node's ranks
        foreign = foreign_files(hosts, node)
        keep = [i for i, o in enumerate(observations) if rank_prefix(o.file) not in foreign]
        verdicts, observations = [verdicts[i] for i in keep], [observations[i] for i in keep]
    return verdicts, observations


def pid_alive(pid: int, anchor_mono_ns: int, uid: int | None = None) -> bool | None:
    """Whether the ring's writer still runs (as ``uid``, the ring's owner); None when this agent cannot see
    pids (another namespace)."""
    if pid <= 0:
        return None
    if not os.path.exists("/proc/self"):
        return None
    return bool(process_facts(pid, anchor_mono_ns, uid).get("alive"))


@dataclass
class AgentConfig:
    state_dir: str
    ring_dir: str | None
    node: str
    job_id: str
    job_dir: str
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    poll_s: float = DEFAULT_POLL_S
    on_hang: str = "report"
    collect_cmd: list[str] | None = None  # "{trigger}" is replaced; None: see default_collect_cmd
    exit_when_done: bool = True
    max_runtime_s: float | None = None
    once: bool = False
    owner: tuple[int, int] | None = None
    nodes: list[str] | None = None  # the job's nodes (SLURM_JOB_NODELIST): each one's agent must be heard
    out_dir: str | None = None  # the bundle directory of its collections [default: the collector's]
    timelimit_lead_s: float | None = TIMELIMIT_LEAD_S  # under Slurm: collect this long before the time limit
    only_job: bool = True  # watch only rings whose header names job_id (False: --job-id was not given)


class Agent:
    """One node's watchdog; see the module docstring."""

    def __init__(self, cfg: AgentConfig, log: Callable[[str], None] = lambda m: None) -> None:
        self.cfg = cfg
        self.log = log
        self.state = safefs.OutDir(cfg.state_dir, cfg.owner)
        self.agents = self.state.subdir("agents")
        self.triggers = self.state.subdir("triggers")
        self.started = time.monotonic_ns()
        self.suspect_since: int | None = None
        self.exited_seen: dict[tuple[str, int, int], int] = {}
        self.requested: list[str] = []
        self.collections: list[dict[str, Any]] = []
        self.stop = False
        self._end_time: float | None = None
        self._end_time_read = -float("inf")

    def ring_dirs(self) -> list[str]:
        """``ring_dir`` if given; else $MEGATRACE_DIR (if it holds rings) and every ring directory of the job
        (looked up on every poll: the training step starts after the agent)."""
        if self.cfg.ring_dir:
            return [self.cfg.ring_dir]
        from megatrace.collect.node import has_rings, job_ring_dirs

        env = os.environ.get("MEGATRACE_DIR")
        found = job_ring_dirs(self.cfg.job_id, uid=self.job_uid)
        return list(dict.fromkeys(([env] if env and has_rings(env) else []) + found))

    @property
    def job_uid(self) -> int:
        """The job's user: whose ring directories and processes this agent watches."""
        return self.cfg.owner[0] if self.cfg.owner else os.geteuid()

    # -- signals ---------------------------------------------------------------
    def install_signals(self) -> None:
        signal.signal(signal.SIGUSR1, lambda *_: self.requested.append("timelimit"))
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stop", True))

    # -- one poll ----------------------------------------------------------------
    def poll(self) -> str:
        """Observe, publish, confirm, act once; returns this node's state."""
        cfg = self.cfg
        now = time.monotonic_ns()
        verdicts, obs = [], []
        for ring_dir in self.ring_dirs():
            v, o = scan(ring_dir, now, cfg.hang_timeout_s, pid_alive, cfg.node, cfg.job_id if cfg.only_job else None,
                        self.job_uid)
            verdicts += v
            obs += o
        verdicts = self._exit_grace(verdicts, obs, now)
        state = node_state(verdicts)
        wall = time.time_ns()
        if state == SUSPECT:
            self.suspect_since = self.suspect_since or wall
        else:
            self.suspect_since = None
        stalled = [o for v, o in zip(verdicts, obs) if v.state in (STALLED, EXITED)]
        onset = min(o.to_wall_ns(o.last_activity_ns) for o in stalled) if state == SUSPECT and stalled else None
        status = AgentStatus(cfg.node, state, wall, os.getpid(), self.suspect_since, onset,
                             [asdict(v) for v in verdicts])
        self.agents.write(f"{safe_name(cfg.node)}.json", json.dumps(asdict(status)).encode(), replace=True)
        self._watch_time_limit()
        for reason in self._pending_triggers():
            self._collect(reason, f"requested ({reason})")
        if state == SUSPECT:
            confirmed, evidence = job_confirmed(self._statuses(), time.time_ns(), self._stale_s(), cfg.nodes,
                                                (time.monotonic_ns() - self.started) / 1e9)
            if confirmed:
                self._on_hang(evidence)
        return state

    def _watch_time_limit(self) -> None:
        """Request a 'timelimit' collection once the job's end is less than the lead away (under Slurm)."""
        cfg = self.cfg
        if not cfg.timelimit_lead_s or not os.environ.get("SLURM_JOB_ID") or not cfg.job_id.isdigit():
            return
        if self.state.exists("collect-hang.lock"):  # the hang's own collection is the better evidence: keep it
            return
        if time.monotonic() - self._end_time_read > END_TIME_REFRESH_S:
            from megatrace.collect.slurm import end_time, job_fields

            self._end_time, self._end_time_read = end_time(job_fields(cfg.job_id)), time.monotonic()
        if self._end_time is not None and time.time() >= self._end_time - cfg.timelimit_lead_s \
                and "timelimit" not in self.requested:
            left = self._end_time - time.time()
            self.log(f"agent {cfg.node}: {max(0.0, left):.0f} s left before the job's time limit: collecting")
            self.requested.append("timelimit")

    def _exit_grace(self, verdicts: list[RankVerdict], obs: list[RankObservation], now: int) -> list[RankVerdict]:
        """An exited rank counts as stalled only once it has been seen exited for the grace period."""
        grace = min(EXIT_GRACE_S, self.cfg.hang_timeout_s)
        out = []
        for v, o in zip(verdicts, obs):
            key = (o.file, o.pid, o.anchor_mono_ns)
            if v.state != EXITED:
                self.exited_seen.pop(key, None)
            elif (now - self.exited_seen.setdefault(key, now)) / 1e9 < grace:
                v = RankVerdict(v.rank, EXITING, v.reason, v.idle_s)
            out.append(v)
        return out

    def _stale_s(self) -> float:
        return max(STALE_MIN_S, STALE_FACTOR * self.cfg.poll_s)

    def _statuses(self) -> list[AgentStatus]:
        out = []
        for name in safefs.list_dir(self.agents.fd):
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                data = json.loads(safefs.read_file(self.agents.fd, name, 1 << 20))
                out.append(AgentStatus(**{k: data.get(k) for k in AgentStatus.__dataclass_fields__}))
            except (OSError, ValueError, TypeError):
                continue
        return out

    def _pending_triggers(self) -> list[str]:
        reasons = list(dict.fromkeys(self.requested))
        self.requested.clear()
        for name in safefs.list_dir(self.triggers.fd):
            if name in TRIGGERS and name not in reasons:
                reasons.append(name)
        return [r for r in reasons if not self.state.exists(f"collect-{r}.lock")]

    def _lock(self, reason: str) -> bool:
        try:
            self.state.write(f"collect-{reason}.lock", f"{self.cfg.node} {os.getpid()} {time.time_ns()}\n".encode())
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                return False
            raise

    def _on_hang(self, evidence: dict[str, Any]) -> None:
        if not self._lock("hang"):
            return
        detail = (f"all {len(evidence['nodes'])} nodes with running ranks stalled for more than "
                  f"{self.cfg.hang_timeout_s:.0f} s")
        exited = evidence.get("exited_ranks") or []
        trigger = "failure" if exited else "hang"  # a rank's process died: the job failed, the others wait
        if exited:
            detail += f"; the processes of ranks {', '.join(map(str, exited[:16]))} are gone (crashed or killed)"
        record = {"confirmed_by": self.cfg.node, "confirmed_wall_ns": time.time_ns(),
                  "hang_timeout_s": self.cfg.hang_timeout_s, **evidence}
        self.state.write("hang.json", json.dumps(record, indent=1).encode() + b"\n", replace=True)
        self.log(f"agent {self.cfg.node}: hang confirmed: {detail}")
        result = self._run_collector(trigger, detail)
        from megatrace.collect.slurm import hang_action

        verdict, culprit_node = self._verdict()
        reason = f"{'job failure' if exited else 'hang'} confirmed ({detail})"
        if verdict:
            reason += f"; {verdict}"
        if self.cfg.out_dir and (Path(self.cfg.out_dir) / "report.html").exists():
            reason += f"; report: {Path(self.cfg.out_dir) / 'report.html'}"
        result["on_hang"] = hang_action(self.cfg.on_hang, self.cfg.job_id, reason=reason, exclude_node=culprit_node)
        self.log(f"agent {self.cfg.node}: on-hang {self.cfg.on_hang}: {result['on_hang']}")

    def _verdict(self) -> tuple[str | None, str | None]:
        """The collection's verdict and the top finding's node, from findings.json in the bundle directory."""
        if not self.cfg.out_dir:
            return None, None
        try:
            doc = json.loads((Path(self.cfg.out_dir) / "findings.json").read_text())
            top = (doc.get("findings") or [{}])[0]
            node = (top.get("subject") or {}).get("host")
            return doc.get("verdict") or top.get("verdict"), node if isinstance(node, str) else None
        except (OSError, ValueError, AttributeError, IndexError):
            return None, None

    def _collect(self, reason: str, detail: str) -> None:
        if self._lock(reason):
            self.log(f"agent {self.cfg.node}: collecting ({detail})")
            self._run_collector(reason, detail)

    def _run_collector(self, trigger: str, detail: str) -> dict[str, Any]:
        """Run the collector; once more when it failed of itself (an exit status other than 0, within its time)
        before it collected anything (no "collect: ..." line of its root): a collector task that gave up in MPI_Init
        (a process manager that did not answer) leaves nothing, and a fresh step of it usually starts."""
        result = self._run_collector_once(trigger, detail)
        if isinstance(result.get("rc"), int) and result["rc"] != 0 and not any(
                line.startswith("collect: ") for line in str(result.get("stdout") or "").splitlines()):
            self.log(f"agent {self.cfg.node}: collector ({trigger}) failed: trying once more")
            result = self._run_collector_once(trigger, detail)
        return result

    def _run_collector_once(self, trigger: str, detail: str) -> dict[str, Any]:
        cmd = [a.replace("{trigger}", trigger) for a in (self.cfg.collect_cmd or default_collect_cmd(self.cfg))]
        # The detail travels in the environment (srun and mpiexec pass it to every task), not as an
        # argument that would reach only the last part of an MPMD command line.
        env = {**os.environ, "MEGATRACE_COLLECT_DETAIL": detail, "MEGATRACE_COLLECT_TRIGGER": trigger}
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                                  timeout=COLLECT_TIMEOUT_S)
            result = {"trigger": trigger, "command": cmd, "rc": proc.returncode,
                      "seconds": round(time.monotonic() - t0, 2), "stdout": proc.stdout[-4000:],
                      "stderr": proc.stderr[-4000:]}
        except (OSError, subprocess.TimeoutExpired) as exc:
            result = {"trigger": trigger, "command": cmd, "rc": None, "error": str(exc)}
        self.collections.append(result)
        line = (f"agent {self.cfg.node}: collector ({trigger}) exit {result.get('rc')} after "
                f"{result.get('seconds', '?')} s")
        if result.get("rc") != 0:  # its last word says why (e.g. an srun of another Slurm release)
            line += _why_failed(str(result.get("error") or result.get("stderr") or ""))
        self.log(line)
        try:
            self.state.write(f"collect-{trigger}.json", json.dumps(result, indent=1).encode(), replace=True)
        except OSError:
            pass
        return result

    # -- the loop ----------------------------------------------------------------
    def run(self) -> int:
        start = time.monotonic()
        done_since: float | None = None
        while not self.stop:
            try:
                state = self.poll()
            except OSError as exc:  # a hiccup of the shared file system: try again next poll
                self.log(f"agent {self.cfg.node}: {exc}")
                state = None
            if self.cfg.once:
                break
            if state == DONE and self.cfg.exit_when_done:
                done_since = done_since or time.monotonic()
                if time.monotonic() - done_since > 2 * self.cfg.poll_s:
                    break
            else:
                done_since = None
            if self.cfg.max_runtime_s and time.monotonic() - start > self.cfg.max_runtime_s:
                break
            _sleep(self.cfg.poll_s, lambda: self.stop or bool(self.requested))
        return 0


STEP_DIR_RE = re.compile(r"step-[A-Za-z0-9_.-]{1,64}")  # the plugin's step-<SLURM_STEP_ID> ring directories
STEP_DONE_POLLS = 3  # a step whose ranks all finished for this many polls stops being watched


class StepsAgent(Agent):
    """One node's watchdog over every step of the job (``--steps-dir``).

    Each ``step-<s>`` directory of ``steps_dir`` gets its own :class:`Agent` as soon as it appears: its
    rings, its meeting place ``<state-dir>/step-<s>`` (a step may run on some of the job's nodes only), its
    bundle and report ``<steps_out>/step-<s>``. The job's triggers (``<state-dir>/triggers``, ``USR1``)
    reach every step still watched; a step whose ranks all finished stops being watched. So the training
    step after a short setup step is watched as the first one is.
    """

    def __init__(self, cfg: AgentConfig, steps_dir: str, steps_out: str,
                 log: Callable[[str], None] = lambda m: None) -> None:
        super().__init__(cfg, log)
        self.steps_dir, self.steps_out = steps_dir, steps_out
        self.steps: dict[str, Agent] = {}
        self.done_polls: dict[str, int] = {}

    def _discover(self) -> None:
        try:
            dfd = safefs.open_dir(self.steps_dir)
        except OSError:
            return  # not made yet (the first task of the job makes it)
        try:
            if os.fstat(dfd).st_uid != self.job_uid:
                return  # not the job's user's own: nothing in it is watched
            names = [n for n in safefs.list_dir(dfd) if STEP_DIR_RE.fullmatch(n) and n not in self.steps]
        finally:
            os.close(dfd)
        for name in sorted(names):
            cfg = replace(self.cfg, ring_dir=os.path.join(self.steps_dir, name),
                          state_dir=os.path.join(self.cfg.state_dir, name),
                          out_dir=os.path.join(self.steps_out, name), exit_when_done=False)
            step = Agent(cfg, self.log)
            step.triggers = self.triggers  # the job's requests reach every step
            self.steps[name] = step
            self.log(f"agent {cfg.node}: watching {name} ({cfg.ring_dir})")

    def poll(self) -> str:
        self._discover()
        forwarded, self.requested = self.requested, []
        states = []
        for name, step in self.steps.items():
            if self.done_polls.get(name, 0) >= STEP_DONE_POLLS:
                continue
            step.requested += forwarded
            state = step.poll()
            self.done_polls[name] = self.done_polls.get(name, 0) + 1 if state == DONE else 0
            if self.done_polls[name] == STEP_DONE_POLLS:
                self.log(f"agent {self.cfg.node}: {name} finished: no longer watched")
            states.append(state)
        for state in (SUSPECT, HEALTHY, DONE):
            if state in states:
                return state
        return NO_RANKS


def _why_failed(output: str) -> str:
    """": <why>" for a failed collector's output: its last line, or where a task gave up on a deadline
    (faulthandler's "Timeout (...)!" and the stacks after it), that, and in MPI_Init when the stack says so."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    timeouts = [k for k, line in enumerate(lines) if line.startswith("Timeout (") and line.rstrip().endswith(")!")]
    if timeouts:
        head = lines[timeouts[-1]].rstrip("!")
        where = " in MPI_Init (mpi4py's import)" if any("_import_mpi" in line for line in lines[timeouts[-1]:]) else ""
        return f": a collector task gave up{where}: {head}"
    return f": {lines[-1][:300]}" if lines else ""


def _sleep(seconds: float, wake: Callable[[], bool]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not wake():
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))


def default_collect_cmd(cfg: AgentConfig) -> list[str]:
    """Under Slurm: srun --overlap, one collector per node of the job; elsewhere: this node only (--local)."""
    import sys

    from megatrace.collect.slurm import collect_command

    if os.environ.get("SLURM_JOB_ID"):
        nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or ""
        count = int(nodes) if nodes.isdigit() else len(cfg.nodes) if cfg.nodes else None
        ring = node_pattern(cfg.ring_dir, cfg.node) if cfg.ring_dir else None
        return collect_command(cfg.job_id, cfg.job_dir, "{trigger}", count, ring_dir=ring, timeout_s=45.0,
                               extra=["--out", cfg.out_dir] if cfg.out_dir else None)
    cmd = [sys.executable, "-m", "megatrace.cli", "collect", "--local", "--trigger", "{trigger}", "--job-id",
           cfg.job_id, "--job-dir", cfg.job_dir, "--node", cfg.node]
    return cmd + (["--ring-dir", cfg.ring_dir] if cfg.ring_dir else []) + (["--out", cfg.out_dir] if cfg.out_dir
                                                                           else [])


def node_pattern(path: str, node: str) -> str:
    """``path`` with this node's name as ``%n`` (``/l/job-7.n1/step-0`` -> ``/l/job-7.%n/step-0``), so that the
    collector task on every node finds its own directory; only whole components or a ``.<node>`` suffix."""
    parts = []
    for comp in path.split("/"):
        if comp == node:
            comp = "%n"
        elif comp.endswith("." + node):
            comp = comp[:-len(node)] + "%n"
        parts.append(comp)
    return "/".join(parts)


def request_trigger(state_dir: str, reason: str, owner: tuple[int, int] | None = None) -> Path:
    """Ask the job's agents to collect now (the batch script's USR1 trap, the epilog)."""
    with safefs.OutDir(state_dir, owner) as state:
        with state.subdir("triggers") as trig:
            return trig.write(reason, f"{time.time_ns()}\n".encode(), replace=True)


def default_state_dir(job_dir: str, job_id: str, restart: str | None = None) -> str:
    """``<job-dir>/.megatrace-<job>``; a requeued job (``SLURM_RESTART_COUNT`` > 0, same job id) gets
    ``.megatrace-<job>.r<count>``, so that its hangs are confirmed and collected afresh."""
    restart = os.environ.get("SLURM_RESTART_COUNT", "0") if restart is None else restart
    return str(Path(job_dir) / f".{job_dir_name(safe_name(job_id))}{attempt_suffix(restart)}")


def split_command(text: str) -> list[str]:
    return shlex.split(text)
