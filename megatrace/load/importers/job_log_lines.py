"""Lines of a job's output log that say where each rank stood: PyTorch's NCCL watchdog, NCCL, Slurm, Python.

A job's output (``slurm-<id>.out``, or one file per rank) mixes every rank's lines. This module reads
one file, line by line (linear, bounded per line), and keeps per rank, per process group, what the
watchdog of ``ProcessGroupNCCL`` printed (``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``,
torch 2.0 to 2.13), plus the lines that tell how a rank ended:

* the timed-out work: ``Watchdog caught collective operation timeout: WorkNCCL(SeqNum=S, OpType=OP,
  NumelIn=N, NumelOut=M, Timeout(ms)=T) ran for R milliseconds before timing out.``;
* how far the rank got: ``Timeout at NCCL work: S, last enqueued NCCL work: E, last completed NCCL work: C.``,
  ``Exception (either an error or timeout) detected by watchdog at work: S, last enqueued NCCL work: E, last
  completed NCCL work: C.``, and the dump signal's ``Received a dump signal due to a collective timeout from
  rank R ... Last enqueued NCCL work: E, last completed NCCL work: C.``;
* the heartbeat monitor's abort (``Heartbeat monitor timed out``; older torch: ``no heartbeat``) and NCCL's
  own ``host:pid:tid [dev] NCCL WARN ...`` lines;
* a Python exception ending the rank (the last line of a traceback), gloo's timeouts and closed connections;
* Slurm's ``srun: error: NODE: task(s) LIST: Exited with exit code N`` / ``Killed``, ``*** JOB|STEP ... CANCELLED
  AT ... [DUE TO TIME LIMIT] ***`` and ``oom_kill`` lines.

The rank of a line comes from torchrun's ``[rankN]:`` prefix, srun ``--label``'s ``N:`` prefix, or the
``[... Rank N]`` tag of the message (the ``[PG ID p PG GUID g(desc) Rank N]`` of torch >= 2.5, ``[PG p Rank N]``
before, ``[Rank N]`` in torch 2.0-2.3, where the group is not named); for one file per rank, from the file's
name when the lines carry none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from megatrace.files import open_input_file

MAX_LINE = 64 * 1024  # longer lines are cut (a log line is never this long; a binary file has no newlines)
MAX_EVENTS = 200  # lines kept as evidence per rank (the first ones: a crash's cause comes first)

# Line prefixes, stacked in any order: torch's global "[rank3]:" (its C++ logger from 2.3, its excepthook's
# "[rank3]: "), torchrun --tee's "[default3]:" (a local rank: not used), srun --label's "3: ", Ray's "(Name pid=N) ".
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?")
OTHER_PREFIX = re.compile(r"^(?:\[[A-Za-z_]+\d+\]:\s?|\([^()]*pid=\d+[^()]*\)\s)")
SRUN_LABEL = re.compile(r"^\s*(\d+): ")
# The rank tag of ProcessGroupNCCL's logPrefix(): "[PG ID 0 PG GUID 0(default_pg) Rank 3]" (2.5+),
# "[PG 0 (default_pg) Rank 3]" / "[PG 0 Rank 3]" (2.3-2.4), "[Rank 3]" (2.0-2.2, and WorkNCCL's lines in every
# version). Its rank is the rank in that group: the global rank only in the default group.
PG_TAG = re.compile(r"\[(?:PG (?:ID )?(?P<pg>[^\s\]()]+)(?: PG GUID (?P<guid>[^\s\]()]+))?\s*"
                    r"(?:\((?P<desc>[^)]*)\))?\s+)?Rank (?P<rank>\d+)\]")
WORK = re.compile(r"WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>[A-Za-z_]+)(?P<rest>[^)]*\)?[^)]*)\)"
                  r"(?: ran for (?P<ran>\d+) milliseconds before timing out)?")
NUMEL = re.compile(r"(NumelIn|NumelOut|Timeout\(ms\))=(\d+)")
LAST = re.compile(r"[Ll]ast enqueued (?:NCCL )?work: (?P<e>-?\d+), last completed (?:NCCL )?work: (?P<c>-?\d+)")
AT_WORK = re.compile(r"(?:Timeout at NCCL work|detected by watchdog at work(?: sequence id)?): (?P<s>-?\d+)")
DUMP_FROM = re.compile(r"Received a dump signal (?:due to a collective timeout )?from\s+"
                       r"(?:rank (?P<r>-?\d+)|this local rank)")
HEARTBEAT = re.compile(r"Heartbeat monitor timed out|watchdog got stuck for|due to ProcessGroupNCCL watchdog hang")
FAILED_OPS = re.compile(r"Some NCCL operations have failed or timed out")
NCCL_WARN = re.compile(r"(?P<host>[\w.-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] (?:\S+:\d+ (?:\(\S+\) )?)?"
                       r"NCCL WARN (?P<msg>.*)")
# Exceptions that are a failed collective (a consequence of another rank's stop), not a crash of this rank.
COMM_ERROR = re.compile(r"DistBackendError|DistNetworkError|NCCL error|ncclRemoteError|gloo/transport|Timed out waiting"
                        r"|Connection closed by peer|Connection reset by peer|Watchdog caught")
EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(?P<type>[A-Z]\w*(?:Error|Exception|Exit|Interrupt))(?::\s*(?P<msg>.*))?$")
SRUN_TASKS = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\- \[\]]+): (?P<what>.*)$")
EXIT_CODE = re.compile(r"Exited with exit code (\d+)")
# torchrun's failure summary (torch.distributed.elastic ChildFailedError): a block per failed rank, e.g.
#   host      : n3
#   rank      : 2 (local_rank: 0)
#   exitcode  : -9 (pid: 15366)  (SIGKILL)
ELASTIC_FIELD = re.compile(r"^\s{2}(?P<key>host|rank|exitcode)\s*: (?P<value>.*)$")
ELASTIC_RANK = re.compile(r"^(\d+) \(local_rank: \d+\)")
ELASTIC_EXIT = re.compile(r"^(-?\d+) \(pid: \d+\)(?:\s+\((?P<sig>SIG[A-Z0-9]+)\))?")
CANCELLED = re.compile(r"\*\*\* (?P<what>JOB|STEP) (?P<id>[\d.]+) ON (?P<node>\S+) CANCELLED AT (?P<at>\S+)"
                       r"(?: DUE TO (?P<why>[A-Z ]+?))? \*\*\*")
OOM = re.compile(r"oom[-_]kill event|Out Of Memory|exceeded memory limit")
# srun's words for a task ended by a signal -> the signal (an "out of memory" kill is the kernel's SIGKILL)
SIGNAL_NAMES = {"killed": "SIGKILL", "terminated": "SIGTERM", "aborted": "SIGABRT", "segmentation fault": "SIGSEGV",
                "out of memory": "SIGKILL (out of memory)", "bus error": "SIGBUS"}
# srun saying it ends the step (--kill-on-bad-exit, a cancel, the time limit): tasks that end after it were ended
STEP_STOP = re.compile(r"^srun: (?:launch/slurm: _step_signal: Terminating StepId=|Job step aborted:|"
                       r"forcing job termination|Force Terminated)")


@dataclass
class GroupState:
    """How far one rank got in one process group, as its watchdog printed it (-1: nothing)."""

    key: str  # the group's id as the log names it ("0", a GUID, or "?" when the log does not name it)
    desc: str  # its description ("default_pg", "undefined", a name given at new_group) or ""
    enqueued: int = -1
    completed: int = -1
    timed_out: int = -1  # the sequence number of the work that timed out
    op: str = ""  # its OpType
    numel_in: int = -1
    numel_out: int = -1
    timeout_ms: int = -1
    ran_ms: int = -1
    line: int = 0  # the line that said it (1-based)


@dataclass
class RankLog:
    """What a log says about one rank."""

    rank: int
    groups: dict[str, GroupState] = field(default_factory=dict)
    events: list[tuple[int, str, str]] = field(default_factory=list)  # (line, kind, text), first MAX_EVENTS
    host: str = ""
    first_line: int = 0
    exception: tuple[int, str] | None = None  # (line, "Type: message") of the first exception ending a traceback
    timed_out_at: int = 0  # the first line saying this rank timed out (watchdog or gloo)
    watchdog_at: int = 0  # the first line of the NCCL watchdog saying it timed out (not gloo's failures)
    comm_error: tuple[int, str] | None = None  # (line, text) of the first failed collective's exception (gloo's)
    dump_from: int = -1  # the rank whose timeout sent this one a dump signal

    def event(self, line: int, kind: str, text: str) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append((line, kind, text[:300]))


@dataclass
class TaskExit:
    """A Slurm line about how tasks ended."""

    line: int
    node: str
    tasks: tuple[int, ...]
    what: str  # "exit code N", "killed", or Slurm's words
    code: int | None = None
    launcher: str = "srun"  # or "torchrun" (its failure summary, printed at the end: not in time order)


@dataclass
class JobLog:
    """Everything read from one output file."""

    path: Path
    ranks: dict[int, RankLog] = field(default_factory=dict)
    exits: list[TaskExit] = field(default_factory=list)
    cancelled: tuple[int, str] | None = None  # (line, reason) of Slurm's CANCELLED line
    stepping: int | None = None  # the first line where Slurm said it ends the step or job (STEP_STOP, CANCELLED)
    oom: list[tuple[int, str]] = field(default_factory=list)
    lines: int = 0
    matched: int = 0  # lines that said something this module reads
    elastic: dict[str, str] = field(default_factory=dict)  # the torchrun summary block being read

    def rank(self, r: int, line: int) -> RankLog:
        if r not in self.ranks:
            self.ranks[r] = RankLog(r, first_line=line)
        return self.ranks[r]


def task_list(text: str) -> tuple[int, ...]:
    """Slurm's task list ``0-3,5`` (maybe bracketed) as numbers (at most 1 M)."""
    out: list[int] = []
    for part in text.strip("[] ").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            a, b = int(lo), int(hi or lo)
            if b >= a and b - a < (1 << 20) - len(out):
                out += range(a, b + 1)
    return tuple(out)


