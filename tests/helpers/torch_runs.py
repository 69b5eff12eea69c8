"""Checked-in outputs of small real torch jobs that are no demo run (tests/data/<format>/<name>/), so the importer
tests of those formats run without torch and without starting a job each time:

* ``flight_recorder/dtype-mismatch``: :func:`mismatch_job`, three gloo ranks, rank 0 calls its fourth all_reduce
  with int32 where the others use float32; each rank's Flight Recorder dump, with stack traces, as a pickle
  (``fr_rank_<R>``) and as JSON (``json/fr_rank_<R>.json``) (tests/test_import_flight_recorder.py);
* ``kineto/slow-rank1`` and ``kineto/healthy``: :func:`kineto_job`, the three ranks of
  tests/programs/kineto_gloo_job.py under ``torch.profiler``, 30 iterations with rank 1 throttled from outside,
  and 20 left alone: one chrome trace per rank (rank 0's gzipped) and the layout a user passes along
  (tests/test_import_kineto.py);
* ``job_logs/<name>``: the output file of a 4-rank gloo job under torchrun (:mod:`helpers.torchrun_job`), as Slurm
  writes it, with the fault of :data:`JOB_LOGS` (tests/test_import_gloo_log.py).

Every file is stored gzipped (``<file>.gz``, so rank 0's ``trace-rank0.json.gz`` as ``trace-rank0.json.gz.gz``);
:func:`unpack` takes one ``.gz`` off. Before a file is stored, this machine's paths (the job's directory, the
repository, the home directory: in stack traces, tracebacks and Kineto's ``traceName``) and its hostname (Kineto's
``host_name``, torchrun's failure summary) are rewritten by :func:`helpers.scenarios.scrub` (pickles are unpickled,
rewritten and pickled again with the protocol torch used), and :func:`helpers.scenarios.check_clean` refuses a file
that still names them. A Kineto trace keeps every event but the compute ops (``aten::*`` cpu_ops, some 500 an
iteration, which no importer reads) after the first :data:`KEEP_COMPUTE_OPS` of each file.

To regenerate (needs torch; the live tests run the same jobs)::

    python tests/helpers/torch_runs.py [NAME ...]     # NAME such as kineto/slow-rank1; none: all of them
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

if __name__ == "__main__":  # run as a script: helpers.* as the tests import them
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.outside import Throttle
from helpers.scenarios import check_clean, scrub, unpack_folder
from helpers.torchrun_job import free_port, torchrun_job

DATA = Path(__file__).resolve().parent.parent / "data"
FR_ENV = {"TORCH_FR_BUFFER_SIZE": "2000"}
KEEP_COMPUTE_OPS = 600  # aten:: cpu_ops kept at the start of each Kineto trace: about one iteration's

# -- the jobs -----------------------------------------------------------------------------------------------------

MISMATCH_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    rank, out, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=3)
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    # the bug: rank 0 reduces int32 where the others reduce float32 (same byte count: gloo does not notice)
    dist.all_reduce(torch.ones(4, dtype=torch.int32 if rank == 0 else torch.float32))
    for _ in range(2):
        dist.all_reduce(torch.ones(4))
    import time
    time.sleep(1.0)  # let the recorder retire the last calls: both dumps below must see the same states
    open(f"{out}/fr_rank_{rank}", "wb").write(torch._C._distributed_c10d._dump_fr_trace())
    open(f"{out}/json/fr_rank_{rank}.json", "wb").write(torch._C._distributed_c10d._dump_fr_trace_json())
    dist.destroy_process_group()
""")


def mismatch_job(out: Path) -> Path:
    """Three real gloo ranks; rank 0 (torchfrtrace's reference rank) calls all_reduce #4 with the wrong dtype.
    Their dumps in ``out`` (pickles) and ``out/json``; the script beside ``out``."""
    (out / "json").mkdir(parents=True)
    script = out.parent / "mismatch.py"
    script.write_text(MISMATCH_SCRIPT)
    env = {**os.environ, **FR_ENV, "MEGATRACE_ENABLE": "0"}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(out), port], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err.decode()[-2000:]
    return out


KINETO_JOB = Path(__file__).resolve().parent.parent / "programs" / "kineto_gloo_job.py"
KINETO_WORLD = 3


