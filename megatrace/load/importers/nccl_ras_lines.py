"""Reading an NCCL RAS report (``ncclras``, or ``echo verbose status | nc localhost 28028``): text or JSON.

The text report (NCCL 2.24+, ``src/ras/client_support.cc``: ``rasClientRunInit``, ``rasClientRunComms``) has a
header (``NCCL version V compiled with CUDA C``), a ``Job summary``, a ``Communicators... (T s)`` table and the
``Errors`` and ``Warnings`` sections that name processes (``Process P on node N managing GPU G``) and communicator
ranks (``Rank R -- GPU G managed by process P on node N``, ``Rank R has launched up to operation C -- ...``).
The JSON report (``set format json``, NCCL 2.28+: ``rasDumpCommsToJSON``) lists every rank of every communicator
with its collective counts. One pass over the lines, each checked; a line that is not the report's is an error
naming file and line (text), the JSON decoder's position (JSON).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from megatrace.files import read_input
from megatrace.load.importers.common import MAX_RANKS, Fields, ImportFormatError

MAX_BYTES = 64 << 20  # a RAS report of a 100k-rank job in JSON is ~50 MB; larger is no report
MAX_LINE = 4096  # the longest text line NCCL writes is far shorter (lineBuf is 1024 bytes)
MAX_PROBLEMS = 20  # ignored lines reported one by one; the rest are counted
FUNCS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")  # ncclFuncStr (src/enqueue.cc)
HEADER = re.compile(r"NCCL version (\S+) compiled with CUDA (\S+)$")
HEADING = re.compile(r"(Job summary|Communicators\.\.\.(?: \(([\d.]+)s\))?|Errors|Warnings)$")
RULE = re.compile(r"=+$")
NUMS = re.compile(r"\s*(\d+(?:\s+\d+)*)\s*$")
TABLE_ROW = re.compile(r"\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+(?:-\d+)?)\s+(\d+)\s+(\d+)\s+"
                       r"(NOCOMM|INIT|RUNNING|FINALIZE|ABORT)\s+([A-Z,]+)$")
COMM = re.compile(r"#(\d+)-(\d+) \(([0-9a-f]{1,16})\) (INCOMPLETE|ERROR|MISMATCH)$")
PROC = re.compile(r"  Process (\d+) on node (\S*) managing GPUs? (.*)$")
WHO = r" -- (?:GPU (\d+)(?: \(NVML \d+\))? managed by process (\d+) on node (\S*)|\[process information not found\])$"
RANK = re.compile(r"  Rank (\d+)(?: (has launched up to operation (\d+)|has not launched any operations|"
                  r"has status (NOCOMM|INIT|RUNNING|FINALIZE|ABORT)|reported (.+?)))?" + WHO)
COUNT = re.compile(r"  (\d+) ranks (?:have launched up to operation (\d+)|have not launched any operations|"
                   r"have status (\w+)|reported (.+))$")
DIFFERENT = re.compile(r"  Communicator ranks have different (?:(\w+) operation counts|status)$")
MISSING = re.compile(r"  Missing communicator data from (\d+) (?:job process(?:es)?|ranks?)$")
DEAD = re.compile(r"  (\d+) job process(?:es are| is) considered dead \(unreachable via the RAS network\)$")
NOTE = re.compile(r"  (?:\[could not find information on \d+ process(?:es)?\]|(?:Initialization|Asynchronous) "
                  r"errors? on \d+ ranks?|Encountered \d+ communication timeouts? while gathering communicator data)$")
TIMEOUTS = re.compile(r"  Encountered (\d+) communication timeout")


@dataclass
class Proc:
    """A process the report names: its pid, node (IP address) and GPUs."""

    pid: int
    node: str
    gpus: str = ""
    line: int = 0


@dataclass
class CommRank:
    """One rank of one communicator as the report gives it (counts: per collective function; absent: unknown)."""

    rank: int
    pid: int | None = None
    node: str | None = None
    gpu: int | None = None
    counts: dict[str, int] = field(default_factory=dict)
    status: str = ""  # RUNNING, INIT, FINALIZE, ABORT, NOCOMM ("" unknown)
    error: str = ""  # an initialization or asynchronous error it reported
    missing: bool = False  # no data from it (unresponsive or dead)
    dead: bool = False
    line: int = 0


@dataclass
class Comm:
    """A communicator: its hash, size and what the report says of its ranks."""

    hash: str
    size: int = 0
    label: str = ""  # "#G-I" in the text report
    errors: set[str] = field(default_factory=set)  # INCOMPLETE, ERROR, MISMATCH
    ranks: dict[int, CommRank] = field(default_factory=dict)
    majority: dict[str, int] = field(default_factory=dict)  # text: the most frequent count of a mismatched function
    complete: bool = False  # every present rank is listed with its counts (JSON)
    line: int = 0


@dataclass
class RasReport:
    """What one RAS report holds."""

    path: Path
    form: str  # "text" or "json"
    version: str = ""
    processes: int = 0  # the job's processes (text: Job summary)
    comms: dict[str, Comm] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)  # text: group number -> ranks per communicator
    dead: list[Proc] = field(default_factory=list)
    unreachable: list[Proc] = field(default_factory=list)  # processes that sent no communicator data
    n_dead: int = 0
    n_missing: int = 0
    timeouts: int = 0
    lines: int = 0
    ignored: list[str] = field(default_factory=list)  # "LINE: text" of lines not understood (outside a section)


def read_report(path: Path) -> RasReport:
    """Read the RAS report in file ``path`` (text or JSON); :class:`ImportFormatError` names what is wrong."""
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ImportFormatError(f"{path}: {size} bytes: an NCCL RAS report is at most {MAX_BYTES >> 20} MiB "
                                    f"here; this is not one (or not one report)")
        data = read_input(path, MAX_BYTES)
    except OSError as exc:
        raise ImportFormatError(f"{path}: cannot read it: {exc.strerror}") from None
    if data.lstrip()[:1] == b"{":
        return _read_json(path, data)
    return _read_text(path, data)


def _decode(path: Path, data: bytes) -> list[str]:
    lines = data.split(b"\n")
    out = []
    for n, raw in enumerate(lines, 1):
        if len(raw) > MAX_LINE:
            raise ImportFormatError(f"{path}:{n}: a line of {len(raw)} bytes: an NCCL RAS report's lines are short "
                                    f"(at most {MAX_LINE}); this is not one")
        try:
            out.append(raw.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError:
            raise ImportFormatError(f"{path}:{n}: not UTF-8 text: an NCCL RAS report is ASCII") from None
    return out


def _read_text(path: Path, data: bytes) -> RasReport:
    lines = _decode(path, data)
    rep = RasReport(path, "text", lines=len(lines))
    start = next((i for i, s in enumerate(lines[:50]) if HEADER.match(s)), None)
    if start is None:
        raise ImportFormatError(f"{path}: no 'NCCL version V compiled with CUDA C' line in its first 50 lines: "
                                f"not an NCCL RAS report (the output of ncclras, NCCL 2.24+)")
    rep.version = HEADER.match(lines[start]).group(1)  # type: ignore[union-attr]
    section, total_row, comm, what = "", "", None, ""  # what: the sub-block a 'Rank'/'Process' line belongs to
    value: int | None = None  # the count of the current '%d ranks have launched up to operation %ld' block
    func = ""
    seen_comms = seen_errors = False
    for n in range(start + 2, len(lines) + 1):
        s = lines[n - 1]
        if not s.strip() or RULE.match(s):
            continue
        head = HEADING.match(s)
        if head:
            section = head.group(1).split(".")[0].split()[0]  # Job, Communicators, Errors, Warnings
            seen_comms |= section == "Communicators"
            seen_errors |= section == "Errors"
            comm, what = None, ""
            continue
        where = Fields(f"{path}:{n}")
        if s.startswith("CUDA runtime version") or s.lstrip().startswith(("Nodes", "Processes", "per ", "(total)")):
            total_row = s if s.lstrip().startswith("(total)") else total_row
            continue
        if section == "Job":
            _job_line(rep, where, n, s, total_row)
            continue
        if section == "Communicators":
            _table_line(rep, where, n, s)
            continue
        if section not in ("Errors", "Warnings"):
            _ignore(rep, n, s)
            continue
        m = COMM.match(s)
        if m:
            g = where.decimal("group", m.group(1), 0, MAX_RANKS)
            comm = rep.comms.setdefault(m.group(3), Comm(m.group(3), rep.sizes.get(g, 0), f"#{g}-{m.group(2)}",
                                                         line=n))
            comm.errors.add(m.group(4))
            what, value, func = m.group(4), None, ""
            continue
        if s in ("INCOMPLETE", "DEAD", "TIMEOUT"):
            comm, what = None, s
            continue
        if _process_line(rep, where, n, s, comm, what):
            continue
        if comm is not None:
            m = DIFFERENT.match(s)
            if m:
                func, value = m.group(1) or "", None
                if func and func not in FUNCS:
                    where.fail("function", f"one of {', '.join(FUNCS)}", func)
                continue
            m = COUNT.match(s)
            if m:
                value = where.decimal("operation", m.group(2), 0) if m.group(2) else 0
                if func:
                    comm.majority.setdefault(func, value)  # (the most frequent count comes first)
                continue
            m = RANK.match(s)
            if m:
                _rank_line(comm, where, m, what, func, value, n)
                continue
        if NOTE.match(s):
            t = TIMEOUTS.match(s)
            rep.timeouts = int(t.group(1)) if t else rep.timeouts
            continue
        _ignore(rep, n, s)
    _check_sections(rep, len(lines), seen_comms, seen_errors)
    for c in rep.comms.values():
        c.size = max(c.size, max(c.ranks, default=-1) + 1)
    return rep


def _job_line(rep: RasReport, where: Fields, n: int, s: str, total_row: str) -> None:
    """A line of the ``Job summary``: the job's processes, from its ``(total)`` row."""
    m = NUMS.match(s)
    if m is None:
        _ignore(rep, n, s)
        return
    nums = m.group(1).split()
    if total_row and len(nums) in (3, 5):  # (total) rows: 5 columns when consistent, else 3
        rep.processes = where.decimal("processes", nums[3 if len(nums) == 5 else 1], 1, MAX_RANKS)


