"""The NCCL interposer (megatrace/trace/nccl), loaded by the real dynamic linker in front of an
NCCL test double over MPI (tests/nccl_double): what it records, how it shares the ring format
with the Python tracer, and how it stays out of the way.

The double and the driver are built once per session with the system C compiler against the
``mpich`` wheel's MPI; without either the tests skip.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from nccl_double.harness import Build, BuildUnavailable, build_all, build_local_scope, run_job
from helpers.planted import planted_step_dir

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind
from megatrace.config import Layout, save_layout
from megatrace.trace import ring_format as fmt
from megatrace.trace.nccl import LIBRARY
from megatrace.trace.ring_format import Flag, Op, State, WriterState
from megatrace.trace.ring_reader import read_meta, read_ring
from megatrace.trace.ring_writer import RingIdentity, RingWriter
from megatrace.trace.settings import TracerSettings

TP, PP, DP = 2, 2, 2
WORLD = TP * PP * DP
LAYOUT = Layout(world_size=WORLD, tp=TP, pp=PP, dp=DP, microbatches=4)
GRID = ["--tp", str(TP), "--pp", str(PP), "--dp", str(DP)]


@pytest.fixture(scope="session")
def nccl(tmp_path_factory: pytest.TempPathFactory) -> Build:
    try:
        return build_all(tmp_path_factory.mktemp("nccl-build"))
    except BuildUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def healthy(nccl: Build, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One traced healthy run with every interposed call (--extras, reduce-scatter DP mode)."""
    out = tmp_path_factory.mktemp("nccl-healthy")
    job = run_job(nccl, out, [*GRID, "--steps", "3", "--extras", "--dp-mode", "rs"])
    assert job.returncode == 0, job.stderr
    return out


def records(path: Path) -> list[dict[str, int]]:
    return read_ring(path).to_dicts()


def groups_of(directory: Path, rank: int) -> dict[int, list[int]]:
    entries, problems = read_meta(directory / fmt.meta_name(rank))
    assert not problems
    return {e["gid"]: e["ranks"] for e in entries if e["kind"] == "group"}


# -- the library ------------------------------------------------------------------------------


def test_the_interposer_exports_only_the_nccl_entry_points(nccl: Build) -> None:
    if not shutil.which("nm"):
        pytest.skip("no nm")
    out = subprocess.run(["nm", "-D", "--defined-only", str(nccl.interposer)], capture_output=True, text=True,
                         check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert names == {"ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast", "ncclBcast",
                     "ncclReduce", "ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd", "ncclCommInitRank",
                     "ncclCommInitRankConfig", "ncclCommInitAll", "ncclCommSplit", "ncclCommDestroy",
                     "ncclCommAbort"}


def test_the_module_prints_the_library_path_and_builds_it(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "megatrace.trace.nccl", "--build", str(tmp_path / "lib")],
                           capture_output=True, text=True)
    if built.returncode != 0 and "no C compiler" in built.stderr:
        pytest.skip("no C compiler")
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip() == str(tmp_path / "lib" / LIBRARY) and (tmp_path / "lib" / LIBRARY).is_file()
    shown = subprocess.run([sys.executable, "-m", "megatrace.trace.nccl"], capture_output=True, text=True)
    if shown.returncode == 0:  # installed: the path of an existing library
        assert Path(shown.stdout.strip()).name == LIBRARY and Path(shown.stdout.strip()).is_file()
    else:  # not built at install time: one error line that says how to build it
        assert shown.stderr.startswith("Error:") and "--build" in shown.stderr


# -- what a run records -------------------------------------------------------------------------


def test_an_nccl_loaded_into_a_local_scope_is_found(nccl: Build, tmp_path: Path) -> None:
    """PyTorch dlopen()s its libraries with RTLD_LOCAL and libnccl.so.2 comes with them: the preloaded
    interposer cannot reach it with RTLD_NEXT. Seen on an H200 (torch 2.11, NCCL 2.28.9): every
    traced PyTorch job failed in init_process_group with ncclInternalError."""
    job = run_job(build_local_scope(nccl), tmp_path, [*GRID, "--steps", "1"])
    assert job.returncode == 0, job.stderr
    assert "not found" not in job.stderr, job.stderr
    for rank in range(WORLD):
        recs = records(tmp_path / fmt.ring_name(rank))
        assert recs and all(r["state"] == State.COMPLETED for r in recs), (rank, recs)
        assert {Op(r["op"]) for r in recs} >= {Op.ALL_REDUCE, Op.SEND, Op.RECV}, (rank, recs)


