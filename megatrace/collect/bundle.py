"""The collection bundle in the job directory: rings byte for byte, node facts, what is missing, the analysis.

Layout of ``<job-dir>/megatrace-<job>/`` (a later collection of the same job
goes to ``megatrace-<job>.1``, ``.2``, ...)::

    collection.json       trigger, expected / collected / missing nodes and ranks, every file with its sha256
    rings/rank-N.ring     the ring files exactly as they were on the nodes (and rank-N.meta.jsonl, earlier
                          attempts rank-N.ring.K); a name two nodes both hold goes to nodes/<node>/ instead
    nodes/<node>.json     the node's facts: ring headers, /proc states of the ranks, GPUs, kernel log, stacks
    tails.pack            each ring's header and newest records, and each meta file: what a quick load reads
                          (megatrace.trace.tail_pack)
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
from megatrace.collect.payload import UNREADABLE, FileEntry, NodeHeader, header_of, streamed_pieces
from megatrace.names import job_dir_name, safe_name
from megatrace.trace import tail_pack

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
    """A streamed file of a node: written under a hidden name in rings/ as its chunks come, put in its place
    (or dropped, or put aside) at its end, once its size and sha256 are known."""

    name: str
    partial: str  # its hidden name in rings/ while it arrives
    size: int  # the most bytes it may have (announced in the header)
    written: int = 0
    sha: Any = field(default_factory=hashlib.sha256)
    ended: bool = False
    failed: str | None = None  # why its bytes stopped being written (the node's other files go on)

    @property
    def whole(self) -> bool:
        return self.ended and not self.failed


@dataclass
class _Incoming:
    head: NodeHeader
    entry: NodeEntry
    targets: dict[int, _Target]  # file index -> its streamed file (absent: the node wrote it into rings/ itself)
    failed: str | None = None  # why the rest of its stream is dropped (a chunk the header did not announce)


class _PackWriter:
    """The bundle's tails pack, written as the tails arrive (the root holds at most a MiB of it)."""

    FLUSH_BYTES = 1 << 20

    def __init__(self, out: safefs.OutDir, enabled: bool = True) -> None:
        self.out = out
        self.enabled = enabled
        self.fd = -1
        self.buffer = bytearray()
        self.names: set[str] = set()
        self.rows: list[tuple[str, int, int]] = []  # its index: (name, where, length) of each entry
        self.end = len(tail_pack.MAGIC)
        self.failed: str | None = None

    def add(self, name: str, size: int, entry: bytes) -> None:
        """Add the entry of file ``name`` (``size`` bytes) unless it is not one, or the pack holds that name."""
        if not self.enabled or name in self.names or self.failed or not _pack_entry_of(entry, name, size):
            return
        self.names.add(name)
        self.rows.append((name, self.end, len(entry)))
        self.end += len(entry)
        self.buffer += entry
        if len(self.buffer) >= self.FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        try:
            if self.fd < 0:
                self.out.unlink(tail_pack.PACK_NAME)  # (a collection that stopped before in this directory)
                self.fd = self.out.create(tail_pack.PACK_NAME)
                os.write(self.fd, tail_pack.MAGIC)
            view = memoryview(self.buffer)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as exc:
            self.failed = f"{tail_pack.PACK_NAME} not written: {exc.strerror or exc}"
        self.buffer = bytearray()

    def close(self, problems: list[str]) -> None:
        """Write what is left and the index; the pack's time is then the moment it was known to describe rings/."""
        if self.rows and not self.failed:
            self.buffer += tail_pack.pack_index(self.rows, self.end)
            self._flush()
        if self.fd >= 0:
            try:
                os.utime(self.fd)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = -1
        if self.failed:
            problems.append(self.failed)
            self.failed = None


def _pack_entry_of(entry: bytes, name: str, size: int) -> bool:
    """Whether ``entry`` is one whole tails-pack entry of file ``name`` of ``size`` bytes, of a tail's size."""
    got = tail_pack.single_entry(entry) if len(entry) <= tail_pack.entry_limit(name) else None
    return got is not None and got[0] == name and got[1].size == size


