"""Plain PyTorch programs (tests/programs/) traced under torchrun: the rings hold every call torch counted.

``ddp_reduce_loop.py`` is issue 27's first script pattern (DDP, whose gradient all-reduces come
from its C++ reducer, plus the script's own ``dist.reduce``); ``player_trainers.py`` is the second
(three process groups: a scatter on the world, DDP on the trainers' group, a broadcast on a pair).
Run with ``MEGATRACE_ENABLE=1`` and nothing else, each rank's ring must hold exactly the collectives
torch's Flight Recorder counted, per process group and op, and the profiler's ``gloo:*`` events agree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.comm_counts import reference_counts, reference_disagreement, reference_env, ring_counts

pytest.importorskip("torch")

PROGRAMS = Path(__file__).with_name("programs")
ITERATIONS = 6
# program, ranks, the ops each rank must show beyond the counts: (rank, group size, op) that prove
# the hard call paths are there (DDP's reducer all-reduces, the script's own calls)
CASES = {
    "ddp_reduce_loop.py": (2, {(0, 2, "all_reduce"), (0, 2, "reduce"), (1, 2, "all_reduce")}),
    "player_trainers.py": (3, {(0, 3, "scatter"), (0, 2, "broadcast"), (1, 2, "all_reduce"), (2, 2, "all_reduce")}),
}


def _group_sizes(ring_dir: Path) -> dict[str, int]:
    """Process group name -> size, from the ranks' meta files."""
    from megatrace.trace.ring_reader import read_meta

    sizes = {}
    for meta in ring_dir.glob("rank-*.meta.jsonl"):
        for entry in read_meta(meta)[0]:
            if entry.get("kind") == "group":
                sizes[entry["name"]] = len(entry["ranks"])
    return sizes


@pytest.mark.slow
@pytest.mark.parametrize("program", list(CASES))
def test_a_plain_program_is_traced_call_for_call(tmp_path: Path, program: str) -> None:
    ranks, must = CASES[program]
    env = dict(os.environ, MEGATRACE_ENABLE="1", MEGATRACE_DIR=str(tmp_path / "rings"), OMP_NUM_THREADS="1",
               **reference_env(tmp_path / "reference"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           str(PROGRAMS / program), "--iterations", str(ITERATIONS)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = ring_counts(tmp_path / "rings"), reference_counts(tmp_path / "reference")
    assert sorted(ours) == sorted(theirs) == list(range(ranks))
    assert not reference_disagreement(tmp_path / "reference")
    for rank in range(ranks):
        assert ours[rank].collectives == theirs[rank].collectives, f"rank {rank}"
        assert ours[rank].p2p == theirs[rank].p2p, f"rank {rank}"
    sizes = _group_sizes(tmp_path / "rings")
    seen = {(rank, sizes[group], op) for rank, counts in ours.items() for (group, op) in counts.collectives}
    assert must <= seen, must - seen
    ddp_ranks = [r for r, _, op in must if op == "all_reduce"]
    for rank in ddp_ranks:  # DDP's reducer: at least one bucket all-reduce per backward
        all_reduces = sum(n for (_, op), n in ours[rank].collectives.items() if op == "all_reduce")
        assert all_reduces >= ITERATIONS * 3, (rank, all_reduces)