def _table_line(rep: RasReport, where: Fields, n: int, s: str) -> None:
    """A line of the ``Communicators...`` table: the ranks per communicator of a group."""
    m = TABLE_ROW.match(s)
    if m:
        rep.sizes[where.decimal("group", m.group(1), 0, MAX_RANKS)] = where.decimal(
            "ranks per comm", m.group(5), 1, MAX_RANKS)
    elif s.strip() not in ("Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors",
                           "No communicator data collected!") and not s.lstrip().startswith("#  in group"):
        _ignore(rep, n, s)


def _process_line(rep: RasReport, where: Fields, n: int, s: str, comm: Comm | None, what: str) -> bool:
    """A count of missing or dead processes, or a process of the ``INCOMPLETE`` or ``DEAD`` block outside a
    communicator's; False: not such a line."""
    m = MISSING.match(s) or DEAD.match(s)
    if m:
        count = where.decimal("count", m.group(1), 1, MAX_RANKS)
        if comm is None and what == "INCOMPLETE":
            rep.n_missing = count
        elif comm is None and what == "DEAD":
            rep.n_dead = count
        return True
    m = PROC.match(s)
    if m and comm is None and what in ("INCOMPLETE", "DEAD"):
        p = Proc(where.decimal("pid", m.group(1), 0, 1 << 32), m.group(2), m.group(3), n)
        (rep.dead if what == "DEAD" else rep.unreachable).append(p)
        return True
    return False


