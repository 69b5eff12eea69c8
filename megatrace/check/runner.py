"""Run the preflight on one node or, under srun/mpiexec, on the whole allocation, and decide the exit status.

Under MPI every task joins: the first task of each node checks that node;
every task checks its own GPUs when Slurm bound the tasks to different GPUs
(``CUDA_VISIBLE_DEVICES`` differs), else the first task checks the job's GPUs
(all of the node's when nothing says which: :func:`assign_gpus`); every task
takes part in the all-reduce, the first tasks of the nodes measure
the node x node matrix, and task 0 gathers everything, compares the nodes with
each other and prints one table. Every task exits with the same status. A
watchdog bounds the whole run: a check that hangs (a wedged driver, a hung file
system, a dead peer in a collective) becomes a failure of the probe it was
running, and the results found until then are still printed and written.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from megatrace.check.dcgm import probe_dcgm
from megatrace.check.gpu import probe_gpus
from megatrace.check.host import judge_allocation, judge_host, read_host, read_net_delay
from megatrace.check.results import ProbeResult, Status, Subject, worst
from megatrace.check.thresholds import Thresholds
from megatrace.names import node_name

EXIT = {Status.OK: 0, Status.SKIP: 0, Status.WARN: 3, Status.FAIL: 4}  # 1: could not run, 2: bad usage
LEVELS = ("quick", "full")
QUICK_BYTES, FULL_BYTES = 1 << 20, 32 << 20  # all-reduce size per level
PAIR_BYTES = {"quick": (1 << 20, 2), "full": (8 << 20, 3)}  # node x node matrix: message size, round trips


@dataclass
class CheckOptions:
    level: str = "quick"
    only: tuple[str, ...] = ()  # probe name prefixes ("gpu", "node", "net", "gpu.ecc", ...)
    expect_gpus: int | None = None
    job_dir: str | None = None
    ring_dir: str | None = None  # the node-local ring directory (its free space)
    timeout_s: float = 60.0
    node: str | None = None
    net_backend: str = "auto"  # auto: NCCL through torch where every task has a GPU, else MPI; mpi; torch
    thresholds: Thresholds = field(default_factory=Thresholds)


@dataclass
class CheckReport:
    nodes: list[str]
    results: list[ProbeResult]
    facts: dict[str, Any] = field(default_factory=dict)  # node -> host facts
    matrix: dict[str, Any] | None = None  # {"nodes", "bandwidth_gbps", "latency_us"}
    elapsed_s: float = 0.0
    verdict_code: int | None = None  # on tasks other than 0: the allocation's exit status, from task 0

    def value_of(self, probe: str) -> Any:
        """The measured value of the first result of ``probe`` (None when there is none)."""
        return next((r.value for r in self.results if r.probe == probe), None)

    @property
    def status(self) -> Status:
        return worst(self.results)

    @property
    def exit_code(self) -> int:
        return EXIT[self.status] if self.verdict_code is None else self.verdict_code

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status.value, "exit_code": self.exit_code, "nodes": self.nodes,
                "elapsed_s": round(self.elapsed_s, 3), "results": [r.to_dict() for r in self.results],
                "matrix": self.matrix, "facts": self.facts}


@dataclass
class Progress:
    """What the run is doing now and what it has found so far: the watchdog reports from it when a probe hangs."""

    node: str
    probe: str = "node.facts"  # the probe (or group of probes) running now
    doing: str = "starting"  # in words
    nodes: list[str] = field(default_factory=list)
    results: list[ProbeResult] = field(default_factory=list)  # finished ones (task 0 under MPI: its own)
    root: bool = True  # this task prints and writes for the allocation

    def now(self, probe: str, doing: str) -> None:
        self.probe, self.doing = probe, doing

    def found(self, results: list[ProbeResult]) -> list[ProbeResult]:
        self.results += results
        return results

    def timed_out(self, timeout_s: float, t0: float) -> CheckReport:
        """The report of a run that did not finish: what it found, and a failure of the probe that hung."""
        hung = ProbeResult(self.probe, Status.FAIL, Subject(self.node),
                           f"{self.probe} did not finish within {timeout_s:g} s ({self.doing}: a probe or a peer "
                           "is hung)",
                           threshold=timeout_s, remediation="Find what blocks it (a wedged GPU driver, a hung file "
                           "system, a dead or unreachable node); drain the node until it is fixed.")
        return CheckReport(self.nodes or [self.node], [*self.results, hung], elapsed_s=time.perf_counter() - t0)


def expected_gpus(given: int | None, node_visible: list[list[str] | None] | None = None) -> int | None:
    """``--expect-gpus``, else what Slurm allocated (SLURM_GPUS_ON_NODE), else CUDA_VISIBLE_DEVICES.

    ``node_visible``: every task's CUDA_VISIBLE_DEVICES on this node, when tasks are bound to their own GPUs.
    """
    if given is not None:
        return given
    on_node = os.environ.get("SLURM_GPUS_ON_NODE", "")
    if on_node.isdigit():
        return int(on_node)
    if node_visible and all(v is not None for v in node_visible):
        return len({g for v in node_visible for g in v or []})
    visible = visible_gpus()
    return None if visible is None else len(visible)


def visible_gpus(variable: str = "CUDA_VISIBLE_DEVICES") -> list[str] | None:
    """This task's GPUs as ``CUDA_VISIBLE_DEVICES`` names them (indices or UUIDs); None when it says nothing."""
    visible = os.environ.get(variable)
    if not visible or visible in ("NoDevFiles", "-1"):
        return None
    return [v.strip() for v in visible.split(",") if v.strip()]


