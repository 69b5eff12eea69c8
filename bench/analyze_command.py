"""``megatrace analyze`` as the user types it: whole-process time to the verdict and to the end, at scale.

Used by ``bench/analysis_scale.py`` (its last table). The analysis inside one process is not what a user at a
hung job waits for: that is the whole command (interpreter start, imports, loading, analysis, findings.json).
For each scale it takes two hung traces, the bench's synthetic one (``bench/synth_trace.py``: TP8·PP8, about
2,000 records per rank) and ``megatrace simulate``'s (``--tp 8 --pp 8 --steps 4``, a hang at step 3: fewer
records, many more point-to-point pairs), and runs in fresh processes, best of ``repeat``:

* ``megatrace analyze --quick DIR --no-report`` (the verdict only);
* ``megatrace analyze DIR --no-report`` (the default): the time until its first verdict line is printed
  (from 256 ranks a hung job's quick pass prints it first) and until it ends;

(the package's bytecode is written first where missing or stale, as an install does: a changed module is not
compiled again in every process) and, in the same run, two baselines: the import floor (``python -c "import
megatrace.analyze.engine"``) and a plain read of every file of the trace (``cat``, page cache warm, as for the
analysis). Each row prints its ratio to them, the peak RSS, and the issue's targets (the quick command and the
default's verdict within 1.0 s at 4,096 ranks and 3 s at 16,384) marked OK or MISSED.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TARGET_VERDICT_S = {4096: 1.0, 16384: 3.0}
MEGATRACE = [sys.executable, "-m", "megatrace.cli"]


@dataclass
class Run:
    """One process: seconds to its first verdict line (None: it printed none), to its end, and its peak RSS."""

    verdict_s: float | None
    total_s: float
    rss_mib: float
    verdict: str


def timed(argv: list[str]) -> Run:
    """Run ``argv``, reading its merged output as it comes; the first line starting "VERDICT" is the verdict."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    verdict_s, verdict = None, ""
    assert proc.stdout is not None
    for line in proc.stdout:
        if verdict_s is None and line.startswith("VERDICT"):
            verdict_s, verdict = time.perf_counter() - t0, line.strip()
    _, status, usage = os.wait4(proc.pid, 0)
    total = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit status {proc.returncode}")
    return Run(verdict_s, total, usage.ru_maxrss / 1024, verdict)


def compile_package() -> Path:
    """Write the bytecode of every module of the package that lacks a current one, as ``pip install`` does: the
    commands then load it, as an installed MegaTrace would, instead of compiling the changed modules again in every
    process (where ``PYTHONDONTWRITEBYTECODE`` is set, as on some CI images, nothing else writes it). Returns the
    package's directory."""
    import compileall

    import megatrace

    package = Path(megatrace.__file__).parent
    if not compileall.compile_dir(str(package), quiet=1):
        raise SystemExit(f"{package}: the package's modules do not compile")
    return package


def best(argv: list[str], repeat: int, key: str = "total_s") -> Run:
    return min((timed(argv) for _ in range(repeat)), key=lambda r: getattr(r, key) or float("inf"))


def plain_read_s(trace: Path, repeat: int) -> float:
    files = [str(p) for p in sorted(trace.rglob("*")) if p.is_file()]
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(["xargs", "cat"], input="\n".join(files), stdout=subprocess.DEVNULL, check=True, text=True)
        times.append(time.perf_counter() - t)
    return min(times)


def simulated(root: Path, ranks: int) -> Path:
    """``megatrace simulate``'s hung trace of ``ranks`` ranks (TP8·PP8, 4 steps, a hang at step 3), reused."""
    trace = root / f"simulate-{ranks}"
    if (trace / "layout.yaml").exists():
        return trace
    shutil.rmtree(trace, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run(MEGATRACE + ["simulate", "--ranks", str(ranks), "--tp", "8", "--pp", "8", "--steps", "4",
                                "--fault", f"hang:rank={1234 % ranks},step=3", "-o", str(trace)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"  wrote the simulated trace of {ranks} ranks in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return trace


@dataclass
class CommandRow:
    ranks: int
    kind: str  # "bench" or "simulate"
    cat_s: float
    quick: Run
    default: Run


def measure(ranks: int, kind: str, trace: Path, out: Path, repeat: int) -> CommandRow:
    """The quick and the default command on ``trace``, and a plain read of it, best of ``repeat`` each."""
    print(f"  {kind} trace, {ranks} ranks: the commands as typed", file=sys.stderr)
    quick = best(MEGATRACE + ["analyze", "--quick", str(trace), "--no-report", "-o", str(out)], repeat)
    default = best(MEGATRACE + ["analyze", str(trace), "--no-report", "-o", str(out)], repeat, key="verdict_s")
    return CommandRow(ranks, kind, plain_read_s(trace, repeat), quick, default)


def import_floor_s(repeat: int) -> float:
    return best([sys.executable, "-c", "import megatrace.analyze.engine"], repeat).total_s


def print_table(rows: list[CommandRow], floor: float) -> int:
    """The whole-command table with its targets; returns the number of targets missed."""
    print(f"\nthe commands as typed (fresh processes, best of each); import floor (python -c 'import "
          f"megatrace.analyze.engine') {floor:.2f} s; cat: a plain read of every file of the trace\n")
    head = (f"{'ranks':>6} {'trace':>9} {'cat s':>6} {'quick s':>8} {'/floor':>7} {'/cat':>6} {'MiB':>5} "
            f"{'default: verdict s':>19} {'end s':>6} {'MiB':>5}  targets")
    print(head)
    print("-" * len(head))
    missed = 0
    for row in rows:
        quick, default, targets = row.quick, row.default, []
        if row.ranks in TARGET_VERDICT_S:
            limit = TARGET_VERDICT_S[row.ranks]
            for what, got in (("quick", quick.total_s), ("default's verdict", default.verdict_s)):
                ok = got is not None and got <= limit
                missed += not ok
                targets.append(f"{what} <= {limit:g} s {'OK' if ok else 'MISSED'}")
        same = quick.verdict == default.verdict
        missed += not same
        targets.append("same verdict" if same else "VERDICTS DIFFER")
        verdict = "-" if default.verdict_s is None else f"{default.verdict_s:.2f}"
        print(f"{row.ranks:>6} {row.kind:>9} {row.cat_s:>6.2f} {quick.total_s:>8.2f} {quick.total_s / floor:>7.1f} "
              f"{quick.total_s / row.cat_s:>6.1f} {quick.rss_mib:>5.0f} {verdict:>19} {default.total_s:>6.2f} "
              f"{default.rss_mib:>5.0f}  {'; '.join(targets)}")
    return missed