def _check_sections(rep: RasReport, last: int, seen_comms: bool, seen_errors: bool) -> None:
    """A report cut short (its ``Communicators...`` or ``Errors`` section missing) is an error at its last line."""
    if not seen_comms:
        raise ImportFormatError(f"{rep.path}:{last}: the report ends before its 'Communicators...' section "
                                f"(cut short? ncclras prints it after gathering the data, up to its timeout)")
    if not seen_errors and rep.sizes:
        raise ImportFormatError(f"{rep.path}:{last}: the report ends before its 'Errors' section (cut short?)")


def _rank_line(comm: Comm, where: Fields, m: re.Match, what: str, func: str, value: int | None, n: int) -> None:
    """One ``Rank R ...`` line of a communicator's block: who it is and what the block says of it."""
    r = where.decimal("rank", m.group(1), 0, MAX_RANKS - 1)
    cr = comm.ranks.setdefault(r, CommRank(r, line=n))
    if m.group(7):
        cr.gpu = where.decimal("GPU", m.group(6), 0, 1 << 16)
        cr.pid, cr.node = where.decimal("pid", m.group(7), 0, 1 << 32), m.group(8)
    if what == "INCOMPLETE":
        cr.missing = True
    elif what == "ERROR":
        cr.error = m.group(5) or cr.error or "an error"
    elif m.group(4):
        cr.status = m.group(4)
    elif func:
        launched = m.group(2)
        cr.counts[func] = (where.decimal("operation", m.group(3), 0) if launched and m.group(3)
                           else 0 if launched else value if value is not None else -1)
        if cr.counts[func] < 0:
            where.fail("rank", "a count before it ('N ranks have launched up to operation C')", m.group(0).strip())