def _group(rank: RankLog, m: re.Match | None) -> GroupState:
    key = (m.group("guid") or m.group("pg")) if m is not None and m.group("pg") else "?"
    desc = (m.group("desc") or "") if m is not None else ""
    g = rank.groups.get(key)
    if g is None:
        g = rank.groups[key] = GroupState(key, desc)
    elif desc and not g.desc:
        g.desc = desc
    return g


def _default(tag: re.Match) -> bool:
    """The tag names the default process group (whose ranks are the global ones)."""
    return tag.group("desc") == "default_pg" or (tag.group("pg") == "0" and (tag.group("guid") or "0") == "0")


def read_job_log(path: Path, file_rank: int | None = None) -> JobLog:
    """Read one output file; ``file_rank``: the rank of lines that name none (one file per rank)."""
    log = JobLog(path)
    in_traceback: dict[int | None, bool] = {}
    with open_input_file(path) as fh:
        for n, raw in enumerate(fh, 1):
            text = raw[:MAX_LINE].decode("utf-8", "replace").rstrip("\r\n")
            log.lines = n
            _line(log, n, text, file_rank, in_traceback)
    return log


def _elastic_field(log: JobLog, n: int, key: str, value: str) -> None:
    """One field of torchrun's failure summary; its exitcode line closes a failed rank's block."""
    if key != "exitcode":
        log.elastic[key] = value
        return
    rank, code = ELASTIC_RANK.match(log.elastic.get("rank", "")), ELASTIC_EXIT.match(value)
    if rank and code and int(rank.group(1)) < (1 << 20):
        c = int(code.group(1))
        what = code.group("sig") or (f"signal {-c}" if c < 0 else f"exit code {c}")
        log.exits.append(TaskExit(n, log.elastic.get("host", "?")[:128], (int(rank.group(1)),), what, c, "torchrun"))
        log.matched += 1
    log.elastic.clear()


