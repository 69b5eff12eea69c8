"""What every demo engine's worker shares: the process group, progress reports, per-step metrics.

A :class:`Session` is one rank of a running demo job. It joins the gloo process group
(:meth:`Session.start`), reports the training loop's progress (:meth:`Session.phase`: fault
injector, ``megatrace.phase`` markers and the heartbeat the launcher watches), runs the
steps and writes one metrics line per step (:meth:`Session.run_steps`), and leaves the job
with a world barrier (:meth:`Session.finish`). Engines own only their model and their step.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import megatrace
from megatrace.config import Layout
from megatrace.demo import rendezvous
from megatrace.demo.env import DistEnv
from megatrace.demo.faults import FaultSpec
from megatrace.demo.inject import COLLECTIVE_OPS, FaultInjector

FR_DUMP_ENV = "MEGATRACE_DEMO_FR_DUMP"  # opt-in: write PyTorch Flight Recorder dumps (needs TORCH_FR_BUFFER_SIZE)
FR_DUMP_PERIOD_S = 1.0


def start_fr_dumps(directory: Path, rank: int) -> None:
    """Write this rank's Flight Recorder dump to ``directory/fr_rank_<R>`` every second and at exit.

    Test data for :mod:`megatrace.load.importers.flight_recorder`, named like torch's own dumps
    (prefix + rank, no suffix) so that ``torchfrtrace`` reads them too. gloo's watchdog does not
    dump, so a daemon thread does; a rank that hangs, in Python or inside a gloo call, leaves a dump
    at most a second old. Without stack traces: with them, ``_dump_fr_trace()`` from a second
    thread deadlocks against the main thread recording a collective (torch 2.13, gloo).
    """
    import atexit

    import torch

    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"fr_rank_{rank}"

    def dump() -> None:
        tmp = target.with_name(target.name + ".tmp")
        try:
            tmp.write_bytes(torch._C._distributed_c10d._dump_fr_trace(True, False, False))
            os.replace(tmp, target)
        except (OSError, RuntimeError) as exc:  # a dump is a diagnostic: never stop training for it
            print(f"megatrace demo: flight recorder dump failed: {exc}", file=sys.stderr)

    def loop() -> None:
        while True:
            time.sleep(FR_DUMP_PERIOD_S)
            dump()

    threading.Thread(target=loop, name="fr-dump", daemon=True).start()
    atexit.register(dump)


class Markers:
    """megatrace.step()/phase() when asked for and available; silent no-ops otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def _call(self, fn: Callable[[], None]) -> None:
        if self.enabled:
            try:
                fn()
            except ImportError:
                print("megatrace demo: marker API not available; markers off", file=sys.stderr)
                self.enabled = False

    def step(self, n: int) -> None:
        self._call(lambda: megatrace.step(n))

    def phase(self, name: str, microbatch: int | None = None) -> None:
        self._call(lambda: megatrace.phase(name, microbatch=microbatch))


@dataclass
class StepResult:
    """What one training step reports: the time spent computing and, where this rank knows it, the loss."""

    compute_s: float = 0.0
    loss: float | None = None


@dataclass
class Session:
    """One rank of a demo job: where it writes, its faults, and the calls its training loop reports to."""

    env: DistEnv
    layout: Layout
    faults: list[FaultSpec]
    out: Path
    markers: Markers
    comm_timeout_s: float
    commhang_ops: tuple[str, ...] = COLLECTIVE_OPS  # the c10d operators a commhang fault stops in
    rendezvous_timeout_s: float = rendezvous.DEFAULT_TIMEOUT_S
    injector: FaultInjector = field(init=False)
    name: str = field(init=False)  # rank-NNNNN, the stem of this rank's log, heartbeat and metrics files
    heartbeat: Path = field(init=False)

    def __post_init__(self) -> None:
        self.injector = FaultInjector(self.faults, self.env.rank, self.layout, self.commhang_ops)
        self.name = f"rank-{self.env.rank:05d}"
        self.heartbeat = self.out / "logs" / f"{self.name}.heartbeat"

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.comm_timeout_s)

    def start(self) -> None:
        """Join the job's gloo process group (torchrun-style variables set from the resolved environment).

        The fault kernels go in first, so that the tracer's dispatcher hook, installed with the
        process group, sits in front of them (see :mod:`megatrace.demo.inject`).
        """
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        torch.manual_seed(0)
        env = self.env
        os.environ.update(MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port), RANK=str(env.rank),
                          WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank))
        self.injector.install()
        store = rendezvous.connect(env, self.rendezvous_timeout_s, self.timeout)
        dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=self.timeout)
        if os.environ.get(FR_DUMP_ENV):
            start_fr_dumps(Path(os.environ[FR_DUMP_ENV]), env.rank)

    def ready(self) -> None:
        """Set-up is done (groups, model): tell the launcher, which from now on takes silence for a hang."""
        self.beat("ready")

    def beat(self, text: str) -> None:
        self.heartbeat.write_text(text + "\n")

    def phase(self, name: str, microbatch: int | None = None, gate: bool = True) -> None:
        """The loop enters a phase (``forward``, ``backward``, ``optimizer``) of the current step.

        With ``gate`` (engines whose collectives torch issues, not the demo), an armed ``hang``
        fault stops the rank here: before the phase's first communication call.
        """
        injector = self.injector
        injector.set_phase(name)
        self.markers.phase(name, microbatch=microbatch)
        where = f"step={injector.step} phase={name}"
        self.beat(where if microbatch is None else f"{where} microbatch={microbatch}")
        if gate:
            injector.before_comm()

    def run_steps(self, steps: int, step: Callable[[int], StepResult]) -> None:
        """Run ``step(n)`` for n in 0..steps-1, with fault hooks around it and a metrics line after it."""
        injector = self.injector
        with open(self.out / "metrics" / f"{self.name}.jsonl", "w", buffering=1) as metrics:
            for n in range(steps):
                start, cpu_start = time.perf_counter(), time.process_time()
                injector.start_step(n)
                self.markers.step(n)
                result = step(n)
                injector.end_step()
                record: dict[str, Any] = {"step": n, "step_time_s": round(time.perf_counter() - start, 6),
                                          "compute_s": round(result.compute_s, 6),
                                          "cpu_s": round(time.process_time() - cpu_start, 6)}  # all its threads
                if result.loss is not None:
                    record["loss"] = result.loss
                metrics.write(json.dumps(record) + "\n")

    def finish(self) -> None:
        """Training is over: a world barrier (every rank leaves together), then leave the process group."""
        import torch.distributed as dist

        self.beat("done")
        dist.barrier()
        dist.destroy_process_group()
