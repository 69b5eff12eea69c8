"""Culprit accuracy on a simulated fault matrix, with healthy controls.

    python bench/accuracy.py [--scenarios 100] [--tp 2] [--pp 4] [--dp 4] [--steps 10] [--seed 0]

Every scenario is a ``megatrace simulate`` job (the demo's 1F1B step, per-rank jitter, per-host
clock errors) with one fault drawn at random: a compute hang (random phase), a communication
hang, a crash, a slow rank (1.1x to 2x) or a slow link (5 to 20 ms per transfer), at a random
rank and step; every fifth scenario is a healthy control. A fault counts as named when the top
finding has its kind and names its rank (its link, for a slow link; a group holding the rank,
for a communication hang), as tests/test_simulate.py judges. A false positive is a healthy run
with any finding of severity warning or worse. Target (issue "Scale and overhead"): at least
99 % named first, no false positive.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.simulate import SimOptions, simulate_job

TARGET_NAMED = 0.99
EXPECTED = {"hang": Kind.COMPUTE_HANG, "commhang": Kind.COMM_HANG, "crash": Kind.CRASHED_PROCESS,
            "slow": Kind.STRAGGLER, "slowlink": Kind.SLOW_LINK}


def draw(rng: random.Random, index: int, world: int, steps: int, tp: int, dp: int) -> tuple[str, str | None]:
    """(label, fault spec or None for a healthy control) of scenario ``index``."""
    if index % 5 == 4:
        return "healthy", None
    kind = rng.choice(list(EXPECTED))
    rank, step = rng.randrange(world), rng.randrange(2, steps - 2)
    if kind == "hang":
        phase = rng.choice(["forward", "backward", "optimizer"])
        return f"hang ({phase})", f"hang:rank={rank},step={step},phase={phase}"
    if kind == "commhang":
        return "commhang", f"commhang:rank={rank},step={step}"
    if kind == "crash":
        return "crash", f"crash:rank={rank},step={step}"
    if kind == "slow":
        factor = rng.choice([1.1, 1.2, 1.5, 2.0])
        return f"slow {factor}x", f"slow:rank={rank},factor={factor}"
    # a slow link between neighbouring stages of one pipeline: tp x dp ranks apart in the tp-dp-pp order
    stride = tp * dp
    peer = rank + stride if rank + stride < world else rank - stride
    return "slowlink", f"slowlink:ranks={min(rank, peer)}-{max(rank, peer)},delay_ms={rng.choice([5, 10, 20])}"


def judge(out: Path, spec: str | None) -> tuple[bool, str]:
    """(correct, the top verdict): the fault named first, or a healthy run left quiet."""
    result = analyze(out)
    if spec is None:
        loud = result.at_least(Severity.WARNING)
        return not loud, loud[0].verdict if loud else "quiet"
    (truth,) = json.loads((out / "fault.json").read_text())["faults"]
    top = result.findings[0]
    kind = EXPECTED[spec.split(":", 1)[0]]
    if top.kind != kind:
        return False, top.verdict
    if kind == Kind.SLOW_LINK:
        return top.subject.link == tuple(sorted(truth["ranks"])), top.verdict
    if kind == Kind.COMM_HANG:
        return truth["rank"] in (top.subject.ranks or ()), top.verdict
    return top.subject.rank == truth["rank"], top.verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", type=int, default=100)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    world = args.tp * args.pp * args.dp
    rng = random.Random(args.seed)
    by_label: dict[str, list[bool]] = defaultdict(list)
    misses: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="megatrace-accuracy-") as tmp:
        for i in range(args.scenarios):
            label, spec = draw(rng, i, world, args.steps, args.tp, args.dp)
            out = Path(tmp) / f"s{i:03d}"
            simulate_job(SimOptions(tp=args.tp, pp=args.pp, dp=args.dp, out=out, steps=args.steps,
                                    faults=(spec,) if spec else (), seed=args.seed * 1000 + i))
            ok, verdict = judge(out, spec)
            by_label[label].append(ok)
            if not ok:
                misses.append(f"  {spec or 'healthy'}: {verdict}")
            print(f"  scenario {i + 1}/{args.scenarios}: {spec or 'healthy'}: {'ok' if ok else 'MISSED'}",
                  file=sys.stderr, flush=True)
    faults = [ok for label, oks in by_label.items() if label != "healthy" for ok in oks]
    healthy = by_label.get("healthy", [])
    named = sum(faults) / len(faults) if faults else 1.0
    false_pos = len(healthy) - sum(healthy)
    print(f"MegaTrace culprit accuracy: {args.scenarios} simulated scenarios, {world} ranks "
          f"(TP{args.tp} PP{args.pp} DP{args.dp}), {args.steps} steps, seed {args.seed}, "
          f"{time.perf_counter() - t0:.0f} s\n")
    print(f"{'scenario':16} {'runs':>5} {'named first':>12}")
    for label in sorted(by_label):
        oks = by_label[label]
        what = "quiet" if label == "healthy" else "named first"
        print(f"{label:16} {len(oks):>5} {sum(oks):>5} {what}")
    print(f"\nnamed first: {named:.1%} of {len(faults)} faults (target ≥ {TARGET_NAMED:.0%}: "
          f"{'OK' if named >= TARGET_NAMED else 'MISSED'}); false positives: {false_pos} of {len(healthy)} healthy runs "
          f"(target 0: {'OK' if false_pos == 0 else 'MISSED'})")
    if misses:
        print("missed:\n" + "\n".join(misses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
