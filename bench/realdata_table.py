"""The real-data table of bench/import_accuracy.py: each case of ../shared/realdata, its truth, MegaTrace's first
finding and torchfrtrace's answer, side by side, timed in the same run (see import_accuracy's docstring)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from test_import_realdata import fault_ranks, slow_truth  # the tests' readers of the ground truth

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind

HANG_KINDS = (Kind.COMPUTE_HANG, Kind.CRASHED_PROCESS, Kind.EXITED_EARLY, Kind.NO_TRACE)
FR_TIMEOUT_S = 600  # torchfrtrace on a case


@dataclass
class Answer:
    ranks: set[int]
    what: str  # in words
    right: bool
    seconds: float


def _megatrace(path: Path, out: Path, truth: set[int], step: int | None) -> Answer:
    t0 = time.perf_counter()
    top = analyze(path, out_dir=out).findings[0]
    took = time.perf_counter() - t0
    ranks = set(top.subject.ranks) if top.subject.ranks else {top.subject.rank} - {None}
    if step is None:  # a hang: its culprits, as a stop (not a communication hang, not a straggler)
        right = ranks == truth and top.kind in HANG_KINDS
    else:  # a slowdown: the straggler and the step
        right = ranks == truth and top.kind == Kind.STRAGGLER and top.data.get("steps", [None])[0] == step
    what = f"{top.severity.value} {top.kind.value} {sorted(ranks)}" + (
        f" step {top.data['steps'][0]}" if top.kind == Kind.STRAGGLER and top.data.get("steps") else "")
    return Answer(ranks, what, right, took)


def _torchfrtrace(dumps: Path, truth: set[int]) -> Answer:
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps)],
                         capture_output=True, text=True, timeout=FR_TIMEOUT_S)
    took = time.perf_counter() - t0
    said = run.stdout + run.stderr  # (it reports through logging)
    named = [set(map(int, re.findall(r"\d+", m))) for m in re.findall(r"missing ranks: \{([^}]*)\}", said)]
    first = named[0] if named else set()
    every = set().union(*named) if named else set()
    what = (f"first {sorted(first)}, all named {sorted(every)}" if named else
            f"no missing ranks named (exit {run.returncode})")
    return Answer(first, what, first == truth, took)


def print_realdata_table(root: Path) -> list[tuple]:
    """Run every case and print the table; returns its rows."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="mt-realdata-") as scratch:
        work = Path(scratch)
        for case in sorted(p for p in root.iterdir() if (p / "dumps").is_dir()):
            dumps = work / case.name / "dumps"
            shutil.copytree(case / "dumps", dumps)  # (a copy: nothing is written near the given data)
            truth = fault_ranks(case)
            mt = _megatrace(dumps.parent, work / f"{case.name}-out", truth, None)
            fr = _torchfrtrace(dumps, truth)
            rows.append((case.name, "Flight Recorder", f"ranks {sorted(truth)} hang", mt, fr))
        for archive in sorted(root.glob("*.tar.xz")):
            name = archive.name[:-len(".tar.xz")]
            with tarfile.open(archive) as tar:
                tar.extractall(work / name, filter="data")
            (logs,) = {p.parent for p in (work / name).rglob("rank_0.log")}
            rank, iteration, ms = slow_truth(logs)
            mt = _megatrace(logs, work / f"{name}-out", {rank}, iteration - 1)
            rows.append((name, "NCCL-patch logs", f"rank {rank} slow in iteration {iteration} ({ms:.0f} ms)", mt,
                         None))
    print("real data (../shared/realdata): MegaTrace's first finding and torchfrtrace's answer, same run\n")
    print("| case | format | truth | MegaTrace first finding | right | time | torchfrtrace | right | time |")
    print("|---|---|---|---|---|---:|---|---|---:|")
    for name, fmt, truth, mt, fr in rows:
        other = (f"{fr.what} | {'yes' if fr.right else 'NO'} | {fr.seconds:.1f} s" if fr is not None
                 else "(not its format) | | ")
        print(f"| {name} | {fmt} | {truth} | {mt.what} | {'yes' if mt.right else 'NO'} | {mt.seconds:.1f} s | "
              f"{other} |")
    right = sum(r[3].right for r in rows)
    print(f"\nMegaTrace right on {right}/{len(rows)}; torchfrtrace right on "
          f"{sum(r[4].right for r in rows if r[4] is not None)}/{sum(r[4] is not None for r in rows)}\n", flush=True)
    return rows
