"""The collector: real rings of a demo hang spread over four emulated nodes, gathered by a real mpiexec.

Each MPI process of ``mpiexec`` plays one node: its own node name (``-env
MEGATRACE_NODE_NAME``) and ring directory (``--ring-dir DIR/%n``). One demo run
(module fixture, ~15 s) provides the rings; every mpiexec run has a timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.memory import PEAK_KIB
from helpers.shm import mpich_segments

from megatrace.collect.run import CollectOptions, collect_local
from megatrace.pipeline import analyze_bundle

BIN = Path(sys.executable).parent
MPIEXEC = shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec")
NODES = ["n1", "n2", "n3", "n4"]
HUNG_RANK = 3
# tp1 x pp2 x dp2: rank 3 (last stage of the second replica) stops in a forward.
DEMO = ["--ranks", "4", "--tp", "1", "--pp", "2", "--dp", "2", "--steps", "4", "--fault",
        f"hang:rank={HUNG_RANK},step=2", "--stall-timeout", "6", "--deadline", "240"]  # a loaded CI host is slow

needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec (make install: the mpich wheel) not available")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real demo run with an injected hang (rings of 4 ranks)."""
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("demo") / "run"
    proc = subprocess.run([str(BIN / "megatrace"), "demo", *DEMO, "-o", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert (out / "rings" / "rank-00003.ring").exists(), proc.stderr[-2000:]
    # the injected hang happened (not the deadline, on a very loaded host): the launcher saw the stall
    assert json.loads((out / "procs.json").read_text())["outcome"] == "stalled", proc.stderr[-2000:]
    return out


def _demo_verdict(demo: Path) -> str:
    """What the analysis says of the demo's own directory (for a failure message)."""
    return subprocess.run([str(BIN / "megatrace"), "analyze", str(demo), "--json", str(demo.parent / "direct.json")],
                          capture_output=True, text=True, timeout=120).stdout[:600]


def _spread(demo: Path, base: Path) -> Path:
    """The demo's rings on four node directories: ranks 0..3 on n1..n4."""
    for rank, node in enumerate(NODES):
        d = base / node
        d.mkdir(parents=True)
        for suffix in ("ring", "meta.jsonl"):
            shutil.copy2(demo / "rings" / f"rank-{rank:05d}.{suffix}", d)
    return base


def _mpiexec(ring_base: Path, job_dir: Path, extra: list[str], per_node: dict[str, list[str]] | None = None,
             flags: list[str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    """mpiexec with one process per emulated node (MPMD: each gets its node name)."""
    cmd = [MPIEXEC, *(flags or [])]
    for i, node in enumerate(NODES):
        argv = (per_node or {}).get(node) or [str(BIN / "megatrace"), "collect", "--ring-dir", f"{ring_base}/%n",
                                              "--job-dir", str(job_dir), "--job-id", "77", "--no-system",
                                              "--group-size", "2", *extra]
        cmd += ([":"] if i else []) + ["-n", "1", "-env", "MEGATRACE_NODE_NAME", node, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@needs_mpi
def test_four_nodes_gather_every_ring_byte_for_byte_and_the_analysis_names_the_hung_rank(demo: Path,
                                                                                          tmp_path: Path) -> None:
    base = _spread(demo, tmp_path / "nodes")
    job = tmp_path / "job"
    job.mkdir()
    proc = _mpiexec(base, job, ["--trigger", "hang", "--timeout", "30", "--nodes", "n[1-4]", "--layout",
                                str(demo / "layout.yaml")])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bundle = job / "megatrace-77"
    doc = json.loads((bundle / "collection.json").read_text())
    assert doc["nodes"]["collected"] == NODES and doc["nodes"]["missing"] == []
    assert doc["ranks"] == {"world_size": 4, "collected": 4, "missing": [], "in_init_process_group": []}
    for rank, node in enumerate(NODES):
        for suffix in ("ring", "meta.jsonl"):
            name = f"rank-{rank:05d}.{suffix}"
            assert _sha(bundle / "rings" / name) == _sha(base / node / name), name
        facts = json.loads((bundle / "nodes" / f"{node}.json").read_text())
        assert facts["node"] == node and facts["rings"][0]["rank"] == rank
        assert str(facts["rings"][0]["pid"]) in facts["procs"]  # the demo's ranks are gone: alive False
    procs = json.loads((bundle / "procs.json").read_text())
    assert procs["outcome"] == "stalled" and set(procs["ranks"]) == {"0", "1", "2", "3"}
    findings = json.loads((bundle / "findings.json").read_text())
    assert findings["findings"][0]["subject"]["rank"] == HUNG_RANK, (findings["verdict"], _demo_verdict(demo))
    assert doc["analysis"]["verdict_finding"]["subject"]["rank"] == HUNG_RANK
    assert findings["trace"]["layout"]["dp"] == 2  # the layout given with --layout reached the analysis
    assert f"rank {HUNG_RANK}" in proc.stdout
    # a second collection of the same job does not overwrite the first
    proc = _mpiexec(base, job, ["--trigger", "end", "--timeout", "30", "--analysis", "none"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads((job / "megatrace-77.1" / "collection.json").read_text())["trigger"]["reason"] == "end"


@pytest.mark.slow
@needs_mpi
def test_a_node_that_dies_before_the_gather_is_named_missing_and_the_rest_is_analysed(demo: Path,
                                                                                    tmp_path: Path) -> None:
    base = _spread(demo, tmp_path / "nodes")
    job = tmp_path / "job"
    job.mkdir()
    # MPI rank 3 (node n4, a member of leader 2's group) joins MPI and crashes before sending anything.
    crash = [sys.executable, "-c", "import os; from mpi4py import MPI; os._exit(3)"]
    before = mpich_segments()
    proc = _mpiexec(base, job, ["--timeout", "8", "--nodes", "n[1-4]"], per_node={"n4": crash},
                    flags=["-disable-auto-cleanup"], timeout=60)
    # Three collectors facing a dead peer skip MPI_Finalize (MPICH's only removal of its start-up segment) and
    # share this host's: each unlinked what it had mapped after MPI_Init, so nothing stays in /dev/shm.
    assert mpich_segments() - before == set(), proc.stderr
    bundle = job / "megatrace-77"
    doc = json.loads((bundle / "collection.json").read_text())
    assert doc["nodes"]["collected"] == ["n1", "n2", "n3"], proc.stderr
    assert [m["node"] for m in doc["nodes"]["missing"]] == ["n4"]
    assert doc["mpi_ranks_missing"][0]["mpi_rank"] == 3
    assert doc["ranks"]["missing"] == [3]
    findings = json.loads((bundle / "findings.json").read_text())
    assert findings["trace"]["missing_ranks"] == [3]
    assert findings["findings"], "the three collected ranks are still analysed"


@pytest.mark.slow
@needs_mpi
def test_unreadable_linked_and_corrupt_inputs_are_reported_and_never_crash_the_collector(demo: Path,
                                                                                        tmp_path: Path) -> None:
    base = _spread(demo, tmp_path / "nodes")
    job = tmp_path / "job"
    job.mkdir()
    # n2: its ring directory is a symbolic link owned by a user: refused (the collector may run as root).
    os.rename(base / "n2", tmp_path / "n2-real")
    os.symlink(tmp_path / "n2-real", base / "n2")
    if os.geteuid() == 0:  # as a user, the link is already the user's own
        os.lchown(base / "n2", 4242, 4242)
    # n3: a truncated ring, a ring with a bad magic, and a link to a file outside.
    ring = base / "n3" / "rank-00002.ring"
    full = ring.read_bytes()
    ring.write_bytes(full[:len(full) // 3])
    (base / "n3" / "rank-00009.ring").write_bytes(b"garbage" * 100)
    secret = tmp_path / "secret"
    secret.write_text("root only")
    os.symlink(secret, base / "n3" / "rank-00010.meta.jsonl")
    if os.geteuid() == 0:  # another user's link (root's own links are followed)
        os.lchown(base / "n3" / "rank-00010.meta.jsonl", 4242, 4242)
    proc = _mpiexec(base, job, ["--timeout", "20"])
    assert proc.returncode in (0, 9) or "Traceback" not in proc.stderr, proc.stderr
    bundle = job / "megatrace-77"
    doc = json.loads((bundle / "collection.json").read_text())
    missing = {m["node"]: m["reason"] for m in doc["nodes"]["missing"]}
    assert "symbolic link" in missing["n2"], missing
    assert (bundle / "rings" / "rank-00002.ring").read_bytes() == full[:len(full) // 3]  # carried as it was
    assert (bundle / "rings" / "rank-00009.ring").read_bytes() == b"garbage" * 100
    assert not (bundle / "rings" / "rank-00010.meta.jsonl").exists()
    problems = "\n".join(doc["problems"])
    assert "truncated" in problems and "rank-00009.ring" in problems and "rank-00010.meta.jsonl" in problems
    assert doc["analysis"]["ran"] and "error" not in doc["analysis"], doc["analysis"]


@pytest.mark.slow
def test_local_collection_copies_this_nodes_rings_without_mpi(demo: Path, tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    opts = CollectOptions(job_dir=str(job), job_id="5", ring_dir=str(demo / "rings"), node="solo", trigger="end",
                          system=False, stacks=False, layout=str(demo / "layout.yaml"), analyse=analyze_bundle)
    doc = collect_local(opts)
    bundle = job / "megatrace-5"
    assert (bundle / "layout.yaml").read_bytes() == (demo / "layout.yaml").read_bytes()
    assert json.loads((bundle / "findings.json").read_text())["trace"]["layout"]["pp"] == 2
    for ring in (demo / "rings").iterdir():
        assert (bundle / "rings" / ring.name).read_bytes() == ring.read_bytes()
    assert doc["nodes"]["collected"] == ["solo"] and doc["ranks"]["collected"] == 4
    assert json.loads((bundle / "findings.json").read_text())["findings"][0]["subject"]["rank"] == HUNG_RANK


@pytest.mark.parametrize("command", ["collect", "agent"])
def test_help_lists_examples(command: str) -> None:
    from click.testing import CliRunner

    from megatrace.cli import main

    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0 and "Examples:" in result.output


@pytest.mark.slow
def test_local_runs_on_each_node_fill_one_bundle_and_the_last_one_finishes_it(demo: Path, tmp_path: Path) -> None:
    base = _spread(demo, tmp_path / "nodes")
    job = tmp_path / "job"
    job.mkdir()
    docs = []
    for node in NODES:  # one epilog per node, one after the other
        opts = CollectOptions(job_dir=str(job), job_id="8", ring_dir=str(base / node), node=node, trigger="end",
                              system=False, stacks=False, expected_nodes=NODES, analyse=analyze_bundle)
        docs.append(collect_local(opts))
    assert docs[0]["waiting_for"] == ["n2", "n3", "n4"] and "nodes" not in docs[2]
    final = docs[-1]
    assert final["nodes"]["collected"] == NODES and final["ranks"]["collected"] == 4
    assert json.loads((job / "megatrace-8" / "collection.json").read_text())["nodes"]["missing"] == []
    assert json.loads((job / "megatrace-8" / "findings.json").read_text())["findings"][0]["subject"]["rank"] \
        == HUNG_RANK
    # no node's run saw every ring: none wrote a tails pack (a quick load reads rings/), and none said it failed to
    assert not (job / "megatrace-8" / "tails.pack").exists() and final["transfer"]["tails_packed"] == 0
    assert not any("tails.pack" in p for p in final["problems"]), final["problems"]
    again = collect_local(CollectOptions(job_dir=str(job), job_id="8", ring_dir=str(base / "n1"), node="n1",
                                         system=False, stacks=False, expected_nodes=NODES, analyse=analyze_bundle))
    assert "nodes" not in again  # finished once; a late duplicate epilog adds nothing


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("transfer", ["auto", "stream"])
def test_eight_nodes_in_uneven_leader_groups_all_arrive(transfer: str, tmp_path: Path) -> None:
    """auto: every emulated node sees the job directory (one host), so each writes its own rings into the bundle
    and only facts and file lists go through MPI; stream: every byte through the root."""
    from megatrace.trace.ring_writer import RingIdentity, RingWriter

    nodes = [f"m{r}" for r in range(8)]
    for r, node in enumerate(nodes):
        w = RingWriter(tmp_path / node, RingIdentity(rank=r, world_size=8, job_id="s", host=node), capacity=64,
                       use_native=False)
        w.write_meta("group", gid=1, name="0", desc="default_pg", ranks=list(range(8)), backend="gloo")
        for i in range(20):
            w.complete(w.begin(1, 1, i + 1, 4))
        w.close()
    job = tmp_path / "job"
    job.mkdir()
    cmd = [MPIEXEC]
    for i, node in enumerate(nodes):  # groups of 3: leaders 0, 3, 6
        cmd += ([":"] if i else []) + ["-n", "1", "-env", "MEGATRACE_NODE_NAME", node, str(BIN / "megatrace"),
                                       "collect", "--ring-dir", f"{tmp_path}/%n", "--job-dir", str(job), "--job-id",
                                       "s", "--no-system", "--no-stacks", "--group-size", "3", "--timeout", "30",
                                       "--analysis", "none", "--transfer", transfer]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((job / "megatrace-s" / "collection.json").read_text())
    assert doc["nodes"]["collected"] == nodes and doc["ranks"]["collected"] == 8
    for r, node in enumerate(nodes):
        for name in (f"rank-{r:05d}.ring", f"rank-{r:05d}.meta.jsonl"):
            data = (tmp_path / node / name).read_bytes()
            assert (job / "megatrace-s" / "rings" / name).read_bytes() == data
            listed = [f for f in doc["files"] if f["name"] == f"rings/{name}"]
            assert listed == [{"name": f"rings/{name}", "node": node, "bytes": len(data),
                               "sha256": hashlib.sha256(data).hexdigest()}]
    ring_bytes = sum(f["bytes"] for f in doc["files"])
    moved = doc["transfer"]
    if transfer == "auto":
        assert moved["files_written_by_nodes"] == 16 and moved["bytes_written_by_nodes"] == ring_bytes, moved
        assert moved["bytes_through_root"] < ring_bytes, moved  # facts and file lists only
    else:
        assert moved["files_written_by_nodes"] == 0 and moved["files_written_by_root"] == 16, moved
        assert moved["bytes_through_root"] > 0, moved
    facts = json.loads((job / "megatrace-s" / "nodes" / "m5.json").read_text())
    assert facts["transfer"]["placed"] == (2 if transfer == "auto" else 0), facts["transfer"]
    # The gather carried every ring's tail and meta file: the root wrote them into one tails.pack, which a quick
    # load reads instead of the 16 files, and finds the very records the files hold.
    assert moved["tails_packed"] == 16, moved
    from megatrace.load.directory import QUICK_TAIL, load_trace

    bundle = job / "megatrace-s"
    packed = load_trace(bundle, tail=QUICK_TAIL)
    (bundle / "tails.pack").unlink()
    from_files = load_trace(bundle, tail=QUICK_TAIL)
    assert packed.records.seq.tolist() == from_files.records.seq.tolist() and len(packed.records.seq) == 160
    assert packed.rank_info == from_files.rank_info and packed.groups == from_files.groups


def test_a_local_collection_of_rings_claiming_two_billion_ranks_still_writes_collection_json(tmp_path: Path) -> None:
    """Issue 20, item 10: range(world) of a hostile header made collect --local die of MemoryError."""
    from megatrace.trace.ring_writer import RingIdentity, RingWriter

    rings = tmp_path / "rings"
    for rank in range(2):
        w = RingWriter(rings, RingIdentity(rank=rank, world_size=2**31 - 1, job_id="5"), capacity=128)
        w.complete(w.begin(1, 7, 1, 4))
        w.close()
    job = tmp_path / "job"
    job.mkdir()
    code = (f"from megatrace.collect.run import CollectOptions, collect_local\n"
            f"from megatrace.pipeline import analyze_bundle\n"
            f"collect_local(CollectOptions(job_dir={str(job)!r}, job_id='5', ring_dir={str(rings)!r}, node='solo',"
            f" trigger='end', system=False, stacks=False, analyse=analyze_bundle))\n"
            f"print({PEAK_KIB})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and int(done.stdout.split()[-1]) < 400_000, done.stderr[-2000:]
    doc = json.loads((job / "megatrace-5" / "collection.json").read_text())
    assert "world size 2147483647 is outside 1..1048576" in "\n".join(doc["problems"])


def _collector_pid(node: str) -> int | None:
    """The pid of the emulated node ``node``'s collector (its environment names the node)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if b"collect" in (d / "cmdline").read_bytes() and \
                    f"MEGATRACE_NODE_NAME={node}".encode() in (d / "environ").read_bytes().split(b"\0"):
                return int(d.name)
        except OSError:
            continue
    return None


@pytest.mark.slow
@needs_mpi
def test_a_leader_wedged_part_way_through_its_stream_is_named_and_leaves_no_partial_ring(tmp_path: Path) -> None:
    """SIGSTOP from outside on a group leader (n3) once the root has written the first bytes of its first large file:
    the root names it ("stopped part-way") and its member n4 missing at its deadline, removes the part it wrote,
    keeps what had arrived whole, and finishes the bundle; nothing waits for the stopped process."""
    import signal

    from helpers.outside import wait_for

    from megatrace.trace.ring_writer import RingIdentity, RingWriter

    for r, node in enumerate(NODES):
        w = RingWriter(tmp_path / "nodes" / node, RingIdentity(rank=r, world_size=4, job_id="w", host=node),
                       capacity=64, use_native=False)
        for i in range(20):
            w.complete(w.begin(1, 1, i + 1, 4))
        w.close()
    for k in range(1, 5):  # 128 MiB that do not compress: eight 16 MiB chunks, seconds through the root
        (tmp_path / "nodes" / "n3" / f"rank-00002.ring.{k}").write_bytes(os.urandom(32 << 20))
    job = tmp_path / "job"
    job.mkdir()
    cmd = [MPIEXEC, "-disable-auto-cleanup"]
    for i, node in enumerate(NODES):
        cmd += ([":"] if i else []) + ["-n", "1", "-env", "MEGATRACE_NODE_NAME", node, str(BIN / "megatrace"),
                                       "collect", "--ring-dir", f"{tmp_path}/nodes/%n", "--job-dir", str(job),
                                       "--job-id", "w", "--no-system", "--no-stacks", "--group-size", "2",
                                       "--timeout", "20", "--analysis", "none", "--transfer", "stream"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    bundle = job / "megatrace-w"
    stopped = None
    try:
        wedged = wait_for(lambda: _collector_pid("n3"), 60, step=0.05, awaited="n3's collector to start")
        # (the root writes a streamed file under a hidden name, and gives it its own once whole)
        wait_for(lambda: any(p.name.startswith(".incoming.") and p.name.endswith(".rank-00002.ring.1")
                             for p in (bundle / "rings").iterdir()) if (bundle / "rings").exists() else False,
                 60, step=0.01, awaited="the root to write the first bytes of n3's first large file")
        os.kill(wedged, signal.SIGSTOP)
        stopped = wedged
        wait_for(lambda: (bundle / "collection.json").exists(), 60, step=0.1,
                 awaited="the root to finish the bundle without n3 and n4")
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    doc = json.loads((bundle / "collection.json").read_text())
    assert doc["nodes"]["collected"] == ["n1", "n2"], (doc["nodes"], err[-2000:])
    missing = {m["node"]: m["reason"] for m in doc["nodes"]["missing"]}
    assert "stopped part-way" in missing["n3"] or "cut" in missing["n3"], missing
    # n3's own ring and meta file came whole before its large files: kept (nothing lost); the file it was cut in
    # is gone, the others never started
    assert doc["ranks"]["collected"] == 3 and doc["ranks"]["missing"] == [3], doc["ranks"]
    left = sorted(p.name for p in (bundle / "rings").iterdir())
    assert left == [f"rank-{r:05d}.{s}" for r in range(3) for s in ("meta.jsonl", "ring")], left
    assert any("rank-00002.ring.1" in p and "did not arrive whole" in p for p in doc["problems"]), doc["problems"]
    for r, node in enumerate(NODES[:3]):
        name = f"rank-{r:05d}.ring"
        assert (bundle / "rings" / name).read_bytes() == (tmp_path / "nodes" / node / name).read_bytes()


@needs_mpi
def test_a_collector_whose_mpi_start_up_never_returns_gives_up_after_half_its_timeout(tmp_path: Path) -> None:
    """MPI_Init waiting on a process manager that never answers (a PMI socket nobody serves: MPICH's own client
    sends its first request and blocks for the reply) ends the collector after half of --timeout, with status 1
    and its stack on stderr, instead of at its step's time limit minutes later (the hang's report with it)."""
    import socket
    import time

    server, client = socket.socketpair()
    env = {**os.environ, "PMI_FD": str(client.fileno()), "PMI_RANK": "0", "PMI_SIZE": "2"}
    job = tmp_path / "job"
    job.mkdir()
    t0 = time.monotonic()
    with server, client:
        proc = subprocess.run([str(BIN / "megatrace"), "collect", "--job-dir", str(job), "--job-id", "7",
                               "--timeout", "8", "--no-system"], env=env, pass_fds=(client.fileno(),),
                              capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        server.settimeout(5)
        asked = server.recv(200)
    assert asked.startswith(b"cmd=init"), asked  # the real MPI_Init, talking to the process manager
    assert proc.returncode == 1 and 4.0 <= took < 40, (proc.returncode, took, proc.stderr[-2000:])
    assert "Timeout (0:00:04)!" in proc.stderr and "in _import_mpi" in proc.stderr, proc.stderr[-2000:]
    assert not list(job.iterdir())  # nothing half-written
