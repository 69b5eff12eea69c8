"""One node's share of a collection: its ring files, byte for byte, and facts about the node.

:func:`snapshot_node` opens every ``rank-N.ring[.K]`` and ``rank-N.meta.jsonl[.K]``
of the node's trace directory (without following a user's symbolic links, see
:mod:`megatrace.collect.safefs`; the files are read later a chunk at a time, never
whole), describes each ring from its header (a corrupt or truncated file is kept
as it is and described, never fatal), and adds what the node can tell about the
ranks' processes:

* process state, kernel wait channel and command line from ``/proc/<pid>``, for
  the pid in each ring header (a pid that started after the ring was created is
  a reused pid, not the writer: reported as such);
* an NVML snapshot of the GPUs when ``pynvml`` works (absent here: recorded as unavailable);
* kernel-log lines about GPU Xid errors, OOM kills and hung tasks when ``/dev/kmsg`` is readable;
* Python stacks of the live trainers when ``py-spy`` is installed.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from megatrace.collect import safefs
from megatrace.names import node_name
from megatrace.trace import ring_format as fmt
from megatrace.trace.init_marker import MAX_MARKER_BYTES, InitMarker, parse_marker
from megatrace.trace.tail_pack import TailCapture, packed

TRACE_FILE_RE = re.compile(r"^rank-(\d+)\.(ring|meta\.jsonl|init)(\.\d+)?$")  # .init: trace/init_marker.py
RING_LIMIT = fmt.file_size(fmt.MAX_CAPACITY)  # the largest legal ring file
META_LIMIT = 64 << 20  # a meta file is a few KiB; refuse anything absurd
RESOLVE_TIMEOUT_S = 3.0  # a rendezvous name's lookup, and a connection to it
STACK_TIMEOUT_S = 10.0  # py-spy attaches and unwinds in well under a second per process
KMSG_PATTERN = re.compile(r"NVRM: Xid|Out of memory|oom-kill|hung_task|blocked for more than|segfault", re.I)
KMSG_MAX_LINES = 200


READ_BYTES = 16 << 20  # a trace file is read, hashed, written and sent this much at a time, never whole


@dataclass(eq=False)
class TraceFile:
    """One trace file of the node, known by its identity at the snapshot and read a chunk at a time: a node's
    memory does not grow with its rings, and it holds one file open at a time however many it has."""

    name: str
    dir_fd: int  # its directory (the snapshot's, open until the snapshot is closed)
    identity: tuple[int, int]  # (st_dev, st_ino) at the snapshot: a file replaced since is not read
    size: int  # bytes at the snapshot; a file that grew since is read up to here
    head: bytes  # its first bytes (a ring's header)
    tail_entry: bytes | None = None  # its tails-pack entry, taken from the bytes of its last whole read

    def chunks(self, size: int | None = None) -> Iterator[bytes]:
        """The file's bytes, ``size`` (:data:`READ_BYTES`) at a time (fewer at the end, or when it shrank since
        the snapshot). A whole read also leaves the file's tails-pack entry in :attr:`tail_entry`. OSError when
        it cannot be opened, or is another file than at the snapshot."""
        size = size or READ_BYTES
        capture = TailCapture(self.name, self.size) if packed(self.name) else None
        fd = safefs.open_regular(self.dir_fd, self.name)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.identity:
                raise OSError(errno.ESTALE, f"{self.name}: replaced since the snapshot")
            offset = 0
            while offset < self.size:
                data = os.pread(fd, min(size, self.size - offset), offset)
                if not data:
                    return
                offset += len(data)
                if capture is not None:
                    capture.feed(data)
                yield data
        finally:
            os.close(fd)
        self.tail_entry = capture.entry() if capture is not None else None

    def read(self) -> bytes:
        """All of it (small files: start markers, meta files)."""
        return b"".join(self.chunks())


@dataclass
class NodeSnapshot:
    """What one node contributes: its trace files (name -> file) and facts (JSON-able).

    Its trace directory stays open, for the files to be read, until :meth:`close` (or the ``with`` block ends)."""

    node: str
    files: dict[str, TraceFile] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the trace directory itself could not be read
    dir_fd: int = -1

    def close(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def __enter__(self) -> "NodeSnapshot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def has_rings(path: str) -> bool:
    try:
        return any(TRACE_FILE_RE.match(n) for n in os.listdir(path))
    except OSError:
        return False


def job_ring_dirs(job_id: str | None, base: str | None = None, uid: int | None = None) -> list[str]:
    """Every ``<base>/<job>`` and ``<base>/<job>.<step>`` holding ring files, newest first.

    ``base``: the tracer's default (:func:`megatrace.trace.settings.default_base` of ``uid``). Only real
    directories (not links) that ``uid`` owns count [default: this process's user]: a directory another
    user named after the job (``<job>.evil``) is never watched or collected.
    """
    if not job_id:
        return []
    uid = os.geteuid() if uid is None else uid
    if base is None:
        from megatrace.trace.settings import default_base

        base = str(default_base(uid))
    try:
        names = [n for n in os.listdir(base) if n == job_id or n.startswith(job_id + ".")]
    except OSError:
        return []
    owned: dict[str, float] = {}
    for name in names:
        try:
            st = os.stat(os.path.join(base, name), follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
            owned[name] = st.st_mtime
    paths = [os.path.join(base, n) for n in sorted(owned, key=owned.__getitem__, reverse=True)]
    return [p for p in paths if has_rings(p)]


def default_ring_dir(job_id: str | None = None) -> str | None:
    """``$MEGATRACE_DIR`` when it holds rings, else the newest ``/dev/shm/megatrace-<uid>/<job>[.<step>]`` that does.

    (Under the SPANK plugin, the collector's and the agent's own steps get a ``MEGATRACE_DIR`` of their
    own, empty step: the training step's directory is then found by the job id.)
    """
    env = os.environ.get("MEGATRACE_DIR")
    if env and has_rings(env):
        return env
    job = job_id or os.environ.get("MEGATRACE_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    found = job_ring_dirs(job)
    return found[0] if found else env


def describe_ring(name: str, head: bytes, size: int) -> dict[str, Any]:
    """Header facts of one ring file from its first bytes and its size; problems (corrupt, truncated) are
    described, never raised."""
    from megatrace.trace.ring_reader import RingFormatError, parse_header

    out: dict[str, Any] = {"file": name, "bytes": size}
    try:
        header, problems = parse_header(name, head[:fmt.HEADER_SIZE], size)
    except RingFormatError as exc:
        out["error"] = str(exc)
        return out
    expected = fmt.file_size(header.capacity)
    out.update(rank=header.rank, local_rank=header.local_rank, world_size=header.world_size, pid=header.pid,
               host=header.host, job_id=header.job_id, step_id=header.step_id, capacity=header.capacity,
               write_counter=header.write_counter, closed=header.closed_cleanly,
               anchor_mono_ns=header.anchor_mono_ns, anchor_wall_ns=header.anchor_wall_ns,
               problems=[str(p) for p in problems])
    if size < expected:
        out["problems"].append(f"{name}: truncated: {size} of {expected} bytes")
    elif size > expected:
        out["problems"].append(f"{name}: {size - expected} bytes longer than its capacity says")
    return out


def open_trace_file(dir_fd: int, name: str, limit: int, owner: int | None = None) -> TraceFile:
    """Trace file ``name`` of ``dir_fd`` (no link of another user followed, regular files only): its identity, size
    and first bytes; larger than ``limit``: OSError EFBIG; not owned by ``owner`` (when given): OSError EPERM (a
    collector run as root never copies into a user's bundle a file the user could not read, hard-linked there)."""
    fd = safefs.open_regular(dir_fd, name)
    try:
        st = os.fstat(fd)
        if owner is not None and st.st_uid != owner:
            raise OSError(errno.EPERM, f"{name}: owned by uid {st.st_uid}, not by the trace directory's owner "
                                       f"(uid {owner})")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{name}: {st.st_size} bytes, more than the limit of {limit}")
        return TraceFile(name, dir_fd, (st.st_dev, st.st_ino), st.st_size, os.pread(fd, min(st.st_size,
                                                                                             fmt.HEADER_SIZE), 0))
    finally:
        os.close(fd)


def read_trace_dir(ring_dir: str, owner: list[int] | None = None) -> tuple[int, dict[str, TraceFile],
                                                                          list[dict[str, str]]]:
    """(directory, files, skipped): ``ring_dir`` open (the caller closes it) and every trace file in it; what could
    not be opened is in ``skipped``.

    ``owner``, when given, receives the uid that owns the directory: the user whose processes wrote it.
    """
    files: dict[str, TraceFile] = {}
    skipped: list[dict[str, str]] = []
    dfd = safefs.open_dir(ring_dir)
    try:
        uid = os.fstat(dfd).st_uid
        if owner is not None:
            owner.append(uid)
        # As root, a file another user owns is not the writer's (the writers run as the directory's owner).
        must_own = uid if os.geteuid() == 0 else None
        for name in safefs.list_dir(dfd):
            m = TRACE_FILE_RE.match(name)
            if not m:
                continue
            limit = {"ring": RING_LIMIT, "init": MAX_MARKER_BYTES}.get(m.group(2), META_LIMIT)
            try:
                files[name] = open_trace_file(dfd, name, limit, must_own)
            except OSError as exc:
                skipped.append({"name": name, "reason": exc.strerror or str(exc)})
    except BaseException:
        os.close(dfd)
        raise
    return dfd, files, skipped


def rank_prefix(name: str) -> str:
    """``rank-00003`` of ``rank-00003.ring.1`` / ``rank-00003.meta.jsonl``: the files of one rank."""
    return name.split(".", 1)[0]


def foreign_files(hosts: dict[str, str], node: str) -> set[str]:
    """Ring-file prefixes written on other nodes, when a trace directory is shared by several (pure).

    ``hosts``: ring file name -> host in its header. Several virtual Slurm nodes on one machine share
    ``/dev/shm``, so each node's collector sees every node's rings; the header's host (the writer's
    ``SLURMD_NODENAME``) tells which are its own. When no ring names this node (host names that are not
    node names), every ring is kept.
    """
    mine = {rank_prefix(f) for f, h in hosts.items() if h == node}
    if not mine:
        return set()
    return {rank_prefix(f) for f in hosts} - mine


_STATE_NAMES = {"R": "running", "S": "sleeping", "D": "uninterruptible (disk/driver wait)", "Z": "zombie",
                "T": "stopped", "t": "traced", "X": "dead", "I": "idle"}


def _read_proc(pid: int, name: str) -> bytes | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as fh:
            return fh.read(1 << 16)
    except OSError:
        return None


def process_facts(pid: int, ring_anchor_mono_ns: int | None = None, uid: int | None = None) -> dict[str, Any]:
    """State of process ``pid`` from /proc; ``alive`` False when it is gone (or is a reused pid).

    ``uid``: the user the ring's writer ran as (the ring directory's owner). A pid taken from a ring header
    is only a claim: a process of another user is never looked into (nor handed to py-spy).
    """
    if pid <= 0:
        return {"pid": pid, "alive": False}
    if uid is not None:
        try:
            owner = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return {"pid": pid, "alive": False}
        if owner != uid:
            return {"pid": pid, "alive": False, "note": f"pid runs as uid {owner}, not the ring's writer "
                                                        f"(uid {uid}): not looked into"}
    stat_raw = _read_proc(pid, "stat")
    if stat_raw is None:
        return {"pid": pid, "alive": False}
    text = stat_raw.decode("utf-8", "replace")
    rest = text[text.rfind(")") + 2:].split()
    out: dict[str, Any] = {"pid": pid, "alive": True, "state": rest[0] if rest else "?"}
    out["state_name"] = _STATE_NAMES.get(out["state"], out["state"])
    try:
        start_ns = int(rest[19]) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
        out["start_ns"] = start_ns
        # The writer made its ring after it started; a process younger than the ring is someone else.
        if ring_anchor_mono_ns is not None and start_ns > ring_anchor_mono_ns + 2_000_000_000:
            return {"pid": pid, "alive": False, "note": "pid reused by a process that started after the ring"}
    except (IndexError, ValueError, OSError):
        pass
    wchan = _read_proc(pid, "wchan")
    if wchan:
        out["wchan"] = wchan.decode("utf-8", "replace")
    cmd = _read_proc(pid, "cmdline")
    if cmd:
        out["cmdline"] = cmd.replace(b"\x00", b" ").decode("utf-8", "replace").strip()[:512]
    status = _read_proc(pid, "status")
    if status:
        for line in status.decode("utf-8", "replace").splitlines():
            if line.startswith(("Threads:", "VmRSS:")):
                key, _, value = line.partition(":")
                out[key.lower()] = value.strip()
    return out


def init_markers(files: dict[str, TraceFile]) -> dict[int, InitMarker]:
    """rank -> the start marker of each rank with no ring among ``files`` (current attempts only)."""
    rings = {int(m.group(1)) for n in files if (m := TRACE_FILE_RE.match(n)) and m.group(2) == "ring"
             and not m.group(3)}
    out = {}
    for name, f in files.items():
        m = TRACE_FILE_RE.match(name)
        if m and m.group(2) == "init" and not m.group(3) and int(m.group(1)) not in rings:
            try:
                mk = parse_marker(f.read())
            except OSError:
                continue
            if mk is not None and mk.rank == int(m.group(1)):
                out[mk.rank] = mk
    return out


def step_tasks(ring_dir: str, uid: int | None, known: set[int]) -> dict[int, int]:
    """rank -> pid of this node's processes of the step that writes ``ring_dir`` (their ``MEGATRACE_DIR``, set per
    step by the SPANK plugin) other than ``known``: the ranks that have not reached init_process_group.

    Only processes of ``uid`` (the ring directory's owner) are looked into; a launcher (a process whose child is
    also the step's) stands for nothing; the rank is ``RANK``, else ``SLURM_PROCID``."""
    if uid is None or not ring_dir:
        return {}
    want = b"MEGATRACE_DIR=" + os.fsencode(ring_dir)
    found: dict[int, tuple[int, int]] = {}  # pid -> (rank, parent)
    try:
        pids = [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return {}
    for pid in pids[:65536]:
        if pid in known or pid == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue
        env = (_read_proc(pid, "environ") or b"").split(b"\0")
        if want not in env:
            continue
        vars_ = dict(v.split(b"=", 1) for v in env if b"=" in v)
        rank = vars_.get(b"RANK") or vars_.get(b"SLURM_PROCID") or b""
        stat_raw = _read_proc(pid, "stat") or b""
        fields = stat_raw[stat_raw.rfind(b")") + 2:].split()
        if rank.isdigit() and len(fields) > 1 and fields[1].isdigit():
            found[pid] = (int(rank), int(fields[1]))
    parents = {parent for _, parent in found.values()}
    return {rank: pid for pid, (rank, _) in sorted(found.items()) if pid not in parents}


def rendezvous_facts(endpoints: set[tuple[str, int | None]], timeout: float = RESOLVE_TIMEOUT_S) -> dict[str, Any]:
    """Per rendezvous ``ADDR:PORT`` the ranks of this node try to reach: does the name resolve here, and does
    anything accept a connection there? Each check bounded by ``timeout`` (a resolver can hang)."""
    out: dict[str, Any] = {}
    for addr, port in sorted(endpoints, key=str)[:8]:
        out[f"{addr}:{port if port is not None else '?'}"] = _reach(addr, port, timeout)
    return out


def _reach(addr: str, port: int | None, timeout: float) -> dict[str, Any]:
    result: dict[str, Any] = {}

    def resolve() -> None:
        try:
            infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
            result["addresses"] = sorted({i[4][0] for i in infos})[:8]
        except (OSError, UnicodeError) as exc:
            result["error"] = str(getattr(exc, "strerror", None) or exc)

    worker = threading.Thread(target=resolve, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return {"resolves": False, "error": f"the resolver did not answer within {timeout:.0f} s"}
    if "error" in result:
        return {"resolves": False, "error": result["error"]}
    out: dict[str, Any] = {"resolves": True, "addresses": result["addresses"]}
    if port is not None and result["addresses"]:
        try:
            with socket.create_connection((result["addresses"][0], port), timeout=timeout):
                out["connects"] = True
        except OSError as exc:
            out["connects"], out["connect_error"] = False, exc.strerror or str(exc)
    return out


def gpu_facts() -> dict[str, Any]:
    """An NVML snapshot of the node's GPUs, or why there is none."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return {"available": False, "reason": "pynvml is not installed"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound and friends: no driver here
        return {"available": False, "reason": f"NVML: {exc}"}
    devices = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            dev: dict[str, Any] = {"index": i}
            probes = {
                "name": lambda: pynvml.nvmlDeviceGetName(h),
                "uuid": lambda: pynvml.nvmlDeviceGetUUID(h),
                "pci_bus_id": lambda: pynvml.nvmlDeviceGetPciInfo(h).busId,
                "temperature_c": lambda: pynvml.nvmlDeviceGetTemperature(h, 0),
                "utilization_gpu_pct": lambda: pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
                "memory_used_bytes": lambda: pynvml.nvmlDeviceGetMemoryInfo(h).used,
                "power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "compute_pids": lambda: [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)],
                "ecc_uncorrected_volatile": lambda: pynvml.nvmlDeviceGetTotalEccErrors(h, 1, 0),
            }
            for key, probe in probes.items():
                try:
                    value = probe()
                    dev[key] = value.decode() if isinstance(value, bytes) else value
                except Exception as exc:  # one unsupported query must not lose the rest
                    dev[key] = None
                    dev.setdefault("unsupported", []).append(f"{key}: {exc}")
            devices.append(dev)
    except Exception as exc:
        return {"available": False, "reason": f"NVML: {exc}", "devices": devices}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return {"available": True, "devices": devices}


def kernel_log_facts(path: str = "/dev/kmsg") -> dict[str, Any]:
    """Kernel-log lines about GPU Xid errors, OOM kills and hung tasks (the newest few hundred)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return {"readable": False, "reason": f"{path}: {exc.strerror}"}
    lines: list[str] = []
    try:
        for _ in range(200_000):  # the ring buffer holds at most a few tens of thousands of records
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == 32:  # EPIPE: a record was overwritten while reading; go on
                    continue
                break
            if not rec:
                break
            text = rec.decode("utf-8", "replace")
            msg = text.split(";", 1)[-1].split("\n", 1)[0]
            if KMSG_PATTERN.search(msg):
                lines.append(msg)
                del lines[:-KMSG_MAX_LINES]
    finally:
        os.close(fd)
    return {"readable": True, "lines": lines}


def _py_spy() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else None


def main_thread_frames(dump: str, limit: int = 4) -> list[str]:
    """The innermost ``limit`` frames of the main thread (else the first thread) in a ``py-spy dump``."""
    threads: list[tuple[str, list[str]]] = []
    for line in dump.splitlines()[:4000]:
        if line.startswith("Thread "):
            threads.append((line, []))
        elif threads and line.startswith((" ", "\t")) and line.strip():
            frames = threads[-1][1]
            if len(frames) < limit and not line.lstrip().startswith(("Arguments:", "Locals:")) \
                    and not line.startswith(" " * 8):  # frames are indented 4; their locals 8
                frames.append(line.strip()[:200])
    pid = re.match(r"Process (\d+):", dump)
    main = ([t for t in threads if '"MainThread"' in t[0]]
            or [t for t in threads if pid and t[0].startswith(f"Thread {pid.group(1)} ")] or threads)
    return main[0][1] if main else []


def python_stacks(pids: list[int], timeout: float = STACK_TIMEOUT_S) -> dict[str, Any]:
    """``py-spy dump`` of each live pid, all at once, each bounded by ``timeout``."""
    exe = _py_spy()
    if exe is None:
        return {"available": False, "reason": "py-spy is not installed"}
    procs = {}
    out: dict[str, Any] = {"available": True, "stacks": {}}
    for pid in pids:
        try:
            procs[pid] = subprocess.Popen([exe, "dump", "--pid", str(pid)], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except OSError as exc:
            out["stacks"][str(pid)] = f"py-spy failed: {exc.strerror}"
    end = time.monotonic() + timeout
    for pid, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=max(0.1, end - time.monotonic()))
            out["stacks"][str(pid)] = text.decode("utf-8", "replace")[-20000:]
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            out["stacks"][str(pid)] = f"py-spy did not answer within {timeout:.0f} s"
    return out


def snapshot_node(ring_dir: str | None, node: str | None = None, stacks: bool = True,
                  system: bool = True) -> NodeSnapshot:
    """Open this node's trace files and read its facts. Never raises for bad input: problems go into the facts.

    The caller closes the snapshot (its files stay open, to be read a chunk at a time).
    ``system=False`` skips NVML and the kernel log (tests).
    """
    node = node or node_name()
    snap = NodeSnapshot(node)
    try:
        _fill_snapshot(snap, ring_dir, stacks, system)
    except BaseException:
        snap.close()
        raise
    return snap


def _fill_snapshot(snap: NodeSnapshot, ring_dir: str | None, stacks: bool, system: bool) -> None:
    node = snap.node
    facts: dict[str, Any] = {"node": node, "hostname": socket.gethostname(), "ring_dir": ring_dir,
                             "time_wall_ns": time.time_ns(), "time_mono_ns": time.monotonic_ns(),
                             "collector_pid": os.getpid(), "uid": os.geteuid()}
    snap.facts = facts
    if ring_dir is None:
        snap.error = "no trace directory (give --ring-dir, or set MEGATRACE_DIR or SLURM_JOB_ID)"
    else:
        owner: list[int] = []
        try:
            snap.dir_fd, snap.files, facts["skipped"] = read_trace_dir(ring_dir, owner)
        except OSError as exc:
            snap.error = f"{ring_dir}: {exc.strerror or exc}"
        if owner:
            facts["ring_dir_uid"] = owner[0]
    if snap.error:
        facts["error"] = snap.error
    rings = [describe_ring(name, f.head, f.size) for name, f in sorted(snap.files.items())
             if TRACE_FILE_RE.match(name).group(2) == "ring"]  # type: ignore[union-attr]
    foreign = foreign_files({r["file"]: r["host"] for r in rings if "host" in r}, node)
    if foreign:
        snap.files = {n: f for n, f in snap.files.items() if rank_prefix(n) not in foreign}
        rings = [r for r in rings if rank_prefix(r["file"]) not in foreign]
        facts["other_nodes_rings"] = len(foreign)  # in a trace directory shared with other nodes: theirs
    facts["rings"] = rings
    procs = {}
    for ring in rings:
        pid = ring.get("pid")
        if isinstance(pid, int) and pid > 0 and str(pid) not in procs:
            procs[str(pid)] = process_facts(pid, ring.get("anchor_mono_ns"), facts.get("ring_dir_uid"))
    markers = init_markers(snap.files)
    for mk in markers.values():  # ranks still in (or stuck in) init_process_group: no ring yet
        if str(mk.pid) not in procs:
            procs[str(mk.pid)] = process_facts(mk.pid, mk.t_mono_ns, facts.get("ring_dir_uid"))
    if markers:
        facts["init_ranks"] = {str(r): mk.pid for r, mk in sorted(markers.items())}
        known = {int(p) for p in procs} | {mk.pid for mk in markers.values()}
        before = step_tasks(ring_dir or "", facts.get("ring_dir_uid"), known)
        for r, pid in before.items():  # the step's ranks that never reached init_process_group
            procs[str(pid)] = process_facts(pid, None, facts.get("ring_dir_uid"))
        if before:
            facts["before_init_ranks"] = {str(r): pid for r, pid in sorted(before.items())}
        facts["rendezvous"] = rendezvous_facts({(m.master_addr, m.master_port) for m in markers.values()
                                                if m.master_addr})
    facts["procs"] = procs
    if system:
        facts["gpu"] = gpu_facts()
        facts["kernel_log"] = kernel_log_facts()
    live = [int(p) for p, f in procs.items() if f.get("alive")]
    if stacks and live:
        facts["python_stacks"] = python_stacks(live)