def job_gpus() -> list[str] | None:
    """The GPUs of this node the job was given: ``SLURM_JOB_GPUS`` (set in the prolog), else
    ``CUDA_VISIBLE_DEVICES``; None when neither says (then every GPU of the node is checked).

    On a node shared with other jobs only these are judged: the others' memory and faults are not this job's.
    """
    return visible_gpus("SLURM_JOB_GPUS") or visible_gpus()


def assign_gpus(visible: list[list[str] | None]) -> list[list[str] | None]:
    """Per task of one node (first task first), the GPUs it checks: None all, [] none.

    Tasks bound to different GPUs check their own (a GPU seen by several, by the first of them); tasks that
    all see the same GPUs: the first checks them; no ``CUDA_VISIBLE_DEVICES`` (or MIG instances): the first
    checks every GPU of the node. The others check none.
    """
    plain = all(v is not None and all(g.isdigit() or g.startswith("GPU-") for g in v) for v in visible)
    if not plain:  # (MIG instances: the first task checks the GPUs)
        return [None] + [[] for _ in visible[1:]]
    if all(v == visible[0] for v in visible):
        return [list(visible[0] or [])] + [[] for _ in visible[1:]]
    taken: set[str] = set()
    out: list[list[str] | None] = []
    for v in visible:
        mine = [g for g in v or [] if g not in taken]
        taken.update(mine)
        out.append(mine)
    return out


def _wanted(name: str, only: tuple[str, ...]) -> bool:
    """A result of probe ``name`` is kept (``--only gpu`` keeps gpu.*, ``--only gpu.ecc`` just that one)."""
    return not only or any(name == o or name.startswith(o + ".") for o in only)


def _family(family: str, only: tuple[str, ...]) -> bool:
    """Some probe of ``family`` ("gpu", "node", "net") is asked for."""
    return not only or any(o.split(".")[0] == family for o in only)