def kineto_job(out: Path, iterations: int, slow: int | None = None) -> Path:
    """The Kineto job's traces in ``out``; ``slow``: the rank throttled from outside while it runs."""
    out.mkdir(parents=True)
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(KINETO_JOB), str(r), str(KINETO_WORLD), str(out), port,
                               str(iterations)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r in range(KINETO_WORLD)]
    try:
        if slow is None:
            codes = [p.wait(timeout=90) for p in procs]
        else:
            with Throttle(procs[slow].pid):
                codes = [p.wait(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * KINETO_WORLD, [p.stderr.read().decode()[-2000:] for p in procs]
    # what a user passes along: the parallel layout (3-way data parallel), from which steps are told apart
    (out / "layout.yaml").write_text(f"world_size: {KINETO_WORLD}\ntp: 1\npp: 1\ndp: {KINETO_WORLD}\n")
    return out


def stop_rank_1(pids: dict[int, int]) -> None:
    """Rank 1 stopped long enough for gloo's 6 s timeout to fire on the others, then let go."""
    os.kill(pids[1], signal.SIGSTOP)
    time.sleep(12)
    os.kill(pids[1], signal.SIGCONT)  # (so torchrun's SIGTERM can end it)


def kill_rank_2(pids: dict[int, int]) -> None:
    os.kill(pids[2], signal.SIGKILL)


# name -> (fault from outside, rank that raises its own error, extra environment) for helpers.torchrun_job
JOB_LOGS: dict[str, tuple[Callable[[dict[int, int]], None], str, dict[str, str]]] = {
    "rank1-stopped": (stop_rank_1, "", {}),  # the others time out waiting for rank 1
    "rank2-killed": (kill_rank_2, "", {}),  # SIGKILL from outside
    "rank3-raised": (lambda pids: None, "3", {}),  # rank 3 raises; the others fail in their all_reduce
    "rank3-raised-others-compute": (lambda pids: None, "3", {"OTHERS_COMPUTE": "1"}),  # ... the others compute
}

# -- checked in ---------------------------------------------------------------------------------------------------


def _job_log(name: str, tmp: Path) -> Path:
    fault, crash_rank, env = JOB_LOGS[name]
    (tmp / "job").mkdir()
    log = torchrun_job(tmp / "job", fault, crash_rank=crash_rank, env=env)
    (tmp / "out").mkdir()
    return Path(shutil.move(log, tmp / "out" / log.name)).parent


RUNS: dict[str, Callable[[Path], Path]] = {  # name -> writer: a temporary directory in, the folder to store out
    "flight_recorder/dtype-mismatch": lambda tmp: mismatch_job(tmp / "out"),
    "kineto/slow-rank1": lambda tmp: kineto_job(tmp / "out", 30, slow=1),
    "kineto/healthy": lambda tmp: kineto_job(tmp / "out", 20),
    **{f"job_logs/{name}": (lambda tmp, name=name: _job_log(name, tmp)) for name in JOB_LOGS},
}


def unpack(name: str, dest: Path) -> Path:
    """Run ``name``'s files in ``dest`` (created), as the job wrote them."""
    src = DATA / name
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such run (regenerate: python tests/helpers/torch_runs.py {name})")
    return unpack_folder(src, dest)


def _scrub_value(value: Any, moved: dict[Path, str]) -> Any:
    if isinstance(value, str):
        return scrub(value, moved)
    if isinstance(value, dict):
        return {_scrub_value(k, moved): _scrub_value(v, moved) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_scrub_value(v, moved) for v in value)
    return value


def _trim_kineto(doc: dict) -> dict:
    kept = 0
    events = []
    for e in doc["traceEvents"]:
        if e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith("aten::"):
            kept += 1
            if kept > KEEP_COMPUTE_OPS:
                continue
        events.append(e)
    return {**doc, "traceEvents": events}


def _stored(path: Path, moved: dict[Path, str]) -> bytes:
    """``path``'s content as checked in: scrubbed (and, a Kineto trace, trimmed)."""
    data = path.read_bytes()
    zipped = path.name.endswith(".gz")
    if zipped:
        data = gzip.decompress(data)
    if data.startswith(b"\x80"):  # a pickle: a Flight Recorder dump of our own run (trusted)
        data = pickle.dumps(_scrub_value(pickle.loads(data), moved), protocol=data[1])
    else:
        text = data.decode()
        if path.name.startswith("trace-rank"):  # a Kineto trace
            text = json.dumps(_trim_kineto(json.loads(text)))
        data = scrub(text, moved).encode()
    check_clean(data, path)
    return gzip.compress(data, mtime=0) if zipped else data


def write(name: str) -> Path:
    """Run ``name``'s job (torch, several processes) and store its files in tests/data/<name>/, each gzipped."""
    with tempfile.TemporaryDirectory() as tmp:
        out = RUNS[name](Path(tmp))
        moved = {out: f"/jobs/{name.split('/')[-1]}", Path(tmp): "/jobs"}
        target = DATA / name
        shutil.rmtree(target, ignore_errors=True)
        for path in sorted(out.rglob("*")):
            if path.is_file():
                dest = target / path.relative_to(out)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.with_name(dest.name + ".gz").write_bytes(gzip.compress(_stored(path, moved), mtime=0))
    return target


if __name__ == "__main__":
    for arg in sys.argv[1:] or sorted(RUNS):
        print(write(arg))
