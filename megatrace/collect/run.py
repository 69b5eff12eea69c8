"""The collector's two ways to run: one MPI task per node (gather to rank 0), or ``--local`` (this node only).

:func:`collect_mpi` is what ``megatrace collect`` runs under ``srun --overlap
--mpi=pmi2 --ntasks-per-node=1`` or ``mpiexec``: MPI rank 0 makes the bundle
directory and tells every task where it is; every task snapshots its node and,
when it sees that very directory (a job directory on a filesystem every node
mounts), writes its own trace files into it; its facts, its file list with
sizes and sha256, and the bytes of any file it could not write travel to rank 0
through the two-level gather (:mod:`megatrace.collect.gather`), in bounded
messages written into the bundle as they arrive. Rank 0 then writes the index
and runs the analysis. No task ever waits past its deadline for a node that
does not answer: that node is named missing and the rest is analysed.

:func:`collect_local` copies this node's rings into the bundle without MPI (the
epilog's fallback); several nodes may add to the same bundle directory.
"""

from __future__ import annotations

import faulthandler
import io
import json
import os
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatrace.collect import mpi_segments, safefs
from megatrace.collect.bundle import GATHER_MARK, LOCAL_MARK, Analyse, BundleWriter, bundle_path, place_files
from megatrace.collect.gather import DEFAULT_GROUP_SIZE, DEFAULT_TIMEOUT_S, gather, release
from megatrace.collect.node import NodeSnapshot, default_ring_dir, snapshot_node
from megatrace.collect.payload import (FileEntry, PayloadError, header_of, is_end, is_tail, messages, unpack_chunk,
                                       unpack_end, unpack_header, unpack_tail)
from megatrace.errors import MegatraceError
from megatrace.names import node_name

MPI_INIT_SHARE = 0.5  # of --timeout: how long MPI_Init may take before a collector task gives up (gather's deadlines
#                       count from the same start: the root's word is due by a quarter of it)


class CollectError(MegatraceError):
    """A usage problem the user must fix (no MPI, no job directory)."""


@dataclass
class CollectOptions:
    job_dir: str = "."
    job_id: str | None = None
    ring_dir: str | None = None  # "%n" is replaced by the node name
    out: str | None = None
    node: str | None = None
    trigger: str = "manual"
    detail: str = ""
    analysis: str = "auto"
    report: bool = True
    stacks: bool = True
    system: bool = True
    timeout: float = DEFAULT_TIMEOUT_S
    group_size: int = DEFAULT_GROUP_SIZE
    transfer: str = "auto"  # auto: nodes that see the bundle write their own files into it; stream: all via MPI
    expected_nodes: list[str] | None = None
    layout: str | None = None  # a layout YAML copied into the bundle (root only)
    log: Any = field(default=None, repr=False)
    analyse: Analyse | None = field(default=None, repr=False)  # the bundle's analysis (megatrace.pipeline)

    def resolved_job_id(self) -> str:
        return self.job_id or os.environ.get("MEGATRACE_JOB_ID") or os.environ.get("SLURM_JOB_ID") or "local"

    def resolved_ring_dir(self, node: str) -> str | None:
        ring = self.ring_dir or default_ring_dir(self.resolved_job_id())
        return ring.replace("%n", node) if ring else None


def _say(opts: CollectOptions, msg: str) -> None:
    if opts.log is not None:
        opts.log(msg)


def _owner(job_dir: str) -> tuple[int, int] | None:
    return safefs.owner_of(job_dir) if os.geteuid() == 0 else None


def _snapshot(opts: CollectOptions) -> NodeSnapshot:
    node = opts.node or node_name()
    return snapshot_node(opts.resolved_ring_dir(node), node, stacks=opts.stacks, system=opts.system)