def check_gpus(opts: CheckOptions, node: str, select: list[str] | None = None, node_level: bool = True,
               expected: int | None = None, progress: Progress | None = None) -> list[ProbeResult]:
    """GPU checks (in a child under a timeout): ``select`` as :func:`megatrace.check.gpu.probe_gpus` takes it.

    ``expected``: the GPUs the node should have (None: :func:`expected_gpus`).
    """
    if not _family("gpu", opts.only):
        return []
    progress = progress or Progress(node)
    expected = expected_gpus(opts.expect_gpus) if expected is None else expected
    progress.now("gpu.nvml", "reading the GPUs through NVML")
    results = progress.found([r for r in probe_gpus(node, expected, timeout_s=min(opts.timeout_s / 2, 30.0),
                                                    thresholds=opts.thresholds.gpu, select=select,
                                                    node_level=node_level) if _wanted(r.probe, opts.only)])
    if node_level and opts.level == "full" and _wanted("gpu.dcgm", opts.only):  # DCGM's level-1 diagnostic
        progress.now("gpu.dcgm", "running dcgmi diag -r 1")
        results += progress.found(probe_dcgm(node, timeout_s=max(10.0, opts.timeout_s / 2)))
    return results


def check_this_node(opts: CheckOptions, node: str, gpus: bool = True,
                    progress: Progress | None = None) -> tuple[list[ProbeResult], dict[str, Any]]:
    """The node's own checks: the host, and (``gpus``) every GPU."""
    progress = progress or Progress(node)
    results = check_gpus(opts, node, job_gpus(), progress=progress) if gpus else []
    progress.now("node.facts", "reading the host: CPUs, memory, free space, NIC ports, versions")
    facts = read_host(opts.job_dir, opts.ring_dir, node)
    results += progress.found([r for r in judge_host(facts, node, opts.thresholds.node) if _wanted(r.probe, opts.only)])
    return results, facts


def _mpi_world() -> Any | None:
    """COMM_WORLD when this process was started by an MPI launcher with more than one task, else None."""
    launched = any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                                             "MPI_LOCALNRANKS", "SLURM_STEP_NUM_TASKS"))
    if not launched:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    from megatrace.collect.mpi_segments import unlink_attached

    unlink_attached()  # (MPICH's start-up segment: none left when a timed-out check ends without MPI_Finalize)
    comm = MPI.COMM_WORLD
    return comm if comm.Get_size() > 1 else None


def run(opts: CheckOptions, progress: Progress | None = None) -> CheckReport:
    """Check this node, or the whole MPI job; the report is complete on task 0 (others: their own part).

    ``progress`` follows the run (for the watchdog): where it is, and the results found so far.
    """
    t0 = time.perf_counter()
    node = node_name(opts.node)
    progress = progress or Progress(node)
    progress.node, progress.nodes = node, [node]
    comm = _mpi_world()
    if comm is None:
        results, facts = check_this_node(opts, node, progress=progress)
        return CheckReport([node], results, {node: facts}, None, time.perf_counter() - t0)
    return _run_mpi(comm, opts, node, t0, progress)