def test_every_rank_writes_a_closed_ring_with_its_identity(healthy: Path) -> None:
    for rank in range(WORLD):
        snap = read_ring(healthy / fmt.ring_name(rank))
        h = snap.header
        assert (h.rank, h.world_size, h.local_rank, h.job_id) == (rank, WORLD, rank, "ncclt")
        assert h.writer_state == WriterState.CLOSED and h.capacity == 4096
        assert not snap.problems and snap.lost == 0
        assert [r["seq"] for r in snap.to_dicts()] == list(range(1, h.write_counter + 1))
        (process,) = [e for e in read_meta(healthy / fmt.meta_name(rank))[0] if e["kind"] == "process"]
        assert process["rank"] == rank and process["backend"] == "nccl" and process["argv"][0].endswith("driver")


def test_group_ids_and_members_agree_across_ranks_and_match_the_layout(healthy: Path) -> None:
    seen: dict[int, list[int]] = {}
    for rank in range(WORLD):
        for gid, members in groups_of(healthy, rank).items():
            assert rank in members
            assert seen.setdefault(gid, members) == members, f"group {gid} differs on rank {rank}"
    expected = {tuple(range(WORLD))}
    for kind in ("tp", "pp", "dp"):
        expected |= {tuple(LAYOUT.group_of(kind, r)) for r in range(WORLD)}
    assert {tuple(m) for m in seen.values()} == expected  # world, 4 TP, 4 PP, 4 DP (from ncclCommSplit)
    assert len(seen) == len(expected) and 0 not in seen


def test_each_call_is_one_record_with_its_op_size_root_and_sequences(healthy: Path) -> None:
    ops: Counter[int] = Counter()
    for rank in range(WORLD):
        recs = records(healthy / fmt.ring_name(rank))
        groups = groups_of(healthy, rank)
        assert {r["group_id"] for r in recs} <= set(groups)
        per_group: dict[int, list[int]] = defaultdict(list)
        per_peer: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for r in recs:
            ops[r["op"]] += 1
            assert r["state"] == State.COMPLETED and r["t_complete"] >= r["t_enqueue"] > 0
            if r["op"] in (Op.SEND, Op.RECV):
                per_peer[(r["group_id"], r["op"], r["peer"])].append(r["group_seq"])
                assert r["flags"] == Flag.BATCHED and r["peer"] in groups[r["group_id"]] and r["peer"] != rank
            else:
                per_group[r["group_id"]].append(r["group_seq"])
                assert r["flags"] == 0
        for seqs in [*per_group.values(), *per_peer.values()]:
            assert seqs == list(range(1, len(seqs) + 1))
        first = recs[:3]  # --extras: broadcast on DP (root DP rank 0), bcast on TP (root TP rank 1), reduce
        dp_members, tp_members = groups[first[0]["group_id"]], groups[first[1]["group_id"]]
        assert [r["op"] for r in first] == [Op.BROADCAST, Op.BROADCAST, Op.REDUCE]
        assert (first[0]["peer"], first[0]["nbytes"], first[0]["dtype"]) == (dp_members[0], 4096 * 4, fmt.Dtype.FLOAT32)
        assert first[1]["peer"] == tp_members[-1]
        assert (first[2]["peer"], first[2]["nbytes"], first[2]["dtype"]) == (1, 256 * 2, fmt.Dtype.BFLOAT16)
    # 8 ranks x 3 steps x (8 actions x 2 layers) TP all-reduces + 8 world barriers; 8 x 3 RS + AG on DP
    assert ops[Op.ALL_REDUCE] == WORLD * 3 * 16 + WORLD
    assert ops[Op.REDUCE_SCATTER] == ops[Op.ALL_GATHER] == WORLD * 3
    assert ops[Op.SEND] == ops[Op.RECV] > 0


