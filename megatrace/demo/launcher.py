"""Run the demo job locally: one worker process per rank, watched for hangs, crashes and the deadline.

Output directory layout::

    layout.yaml              the parallel layout and rank placement (ground truth for the analyzer)
    fault.json               the injected faults (for tests and benchmarks only)
    procs.json               per rank: pid, exit code, signal, whether the launcher killed it; the outcome
    rings/rank-NNNNN.ring    traces (when tracing is on)
    logs/rank-NNNNN.log      worker stdout and stderr; logs/rank-NNNNN.heartbeat its last progress
    metrics/rank-NNNNN.jsonl per-step step time, compute time and (last stage) loss
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from megatrace.config import Layout, LayoutError, RankPlacement, save_layout
from megatrace.demo.engines import DEFAULT_ENGINE, check_engine_fault, engine_layout, get_engine
from megatrace.demo.faults import format_fault, parse_fault, validate_fault, write_fault_json
from megatrace.schedule import DP_MODES
from megatrace.trace import ring_format as fmt

POLL_S = 0.1
KILL_WAIT_S = 1.0


@dataclass(frozen=True)
class DemoOptions:
    """What ``megatrace demo`` runs; a size left None takes the engine's default (3d: TP2 x PP2 x DP2)."""

    engine: str = DEFAULT_ENGINE  # megatrace.demo.engines.ENGINES
    ranks: int | None = None  # the world size; default: the product of the sizes, else the engine's
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    order: str = "tp-dp-pp"  # rank order (megatrace.config.ORDERS, 3d only); Megatron-LM's default first
    steps: int = 20
    microbatches: int | None = None  # 3d and pipeline: default 4
    layers_per_stage: int = 2
    faults: tuple[str, ...] = ()
    out: Path | None = None
    trace: bool = True
    markers: bool = False
    compute_ms: float = 2.0
    dp_mode: str = "allreduce"
    stall_s: float = 10.0
    deadline_s: float | None = None  # default: 60 s + 2 s per step
    crash_grace_s: float = 5.0
    job_id: str | None = None

    @property
    def deadline(self) -> float:
        return self.deadline_s if self.deadline_s is not None else 60.0 + 2.0 * self.steps


@dataclass
class RankProc:
    rank: int
    pid: int
    exit_code: int | None = None
    signal: str | None = None
    killed_by_launcher: bool = False


@dataclass
class DemoResult:
    out: Path
    outcome: str  # "ok", "failed" (a rank exited non-zero), "stalled" or "deadline"
    message: str
    procs: list[RankProc]
    losses: list[float] = field(default_factory=list)  # per step, mean over last-stage DP ranks

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def build_layout(opts: DemoOptions) -> Layout:
    """Validate options, layout and faults (before any process starts); return the layout."""
    if opts.steps < 1:
        raise ValueError(f"steps must be a positive integer, got {opts.steps}")
    if opts.dp_mode not in DP_MODES:
        raise ValueError(f"dp_mode {opts.dp_mode!r} is not one of {', '.join(DP_MODES)}")
    for name, value, default in (("dp-mode", opts.dp_mode, "allreduce"), ("order", opts.order, "tp-dp-pp")):
        if value != default and opts.engine != "3d":
            raise LayoutError(f"--{name} {value}: only the 3d engine has a --{name}")
    layout = engine_layout(opts.engine, opts.ranks, tp=opts.tp, pp=opts.pp, dp=opts.dp, microbatches=opts.microbatches,
                           layers_per_stage=opts.layers_per_stage, order=opts.order)
    host = socket.gethostname()
    layout = dataclasses.replace(layout, ranks={r: RankPlacement(host, r) for r in range(layout.world_size)})
    for spec in opts.faults:
        fault = parse_fault(spec)
        check_engine_fault(opts.engine, fault, text=spec)
        validate_fault(fault, layout, opts.steps, text=spec)
    return layout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_argv(opts: DemoOptions, layout: Layout, out: Path) -> list[str]:
    argv = [sys.executable, "-m", "megatrace.demo", "--engine", opts.engine, "--steps", str(opts.steps),
            "--layers-per-stage", str(opts.layers_per_stage), "--compute-ms", str(opts.compute_ms),
            "--comm-timeout", str(opts.deadline + 60.0), "-o", str(out)]
    engine = get_engine(opts.engine)
    argv += [a for size in engine.sizes for a in (f"--{size}", str(getattr(layout, size)))]
    if engine.microbatches:
        argv += ["--microbatches", str(layout.microbatches)]
    if opts.engine == "3d":
        argv += ["--order", opts.order, "--dp-mode", opts.dp_mode]
    for spec in opts.faults:
        argv += ["--fault", format_fault(parse_fault(spec))]
    return argv + (["--markers"] if opts.markers else [])