def _run_mpi(comm: Any, opts: CheckOptions, node: str, t0: float, progress: Progress) -> CheckReport:
    from megatrace.check.network import (VIA, allreduce_busbw, choose_backend, judge_busbw, judge_matrix, pair_matrix,
                                         torch_allreduce_busbw)

    progress.root = comm.Get_rank() == 0
    progress.now("net.gather", "meeting the other tasks")
    names = comm.allgather(node)
    nodes = sorted(set(names))
    progress.nodes = nodes
    node_comm = comm.Split(nodes.index(node), comm.Get_rank())
    leader = node_comm.Get_rank() == 0
    visible = node_comm.allgather(visible_gpus())
    mine = assign_gpus(visible)
    checkers = node_comm.allgather(comm.Get_rank())
    results: list[ProbeResult] = []
    facts: dict[str, Any] = {}
    if leader:
        results, facts = check_this_node(opts, node, gpus=False, progress=progress)
        facts["gpu_checks"] = {"all": checkers[0]} if mine[0] is None else \
            {g: checkers[i] for i, gs in enumerate(mine) for g in gs or []}
    if leader or mine[node_comm.Get_rank()]:  # each task its own GPUs, in parallel; the first also the node's
        results = check_gpus(opts, node, mine[node_comm.Get_rank()], leader,
                             expected_gpus(opts.expect_gpus, visible), progress) + results
    if leader:  # the node's GPU driver and CUDA, compared across the allocation with the other versions
        facts["gpu_driver"] = next((r.value for r in results if r.probe == "gpu.driver"), None)
    progress.now("net.gather", "waiting for the other tasks to finish their node and GPU checks")
    comm.Barrier()
    if leader:
        facts["wall_ns"] = time.time_ns()  # read right after a barrier: comparable across nodes
    matrix = None
    if _family("net", opts.only):
        nbytes = FULL_BYTES if opts.level == "full" else QUICK_BYTES
        backend = choose_backend(comm, opts.net_backend)
        delay_s = read_net_delay(node)  # a slow node injected by the site (drills, tests): 0 normally
        progress.now("net.allreduce", f"the all-reduce through {VIA.get(backend, backend)}")
        if backend == "mpi":
            busbw = allreduce_busbw(comm, nbytes, delay_s=delay_s)
        else:
            busbw = torch_allreduce_busbw(comm, nbytes, backend, node_comm.Get_rank(), opts.timeout_s)
        if comm.Get_rank() == 0:
            results.append(progress.found([judge_busbw(busbw, node, comm.Get_size(), opts.thresholds.net,
                                                       backend)])[0])
        leaders = comm.Split(0 if leader else 1, nodes.index(node))
        if leader and leaders.Get_size() > 1:
            progress.now("net.matrix", "the node x node bandwidth and latency matrix")
            pair_bytes, round_trips = PAIR_BYTES[opts.level]
            bw, lat = pair_matrix(leaders, pair_bytes, iters=round_trips, delay_s=delay_s)
            if leaders.Get_rank() == 0:
                results += progress.found(judge_matrix(nodes, bw, opts.thresholds.net, lat))
                matrix = {"nodes": nodes, "bandwidth_gbps": _rounded(bw), "latency_us": _rounded(lat)}
        leaders.Free()
    progress.now("net.gather", "gathering the results on task 0")
    gathered = comm.gather((node, leader, results, facts, matrix), root=0)
    node_comm.Free()
    if comm.Get_rank() != 0:
        code = comm.bcast(None, root=0)
        return CheckReport([node], results, {node: facts}, None, time.perf_counter() - t0, verdict_code=code)
    all_results: list[ProbeResult] = []
    all_facts: dict[str, Any] = {}
    for name, is_leader, res, f, m in gathered:
        all_results += res
        if is_leader:
            all_facts[name] = f
        matrix = matrix or m
    if _family("node", opts.only):
        all_results += [r for r in judge_allocation(all_facts, opts.thresholds.node) if _wanted(r.probe, opts.only)]
    report = CheckReport(nodes, all_results, all_facts, matrix, time.perf_counter() - t0)
    comm.bcast(report.exit_code, root=0)
    return report


def _rounded(m: Any) -> list[list[float | None]]:
    return [[None if v != v else round(float(v), 3) for v in row] for row in m]


class Watchdog:
    """Ends the process with exit 4 when the whole check runs past its deadline.

    ``on_timeout`` (called first, from the watchdog's thread) reports what was found and which probe hung;
    whatever it does, the process then ends: a prolog must never wait on a hung check.
    """

    def __init__(self, timeout_s: float, node: str, on_timeout: Callable[[], None] | None = None) -> None:
        self._done = threading.Event()
        self._on_timeout = on_timeout
        self._thread = threading.Thread(target=self._watch, args=(timeout_s, node), daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _watch(self, timeout_s: float, node: str) -> None:
        if self._done.wait(timeout_s):
            return
        try:
            if self._on_timeout is not None:
                self._on_timeout()
            else:
                sys.stderr.write(f"megatrace-check: FAIL {node}: the checks did not finish within {timeout_s:g} s "
                                 "(a probe or a peer is hung)\n")
        except Exception as exc:  # noqa: BLE001  (reporting must not keep the process alive)
            sys.stderr.write(f"megatrace-check: FAIL {node}: timed out after {timeout_s:g} s, and could not "
                             f"report it: {exc}\n")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT[Status.FAIL])