def test_the_analyzer_reads_the_rings_unchanged_and_finds_a_healthy_job(healthy: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace"
    shutil.copytree(healthy, out, ignore=shutil.ignore_patterns("exits"))
    save_layout(LAYOUT, out / "layout.yaml")
    result = analyze(out)
    assert result.findings[0].kind == Kind.HEALTHY, result.findings[0].verdict
    assert not [p for p in result.trace.problems if p.severity == "error"], result.trace.problems
    assert result.trace.world_size == WORLD and len(result.trace.groups) == 1 + 3 * 4


# -- one format, two writers ----------------------------------------------------------------------


def test_the_ring_is_byte_for_byte_what_the_python_writer_makes_of_the_same_calls(healthy: Path,
                                                                                   tmp_path: Path) -> None:
    """Replay rank 3's records through the pure-Python RingWriter; only the clock readings may differ."""
    c_path = healthy / fmt.ring_name(3)
    snap = read_ring(c_path)
    h = snap.header
    writer = RingWriter(tmp_path, RingIdentity(h.rank, h.world_size, h.local_rank, h.job_id, h.step_id, h.host, h.pid),
                        h.capacity, use_native=False)
    for r in snap.to_dicts():
        handle = writer.begin(r["op"], r["group_id"], r["group_seq"], r["nbytes"], r["peer"], r["dtype"], r["flags"])
        if r["state"] != State.ENQUEUED:
            writer.complete(handle, r["state"])
    c_meta = [line for line in (healthy / fmt.meta_name(3)).read_text().splitlines()]
    for line in c_meta:
        entry = json.loads(line)
        if entry["kind"] == "group":
            writer.write_meta("group", gid=entry["gid"], name=entry["name"], desc=entry["desc"],
                              ranks=entry["ranks"], backend=entry["backend"])
    writer.close()

    c_bytes, py = c_path.read_bytes(), bytearray(writer.path.read_bytes())
    assert len(c_bytes) == len(py) == fmt.file_size(h.capacity)
    py[40:56] = c_bytes[40:56]  # the clock anchors
    fmt.HEADER_CHECK.pack_into(py, fmt.HEADER_CHECK_OFFSET, fmt.header_check(bytes(py[:252])))
    for r in snap.to_dicts():
        off = fmt.HEADER_SIZE + (r["seq"] - 1) % h.capacity * fmt.RECORD_SIZE
        py[off + 16:off + 24] = c_bytes[off + 16:off + 24]  # t_enqueue
        py[off + 48:off + 56] = c_bytes[off + 48:off + 56]  # t_complete
        fmt.HEAD_CHECK.pack_into(py, off + 44, fmt.head_check(bytes(py[off:off + 44])))
        struct.pack_into("<I", py, off + 60, fmt.tail_check(r["t_complete"], r["state"], r["seq"]))
    assert bytes(py) == c_bytes

    # group lines: the same JSON text, up to the time they were written
    def groups_text(lines: list[str]) -> list[str]:
        return [json.dumps({**json.loads(x), "t_mono_ns": 0}, separators=(",", ":"))
                for x in lines if json.loads(x)["kind"] == "group"]
    py_meta = writer.meta_path.read_text().splitlines()
    assert groups_text(c_meta) == groups_text(py_meta) and len(groups_text(c_meta)) == 4
    for line in c_meta:  # key order as the Python writer writes it, so a line-level diff is meaningful
        entry = json.loads(line)
        if entry["kind"] == "group":
            assert list(entry) == ["kind", "t_mono_ns", "gid", "name", "desc", "ranks", "backend"]


# -- staying out of the way -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_process_killed_with_sigkill_mid_run_leaves_a_readable_ring(nccl: Build, tmp_path: Path) -> None:
    # --fork-child: each rank forks a child that exits normally; it must not mark the parent's ring closed
    job = run_job(nccl, tmp_path, [*GRID, "--steps", "100000", "--compute-ms", "0.2", "--fork-child"],
                  kill_after_records=3000, deadline_s=60)
    assert job.returncode != 0 and not job.exits  # every rank died by SIGKILL, none exited
    for rank in range(WORLD):
        snap = read_ring(tmp_path / fmt.ring_name(rank))
        assert snap.header.writer_state == WriterState.OPEN
        assert not [p for p in snap.problems if p.severity == "error"], snap.problems
        seqs = [r["seq"] for r in snap.to_dicts()]
        assert len(seqs) > 50 and seqs == list(range(1, len(seqs) + 1))
        assert snap.lost == 0
    trace = tmp_path / "trace"
    shutil.copytree(tmp_path, trace, ignore=shutil.ignore_patterns("exits", "trace"))
    save_layout(LAYOUT, trace / "layout.yaml")
    assert analyze(trace).findings  # the analyzer takes the killed job's rings as they are


@pytest.mark.slow
def test_an_unwritable_trace_directory_warns_once_and_the_job_runs_untraced(nccl: Build, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    job = run_job(nccl, tmp_path / "job", [*GRID, "--steps", "2", "--extras"],
                  env={"MEGATRACE_DIR": str(blocker / "rings")})
    assert job.returncode == 0 and job.exits == {r: 0 for r in range(WORLD)}, job.stderr
    warnings = [line for line in job.stderr.splitlines() if line.startswith("megatrace-nccl:")]
    assert len(warnings) == WORLD and all("cannot create trace directory" in w for w in warnings), job.stderr


@pytest.mark.slow
def test_a_rank_whose_ring_cannot_be_created_still_takes_part_and_the_others_trace(nccl: Build,
                                                                                   tmp_path: Path) -> None:
    job = run_job(nccl, tmp_path, [*GRID, "--steps", "2", "--bad-dir-rank", "3"], deadline_s=60)
    assert job.returncode == 0 and job.exits == {r: 0 for r in range(WORLD)}, job.stderr
    assert [line for line in job.stderr.splitlines() if line.startswith("megatrace-nccl:")] == [
        "megatrace-nccl: cannot create trace directory /proc/self/megatrace-cannot-be-here: No such file or "
        "directory; NCCL calls are not traced"]
    assert sorted(p.name for p in tmp_path.glob("*.ring")) == [fmt.ring_name(r) for r in range(WORLD) if r != 3]
    assert sorted(map(tuple, groups_of(tmp_path, 2).values())) == [(0, 1, 2, 3, 4, 5, 6, 7), (0, 2), (2, 3), (2, 6)]


@pytest.mark.slow
def test_a_full_ring_wraps_keeps_the_newest_records_and_warns_once(nccl: Build, tmp_path: Path) -> None:
    job = run_job(nccl, tmp_path, [*GRID, "--steps", "3"], env={"MEGATRACE_RING_RECORDS": "20"})  # rounded to 32
    assert job.returncode == 0, job.stderr
    warnings = Counter(line for line in job.stderr.splitlines() if line.startswith("megatrace-nccl:"))
    assert warnings == {"megatrace-nccl: MEGATRACE_RING_RECORDS=20 rounded up to 32, a power of two": WORLD,
                        "megatrace-nccl: the ring is full after 32 records; it now wraps and overwrites the oldest "
                        "(raise MEGATRACE_RING_RECORDS to keep more)": WORLD}, warnings
    for rank in range(WORLD):
        snap = read_ring(tmp_path / fmt.ring_name(rank))
        seqs = [r["seq"] for r in snap.to_dicts()]
        assert snap.header.capacity == 32 and len(seqs) == 32 and snap.dropped == snap.header.write_counter - 32 > 0
        assert seqs == list(range(snap.dropped + 1, snap.header.write_counter + 1)) and not snap.problems


@pytest.mark.slow
def test_without_megatrace_enable_the_interposer_only_passes_calls_through(nccl: Build, tmp_path: Path) -> None:
    job = run_job(nccl, tmp_path, [*GRID, "--steps", "2", "--extras"], env={"MEGATRACE_ENABLE": "0"})
    assert job.returncode == 0 and job.exits == {r: 0 for r in range(WORLD)}, job.stderr
    assert not list(tmp_path.glob("rank-*")) and "megatrace" not in job.stderr


@pytest.mark.slow
def test_without_an_observable_completion_records_carry_enqueue_times_only(nccl: Build, tmp_path: Path) -> None:
    """MEGATRACE_NCCL_COMPLETION=none is what a process without the CUDA runtime gets."""
    job = run_job(nccl, tmp_path, [*GRID, "--steps", "2"], env={"MEGATRACE_NCCL_COMPLETION": "none"})
    assert job.returncode == 0, job.stderr
    for rank in range(WORLD):
        recs = records(tmp_path / fmt.ring_name(rank))
        assert recs and all(r["flags"] & Flag.NO_COMPLETION and r["state"] == State.ENQUEUED
                            and r["t_complete"] == 0 for r in recs)
        # members cannot be learned without a buffer NCCL accepts: only the world group (member i = rank i)
        assert list(groups_of(tmp_path, rank).values()) == [list(range(WORLD))]


@pytest.mark.slow
def test_with_a_cuda_runtime_completion_comes_from_events_polled_by_the_helper_thread(nccl: Build,
                                                                                      tmp_path: Path) -> None:
    """A CUDA runtime double whose events fire 2 ms after they are recorded: each record is completed
    by the helper thread no earlier than that, and the members are learned through 'device' memory."""
    job = run_job(nccl, tmp_path, [*GRID, "--steps", "2", "--extras"], preload=(nccl.cudart,),
                  env={"MEGATRACE_NCCL_COMPLETION": "event", "MT_FAKE_EVENT_DELAY_US": "2000"})
    assert job.returncode == 0, job.stderr
    for rank in range(WORLD):
        recs = records(tmp_path / fmt.ring_name(rank))
        assert recs and all(r["flags"] & Flag.DEVICE and not r["flags"] & Flag.NO_COMPLETION for r in recs)
        assert all(r["state"] == State.COMPLETED and r["t_complete"] - r["t_enqueue"] >= 2_000_000 for r in recs)
        batched = [r for r in recs if r["flags"] & Flag.BATCHED]
        assert batched and all(r["op"] in (Op.SEND, Op.RECV) for r in batched)
        assert len(groups_of(tmp_path, rank)) == 4  # world, TP, PP, DP: members exchanged via cudaMalloc'd buffers


PYTHON_TRACER_AND_INTERPOSER = r'''
import ctypes, os, sys
from megatrace.trace.ring_writer import RingIdentity, RingWriter
from megatrace.trace.settings import TracerSettings
writer = RingWriter(sys.argv[2], RingIdentity(rank=0, world_size=1, pid=os.getpid()), 64)  # the Python tracer's ring
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # the NCCL double
nccl = ctypes.CDLL(None)  # calls bind as a linked program's do: the preloaded interposer first
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
uid, comm, buf = UniqueId(), ctypes.c_void_p(), (ctypes.c_float * 2)()
assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
assert nccl.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) == 0
assert nccl.ncclAllReduce(buf, buf, 2, 7, 0, comm, None) == 0
writer.close()
'''


@pytest.mark.slow
def test_the_interposer_leaves_a_ring_of_this_process_s_python_tracer_alone(nccl: Build, tmp_path: Path) -> None:
    env = {"MEGATRACE_ENABLE": "1", "MEGATRACE_DIR": str(tmp_path), "LD_PRELOAD": str(nccl.interposer), "RANK": "0",
           "PATH": "/usr/bin:/bin"}
    result = subprocess.run([str(nccl.mpiexec), "-n", "1", sys.executable, "-c", PYTHON_TRACER_AND_INTERPOSER,
                             str(nccl.double), str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-00000.meta.jsonl", "rank-00000.ring"]
    assert read_ring(tmp_path / "rank-00000.ring").header.write_counter == 0  # no NCCL record in the Python ring
    assert "written by this process's Python tracer" in result.stderr


@pytest.mark.slow
def test_the_default_trace_directory_is_the_python_tracer_s(nccl: Build) -> None:
    job_id = f"nccl-test-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRACE_", "SLURM_"))}
    env.update({"MEGATRACE_ENABLE": "1", "MEGATRACE_JOB_ID": job_id, "MEGATRACE_STEP_ID": "7",
                "LD_PRELOAD": str(nccl.interposer)})
    expected = TracerSettings.from_env(env).directory
    try:
        subprocess.run([str(nccl.mpiexec), "-n", "1", str(nccl.driver), "--steps", "1"], env=env, check=True,
                       capture_output=True, timeout=60)
        header = read_ring(expected / fmt.ring_name(0)).header
        assert (header.job_id, header.step_id, header.world_size) == (job_id, "7", 1)
    finally:
        shutil.rmtree(expected, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's directory needs root")
def test_the_interposer_refuses_a_trace_directory_another_user_made_and_never_writes_through_its_links(
        nccl: Build, tmp_path: Path) -> None:
    """Issue 20, item 1, for the NCCL path: the attacker's 0777 directory with the victim's meta file as a link."""
    victim, step = planted_step_dir(tmp_path)
    env = {"MEGATRACE_ENABLE": "1", "MEGATRACE_DIR": str(step), "LD_PRELOAD": str(nccl.interposer), "RANK": "0",
           "PATH": "/usr/bin:/bin"}
    done = subprocess.run([str(nccl.mpiexec), "-n", "1", str(nccl.driver), "--steps", "1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr  # training goes on
    assert f"cannot use trace directory {step}: owned by another user; NCCL calls are not traced" in done.stderr
    assert victim.read_text() == "keep\n" and sorted(p.name for p in step.iterdir()) == [fmt.meta_name(0)]
    step.chmod(0o700)
    os.chown(step, 0, 0)  # made by this user, but inside a directory the other user can change
    done = subprocess.run([str(nccl.mpiexec), "-n", "1", str(nccl.driver), "--steps", "1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert "a directory above it is owned by another user" in done.stderr and victim.read_text() == "keep\n"