def _ignore(rep: RasReport, n: int, s: str) -> None:
    rep.ignored.append(f"{n}: {s[:80]}")


def _read_json(path: Path, data: bytes) -> RasReport:
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ImportFormatError(f"{path}: not UTF-8 text (byte {exc.start}): an NCCL RAS report is ASCII") from None
    except json.JSONDecodeError as exc:
        raise ImportFormatError(f"{path}:{exc.lineno}: not JSON ({exc.msg}, column {exc.colno}): cut short, or "
                                f"not an NCCL RAS report") from None
    except RecursionError:
        raise ImportFormatError(f"{path}: JSON nested too deep: not an NCCL RAS report") from None
    top = Fields(f"{path}")
    top.mapping("(the document)", doc)
    if "nccl_version" not in doc or "communicators" not in doc:
        raise ImportFormatError(f"{path}: a JSON object without nccl_version and communicators: not an NCCL RAS "
                                f"report (ncclras -f json)")
    rep = RasReport(path, "json", version=top.text("nccl_version", doc["nccl_version"]) or "",
                    lines=data.count(b"\n") + 1)
    ras = top.mapping("ras", doc.get("ras"), optional=True)
    rep.timeouts = top.integer("ras.timeouts_count", ras.get("timeouts_count", 0), 0, MAX_RANKS)
    for i, c in enumerate(top.sequence("communicators", doc["communicators"])):
        f = Fields(f"{path}: communicators[{i}]")
        f.mapping("(the communicator)", c)
        h = f.text("hash", c.get("hash")) or ""
        comm = Comm(h.removeprefix("0x"), f.integer("size", c.get("size"), 1, MAX_RANKS), f"#{i}", complete=True)
        if comm.hash in rep.comms:
            f.fail("hash", "a communicator listed once", h)
        for j, r in enumerate(f.sequence("ranks", c.get("ranks"))):
            comm_rank = _json_rank(Fields(f"{path}: communicators[{i}].ranks[{j}]"), r, comm.size)
            counts = Fields(f"{path}: communicators[{i}].ranks[{j}].collective_counts")
            for name, v in counts.mapping("collective_counts", r.get("collective_counts")).items():
                comm_rank.counts[str(name)] = counts.integer(str(name), v, 0)
            st = f.mapping("status", r.get("status"), optional=True)
            comm_rank.status = ("ABORT" if st.get("abort_flag") else "FINALIZE" if st.get("finalize_called") or
                                st.get("destroy_flag") else "RUNNING" if st.get("init_state", 0) == 0 else "INIT")
            err = st.get("async_error", 0) or st.get("init_state", 0)
            comm_rank.error = "" if err in (0, 7) else f"ncclResult_t {err}"  # 7: ncclInProgress
            comm.ranks[comm_rank.rank] = comm_rank
        for j, r in enumerate(f.sequence("missing_ranks", c.get("missing_ranks"), optional=True)):
            mf = Fields(f"{path}: communicators[{i}].missing_ranks[{j}]")
            comm_rank = _json_rank(mf, r, comm.size)
            st = mf.mapping("status", r.get("status"), optional=True)
            comm_rank.missing = bool(st.get("unresponsive", True))
            comm_rank.dead = bool(st.get("considered_dead", False))
            comm_rank.status = "" if comm_rank.missing else "NOCOMM"
            comm.ranks.setdefault(comm_rank.rank, comm_rank)
            comm.errors.add("INCOMPLETE" if comm_rank.missing else "MISMATCH")
        rep.comms[comm.hash] = comm
    return rep


def _json_rank(f: Fields, r: object, size: int) -> CommRank:
    f.mapping("(the rank)", r)
    assert isinstance(r, dict)
    pid = f.integer("pid", r.get("pid", -1), -1, 1 << 32)
    host = f.text("host", r.get("host", "unknown")) or "unknown"
    return CommRank(f.integer("rank", r.get("rank"), 0, size - 1), None if pid < 0 else pid,
                    None if host == "unknown" else host, f.integer("cuda_dev", r.get("cuda_dev", 0), -1, 1 << 16))
