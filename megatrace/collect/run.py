"""The collector's two ways to run: one MPI task per node (gather to rank 0), or ``--local`` (this node only).

:func:`collect_mpi` is what ``megatrace collect`` runs under ``srun --overlap
--mpi=pmi2 --ntasks-per-node=1`` or ``mpiexec``: every task snapshots its node,
the payloads travel to MPI rank 0 through the two-level gather
(:mod:`megatrace.collect.gather`), and rank 0 writes the bundle as they arrive,
then runs the analysis. No task ever waits past its deadline for a node that
does not answer: that node is named missing and the rest is analysed.

:func:`collect_local` copies this node's rings into the bundle without MPI (the
epilog's fallback); several nodes may add to the same bundle directory.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatrace.collect import safefs
from megatrace.collect.bundle import GATHER_MARK, LOCAL_MARK, Analyse, BundleWriter, bundle_path
from megatrace.collect.gather import DEFAULT_GROUP_SIZE, DEFAULT_TIMEOUT_S, gather, release
from megatrace.collect.node import NodeSnapshot, default_ring_dir, snapshot_node
from megatrace.collect.payload import PayloadError, pack_node, unpack_node
from megatrace.errors import MegatraceError
from megatrace.names import node_name


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
    snap = _snapshot(opts)
    writer = BundleWriter(out, job_id, _owner(opts.job_dir))
    writer.claim(LOCAL_MARK)
    writer.add_node(snap)
    expected = opts.expected_nodes or [snap.node]
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


def _import_mpi() -> Any:
    try:
        import mpi4py

        mpi4py.rc.finalize = False  # never wait in MPI_Finalize for a dead peer: we leave with os._exit
        mpi4py.rc.threads = False
        from mpi4py import MPI
    except ImportError as exc:
        raise CollectError(f"mpi4py is not importable ({exc}); install the 'mpi' extra "
                           "(pip install 'megatrace[mpi]') or use --local") from None
    return MPI


def collect_mpi(opts: CollectOptions, report: Any = None) -> bool:
    """Run as one task of an MPI job; on rank 0, ``report(collection_doc)`` is called once the bundle is done.

    Returns True when MPI was finalized (leave normally), False when the caller must leave with
    :func:`exit_now` (a peer is dead or silent: MPI_Finalize would never return).
    """
    start = time.monotonic()
    MPI = _import_mpi()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    job_id = opts.resolved_job_id()
    writer: BundleWriter | None = None
    if rank == 0:
        root = os.geteuid() == 0
        out = Path(opts.out) if opts.out else bundle_path(opts.job_dir, job_id, fresh=root)
        writer = BundleWriter(out, job_id, _owner(opts.job_dir), exclusive=root and not opts.out)
        writer.claim(GATHER_MARK)
        _say(opts, f"collect: {comm.Get_size()} collector tasks -> {out}")

    def sink(info: dict[str, Any], payload: bytes | None) -> None:
        assert writer is not None
        if payload is None:
            writer.add_missing(info)
            return
        try:
            snap = unpack_node(payload)
        except PayloadError as exc:
            writer.add_missing({**info, "reason": f"payload unreadable: {exc}"})
            return
        writer.add_node(snap, info.get("mpi_rank"))

    def produce() -> bytes:
        try:
            return pack_node(_snapshot(opts))
        except Exception as exc:  # a node that cannot snapshot still reports why
            node = opts.node or node_name()
            return pack_node(NodeSnapshot(node, {}, {"node": node}, f"snapshot failed: {type(exc).__name__}: "
                                                                   f"{exc}"))

    outcome = gather(comm, produce, sink if rank == 0 else None, opts.group_size, opts.timeout, start)
    if rank == 0:
        assert writer is not None
        _add_layout(writer, opts)
        doc = writer.finish(opts.trigger, opts.detail, opts.expected_nodes, opts.analysis, opts.report,
                            opts.analyse)
        doc["path"] = str(writer.path)
        if report is not None:
            report(doc)
    return release(comm, outcome)


def exit_now(code: int) -> None:
    """Leave without MPI_Finalize (which would wait for a dead peer); flush our streams first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