def collect_local(opts: CollectOptions) -> dict[str, Any]:
    """Copy this node's rings and facts into the bundle directory (created or shared); no MPI.

    With one expected node (or none given) the bundle is finished at once: collection.json, the
    analysis, the report. With several (``--nodes``, or ``SLURM_JOB_NODELIST`` in an epilog), each node
    adds its files, and the node that completes the set (every expected node's facts are there)
    finishes it, once (a marker file created with O_EXCL decides). Returns collection.json, or this
    node's part (node, files, problems, path) when the bundle is not finished yet.
    """
    job_id = opts.resolved_job_id()
    out = Path(opts.out) if opts.out else bundle_path(opts.job_dir, job_id, local=True)
    with _snapshot(opts) as snap:
        expected = opts.expected_nodes or [snap.node]
        # (several nodes' runs fill one bundle: none of them sees every ring, so none writes a tails pack)
        writer = BundleWriter(out, job_id, _owner(opts.job_dir), packing=len(expected) <= 1)
        writer.claim(LOCAL_MARK)
        writer.add_node(snap)
    if len(expected) <= 1 or (writer.has_facts_of(expected) and writer.claim(".finishing")):
        writer.adopt()
        _add_layout(writer, opts)
        doc = writer.finish(opts.trigger, opts.detail, expected, opts.analysis, opts.report,
                            opts.analyse)
        doc["path"] = str(out)
        return doc
    part = {"node": snap.node, "files": len(writer.files), "problems": writer.problems, "path": str(out),
            "waiting_for": [n for n in expected if not writer.has_facts_of([n])]}
    writer.close()
    return part


def _add_layout(writer: BundleWriter, opts: CollectOptions) -> None:
    """Copy ``opts.layout`` into the bundle as layout.yaml (read without following a user's link)."""
    if not opts.layout:
        return
    path = os.path.abspath(opts.layout)
    try:
        dfd = safefs.open_dir(os.path.dirname(path))
        try:
            data = safefs.read_file(dfd, os.path.basename(path), 1 << 20)
        finally:
            os.close(dfd)
        writer.out.write("layout.yaml", data, replace=True)
    except OSError as exc:
        writer.problems.append(f"layout {opts.layout} not copied: {exc.strerror or exc}")


def _import_mpi(deadline_s: float | None = None) -> tuple[Any, list[str]]:
    """mpi4py's MPI, started (its import runs ``MPI_Init``), and what was done to MPICH's start-up segments around
    that (``collect/mpi_segments.py``: a stale one of this job step removed first, ours unlinked once attached).

    ``deadline_s``: an ``MPI_Init`` that has not returned by then (a process manager that stopped answering, a peer
    wedged in its start-up) ends this process with status 1, the stacks of its threads on stderr under
    "Timeout (...)!": faulthandler's watchdog, a thread of C that runs while ``MPI_Init`` holds the interpreter.
    Otherwise only the step's time limit would end it, minutes later, and the hang's report with it."""
    try:
        import mpi4py

        mpi4py.rc.finalize = False  # never wait in MPI_Finalize for a dead peer: we leave with os._exit
        mpi4py.rc.threads = False
        notes = mpi_segments.clear_stale()
        watched = _watchdog(deadline_s)
        try:
            from mpi4py import MPI
        finally:
            if watched:
                faulthandler.cancel_dump_traceback_later()
    except ImportError as exc:
        raise CollectError(f"mpi4py is not importable ({exc}); install the 'mpi' extra "
                           "(pip install 'megatrace[mpi]') or use --local") from None
    return MPI, notes + mpi_segments.unlink_attached()


def _watchdog(deadline_s: float | None) -> bool:
    """Arm faulthandler's exit after ``deadline_s`` (stacks to stderr); False where stderr is no file (nothing armed)."""
    if not deadline_s:
        return False
    try:
        faulthandler.dump_traceback_later(deadline_s, exit=True, file=sys.stderr)
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):  # (stderr without a descriptor)
        return False
    return True


class _BundleReceiver:
    """The root's receiver: each node's stream (header, then chunks) written into the bundle as it arrives."""

    def __init__(self, writer: BundleWriter) -> None:
        self.writer = writer
        self.heard: set[int] = set()  # MPI ranks whose header arrived
        self.unreadable: dict[int, str] = {}

    def message(self, rank: int, data: bytes) -> None:
        if rank in self.unreadable:
            return
        try:
            if rank in self.heard:
                if is_end(data):
                    self.writer.end_file(rank, *unpack_end(data))
                elif is_tail(data):
                    self.writer.add_tail(rank, *unpack_tail(data))
                else:
                    self.writer.add_chunk(rank, *unpack_chunk(data))
                return
            head = unpack_header(data)
        except PayloadError as exc:
            self.unreadable[rank] = f"payload unreadable: {exc}"
            self.writer.end_node(rank, self.unreadable[rank])
            return
        self.heard.add(rank)
        self.writer.begin_node(head, rank, rank)

    def end(self, rank: int) -> None:
        if rank in self.heard:
            self.writer.end_node(rank, self.unreadable.get(rank))
        else:
            self.writer.add_missing({"mpi_rank": rank, "reason": self.unreadable.get(rank, "sent no header")})

    def missing(self, rank: int, reason: str) -> None:
        if rank in self.heard:
            self.writer.end_node(rank, reason)
        else:
            self.writer.add_missing({"mpi_rank": rank, "reason": reason})