def _line(log: JobLog, n: int, text: str, file_rank: int | None, in_traceback: dict[int | None, bool]) -> None:
    prefixed, text = _strip_prefixes(text)
    f = ELASTIC_FIELD.match(text) if prefixed is None else None
    if f:
        _elastic_field(log, n, f.group("key"), f.group("value").strip())
        return
    if _job_line(log, n, text):
        return
    tag = PG_TAG.search(text)
    local = int(tag.group("rank")) if tag and (not tag.group("pg") or _default(tag)) else None
    who = prefixed if prefixed is not None else local if local is not None else file_rank
    if who is None:
        return
    if who >= (1 << 20):
        return
    if _rank_line(log.rank(who, n), who, n, text, tag, in_traceback):
        log.matched += 1


def _strip_prefixes(text: str) -> tuple[int | None, str]:
    """The rank a line's prefixes name (None: none does) and the line without them."""
    prefixed = None
    for _ in range(4):  # prefixes stack ("[default0]:[rank0]: ...")
        m = RANK_PREFIX.match(text) or SRUN_LABEL.match(text)
        if m:
            prefixed = int(m.group(1))
        else:
            m = OTHER_PREFIX.match(text)
            if not m:
                break
        text = text[m.end():]
    return prefixed, text


def _job_line(log: JobLog, n: int, text: str) -> bool:
    """A line about the job or its tasks (srun, Slurm, the OOM killer), noted in ``log``; False: not one."""
    s = SRUN_TASKS.match(text)
    if s:
        code = EXIT_CODE.search(s.group("what"))
        what = f"exit code {code.group(1)}" if code else s.group("what").strip().rstrip(".").lower()
        log.exits.append(TaskExit(n, s.group("node"), task_list(s.group("tasks")), what,
                                  int(code.group(1)) if code else None))
        log.matched += 1
        return True
    if STEP_STOP.match(text):
        log.stepping = log.stepping or n
        log.matched += 1
        return True
    c = CANCELLED.search(text)
    if c:
        log.cancelled = (n, (c.group("why") or "cancelled").strip().lower())
        log.stepping = log.stepping or n
        log.matched += 1
        return True
    if OOM.search(text) and not text.startswith("srun: error:") and "error:" in text:
        log.oom.append((n, text.strip()[:300]))
        log.matched += 1
        return True
    return False


