"""The NCCL interposer in Slurm job steps on the local lab (the ``lab`` fixture: ``megatrace lab up``).
The tasks run the NCCL test double's driver under ``srun --mpi=pmi2`` on 4 virtual
nodes with ``LD_PRELOAD=libmegatrace_nccl.so``.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from helpers.outside import wait_for
from helpers.slurm_lab import lab_unavailable
from nccl_double.harness import Build, BuildUnavailable, build_all, run_job

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.config import Layout, save_layout
from megatrace.trace import ring_format as fmt

pytestmark = pytest.mark.slow
LAYOUT = Layout(world_size=8, tp=2, pp=2, dp=2, microbatches=4)
GRID = ["--tp", "2", "--pp", "2", "--dp", "2"]
NODES = ["-N4", "--overcommit"]


@pytest.fixture(scope="module")
def nccl(lab: dict, tmp_path_factory: pytest.TempPathFactory) -> Build:
    try:
        return build_all(tmp_path_factory.mktemp("nccl-build"))
    except BuildUnavailable as exc:
        lab_unavailable(str(exc))


def _gathered(out: Path, ranks: int) -> bool:
    """``ranks`` rings and meta files in the job directory, every ring copied in full: each node's epilog copies
    its files one by one (cp), a rank's meta file before its ring, so the last ring there may still be growing."""
    rings = list(out.glob("step-*/rings/rank-*.ring"))
    if len(rings) < ranks or len(list(out.glob("step-*/rings/rank-*.meta.jsonl"))) < ranks:
        return False
    for ring in rings:
        with ring.open("rb") as f:
            head = f.read(24)  # the header's first fields: its capacity is the u32 at offset 20 (docs/trace-format.md)
        if len(head) < 24 or ring.stat().st_size < fmt.file_size(struct.unpack_from("<I", head, 20)[0]):
            return False
    return True


def test_srun_megatrace_alone_loads_the_interposer_and_the_step_s_rings_are_collected(nccl: Build,
                                                                                       tmp_path: Path) -> None:
    """Nothing from the user but --megatrace: the plugin puts the lab's interposer (plugstack nccl_preload=)
    in front of LD_PRELOAD and sets MEGATRACE_ENABLE and MEGATRACE_DIR per node."""
    out = tmp_path / "out"
    job = run_job(nccl, tmp_path / "job", [*GRID, "--steps", "3"], trace=False, deadline_s=120,
                  srun=[*NODES, f"--megatrace=check=off,dir={out}"], env={"MEGATRACE_ENABLE": "0"})
    assert job.returncode == 0 and job.exits == {r: 0 for r in range(8)}, job.stderr
    # the plugin gathers each node's rings and meta files when the step ends, asynchronously (a timeout fails below)
    wait_for(lambda: _gathered(out, 8), timeout=60, step=0.5)
    rings = sorted(out.glob("step-*/rings"))
    assert len(rings) == 1 and len(list(rings[0].glob("rank-*.ring"))) == 8, list(out.rglob("*"))
    save_layout(LAYOUT, rings[0] / "layout.yaml")
    result = analyze(rings[0])
    kinds = [f.kind for f in result.findings]  # a loaded 2-core lab may add a noise straggler (a warning)
    assert Kind.HEALTHY in kinds and not [f for f in result.findings if f.severity == Severity.CRITICAL], kinds
    assert {i.host for i in result.trace.rank_info} == {"n1", "n2", "n3", "n4"}


def test_a_hang_in_an_srun_step_is_analysed_to_the_injected_rank(nccl: Build, tmp_path: Path) -> None:
    job = run_job(nccl, tmp_path, [*GRID, "--steps", "6", "--fault", "hang", "--fault-rank", "5",
                                   "--fault-step", "3"], stall_s=2.0, deadline_s=120, srun=NODES)
    assert job.stalled
    save_layout(LAYOUT, tmp_path / "layout.yaml")
    top = analyze(tmp_path).findings[0]
    assert (top.kind, top.subject.rank, top.subject.host) == (Kind.COMPUTE_HANG, 5, "n3"), top.verdict
