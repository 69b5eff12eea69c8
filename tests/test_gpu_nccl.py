"""On a real GPU: real NCCL under PyTorch, real NVML, the NCCL watchdog's own timeout.

Each test runs ``tests/programs/nccl_gpu_job.py`` (one rank, world size 1: a single GPU cannot
hold two NCCL ranks) and checks what MegaTrace makes of it:

* the NCCL interposer in front of PyTorch's own ``libnccl.so.2``: every call recorded, completed
  from a real CUDA event (an all-reduce queued behind 0.5 s of GPU work completes 0.5 s later,
  though the call returned at once);
* the Python tracer on DistributedDataParallel over NCCL: the gradient all-reduces DDP issues from
  C++ are recorded by the c10d hook's CUDA kernels and completed when the GPU has run them;
* a collective the NCCL watchdog times out: the job's own output log, PyTorch's Flight Recorder
  dump and the rings each give a verdict on the stuck rank;
* an all-reduce captured in a CUDA graph: the hook's poller never invalidates the capture;
* ``megatrace-check``'s GPU probes through the real NVML: a healthy GPU passes.

They skip without CUDA. Their CPU twins: ``test_nccl_interposer.py`` (the interposer and its event
path over an NCCL and CUDA-runtime double), ``test_dispatch_hook.py`` (the hook's kernels with the
device path's completion by polling, on gloo), ``test_torch_hook.py`` and ``test_real_programs.py``,
``test_import_job_log.py`` and ``test_import_flight_recorder.py`` (watchdog lines and dumps built
from PyTorch's format strings), ``test_check_gpu.py`` (NVML double).
``MEGATRACE_GPU_KEEP=DIR`` keeps every log, dump, ring and findings file there for study.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU (CPU twins: see this module's docstring)", allow_module_level=True)

from megatrace.trace import ring_format as fmt  # noqa: E402
from megatrace.trace.ring_format import Flag, Op, State  # noqa: E402
from megatrace.trace.ring_reader import read_meta, read_ring  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).resolve().parent / "programs" / "nccl_gpu_job.py"
# Start the Python tracer as the autoload .pth does, wherever this interpreter's site-packages lacks it.
WITH_TRACER = ("import megatrace.trace.autoload, runpy, sys; sys.argv = sys.argv[1:]; "
               "runpy.run_path(sys.argv[0], run_name='__main__')")
BEHIND_BYTES = 4096 * 4


def _autoload_installed() -> bool:
    return any((Path(p) / "megatrace-autoload.pth").exists() for p in site.getsitepackages())


def keep(name: str, *paths: Path) -> None:
    """Copy what a test produced under $MEGATRACE_GPU_KEEP/<name>/ (no-op when unset)."""
    base = os.environ.get("MEGATRACE_GPU_KEEP")
    if not base:
        return
    dest = Path(base) / name
    dest.mkdir(parents=True, exist_ok=True)
    for p in paths:
        if p.is_dir():
            shutil.copytree(p, dest / p.name, dirs_exist_ok=True)
        elif p.exists():
            shutil.copy2(p, dest / p.name)


def _with_root(env) -> dict[str, str]:
    """``env`` with this checkout first on PYTHONPATH (what is already there is kept)."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)}