def _rank_line(rank: RankLog, who: int, n: int, text: str, tag: re.Match | None,
               in_traceback: dict[int | None, bool]) -> bool:
    """A line of rank ``who`` (watchdog, NCCL warning, traceback), noted in ``rank``; False: nothing in it."""
    matched = True
    w = WORK.search(text)
    last = LAST.search(text)
    warn = NCCL_WARN.search(text)
    if w and (w.group("ran") or "timeout" in text.lower()):
        g = _group(rank, tag)
        g.timed_out, g.op, g.line = int(w.group("seq")), w.group("op").upper(), n
        fields = dict(NUMEL.findall(w.group(0)))
        g.numel_in = int(fields.get("NumelIn", -1))
        g.numel_out = int(fields.get("NumelOut", -1))
        g.timeout_ms = int(fields.get("Timeout(ms)", -1))
        g.ran_ms = int(w.group("ran") or -1)
        rank.timed_out_at = rank.timed_out_at or n
        rank.watchdog_at = rank.watchdog_at or n
        rank.event(n, "timeout", text)
    elif last:
        g = _group(rank, tag)
        g.enqueued, g.completed, g.line = int(last.group("e")), int(last.group("c")), n
        at = AT_WORK.search(text)
        if at and g.timed_out < 0:
            g.timed_out = int(at.group("s"))
        d = DUMP_FROM.search(text)
        if d:
            rank.dump_from = int(d.group("r")) if d.group("r") else who
            rank.event(n, "dump-signal", text)
        else:
            rank.timed_out_at = rank.timed_out_at or n
            rank.watchdog_at = rank.watchdog_at or n
            rank.event(n, "timeout", text)
    elif HEARTBEAT.search(text) or FAILED_OPS.search(text):
        rank.event(n, "heartbeat" if HEARTBEAT.search(text) else "abort", text)
    elif warn:
        rank.host = rank.host or warn.group("host")
        rank.event(n, "nccl-warn", warn.group("msg"))
    elif text.startswith("Traceback (most recent call last)"):
        in_traceback[who] = True
    elif in_traceback.get(who) and EXCEPTION.match(text.strip()) and not text.startswith(" "):
        in_traceback[who] = False
        if COMM_ERROR.search(text):  # its collective failed: the rank waited on another
            rank.timed_out_at = rank.timed_out_at or n
            rank.comm_error = rank.comm_error or (n, text.strip()[:300])
            rank.event(n, "comm-error", text.strip())
        else:
            if rank.exception is None:
                rank.exception = (n, text.strip()[:300])
            rank.event(n, "exception", text.strip())
    else:
        matched = False
    return matched