@dataclass
class BundleWriter:
    """Write node snapshots into the bundle as they arrive (the root never holds them all), then finish."""

    path: Path
    job_id: str
    owner: tuple[int, int] | None = None
    exclusive: bool = False  # the directory must be new (see bundle_path's ``fresh``)
    packing: bool = True  # write tails.pack (not when several --local runs share the bundle)
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
        self.pack = _PackWriter(self.out, self.packing)  # tails.pack: the tails of the rings in rings/
        self.transfer: dict[str, Any] = {}  # how the gather moved them (set by the collector)

    # -- arrival ------------------------------------------------------------
    def add_missing(self, info: dict[str, Any]) -> None:
        self.missing.append({"mpi_rank": info.get("mpi_rank"), "reason": info.get("reason", "did not report")})

    def add_node(self, snap: NodeSnapshot, mpi_rank: int | None = None) -> None:
        """Write one node's files (read a chunk at a time) and facts from its snapshot; never raises for the
        node's content."""
        head = header_of(snap)
        key = -1 if mpi_rank is None else mpi_rank
        if not self.begin_node(head, key, mpi_rank):
            return
        for index, at, data, digest in streamed_pieces(snap, head):
            if data is not None:
                self.add_chunk(key, index, at, data)
                continue
            self.end_file(key, index, at, digest.hex())
            if (entry := snap.files[head.files[index].name].tail_entry) is not None:
                self.add_tail(key, index, entry)
        self.end_node(key)

    def begin_node(self, head: NodeHeader, key: int, mpi_rank: int | None = None) -> bool:
        """A node's header: its facts, the files it wrote into the bundle itself, and the files whose chunks
        (:meth:`add_chunk`, :meth:`end_file`, under ``key``) follow. False for a node heard twice."""
        if any(e.node == head.node for e in self.entries):
            self.problems.append(f"node {head.node} reported twice (MPI rank {mpi_rank}); the second copy was "
                                 "ignored (more than one collector task on that node?)")
            return False
        entry = NodeEntry(head.node, mpi_rank, len(head.files), head.error)
        self.entries.append(entry)
        targets: dict[int, _Target] = {}
        for index, f in enumerate(head.files):
            if f.placed is None:
                targets[index] = _Target(f.name, f"{INCOMING_PREFIX}root.{key}.{f.name}", f.size)
                continue
            # written by the node itself (O_EXCL), its digest taken as it wrote
            known = self._sha.get(f.name)
            if known is None:
                self._sha[f.name] = f.sha256  # type: ignore[assignment]  (a placed file has its digest)
                self.placed[0] += 1
                self.placed[1] += f.size
                self.files.append({"name": f.placed, "node": head.node, "bytes": f.size, "sha256": f.sha256})
            elif known != f.sha256:
                self.problems.append(f"{f.placed}: node {head.node} wrote it, but another node's copy of "
                                     "that name differs")
            # (else the same bytes as a copy listed already: a trace directory two nodes share)
        self._incoming[key] = _Incoming(head, entry, targets)
        self._add_facts(head.node, dict(head.facts))
        try:
            self.nodes.write(f"{safe_name(head.node)}.json",
                             json.dumps(head.facts, indent=1, default=str).encode() + b"\n")
        except OSError as exc:
            self.problems.append(f"cannot write facts of node {head.node}: {exc.strerror or exc}")
        return True

    def _streamed(self, key: int, index: int) -> "_Target | None":
        """The streamed file ``index`` of the node under ``key``, while its bytes are still wanted."""
        inc = self._incoming.get(key)
        if inc is None or inc.failed:
            return None
        target = inc.targets.get(index)
        if target is None:
            inc.failed = f"bytes of file {index}, which it does not stream"
        elif target.ended:
            inc.failed = f"bytes of {target.name} after its end"
        return None if inc.failed or target is None or target.failed else target

    def add_chunk(self, key: int, index: int, offset: int, data: bytes | memoryview) -> None:
        """Bytes of file ``index`` of the node streaming under ``key``, at ``offset`` (in order)."""
        target = self._streamed(key, index)
        if target is None:
            return
        if offset != target.written or target.written + len(data) > target.size:
            target.failed = f"{target.name}: bytes at {offset} where {target.written} were expected"
            return
        try:
            self.rings.append(target.partial, data, new=target.written == 0)
        except OSError as exc:
            target.failed = f"cannot write rings/{target.name}: {exc.strerror or exc}"
            return
        target.sha.update(data)
        target.written += len(data)

    def end_file(self, key: int, index: int, size: int, sha256: str) -> None:
        """The end of file ``index`` of the node under ``key``: its size and sha256 as its node read it. A
        whole file goes to rings/ (or, when rings/ holds other bytes of that name, to nodes/<node>/)."""
        target = self._streamed(key, index)
        if target is None:
            return
        target.ended = True
        if sha256 == UNREADABLE.hex():
            target.failed = f"{target.name}: its node could not read it (gone, or replaced since the snapshot)"
            return
        if size != target.written or sha256 != target.sha.hexdigest():
            target.failed = f"{target.name}: its bytes did not match the size and sha256 it announced"
            return
        try:
            if target.written == 0:
                self.rings.append(target.partial, b"", new=True)
            where = self._settle(self._incoming[key].head.node, target.name, target.partial, sha256)
        except OSError as exc:
            target.failed = f"cannot write rings/{target.name}: {exc.strerror or exc}"
            return
        if where is not None:
            self.files.append({"name": where, "node": self._incoming[key].head.node, "bytes": size,
                               "sha256": sha256})

    def _settle(self, node: str, name: str, partial: str, digest: str) -> str | None:
        """Link the whole file ``partial`` of ``node`` to its own name: rings/<name>, or nodes/<node>/<name> when
        rings/ holds other bytes of that name; None when rings/ holds the very same bytes (a trace directory
        two nodes share). Never replaces a file; ``partial`` is removed."""
        try:
            if name not in self._sha:
                try:
                    os.link(partial, name, src_dir_fd=self.rings.fd, dst_dir_fd=self.rings.fd,
                            follow_symlinks=False)
                    self._sha[name] = digest
                    return f"rings/{name}"
                except FileExistsError:  # written by a node itself, or by another node's --local run
                    try:
                        self._sha[name] = safefs.sha256_file(self.rings.fd, name, RING_LIMIT)[1]
                    except OSError:  # not a file we can read (a link, a FIFO): set aside below
                        self._sha[name] = ""
            if self._sha[name] == digest:
                return None
            if node not in self._extra:
                self._extra[node] = self.nodes.subdir(safe_name(node))
            where = f"nodes/{safe_name(node)}/{name}"
            os.link(partial, name, src_dir_fd=self.rings.fd, dst_dir_fd=self._extra[node].fd, follow_symlinks=False)
            self.problems.append(f"{name} exists on more than one node with different content; the copy of node "
                                 f"{node} is in {where}")
            return where
        finally:
            self.rings.unlink(partial)

    def add_tail(self, key: int, index: int, entry: bytes) -> None:
        """The tails-pack entry of file ``index`` of the node under ``key``: packed when that very file (its
        sha256) is the one in rings/ and the pack holds none of that name yet; else dropped."""
        inc = self._incoming.get(key)
        if inc is None or index >= len(inc.head.files):
            return
        f = inc.head.files[index]
        target = inc.targets.get(index)
        digest = f.sha256 if f.placed is not None else (target.sha.hexdigest() if target and target.whole else None)
        if digest is not None and self._sha.get(f.name) == digest:
            self.pack.add(f.name, f.size if target is None else target.written, entry)

    def end_node(self, key: int, reason: str | None = None) -> None:
        """The node's stream is over: whole, or cut for ``reason``. A file that did not arrive whole is removed
        and named, with the node, in the problems."""
        inc = self._incoming.pop(key, None)
        if inc is None:
            return
        cut, whys = [], []
        for t in inc.targets.values():
            if t.ended and not t.failed:
                continue
            cut.append(f"rings/{t.name}")
            whys.append(t.failed or inc.failed or reason)
            self.rings.unlink(t.partial)
        if cut:
            detail = "; ".join(dict.fromkeys(w for w in whys if w)) or "its stream ended before the file did"
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
                    size, self._sha[name] = safefs.sha256_file(self.rings.fd, name, RING_LIMIT)
                except OSError:
                    continue
                self.files.append({"name": f"rings/{name}", "node": None, "bytes": size, "sha256": self._sha[name]})

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
        self.pack.close(self.problems)
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
            "transfer": {**self.transfer, "tails_packed": len(self.pack.names),
                         "files_written_by_nodes": self.placed[0],
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
        self.pack.close(self.problems)  # (before the analysis, which reads it)
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


def place_files(snap: NodeSnapshot, bundle: str, nonce: str,
                owner: tuple[int, int] | None) -> tuple[dict[str, FileEntry], str | None]:
    """Write ``snap``'s trace files into ``bundle``'s rings/ from this node, when this node sees the very
    directory the root made (its ``.gather`` mark holds ``nonce``: a shared filesystem). Each file is read
    once, a chunk at a time, and hashed as it is written.

    Returns (file name -> its entry, for each file written or found there with the same bytes; why nothing
    was placed, or None). A file not placed is left for the stream to the root.
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
    placed: dict[str, FileEntry] = {}
    try:
        rings = safefs.OutDir(Path(bundle) / "rings", owner, create=False)
    except OSError as exc:
        return {}, f"rings/ of the bundle not writable from this node ({exc.strerror or exc})"
    with rings:
        for name, f in sorted(snap.files.items()):
            # Written under a name no reader takes for a trace file, then linked to its own (no replace): a
            # node wedged or killed part-way leaves a hidden partial file, never a short ring for the analysis.
            partial = f"{INCOMING_PREFIX}{nonce[:8]}.{safe_name(snap.node)}.{name}"
            digest, size, created = hashlib.sha256(), 0, False
            try:
                for data in f.chunks():
                    rings.append(partial, data, new=not created)
                    created = True
                    digest.update(data)
                    size += len(data)
                if not created:
                    rings.append(partial, b"", new=True)
            except FileExistsError:  # (not ours to remove): the root gets the bytes
                continue
            except OSError:  # (a full filesystem, a quota): the root gets the bytes
                rings.unlink(partial)
                continue
            entry = FileEntry(name, size, digest.hexdigest(), f"rings/{name}")
            try:
                os.link(partial, name, src_dir_fd=rings.fd, dst_dir_fd=rings.fd, follow_symlinks=False)
                placed[name] = entry
            except FileExistsError:  # another node's copy: the same bytes are that copy, others go to the root
                try:
                    if safefs.sha256_file(rings.fd, name, RING_LIMIT) == (size, entry.sha256):
                        placed[name] = entry
                except OSError:
                    pass
            except OSError:
                pass
            rings.unlink(partial)
    return placed, None