def job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = _with_root(os.environ)
    env.pop("LD_PRELOAD", None)
    env.update({"MEGATRACE_ENABLE": "1", "MEGATRACE_DIR": str(tmp_path / "rings"), "RANK": "0", "WORLD_SIZE": "1",
                "LOCAL_RANK": "0", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def interposer(tmp_path_factory) -> Path:
    from megatrace.trace.nccl.build import LIBRARY, compile_interposer

    lib = tmp_path_factory.mktemp("interposer") / LIBRARY
    failure = compile_interposer(lib)
    assert failure is None, failure
    return lib


def run_job(tmp_path: Path, mode: str, env: dict[str, str], tracer: bool, timeout: float = 240):
    prefix = [sys.executable, "-c", WITH_TRACER] if tracer else [sys.executable]
    cmd = [*prefix, str(JOB), mode, str(tmp_path / "store")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    (tmp_path / f"{mode}.out").write_text(proc.stdout)
    (tmp_path / f"{mode}.err").write_text(proc.stderr)
    return proc


def result_line(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert lines, stdout
    return json.loads(lines[-1])


def ring_of_rank0(tmp_path: Path):
    rings = sorted((tmp_path / "rings").rglob(fmt.ring_name(0)))
    assert rings, sorted(str(p) for p in (tmp_path / "rings").rglob("*"))
    return rings[0], read_ring(rings[0])


def analyze(target: Path, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "megatrace.cli", "analyze", str(target), "-o", str(out),
                           "--no-report", *extra], capture_output=True, text=True, timeout=300,
                          env=_with_root(os.environ))
    assert "Traceback" not in proc.stderr, proc.stderr
    doc = json.loads((out / "findings.json").read_text())
    return proc, doc


def test_the_interposer_records_real_nccl_calls_and_completes_them_from_cuda_events(tmp_path, interposer):
    if _autoload_installed():
        pytest.skip("the Python tracer autoloads in this interpreter, and the interposer stands aside for it")
    proc = run_job(tmp_path, "collectives", job_env(tmp_path, LD_PRELOAD=str(interposer)), tracer=False)
    keep("interposer", tmp_path / "rings", tmp_path / "collectives.out", tmp_path / "collectives.err")
    assert proc.returncode == 0, proc.stderr[-4000:]
    done = result_line(proc.stdout)
    path, snap = ring_of_rank0(tmp_path)
    assert not [p for p in snap.problems if p.severity == "error"], snap.problems
    recs = snap.to_dicts()
    ops = [r["op"] for r in recs]
    # (torch 2.11: reduce_scatter_tensor on a world of one made no NCCL call)
    assert ops.count(Op.ALL_REDUCE) >= 6 and ops.count(Op.BROADCAST) >= 2 and ops.count(Op.ALL_GATHER) >= 2, ops
    (behind,) = [r for r in recs if r["op"] == Op.ALL_REDUCE and r["nbytes"] == BEHIND_BYTES]
    waited_s = (behind["t_complete"] - behind["t_enqueue"]) / 1e9
    # The call returned at once; the CUDA event fired when the 0.5 s kernel before it had run.
    assert done["behind_returned_after_s"] < 0.2 and 0.4 < waited_s < 5, (done, waited_s)
    groups = [e for e in read_meta(path.with_name(fmt.meta_name(0)))[0] if e["kind"] == "group"]
    assert groups and all(g["ranks"] == [0] for g in groups), groups
    assert all(r["state"] == State.COMPLETED and r["t_complete"] >= r["t_enqueue"] for r in recs), recs


def test_the_python_tracer_records_ddp_on_nccl(tmp_path):
    proc = run_job(tmp_path, "ddp", job_env(tmp_path), tracer=True)
    keep("ddp", tmp_path / "rings", tmp_path / "ddp.out", tmp_path / "ddp.err")
    assert proc.returncode == 0, proc.stderr[-4000:]
    _, snap = ring_of_rank0(tmp_path)
    recs = snap.to_dicts()
    reduces = [r for r in recs if r["op"] == Op.ALL_REDUCE]
    # Issued by DDP's reducer from C++ on CUDA tensors: the c10d hook's CUDA kernels, one bucket per step at least.
    assert len(reduces) >= 5, recs
    assert all(r["flags"] & Flag.DEVICE for r in reduces), reduces
    assert all(r["state"] == State.COMPLETED and r["t_complete"] >= r["t_enqueue"] for r in reduces), reduces


def test_the_python_tracer_and_the_interposer_together_keep_ddp_in_the_rank_ring(tmp_path, interposer):
    """The two tracers in one process (MEGATRACE_ENABLE=1 LD_PRELOAD=... torchrun train.py): the rank's ring
    is the Python tracer's, with each of DDP's all-reduces once (the c10d hook's CUDA kernels); the
    interposer's ring, created first by NCCL's eager init, is kept beside it under another name."""
    proc = run_job(tmp_path, "ddp", job_env(tmp_path, LD_PRELOAD=str(interposer)), tracer=True)
    keep("ddp-both", tmp_path / "rings", tmp_path / "ddp.out", tmp_path / "ddp.err")
    assert proc.returncode == 0, proc.stderr[-4000:]
    _, snap = ring_of_rank0(tmp_path)
    reduces = [r for r in snap.to_dicts() if r["op"] == Op.ALL_REDUCE]
    assert len(reduces) >= 5, snap.to_dicts()
    assert [r["group_seq"] for r in reduces] == sorted({r["group_seq"] for r in reduces}), reduces
    assert all(r["state"] == State.COMPLETED and r["flags"] & Flag.DEVICE for r in reduces), reduces


def test_a_real_watchdog_timeout_is_named_from_the_log_the_dump_and_the_rings(tmp_path):
    fr = tmp_path / "fr"
    fr.mkdir()
    env = job_env(tmp_path, TORCH_NCCL_TRACE_BUFFER_SIZE="2000", TORCH_NCCL_DUMP_ON_TIMEOUT="1",
                  TORCH_FR_DUMP_TEMP_FILE=str(fr / "nccl_trace_rank_"),
                  TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(fr / "nccl_trace_rank_"),
                  TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC="5000")
    proc = run_job(tmp_path, "timeout", env, tracer=True, timeout=200)
    log = tmp_path / "job.log"
    log.write_text(proc.stdout + proc.stderr)
    keep("timeout", tmp_path / "rings", fr, log)
    assert proc.returncode != 0, "the watchdog did not end the process"
    assert "Watchdog caught collective operation timeout" in proc.stderr, proc.stderr[-4000:]
    assert "SeqNum=4" in proc.stderr, proc.stderr[-4000:]

    results = {}
    for name, target, extra in (("log", log, ["--format", "job-log"]), ("dump", fr, ["--format", "flight-recorder"]),
                                ("rings", tmp_path / "rings", [])):
        if name == "dump" and not any(fr.iterdir()):
            results[name] = "no dump written"
            continue
        out = tmp_path / f"analysis-{name}"
        run, doc = analyze(target, out, *extra)
        keep(f"timeout-analysis-{name}", out / "findings.json")
        first = doc["findings"][0] if doc["findings"] else {}
        results[name] = (first.get("severity"), first.get("kind"), first.get("subject"), run.stdout[:400])
    for name, got in results.items():
        assert isinstance(got, tuple) and got[0] in ("critical", "error"), (name, results)
        subject = got[2]
        assert subject.get("rank") == 0 or 0 in subject.get("ranks", []), (name, results)


def test_a_collective_captured_in_a_cuda_graph_is_not_disturbed(tmp_path):
    """The hook's poller queries CUDA events while the trainer captures a graph: it must never invalidate
    the capture (its thread relaxes its capture mode, as PyTorch's NCCL watchdog does). The captured call
    is not recorded: it runs at each replay, which c10d never sees, and nothing of it can be queried (on
    torch 2.11 its record read FAILED, and a clean job would have looked stuck in it)."""
    proc = run_job(tmp_path, "graph", job_env(tmp_path), tracer=True)
    keep("graph", tmp_path / "rings", tmp_path / "graph.out", tmp_path / "graph.err")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert result_line(proc.stdout) == {"mode": "graph", "replayed": 3, "value": 1.0}, proc.stdout
    _, snap = ring_of_rank0(tmp_path)
    reduces = [r for r in snap.to_dicts() if r["op"] == Op.ALL_REDUCE]
    assert len(reduces) == 3, reduces  # the warm-ups
    assert all(r["state"] == State.COMPLETED for r in reduces), reduces


def test_megatrace_check_passes_a_healthy_gpu_through_the_real_nvml(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-c", "from megatrace.cli import check_main; check_main()",
                           "--only", "gpu", "--expect-gpus", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=_with_root(os.environ))
    (tmp_path / "check.txt").write_text(proc.stdout + proc.stderr)
    keep("check", out, tmp_path / "check.txt")
    assert "Traceback" not in proc.stderr, proc.stderr
    doc = json.loads(out.read_text())
    results = _results(doc)
    by_probe = {r["probe"]: r for r in results}
    assert by_probe["gpu.count"]["status"] == "ok" and by_probe["gpu.count"]["value"] == 1, by_probe.get("gpu.count")
    per_gpu = [r for r in results if r["subject"].get("gpu") == 0]
    assert per_gpu and all(r["subject"]["uuid"].startswith("GPU-") for r in per_gpu), per_gpu
    failed = [r for r in results if r.get("status") == "fail"]
    assert not failed and proc.returncode == 0, failed


def _results(doc) -> list[dict]:
    """Every probe result in a check report, wherever the report nests them."""
    found: list[dict] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            if "probe" in node and "status" in node:
                found.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    return found
