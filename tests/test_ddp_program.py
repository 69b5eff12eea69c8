"""The first script's pattern of issue 27, rebuilt: an unmodified DDP training script under torchrun, traced.

``tests/programs/ddp_policy.py`` knows nothing of MegaTrace: DDP's gradient all-reduces come from
its C++ reducer, and the script's own ``dist.reduce`` / ``dist.all_reduce`` report metrics. Run with
``MEGATRACE_ENABLE=1`` under torchrun, every rank's ring must hold exactly the collectives torch's
Flight Recorder counted, per process group and op (and the profiler's ``gloo:*`` events agree).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from comm_counts import reference_counts, reference_disagreement, reference_env, ring_counts

pytest.importorskip("torch")

PROGRAM = Path(__file__).parent / "programs" / "ddp_policy.py"
ITERATIONS, MINIBATCHES, EVAL_EVERY = 6, 3, 3


@pytest.mark.slow
def test_unmodified_ddp_script_is_traced_call_for_call(tmp_path: Path) -> None:
    env = dict(os.environ, MEGATRACE_ENABLE="1", MEGATRACE_DIR=str(tmp_path / "rings"), OMP_NUM_THREADS="1",
               **reference_env(tmp_path / "reference"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(PROGRAM),
           "--iterations", str(ITERATIONS), "--minibatches", str(MINIBATCHES), "--eval-every", str(EVAL_EVERY)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"iteration {ITERATIONS - 1}: return" in proc.stdout
    ours, theirs = ring_counts(tmp_path / "rings"), reference_counts(tmp_path / "reference")
    assert sorted(ours) == sorted(theirs) == [0, 1]
    assert not reference_disagreement(tmp_path / "reference")
    for rank in (0, 1):
        assert ours[rank].collectives == theirs[rank].collectives, f"rank {rank}"
        assert not ours[rank].p2p and not theirs[rank].p2p
        per_op = {op: n for (_, op), n in ours[rank].collectives.items()}
        # the script's own calls: two reduces per iteration, one all_reduce per evaluation
        assert per_op["reduce"] == 2 * ITERATIONS
        # DDP's: at least one bucket all-reduce per backward, beyond the evaluations' all_reduces
        assert per_op["all_reduce"] >= ITERATIONS * MINIBATCHES + ITERATIONS // EVAL_EVERY
        assert per_op["broadcast"] >= 1  # DDP's start-up broadcast of the parameters