def collect_mpi(opts: CollectOptions, report: Any = None) -> bool:
    """Run as one task of an MPI job; on rank 0, ``report(collection_doc)`` is called once the bundle is done.

    Returns True when MPI was finalized (leave normally), False when the caller must leave with
    :func:`exit_now` (a peer is dead or silent: MPI_Finalize would never return).
    """
    start = time.monotonic()
    MPI, segment_notes = _import_mpi(MPI_INIT_SHARE * opts.timeout)
    for note in segment_notes:
        _say(opts, f"collect: {note}")
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    job_id = opts.resolved_job_id()
    writer: BundleWriter | None = None
    word: bytes | None = None
    if rank == 0:
        root = os.geteuid() == 0
        out = Path(opts.out) if opts.out else bundle_path(opts.job_dir, job_id, fresh=root)
        writer = BundleWriter(out, job_id, _owner(opts.job_dir), exclusive=root and not opts.out)
        nonce = secrets.token_hex(16)  # a node that reads it in the bundle directory sees the root's very directory
        writer.out.write(GATHER_MARK, nonce.encode() + b"\n", replace=True)
        word = json.dumps({"bundle": str(writer.path), "nonce": nonce, "place": opts.transfer == "auto"}).encode()
        _say(opts, f"collect: {comm.Get_size()} collector tasks -> {out}")

    def produce(word: bytes | None) -> Iterator[bytes]:
        node = opts.node or node_name()
        t0, c0 = time.monotonic(), time.process_time()
        try:
            snap = _snapshot(opts)
        except Exception as exc:  # a node that cannot snapshot still reports why
            snap = NodeSnapshot(node, {}, {"node": node}, f"snapshot failed: {type(exc).__name__}: {exc}")
        if segment_notes:
            snap.facts["mpi_segments"] = segment_notes
        with snap:  # (its files are open until every byte is written or sent)
            placed, why = _place(snap, word, opts)
            head = header_of(snap, placed)
            snap.facts["transfer"] = {"placed": len(placed), "streamed": len(snap.files) - len(placed),
                                      "bytes": sum(f.size for f in snap.files.values()),
                                      "seconds": round(time.monotonic() - t0, 4),  # snapshot, own writes
                                      "cpu_seconds": round(time.process_time() - c0, 4)} | (
                {"why_streamed": why} if why else {})
            yield from messages(snap, head)

    receiver = _BundleReceiver(writer) if writer is not None else None
    outcome = gather(comm, produce, receiver, opts.group_size, opts.timeout, start, announce=word)
    if rank == 0:
        assert writer is not None
        writer.transfer = {"mode": opts.transfer, "bytes_through_root": outcome.bytes_received,
                           "largest_message": outcome.largest_message}
        _add_layout(writer, opts)
        doc = writer.finish(opts.trigger, opts.detail, opts.expected_nodes, opts.analysis, opts.report,
                            opts.analyse)
        doc["path"] = str(writer.path)
        if report is not None:
            report(doc)
    return release(comm, outcome)


def _place(snap: NodeSnapshot, word: bytes | None, opts: CollectOptions) -> tuple[dict[str, FileEntry],
                                                                                str | None]:
    """Write this node's files into the bundle itself when the root's word allows it and this node sees
    the bundle (a shared job directory); else every byte goes through the gather."""
    if word is None:
        return {}, "the root's word did not arrive in time"
    try:
        doc = json.loads(word)
    except ValueError:
        return {}, "the root's word is unreadable"
    if not doc.get("place"):
        return {}, "--transfer stream"
    if not snap.files:
        return {}, None
    return place_files(snap, str(doc.get("bundle", "")), str(doc.get("nonce", "")), _owner(opts.job_dir))


def exit_now(code: int) -> None:
    """Leave without MPI_Finalize (which would wait for a dead peer); flush our streams first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
