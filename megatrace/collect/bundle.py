"""The collection bundle in the job directory: rings byte for byte, node facts, what is missing, the analysis.

Layout of ``<job-dir>/megatrace-<job>/`` (a later collection of the same job
goes to ``megatrace-<job>.1``, ``.2``, ...)::

    collection.json       trigger, expected / collected / missing nodes and ranks, every file with its sha256
    rings/rank-N.ring     the ring files exactly as they were on the nodes (and rank-N.meta.jsonl, earlier
                          attempts rank-N.ring.K); a name two nodes both hold goes to nodes/<node>/ instead
    nodes/<node>.json     the node's facts: ring headers, /proc states of the ranks, GPUs, kernel log, stacks
    procs.json            per rank: pid, node, process state (read by the analysis); "stalled" on a hang
    findings.json         the analysis (megatrace analyze); summary.txt its text; report.html if available
                          (megatrace.pipeline runs them once the bundle is written)
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from megatrace.collect import safefs
from megatrace.collect.node import RING_LIMIT, TRACE_FILE_RE, NodeSnapshot, main_thread_frames
from megatrace.collect.payload import NodeHeader, header_of
from megatrace.names import job_dir_name, safe_name

FORMAT_VERSION = 1
ANALYSIS_MODES = ("auto", "full", "quick", "none")
# The analysis of a finished bundle (megatrace.pipeline.analyze_bundle): (writer, "full" or "quick", write the
# report) -> its entry in collection.json. Passed in: collection never imports analysis or report.
Analyse = Callable[["BundleWriter", str, bool], dict[str, Any]]


def _proc_entry(facts: dict[str, Any], pid: Any, node: str) -> dict[str, Any]:
    """procs.json's entry for the process ``pid`` as ``node``'s collector saw it (its state, where it waits, and
    the innermost frames of its main thread when py-spy dumped it)."""
    proc = (facts.get("procs") or {}).get(str(pid), {})
    dump = ((facts.get("python_stacks") or {}).get("stacks") or {}).get(str(pid))
    entry = {"pid": pid, "node": node, "exit_code": None, "signal": None, "alive": proc.get("alive"),
             "state": proc.get("state_name"), "wchan": proc.get("wchan")}
    if isinstance(dump, str) and (frames := main_thread_frames(dump)):
        entry["stack"] = frames
    return entry


GATHER_MARK, LOCAL_MARK = ".gather", ".local"  # which kind of collection fills a bundle directory
INCOMING_PREFIX = ".incoming."  # a file a node is still writing into rings/ (see place_files)


def bundle_path(job_dir: str | os.PathLike[str], job_id: str, fresh: bool = False, local: bool = False) -> Path:
    """The bundle directory for a new collection: the first fitting ``megatrace-<job>``, ``megatrace-<job>.1``, ...

    A gather (``local`` False) takes the first without a finished collection and not filled by ``--local``
    runs; with ``fresh`` (as root: a directory the user made could hold links planted for whatever writes
    into it by name) the first that does not exist at all. ``--local`` runs of the nodes of one job share
    one directory: the first not used by a gather.
    """
    base = Path(job_dir) / job_dir_name(safe_name(job_id))
    n = 0
    while True:
        candidate = base if n == 0 else base.with_name(f"{base.name}.{n}")
        n += 1
        if candidate.is_symlink() or (candidate.exists() and not candidate.is_dir()):
            continue
        if not candidate.exists():
            return candidate
        if local:
            if not (candidate / GATHER_MARK).exists() and \
                    ((candidate / LOCAL_MARK).exists() or not (candidate / "collection.json").exists()):
                return candidate
        elif not fresh and not (candidate / "collection.json").exists() and not (candidate / LOCAL_MARK).exists():
            return candidate


@dataclass
class NodeEntry:
    node: str
    mpi_rank: int | None
    files: int = 0
    error: str | None = None


@dataclass
class _Target:
    """Where a streamed file of a node is written, and what arrived of it."""

    dir: safefs.OutDir
    name: str
    where: str  # bundle-relative
    digest: str  # the sha256 its node announced
    written: int = 0
    sha: Any = field(default_factory=hashlib.sha256)
    failed: str | None = None  # why its bytes stopped being written (the node's other files go on)


@dataclass
class _Incoming:
    head: NodeHeader
    entry: NodeEntry
    targets: dict[int, _Target]  # file index -> where its chunks go (absent: rings/ holds it already)
    failed: str | None = None  # why the rest of its stream is dropped (a chunk the header did not announce)


@dataclass
class BundleWriter:
    """Write node snapshots into the bundle as they arrive (the root never holds them all), then finish."""

    path: Path
    job_id: str
    owner: tuple[int, int] | None = None
    exclusive: bool = False  # the directory must be new (see bundle_path's ``fresh``)
    started_wall_ns: int = field(default_factory=time.time_ns)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.out = safefs.OutDir(self.path, self.owner, exclusive=self.exclusive)
        self.rings = self.out.subdir("rings")
        self.nodes = self.out.subdir("nodes")
        self.entries: list[NodeEntry] = []
        self.missing: list[dict[str, Any]] = []  # MPI ranks (nodes) that sent nothing
        self.files: list[dict[str, Any]] = []
        self.ring_facts: list[dict[str, Any]] = []
        self.procs: dict[str, dict[str, Any]] = {}
        self.problems: list[str] = []
        self._sha: dict[str, str] = {}
        self._incoming: dict[int, _Incoming] = {}  # nodes whose stream is being written, by key (MPI rank)
        self._extra: dict[str, safefs.OutDir] = {}  # nodes/<node>/ directories opened for name clashes
        self.placed = [0, 0]  # files and bytes the nodes wrote into rings/ themselves
        self.transfer: dict[str, Any] = {}  # how the gather moved them (set by the collector)

    # -- arrival ------------------------------------------------------------
    def add_missing(self, info: dict[str, Any]) -> None:
        self.missing.append({"mpi_rank": info.get("mpi_rank"), "reason": info.get("reason", "did not report")})

    def add_node(self, snap: NodeSnapshot, mpi_rank: int | None = None) -> None:
        """Write one node's files and facts from its snapshot; never raises for the node's content."""
        head = header_of(snap)
        key = -1 if mpi_rank is None else mpi_rank
        if not self.begin_node(head, key, mpi_rank):
            return
        for index, entry in head.streamed:
            self.add_chunk(key, index, 0, snap.files[entry.name])
        self.end_node(key)

    def begin_node(self, head: NodeHeader, key: int, mpi_rank: int | None = None) -> bool:
        """A node's header: its facts, the files it wrote into the bundle itself, and where the bytes of
        the others (its chunks, :meth:`add_chunk`, under ``key``) go. False for a node heard twice."""
        if any(e.node == head.node for e in self.entries):
            self.problems.append(f"node {head.node} reported twice (MPI rank {mpi_rank}); the second copy was "
                                 "ignored (more than one collector task on that node?)")
            return False
        entry = NodeEntry(head.node, mpi_rank, len(head.files), head.error)
        self.entries.append(entry)
        targets: dict[int, _Target] = {}
        for index, f in enumerate(head.files):
            if f.placed is not None:  # written by the node itself (O_EXCL), its digest taken as it wrote
                known = self._sha.get(f.name)
                if known is None:
                    self._sha[f.name] = f.sha256
                    self.placed[0] += 1
                    self.placed[1] += f.size
                    self.files.append({"name": f.placed, "node": head.node, "bytes": f.size, "sha256": f.sha256})
                elif known != f.sha256:
                    self.problems.append(f"{f.placed}: node {head.node} wrote it, but another node's copy of "
                                         "that name differs")
                continue  # (the same bytes as a copy listed already: a trace directory two nodes share)
            target = self._target(head.node, f.name, f.sha256)
            if target is not None:
                targets[index] = target
        self._incoming[key] = _Incoming(head, entry, targets)
        self._add_facts(head.node, dict(head.facts))
        try:
            self.nodes.write(f"{safe_name(head.node)}.json",
                             json.dumps(head.facts, indent=1, default=str).encode() + b"\n")
        except OSError as exc:
            self.problems.append(f"cannot write facts of node {head.node}: {exc.strerror or exc}")
        return True

    def _target(self, node: str, name: str, digest: str) -> "_Target | None":
        """Where the file ``name`` of ``node`` goes: rings/, nodes/<node>/ when rings/ holds another file of that
        name, or nowhere (None) when rings/ holds the very same bytes (a trace directory two nodes share)."""
        try:
            if name not in self._sha and self.rings.exists(name):  # written by another node's --local run
                self._sha[name] = hashlib.sha256(safefs.read_file(self.rings.fd, name, RING_LIMIT)).hexdigest()
        except OSError as exc:
            self.problems.append(f"cannot read rings/{name}: {exc.strerror or exc}")
            return None
        if name not in self._sha:
            self._sha[name] = digest
            return _Target(self.rings, name, f"rings/{name}", digest)
        if self._sha[name] == digest:
            return None
        if node not in self._extra:
            self._extra[node] = self.nodes.subdir(safe_name(node))
        extra = self._extra[node]
        where = f"nodes/{safe_name(node)}/{name}"
        self.problems.append(f"{name} exists on more than one node with different content; the copy of node "
                             f"{node} is in {where}")
        return _Target(extra, name, where, digest)

    def add_chunk(self, key: int, index: int, offset: int, data: bytes | memoryview) -> None:
        """Bytes of file ``index`` of the node streaming under ``key``, at ``offset`` (in order)."""
        inc = self._incoming.get(key)
        if inc is None or inc.failed:
            return
        target = inc.targets.get(index)
        if index >= len(inc.head.files) or inc.head.files[index].placed is not None:
            inc.failed = f"a chunk of file {index}, which it does not stream"
            return
        if target is None or target.failed:
            return  # a copy rings/ already holds, or a file that failed already
        if offset != target.written or target.written + len(data) > inc.head.files[index].size:
            target.failed = f"{target.name}: bytes at {offset} where {target.written} were expected"
            return
        try:
            target.dir.append(target.name, data, new=target.written == 0)
        except OSError as exc:
            target.failed = f"cannot write {target.where}: {exc.strerror or exc}"
            return
        target.sha.update(data)
        target.written += len(data)

    def end_node(self, key: int, reason: str | None = None) -> None:
        """The node's stream is over: whole, or cut for ``reason``. A file that did not arrive whole is removed
        and named, with the node, in the problems."""
        inc = self._incoming.pop(key, None)
        if inc is None:
            return
        cut, whys = [], []
        for index, t in sorted(inc.targets.items()):
            f = inc.head.files[index]
            if t.written == f.size and t.sha.hexdigest() == f.sha256 and not t.failed:
                if f.size == 0:  # (no chunk: the header said it all)
                    try:
                        t.dir.append(t.name, b"", new=True)
                    except OSError as exc:
                        self.problems.append(f"cannot write {t.where}: {exc.strerror or exc}")
                        continue
                self.files.append({"name": t.where, "node": inc.head.node, "bytes": f.size, "sha256": f.sha256})
                continue
            cut.append(t.where)
            whys.append(t.failed or inc.failed or reason)
            if t.written:
                t.dir.unlink(t.name)
            if self._sha.get(t.name) == t.digest and t.dir is self.rings:
                del self._sha[t.name]
        if cut:
            detail = "; ".join(dict.fromkeys(w for w in whys if w)) or \
                "its bytes did not match the size and sha256 it announced"
            self.problems.append(f"node {inc.head.node}: {len(cut)} file(s) did not arrive whole ({detail}): "
                                 + ", ".join(cut[:8]) + (" ..." if len(cut) > 8 else ""))
            if inc.entry.error is None:
                inc.entry.error = f"its stream was cut: {detail}"

    def adopt(self) -> None:
        """Take in what other nodes' ``--local`` runs wrote into this bundle (nodes/*.json, rings/)."""
        known = {e.node for e in self.entries}
        for name in safefs.list_dir(self.nodes.fd):
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                facts = json.loads(safefs.read_file(self.nodes.fd, name, 64 << 20))
            except (OSError, ValueError) as exc:
                self.problems.append(f"nodes/{name} unreadable: {exc}")
                continue
            node = str(facts.get("node") or name[:-5])
            if node in known:
                continue
            self.entries.append(NodeEntry(node, None, len(facts.get("rings") or []), facts.get("error")))
            self._add_facts(node, facts)
        for name in safefs.list_dir(self.rings.fd):
            if TRACE_FILE_RE.match(name) and name not in self._sha:
                try:
                    data = safefs.read_file(self.rings.fd, name, RING_LIMIT)
                except OSError:
                    continue
                self._sha[name] = hashlib.sha256(data).hexdigest()
                self.files.append({"name": f"rings/{name}", "node": None, "bytes": len(data),
                                   "sha256": self._sha[name]})

    def _add_facts(self, node: str, facts: dict[str, Any]) -> None:
        for ring in facts.get("rings", []):
            self.ring_facts.append({**ring, "node": node})
            if ring.get("error") or ring.get("problems"):
                self.problems.append(f"node {node}: {ring['file']}: "
                                     + "; ".join([ring["error"]] if ring.get("error") else ring["problems"]))
            pid = ring.get("pid")
            m = TRACE_FILE_RE.match(ring["file"])
            if isinstance(ring.get("rank"), int) and m and not m.group(3):
                self.procs[str(ring["rank"])] = {**_proc_entry(facts, pid, node), "tracer_closed": ring.get("closed")}
        # Ranks without a ring yet: in init_process_group (start markers), or not there yet (the step's processes).
        for key, flag in (("init_ranks", "in_init_process_group"), ("before_init_ranks", "before_init_process_group")):
            for rank, pid in (facts.get(key) or {}).items():
                self.procs.setdefault(str(rank), {**_proc_entry(facts, pid, node), flag: True})
        for skipped in facts.get("skipped") or []:
            self.problems.append(f"node {node}: {skipped['name']} not collected: {skipped['reason']}")

    def has_facts_of(self, nodes: list[str]) -> bool:
        """Whether nodes/<node>.json exists for every one of ``nodes``."""
        return all(self.nodes.exists(f"{safe_name(n)}.json") for n in nodes)

    def claim(self, name: str) -> bool:
        """Create the empty marker file ``name`` (O_EXCL): True for the one process that made it."""
        try:
            self.out.write(name, b"")
            return True
        except FileExistsError:
            return False

    def close(self) -> None:
        """Leave without finishing (another node's --local run finishes the bundle)."""
        for d in (*self._extra.values(), self.rings, self.nodes, self.out):
            d.give_away()
            d.close()

    # -- the end --------------------------------------------------------------
    def summary(self, trigger: str, detail: str, expected_nodes: list[str] | None) -> dict[str, Any]:
        collected = sorted(e.node for e in self.entries if not e.error)
        failed = [{"node": e.node, "reason": e.error} for e in self.entries if e.error]
        missing_nodes: list[dict[str, Any]] = list(failed)
        if expected_nodes:
            seen = {e.node for e in self.entries}
            missing_nodes += [{"node": n, "reason": "no collector task reported from it"}
                              for n in expected_nodes if n not in seen]
            unknown = [m for m in self.missing]
            if unknown and not any(n not in seen for n in expected_nodes):
                missing_nodes += [{"node": f"MPI rank {m['mpi_rank']}", "reason": m["reason"]} for m in unknown]
        else:
            missing_nodes += [{"node": f"MPI rank {m['mpi_rank']}", "reason": m["reason"]} for m in self.missing]
        main = [r for r in self.ring_facts if "rank" in r and not TRACE_FILE_RE.match(r["file"]).group(3)]
        worlds = Counter(r["world_size"] for r in main)
        world = worlds.most_common(1)[0][0] if worlds else 0
        have = sorted({r["rank"] for r in main if 0 <= r["rank"] < world})
        missing_ranks = sorted(set(range(world)) - set(have))
        return {
            "format": FORMAT_VERSION, "job_id": self.job_id,
            "trigger": {"reason": trigger, "detail": detail},
            "started_wall_ns": self.started_wall_ns, "finished_wall_ns": time.time_ns(),
            "nodes": {"expected": expected_nodes, "collected": collected,
                      "without_traces": sorted(e.node for e in self.entries if not e.error and not e.files),
                      "missing": missing_nodes},
            "ranks": {"world_size": world, "collected": len(have), "missing": missing_ranks,
                      "in_init_process_group": sorted(int(r) for r, p in self.procs.items()
                                                      if p.get("in_init_process_group"))},
            "mpi_ranks_missing": self.missing,
            "problems": self.problems,
            "transfer": {**self.transfer, "files_written_by_nodes": self.placed[0],
                         "bytes_written_by_nodes": self.placed[1],
                         "files_written_by_root": len(self.files) - self.placed[0]},
            "files": self.files,
        }

    def finish(self, trigger: str = "manual", detail: str = "", expected_nodes: list[str] | None = None,
               analysis: str = "auto", report: bool = True, analyse: Analyse | None = None) -> dict[str, Any]:
        """Write procs.json and collection.json, run ``analyse`` (the analysis and the report, see
        :func:`megatrace.pipeline.analyze_bundle`) unless ``analysis`` is "none"; returns collection.json."""
        procs = {"ranks": self.procs, "collected_by": "megatrace collect"}
        if trigger in ("hang", "failure"):
            procs["outcome"] = "stalled"
            procs["message"] = f"the MegaTrace agents confirmed a {trigger}{': ' + detail if detail else ''}"
        alive = [p for p in self.procs.values() if p.get("alive")]
        if trigger not in ("hang", "failure") and alive:
            procs["outcome"] = "running"
            procs["message"] = (f"collected while the job ran ({trigger}{': ' + detail if detail else ''}); "
                                "operations in flight at that moment are not hangs")
        if trigger == "failure" and alive:
            # In a job that still runs, a rank whose process vanished with its ring open has crashed.
            for p in self.procs.values():
                if p.get("alive") is False and p.get("tracer_closed") is False:
                    p["signal"] = "an unknown signal or crash (process gone, its ring still open)"
        self._write("procs.json", procs)
        try:
            left = [n for n in safefs.list_dir(self.rings.fd) if n.startswith(INCOMING_PREFIX)]
        except OSError:
            left = []
        if left:
            self.problems.append(f"{len(left)} file(s) in rings/ left part-written by a node that stopped while "
                                 "writing them (not trace files to the analysis): " + ", ".join(sorted(left)[:8]))
        doc = self.summary(trigger, detail, expected_nodes)
        if analysis == "none" or not self._sha:
            doc["analysis"] = {"ran": False, "reason": "disabled" if analysis == "none" else
                               "no ring files were collected"}
        elif analyse is None:
            doc["analysis"] = {"ran": False, "reason": "no analysis step was given to the collection"}
        else:
            mode = "quick" if analysis == "auto" and trigger == "hang" and len(self._sha) > 2048 else analysis
            doc["analysis"] = analyse(self, "full" if mode == "auto" else mode, report)
        self._write("collection.json", doc)
        for d in (*self._extra.values(), self.rings, self.nodes, self.out):
            d.give_away()
            d.close()
        return doc

    def _write(self, name: str, obj: Any) -> None:
        self.out.write(name, json.dumps(obj, indent=1, default=str).encode() + b"\n", replace=True)

    def collection_problems(self) -> list[str]:
        """What the collection could not bring, as lines for the analysis's trace problems."""
        out = [f"collection: node {e.node} missing: {e.error}" for e in self.entries if e.error]
        out += [f"collection: MPI rank {m['mpi_rank']} (one node) missing: {m['reason']}" for m in self.missing]
        out += [f"collection: {p}" for p in self.problems]
        return out