def _worker_env(opts: DemoOptions, out: Path, rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in [k for k in env if k.startswith("SLURM_")]:
        del env[name]  # a local run inside an allocation must not look like an srun step
    if opts.trace:
        env.update(MEGATRACE_ENABLE="1", MEGATRACE_DIR=str(out / "rings"),
                   MEGATRACE_JOB_ID=opts.job_id or f"demo-{out.name}")
    else:
        env["MEGATRACE_ENABLE"] = "0"
    return env


def _kill(procs: dict[int, subprocess.Popen], killed: set[int]) -> None:
    """SIGTERM (plus SIGCONT for stopped ones) to every live worker, SIGKILL after a second."""
    live = {r: p for r, p in procs.items() if p.poll() is None}
    for rank, proc in live.items():
        killed.add(rank)
        for sig in (signal.SIGTERM, signal.SIGCONT):
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
    until = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < until and any(p.poll() is None for p in live.values()):
        time.sleep(0.02)
    for proc in live.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _last_progress(logs: Path, world: int) -> tuple[set[int], set[int], float]:
    """(ranks that have written a heartbeat, ranks that finished training, latest heartbeat mtime)."""
    beating, done, latest = set(), set(), 0.0
    for rank in range(world):
        path = logs / f"rank-{rank:05d}.heartbeat"
        try:
            latest = max(latest, path.stat().st_mtime)
            beating.add(rank)
            if path.read_text().startswith("done"):
                done.add(rank)
        except FileNotFoundError:
            pass
    return beating, done, latest


def _ring_counters(rings: Path, world: int) -> tuple[int, ...]:
    """Each rank's ring write counter (0 while it has no ring): it moves with every call a rank starts."""
    counters = []
    for rank in range(world):
        try:
            with open(rings / fmt.ring_name(rank), "rb") as fh:
                blob = fh.read(fmt.WRITE_COUNTER_OFFSET + fmt.WRITE_COUNTER.size)
            counters.append(fmt.WRITE_COUNTER.unpack_from(blob, fmt.WRITE_COUNTER_OFFSET)[0])
        except (OSError, struct.error):
            counters.append(0)
    return tuple(counters)


def _status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"


def _watch(opts: DemoOptions, procs: dict[int, subprocess.Popen], logs: Path, killed: set[int],
           log: Callable[[str], None]) -> tuple[str, str]:
    """Wait for the workers; kill them on a stall, the deadline, or after a failure plus grace.

    Progress is a heartbeat (a rank entered a phase) or a call a rank started (its ring's write
    counter moved): a slow step whose collectives still go through is no stall.
    """
    world = len(procs)
    start = time.monotonic()
    wall_offset = time.time() - start
    armed_at: float | None = None
    rings = logs.parent / "rings"
    counters, called_at = _ring_counters(rings, world), start
    first_failure: tuple[float, int, str] | None = None  # (when, rank, what)
    while True:
        now = time.monotonic()
        codes = {r: p.poll() for r, p in procs.items()}
        running = sum(c is None for c in codes.values())
        bad = sorted(r for r, c in codes.items() if c not in (None, 0))
        if bad and first_failure is None:
            first_failure = (now, bad[0], f"rank {bad[0]} exited first with {_status(codes[bad[0]])}")
            log(f"demo: {first_failure[2]}; waiting up to {opts.crash_grace_s:g} s for the others")
        if not running:
            if first_failure is None:
                return "ok", "all ranks finished"
            others = [r for r in bad if r != first_failure[1]]
            return "failed", first_failure[2] + (f"; ranks {_compact(others)} then failed too" if others else "")
        if first_failure is not None and now - first_failure[0] > opts.crash_grace_s:
            _kill(procs, killed)
            return "failed", f"{first_failure[2]}; killed {running} ranks still running after {opts.crash_grace_s:g} s"
        if now - start > opts.deadline:
            _kill(procs, killed)
            return "deadline", f"deadline of {opts.deadline:g} s passed; killed {running} ranks"
        beating, done, latest = _last_progress(logs, world)
        now_counters = _ring_counters(rings, world)
        if now_counters != counters:
            counters, called_at = now_counters, now
        if armed_at is None and len(beating | {r for r, c in codes.items() if c is not None}) == world:
            armed_at = now  # every rank is past startup: from now on, silence means a hang
        if {r for r, c in codes.items() if c is None} <= done or first_failure is not None:
            # Every rank still running has finished training and is tearing down (on a loaded
            # machine torch's exit can outlast the stall timeout), or a rank has failed and the
            # others have their grace period to fail too: the run is not a stall.
            time.sleep(POLL_S)
            continue
        if armed_at is not None and now - max(armed_at, latest - wall_offset, called_at) > opts.stall_s:
            _kill(procs, killed)
            return "stalled", f"no progress for {opts.stall_s:g} s — ranks look hung; killed {running} ranks"
        time.sleep(POLL_S)


def read_losses(out: Path, layout: Layout) -> list[float]:
    """Per-step loss, averaged over the last stage's DP replicas (TP rank 0)."""
    per_step: dict[int, list[float]] = {}
    for dp in range(layout.dp):
        path = out / "metrics" / f"rank-{layout.rank_of(layout.pp - 1, dp, 0):05d}.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                per_step.setdefault(rec["step"], []).append(rec["loss"])
    return [sum(v) / len(v) for _, v in sorted(per_step.items())]


def default_out_dir() -> Path:
    return Path(f"megatrace-demo-{time.strftime('%Y%m%d-%H%M%S')}")


def run_local(opts: DemoOptions, log: Callable[[str], None] | None = None) -> DemoResult:
    """Validate, start one worker per rank of the engine's layout on this host, watch them, record what happened."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    layout = build_layout(opts)
    out = (opts.out or default_out_dir()).resolve()
    logs = out / "logs"
    for sub in ("logs", "metrics", "rings"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    for sub, pattern in (("logs", "rank-*"), ("metrics", "rank-*.jsonl"), ("rings", "rank-*")):
        for stale in (out / sub).glob(pattern):  # left by an earlier run into the same directory
            stale.unlink()
    save_layout(layout, out / "layout.yaml")
    write_fault_json(out / "fault.json", [parse_fault(s) for s in opts.faults])
    port = _free_port()
    argv = _worker_argv(opts, layout, out)
    procs: dict[int, subprocess.Popen] = {}
    killed: set[int] = set()
    try:
        for rank in range(layout.world_size):
            with open(logs / f"rank-{rank:05d}.log", "wb") as fh:
                procs[rank] = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env=_worker_env(opts, out, rank, layout.world_size, port))
        outcome, message = _watch(opts, procs, logs, killed, log)
    except BaseException:
        _kill(procs, killed)
        raise
    if outcome != "ok":
        log(f"demo: {message}")
    ranks = []
    for rank, proc in sorted(procs.items()):
        code = proc.returncode
        ranks.append(RankProc(rank, proc.pid, exit_code=code if code >= 0 else None,
                              signal=signal.Signals(-code).name if code < 0 else None,
                              killed_by_launcher=rank in killed))
    (out / "procs.json").write_text(json.dumps(
        {"outcome": outcome, "message": message,
         "ranks": {str(p.rank): {k: v for k, v in vars(p).items() if k != "rank"} for p in ranks}},
        indent=2, ensure_ascii=False) + "\n")
    return DemoResult(out, outcome, message, ranks, read_losses(out, layout))


def _compact(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def summary_lines(result: DemoResult) -> list[str]:
    """What a person wants after a run: where things are, how each rank ended, the loss curve."""
    out = result.out
    lines = [f"demo: {result.outcome}: {result.message}",
             f"  traces:  {out / 'rings'}/", f"  layout:  {out / 'layout.yaml'}", f"  logs:    {out / 'logs'}/",
             f"  metrics: {out / 'metrics'}/"]
    faults = json.loads((out / "fault.json").read_text())["faults"]
    if faults:
        lines.append(f"  faults:  {'; '.join(f['spec'] for f in faults)} (ground truth: {out / 'fault.json'})")
    ends: dict[str, list[int]] = {}
    for p in result.procs:
        end = f"exit {p.exit_code}" if p.signal is None else f"signal {p.signal}"
        ends.setdefault(end + (" (killed by the launcher)" if p.killed_by_launcher else ""), []).append(p.rank)
    lines += [f"  ranks {_compact(ranks)}: {end}" for end, ranks in ends.items()]
    if result.losses:
        lines.append(f"  loss:    {result.losses[0]:.4f} (step 0) -> {result.losses[-1]:.4f} "
                     f"(step {len(result.losses) - 1})")
    else:
        lines.append("  loss:    no step completed on the last pipeline stage")
    return lines
