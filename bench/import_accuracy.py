"""Culprit accuracy of the importers: real diagnostic data nobody here wrote, and real demo runs in every format.

    python bench/import_accuracy.py [--runs 12] [--seed 0] [--steps 6] [--realdata DIR]

First table, real data (``../shared/realdata``, see its README; skipped when absent): each case with its
ground truth (read here only, never by the analysis), MegaTrace's first finding, right or wrong, its time,
and for Flight Recorder dumps what ``torchfrtrace`` (torch's own analyzer, run in the same process tree)
names: the missing ranks it reports first, and every rank it names anywhere. Right: MegaTrace's first
finding names exactly the culprits (a hang's ranks for the dumps, the straggler for the logs, with the
slowed iteration as its step); torchfrtrace's first missing ranks are exactly the culprits.

Each run is the real 4- or 8-rank demo (TP2 x PP2 x DP1, TP2 x PP2 x DP2 or TP2 x PP4 x DP1,
torch.distributed over gloo) with one
rank at half speed, or none (a healthy control, one run in three), chosen at random. The run is
analysed four ways: its MegaTrace rings (the baseline, measured in the same run), its PyTorch Flight
Recorder dumps (gloo: arrivals only), NCCL Inspector lines and Megatrace NCCL-patch logs written from
it by the tests' writers (tests/test_import_inspector.py, tests/test_import_nccl_log.py; logs with and
without groupHash in turn). A run counts as right when exactly the slow rank is named a straggler
(none for a control). Prints one line per run and format, then the share right per format and its
ratio to the rings' (``--runs 0``: the real-data table only).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind
from megatrace.demo.launcher import DemoOptions, run_local
from megatrace.load import load_trace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_import_inspector import write_inspector  # noqa: E402  (the tests' format writers)
from test_import_nccl_log import write_nccl_logs  # noqa: E402

FORMATS = ("rings", "flight-recorder", "inspector", "nccl-log")
REALDATA = Path(__file__).resolve().parents[1].parent / "shared" / "realdata"


def stragglers(path: Path, fmt: str) -> list[int]:
    result = analyze(path, format="auto" if fmt == "rings" else fmt)
    return [f.subject.rank for f in result.findings if f.kind == Kind.STRAGGLER]


LAYOUTS = ((2, 2, 1), (2, 2, 2), (2, 4, 1))  # (tp, pp, dp)


def one_run(out: Path, index: int, layout: tuple[int, int, int], slow: int | None,
            steps: int) -> dict[str, list[int]]:
    """The demo run and what each format's analysis named."""
    os.environ.update({"TORCH_FR_BUFFER_SIZE": "2000", "MEGATRACE_DEMO_FR_DUMP": str(out / "fr")})
    faults = (f"slow:rank={slow},factor=2",) if slow is not None else ()
    tp, pp, dp = layout
    run_local(DemoOptions(tp=tp, pp=pp, dp=dp, steps=steps, faults=faults, out=out, stall_s=8.0), log=lambda m: None)
    trace = load_trace(out)
    write_inspector(trace, out / "inspector")
    (out / "inspector" / "layout.yaml").write_text((out / "layout.yaml").read_text())
    write_nccl_logs(trace, out / "nccl-log", group_hash=bool(index % 2))
    where = {"rings": out, "flight-recorder": out, "inspector": out / "inspector", "nccl-log": out / "nccl-log"}
    return {fmt: stragglers(where[fmt], fmt) for fmt in FORMATS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=12, help="Demo runs (0: the real-data table only).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--keep", type=Path, default=None, help="Keep the runs in this folder (to look at a miss).")
    ap.add_argument("--realdata", type=Path, default=REALDATA,
                    help="Folder of real cases with their ground truth [default: ../shared/realdata].")
    args = ap.parse_args()
    if args.realdata.is_dir():
        from realdata_table import print_realdata_table

        print_realdata_table(args.realdata)
    else:
        print(f"(no real data at {args.realdata}: its table is skipped)\n")
    if args.runs <= 0:
        return 0
    rng = random.Random(args.seed)
    right = dict.fromkeys(FORMATS, 0)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mt-import-acc-") as scratch:
        tmp = args.keep or scratch
        for i in range(args.runs):
            layout = rng.choice(LAYOUTS)
            slow = None if i % 3 == 2 else rng.randrange(layout[0] * layout[1] * layout[2])
            named = one_run(Path(tmp) / f"run{i}", i, layout, slow, args.steps)
            want = [] if slow is None else [slow]
            for fmt in FORMATS:
                right[fmt] += named[fmt] == want
            print(f"run {i:2d}  TP{layout[0]}·PP{layout[1]}·DP{layout[2]}  slow rank {'-' if slow is None else slow:>2}  "
                  + "  ".join(f"{fmt} {named[fmt]}" for fmt in FORMATS), flush=True)
    base = right["rings"] / args.runs
    print(f"\n{'format':16} {'right':>7} {'share':>6} {'ratio to rings':>15}")
    for fmt in FORMATS:
        share = right[fmt] / args.runs
        print(f"{fmt:16} {right[fmt]:>3}/{args.runs:<3} {share:6.0%} {share / base if base else float('nan'):15.2f}")
    print(f"({args.runs} runs in {time.perf_counter() - t0:.0f} s)")
    print(json.dumps({"runs": args.runs, "right": right}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