def place_files(snap: NodeSnapshot, bundle: str, nonce: str, owner: tuple[int, int] | None) -> tuple[dict[str, str],
                                                                                                        str | None]:
    """Write ``snap``'s trace files into ``bundle``'s rings/ from this node, when this node sees the very
    directory the root made (its ``.gather`` mark holds ``nonce``: a shared filesystem).

    Returns (file name -> bundle-relative path, for each file written or found there with the same bytes;
    why nothing was placed, or None). A file not placed is left for the stream to the root.
    """
    try:
        dfd = safefs.open_dir(bundle)
        try:
            mark = safefs.read_file(dfd, GATHER_MARK, 256).decode("ascii", "replace").strip()
        finally:
            os.close(dfd)
    except OSError as exc:
        return {}, f"the bundle directory is not visible from this node ({exc.strerror or exc})"
    if not nonce or mark != nonce:
        return {}, "the bundle directory seen from this node is not the root's (another filesystem)"
    placed: dict[str, str] = {}
    try:
        rings = safefs.OutDir(Path(bundle) / "rings", owner, create=False)
    except OSError as exc:
        return {}, f"rings/ of the bundle not writable from this node ({exc.strerror or exc})"
    with rings:
        for name, data in sorted(snap.files.items()):
            # Written under a name no reader takes for a trace file, then linked to its own (no replace): a
            # node wedged or killed part-way leaves a hidden partial file, never a short ring for the analysis.
            partial = f"{INCOMING_PREFIX}{nonce[:8]}.{safe_name(snap.node)}.{name}"
            try:
                rings.append(partial, data, new=True)
            except OSError:  # (a full filesystem, a quota, a name taken): the root gets the bytes
                if rings.exists(partial):
                    rings.unlink(partial)
                continue
            try:
                os.link(partial, name, src_dir_fd=rings.fd, dst_dir_fd=rings.fd, follow_symlinks=False)
                placed[name] = f"rings/{name}"
            except FileExistsError:  # another node's copy: the same bytes are that copy, others go to the root
                try:
                    if safefs.read_file(rings.fd, name, RING_LIMIT) == data:
                        placed[name] = f"rings/{name}"
                except OSError:
                    pass
            except OSError:
                pass
            rings.unlink(partial)
    return placed, None
