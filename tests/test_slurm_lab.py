"""The SPANK plugin, prolog and epilog against real Slurm daemons: the local lab (4 virtual nodes).

A session fixture runs ``megatrace lab up`` (or reuses a lab that is up); every
test submits real jobs and waits for them with timeouts. The last test brings
the lab down and checks that no daemon it started is left.

Without root (a developer machine) these tests skip, unless CI is set: then they fail.
"""

from __future__ import annotations

import calendar
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.outside import wait_for
from helpers.slurm_lab import PYTHON, job_info, sbatch, submit
from helpers.slurm_lab import clean_env as _clean_env
from helpers.slurm_lab import run as _run

MEGATRACE = str(Path(sys.executable).parent / "megatrace")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}
TEST_USER = "mtlabuser"
FAIL_FILE = Path("/etc/megatrace/fail-preflight-n2")


# The `lab` fixture (a session fixture: `megatrace lab up`, or the lab that is up) is in tests/conftest.py;
# submitting jobs (sbatch, submit, job_info) in tests/helpers/slurm_lab.py.


def wait_job(job_id: str, timeout: float = 180) -> dict[str, str]:
    """Until the job is finished and its epilogs are done (not COMPLETING)."""
    info: dict[str, str] = {}

    def finished() -> bool:
        nonlocal info
        info = job_info(job_id)
        # Epilogs of every node are done once no node is still completing this job.
        return (info.get("JobState") in TERMINAL and "COMPLETING" not in info.get("Reason", "")
                and not _run(["squeue", "-h", "-j", job_id, "-t", "CG"]).stdout.strip())

    if wait_for(finished, timeout, step=0.5):
        return info
    _run(["scancel", job_id])
    raise AssertionError(f"job {job_id} not finished after {timeout:g} s: {info}")


def output(cwd: Path, job_id: str) -> str:
    return (cwd / f"out-{job_id}.txt").read_text()


def node_state(node: str) -> tuple[str, str]:
    out = _run(["sinfo", "-h", "-N", "-n", node, "-o", "%T|%E"]).stdout.strip().splitlines()
    state, _, reason = out[0].partition("|")
    return state, reason


# -- the option ------------------------------------------------------------------------------

def test_sbatch_help_lists_the_megatrace_option(lab):
    for tool in ("sbatch", "salloc", "srun"):
        out = _run([tool, "--help"]).stdout
        assert "--megatrace" in out, tool
        assert "hang-timeout=SECONDS" in out and "on-hang=report|cancel|requeue" in out


def test_a_malformed_option_is_rejected_at_submission_with_a_clear_message(lab, tmp_path):
    proc = sbatch("true\n", tmp_path, "--megatrace=bogus=1")
    assert proc.returncode != 0 and not proc.stdout.strip()
    assert "megatrace: invalid --megatrace=bogus=1: unknown key 'bogus'" in proc.stderr
    assert "hang-timeout, dir, on-hang, check" in proc.stderr
    proc = sbatch("true\n", tmp_path, "--megatrace=on-hang=explode")
    assert proc.returncode != 0 and "on-hang=explode: want report, cancel or requeue" in proc.stderr


# -- tracing every task ------------------------------------------------------------------------

TORCH_STEP = f"""export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
env | grep '^MEGATRACE' | sort | sed 's/^/batch: /'
srun {PYTHON} -c '
import os, torch, torch.distributed as dist
dist.init_process_group("gloo", rank=int(os.environ["SLURM_PROCID"]), world_size=int(os.environ["SLURM_NTASKS"]))
t = torch.ones(1); dist.all_reduce(t); dist.barrier()
print("task", os.environ["SLURM_PROCID"], os.environ["SLURMD_NODENAME"], os.environ.get("MEGATRACE_DIR"), t.item())
dist.destroy_process_group()'
"""


@pytest.mark.slow
def test_a_traced_job_writes_every_tasks_ring_into_the_job_dir(lab, tmp_path):
    from megatrace.trace.ring_reader import read_ring

    job = submit(TORCH_STEP, tmp_path, "--megatrace=hang-timeout=120,check=quick", "-N4", "-n4")
    info = wait_job(job, timeout=240)
    text = output(tmp_path, job)
    assert info["JobState"] == "COMPLETED", text
    assert "batch: MEGATRACE_ENABLE=1" in text and "batch: MEGATRACE_HANG_TIMEOUT=120" in text
    assert f"batch: MEGATRACE_OUT_DIR={tmp_path}/megatrace-{job}" in text
    tasks = [line.split() for line in text.splitlines() if line.startswith("task ")]
    assert sorted(t[2] for t in tasks) == ["n1", "n2", "n3", "n4"]
    for _, rank, node, ring_dir, total in tasks:
        assert ring_dir == f"/dev/shm/megatrace/job-{job}.{node}/step-0" and float(total) == 4.0
    rings = sorted((tmp_path / f"megatrace-{job}" / "step-0" / "rings").glob("rank-*.ring"))
    assert [p.name for p in rings] == [f"rank-{r:05d}.ring" for r in range(4)]
    headers = [read_ring(p).header for p in rings]
    assert [h.rank for h in headers] == [0, 1, 2, 3]
    assert {h.world_size for h in headers} == {4}
    assert {h.job_id for h in headers} == {job} and {h.step_id for h in headers} == {"0"}
    assert sorted(h.host for h in headers) == ["n1", "n2", "n3", "n4"]
    # The prolog started an agent on every node (when this megatrace has one); the epilog kept its
    # log, cleaned the node-local copies and stopped the agents.
    if _run([MEGATRACE, "agent", "--help"]).returncode == 0:
        logs = sorted(p.name for p in (tmp_path / f"megatrace-{job}").glob("agent-*.log"))
        assert logs == [f"agent-n{i}.log" for i in range(1, 5)], logs
        first = (tmp_path / f"megatrace-{job}" / "agent-n1.log").read_text().splitlines()[0]
        stamp = calendar.timegm(time.strptime(first.split(" ", 1)[0], "%Y-%m-%dT%H:%M:%SZ"))
        assert abs(stamp - time.time()) < 600 and " agent n1: watching " in first, first  # (UTC time first)
    assert not list(Path("/dev/shm/megatrace").glob(f"job-{job}.*"))
    assert not list(Path("/run/megatrace").glob(f"agent-{job}.*"))
    assert not agents_of(job)


def agents_of(job: str) -> list[int]:
    """Pids of `megatrace agent --job-id JOB` processes still running."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"agent" in argv and b"--job-id" in argv and argv[argv.index(b"--job-id") + 1] == job.encode():
            pids.append(int(proc.name))
    return pids


def test_a_job_without_the_option_gets_no_tracer_environment(lab, tmp_path):
    job = submit("env | grep -c '^MEGATRACE' || true\nsrun -N2 -n2 bash -c 'env | grep -c ^MEGATRACE || true'\n",
                 tmp_path, "-N2")
    info = wait_job(job)
    assert info["JobState"] == "COMPLETED"
    assert output(tmp_path, job).split() == ["0", "0", "0"]
    assert not (tmp_path / f"megatrace-{job}").exists()


def test_megatrace_1_at_submission_traces_the_job(lab, tmp_path):
    job = submit("srun -N2 -n2 bash -c 'echo $MEGATRACE_ENABLE $MEGATRACE_JOB_ID $MEGATRACE_STEP_ID'\n",
                 tmp_path, "-N2", env=_clean_env(MEGATRACE="1"))
    wait_job(job)
    assert output(tmp_path, job).splitlines() == [f"1 {job} 0"] * 2
    assert (tmp_path / f"megatrace-{job}").is_dir()
    job = submit("srun bash -c 'echo $MEGATRACE_HANG_TIMEOUT $MEGATRACE_ON_HANG'\n", tmp_path,
                 env=_clean_env(MEGATRACE_OPTS="hang-timeout=77,on-hang=cancel"))
    wait_job(job)
    assert output(tmp_path, job).split() == ["77", "cancel"]


def test_megatrace_1_only_in_the_jobs_environment_still_traces_and_collects(lab, tmp_path):
    """As through slurmrestd: sbatch (and its plugin) never sees MEGATRACE, only the job does."""
    script = ("srun -N2 -n2 bash -c 'mkdir -p $MEGATRACE_DIR && echo x > $MEGATRACE_DIR/rank-0000$SLURM_PROCID.ring"
              " && echo $MEGATRACE_ENABLE'\n")
    job = submit(script, tmp_path, "-N2", "--export=ALL,MEGATRACE=1")
    wait_job(job)
    assert output(tmp_path, job).split() == ["1", "1"]
    rings = tmp_path / f"megatrace-{job}" / "step-0" / "rings"
    assert sorted(p.name for p in rings.iterdir()) == ["rank-00000.ring", "rank-00001.ring"]


# -- prolog: preflight, drain, requeue --------------------------------------------------------

def test_a_failed_preflight_drains_the_node_and_the_job_runs_on_the_others(lab, tmp_path):
    FAIL_FILE.parent.mkdir(parents=True, exist_ok=True)
    FAIL_FILE.write_text("drill: injected by the test suite\n")
    os.chmod(FAIL_FILE, 0o644)
    try:
        job = submit("srun bash -c 'echo $SLURMD_NODENAME'\n", tmp_path, "--megatrace", "-N3")
        wait_for(lambda: "drain" in node_state("n2")[0], timeout=60)  # (a timeout fails below)
        state, reason = node_state("n2")
        # the check's own reason (MEGATRACE_CHECK_REASON_FILE), not the prolog's fallback
        assert "drain" in state and reason.startswith("megatrace: drill: injected by the test suite"), (state, reason)
        wait_for(lambda: int(job_info(job).get("Restarts", 0)) >= 1, timeout=60)  # (a timeout fails below)
        assert int(job_info(job)["Restarts"]) >= 1, job_info(job)

        # Slurm holds a requeued job back for two minutes (Reason=BeginTime, set once the requeue
        # is done, a moment after Restarts counts it); the lab need not wait.
        def started() -> bool:
            info = job_info(job)
            if info.get("JobState") == "RUNNING" or info.get("JobState") in TERMINAL:
                return True
            if info.get("Reason") == "BeginTime":
                _run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
            return False

        wait_for(started, timeout=60, step=1)  # (a timeout fails in wait_job below)
        info = wait_job(job, timeout=120)
        assert info["JobState"] == "COMPLETED", info
        assert sorted(output(tmp_path, job).split()) == ["n1", "n3", "n4"]
    finally:
        FAIL_FILE.unlink(missing_ok=True)
        _run(["scontrol", "update", "NodeName=n2", "State=RESUME"])
    assert "drain" not in node_state("n2")[0]


def test_srun_n4_megatrace_check_prints_one_table_and_names_the_slow_node(lab, tmp_path):
    """The whole allocation checked at once, every probe at the default level; n3 made slow in the network
    test by a root-owned site file."""
    slow = FAIL_FILE.with_name("slow-net-n3")
    slow.write_text("50\n")  # ms before each message n3 sends
    os.chmod(slow, 0o644)
    env = {**os.environ, "MEGATRACE_THRESHOLDS": str(FAIL_FILE.with_name("thresholds.yaml"))}  # the lab's limits
    try:
        done = _run(["srun", "-N4", "--ntasks-per-node=1", "--mpi=pmi2", "--chdir", str(tmp_path),
                     str(Path(sys.executable).parent / "megatrace-check"),
                     "--json", str(tmp_path / "check.json"), "--timeout", "120"], timeout=180, env=env)
    finally:
        slow.unlink(missing_ok=True)
    assert done.returncode == 4, done.stdout + done.stderr  # exit 4: a failure (docs/check.md)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("FAIL n3") and "net.node" in lines[0], done.stdout
    assert sum(line.startswith("verdict: fail (4 node(s)") for line in lines) == 1, done.stdout
    head = next(i for i, line in enumerate(lines) if line.startswith("node "))  # the node x check grid
    assert lines[head].split()[:2] == ["node", "verdict"] and lines[head].split()[-1] == "network", done.stdout
    assert [line.split()[:2] + line.split()[-1:] for line in lines[head + 1:head + 5]] == [
        ["n3", "FAIL", "FAIL"], ["n1", "OK", "ok"], ["n2", "OK", "ok"], ["n4", "OK", "ok"]], done.stdout
    doc = json.loads((tmp_path / "check.json").read_text())
    assert doc["nodes"] == ["n1", "n2", "n3", "n4"] and doc["exit_code"] == 4
    rows = [sorted(v for v in row if v is not None)[1] for row in doc["matrix"]["bandwidth_gbps"]]  # row medians
    assert min(rows) == rows[2] and rows[2] < 0.5 * sorted(rows)[2], rows
    assert [r["subject"]["node"] for r in doc["results"] if r["status"] == "fail"] == ["n3"]


def webhook_receiver():
    """A loopback HTTP server that keeps every JSON alert POSTed to it: (server, the alerts so far)."""
    from http.server import BaseHTTPRequestHandler, HTTPServer
    import threading

    got: list[dict] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, got


def test_the_health_check_drains_a_failing_node_alerts_once_and_resumes_it(lab, tmp_path):
    """megatrace health, run as slurmd runs a HealthCheckProgram (root, on the node), against the real slurmctld."""
    server, got = webhook_receiver()
    alerts = tmp_path / "alerts.yaml"
    alerts.write_text(f"webhook: {{url: 'http://127.0.0.1:{server.server_address[1]}/hook'}}\n")
    fail = FAIL_FILE.with_name("fail-preflight-n4")
    env = _clean_env(MEGATRACE_HISTORY=str(tmp_path / "history.db"), MEGATRACE_ALERTS=str(alerts),
                     MEGATRACE_THRESHOLDS="/etc/megatrace/thresholds.yaml")
    health = [MEGATRACE, "health", "--node", "n4", "--resume-after", "2"]
    # slurmd's own HealthCheckProgram (every 300 s, and when slurmd starts) must judge from the same history:
    # with one of its own, which never saw the drill, a run of it after the file is removed resumes n4 early.
    site = Path("/etc/megatrace/slurm.conf")
    site_text = site.read_text()
    site.write_text(site_text.replace("HEALTH_ARGS=", f"HEALTH_ARGS=--history {tmp_path}/history.db ", 1))
    try:
        fail.write_text("drill: health check\n")
        os.chmod(fail, 0o644)
        first = _run(health, env=env)
        assert first.returncode == 4 and "drained: megatrace:" in first.stdout, first.stdout + first.stderr
        state, reason = node_state("n4")
        assert "drain" in state and reason.startswith("megatrace:") and "drill: health check" in reason
        again = _run(health, env=env)  # the next interval: still failing, already drained, no second alert
        assert again.returncode == 4 and "alert" not in again.stdout
        assert len(got) == 1 and got[0]["key"] == "n4:node.injected" and got[0]["level"] == "P2", got
        fail.unlink()
        once = _run(health, env=env)
        assert once.returncode == 0 and "drain" in node_state("n4")[0]  # one pass is not enough
        twice = _run(health, env=env)
        assert "returned to service" in twice.stdout, twice.stdout + twice.stderr
        assert "drain" not in node_state("n4")[0]
        # A node drained by someone else stays drained, however healthy it is.
        _run(["scontrol", "update", "NodeName=n4", "State=DRAIN", "Reason=ticket 4711"])
        for _ in range(3):
            assert _run(health, env=env).returncode == 0
        assert node_state("n4")[1].startswith("ticket 4711")
        nodes = _run([MEGATRACE, "nodes"], env=env)
        assert nodes.returncode == 0 and "n4" in nodes.stdout and "drill: health check" in nodes.stdout
    finally:
        fail.unlink(missing_ok=True)
        site.write_text(site_text)
        server.shutdown()
        _run(["scontrol", "update", "NodeName=n4", "State=RESUME"])


@pytest.mark.slow
def test_slurmd_runs_the_health_check_each_interval_drains_alerts_once_and_resumes(lab, tmp_path):
    """The lab's slurm.conf names slurm/healthcheck as HealthCheckProgram; here with a 10 s interval."""
    server, got = webhook_receiver()
    alerts = Path("/etc/megatrace/alerts.yaml")
    alerts.write_text(f"webhook: {{url: 'http://127.0.0.1:{server.server_address[1]}/hook'}}\n")
    fail = FAIL_FILE.with_name("fail-preflight-n3")
    interval = 10
    try:
        proc = _run([MEGATRACE, "lab", "up", "--nodes", "4", "--skip-install", "--health-interval", str(interval)],
                    timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert f"HealthCheckInterval={interval}" in Path("/etc/slurm/slurm.conf").read_text()
        # A history of its own: an alert sent by an earlier run on this machine would still be deduplicated.
        site = Path("/etc/megatrace/slurm.conf")
        site.write_text(site.read_text().replace("HEALTH_ARGS=", f"HEALTH_ARGS=--history {tmp_path}/history.db ", 1))
        # Inject only once a check has run with that history: one that read the site config before the change
        # but saw the failure would alert from the default history too (two alerts, from two histories).
        assert wait_for(lambda: (tmp_path / "history.db").exists(), timeout=3 * interval)
        fail.write_text("drill: slurmd health check\n")
        os.chmod(fail, 0o644)
        injected = time.monotonic()
        assert wait_for(lambda: "drain" in node_state("n3")[0], timeout=3 * interval), node_state("n3")
        assert time.monotonic() - injected <= interval + 10  # one interval, plus the check's own run time
        assert node_state("n3")[1].startswith("megatrace:") and "slurmd health check" in node_state("n3")[1]
        time.sleep(2 * interval)  # a duration, not a wait (nothing is to arrive): two more failing checks, one alert
        assert len(got) == 1 and got[0]["key"] == "n3:node.injected", got
        fail.unlink()
        assert wait_for(lambda: "drain" not in node_state("n3")[0], timeout=4 * interval), node_state("n3")
        nodes = _run([MEGATRACE, "nodes", "--history", str(tmp_path / "history.db")])
        assert "n3" in nodes.stdout and "slurmd health check" in nodes.stdout, nodes.stdout
    finally:
        fail.unlink(missing_ok=True)
        alerts.unlink(missing_ok=True)
        server.shutdown()
        _run([MEGATRACE, "lab", "up", "--nodes", "4", "--skip-install"], timeout=120)  # the default interval, site conf
        _run(["scontrol", "update", "NodeName=n3", "State=RESUME"])


# -- an ordinary user --------------------------------------------------------------------------

def _ordinary_user(name: str) -> pwd.struct_passwd:
    """The account ``name``, made (no home, a shell) when it does not exist yet."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        proc = _run(["useradd", "--system", "--no-create-home", "--shell", "/bin/bash", name])
        assert proc.returncode == 0, proc.stderr
        return pwd.getpwnam(name)


@pytest.fixture(scope="module")
def test_user() -> pwd.struct_passwd:
    return _ordinary_user(TEST_USER)


@pytest.fixture
def user_dir(test_user):
    """A directory the test user owns (pytest's tmp_path is private to root); kept afterwards, to look into a job,
    with MEGATRACE_TEST_KEEP=1."""
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="megatrace-slurm-test-", dir="/tmp"))
    os.chown(work, test_user.pw_uid, test_user.pw_gid)
    yield work
    if not os.environ.get("MEGATRACE_TEST_KEEP"):
        shutil.rmtree(work, ignore_errors=True)


def test_a_users_job_dir_and_rings_belong_to_that_user(lab, test_user, user_dir):
    work = user_dir
    job = submit("srun -N2 -n2 bash -c 'mkdir -p $MEGATRACE_DIR && echo x > $MEGATRACE_DIR/rank-0000$SLURM_PROCID.ring'\n",
                 work, "--megatrace", "-N2", user=TEST_USER)
    info = wait_job(job)
    assert info["JobState"] == "COMPLETED", output(work, job)
    assert info["UserId"].startswith(TEST_USER)
    bundle = work / f"megatrace-{job}"
    owned = [bundle, *bundle.rglob("*")]
    assert len(owned) >= 4  # the dir, step-0, rings/, two rings
    assert {p.stat().st_uid for p in owned} == {test_user.pw_uid}
    assert sorted(p.name for p in (bundle / "step-0" / "rings").iterdir()) == ["rank-00000.ring",
                                                                               "rank-00001.ring"]


def test_a_failure_file_a_user_planted_is_ignored(lab, test_user, user_dir):
    from megatrace.check.host import read_injected

    planted = user_dir / "fail-preflight-n1"
    assert _run(["runuser", "-u", TEST_USER, "--", "touch", str(planted)]).returncode == 0
    result = read_injected("n1", user_dir)
    assert result is not None and "ignored" in result and "text" not in result


def test_an_unwritable_job_dir_falls_back_and_says_so(lab, test_user, user_dir):
    work = user_dir
    locked = work / "locked"  # root's, not writable by the user
    locked.mkdir(mode=0o755)
    job = submit("echo out=$MEGATRACE_OUT_DIR\n", work, f"--megatrace=dir={locked}/trace", user=TEST_USER)
    wait_job(job)
    text = output(work, job)
    fallback = Path(f"/var/tmp/megatrace/{test_user.pw_uid}/megatrace-{job}")  # in the user's own, made by root
    assert f"out={fallback}" in text
    assert f"megatrace: job directory {locked}/trace cannot be created: using {fallback}" in text
    assert fallback.stat().st_uid == test_user.pw_uid and fallback.stat().st_mode & 0o777 == 0o700
    assert fallback.parent.stat().st_uid == test_user.pw_uid and fallback.parent.stat().st_mode & 0o777 == 0o700
    shutil.rmtree(fallback, ignore_errors=True)


# -- two ordinary users on one node: the attacks of issue 20 ----------------------------------
# The victim is TEST_USER, the attacker a second ordinary user (made the same way). Each attack runs
# with fs.protected_symlinks 0 and 1: the fixes must not depend on it (the original report planted its
# links in directories that are not sticky, where the default 1 does not help anyway).

ATTACKER = "mtlabuser2"
SHM_BASE = Path("/dev/shm/megatrace")
FALLBACK_BASE = Path("/var/tmp/megatrace")


@pytest.fixture(scope="module")
def attacker() -> pwd.struct_passwd:
    return _ordinary_user(ATTACKER)


@pytest.fixture(params=[0, 1], ids=["protected_symlinks=0", "protected_symlinks=1"])
def protected_symlinks(request):
    """fs.protected_symlinks set for the test, the machine's own value restored after it."""
    knob = Path("/proc/sys/fs/protected_symlinks")
    old = knob.read_text().strip()
    knob.write_text(f"{request.param}\n")
    yield request.param
    knob.write_text(f"{old}\n")


USER_PYTHON = "/usr/bin/python3"  # the ordinary users cannot run this venv's interpreter (root's home)


@pytest.fixture(scope="module")
def user_pkg():
    """A copy of the megatrace package every user can import with the system Python (stdlib parts only)."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="megatrace-pkg-", dir="/tmp"))
    shutil.copytree(Path(__file__).resolve().parent.parent / "megatrace", root / "megatrace",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    if not Path(USER_PYTHON).exists():
        pytest.skip(f"no {USER_PYTHON} for the ordinary users")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def shared_dir():
    """A sticky directory every user may create in, like /tmp or a scratch area."""
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="megatrace-shared-", dir="/tmp"))
    work.chmod(0o1777)
    yield work
    shutil.rmtree(work, ignore_errors=True)


def _as(user: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
    return _run(["runuser", "-u", user, "--", *argv], **kw)


def _product_bases(work: Path) -> None:
    """The ring and fallback bases as the plugin and prolog make them (a traced job makes them when absent)."""
    if not (SHM_BASE.is_dir() and FALLBACK_BASE.is_dir()):
        wait_job(submit("srun true\n", work, "--megatrace=check=off", "-N1"))


def _victims_file(user_dir: Path, test_user: pwd.struct_passwd) -> Path:
    """A file of the victim's that the attacker picks as the target of a planted link."""
    notes = user_dir / "notes"
    notes.write_text("victim's notes\n")
    os.chown(notes, test_user.pw_uid, test_user.pw_gid)
    notes.chmod(0o600)
    return notes


# The attacker's loop: keep making the victim's node directory (and step-0) first, world-writable, with the
# victim's meta file as a link to a file of the victim's; read whatever appears in it. Runs until STOP exists;
# makes STOP.running first, when it starts.
ATTACK_LOOP = r"""
import os, sys, time
node_dir, target, stop = sys.argv[1], sys.argv[2], sys.argv[3]
made, seen = 0, []
open(stop + ".running", "w").close()
while not os.path.exists(stop):
    for d in (node_dir, node_dir + "/step-0"):
        try:
            os.mkdir(d, 0o777)
            os.chmod(d, 0o777)
            made += 1
        except OSError:
            pass
        try:
            os.symlink(target, d + "/rank-00000.meta.jsonl")
        except OSError:
            pass
    for root, _, files in os.walk(node_dir):
        for f in files:
            try:
                with open(os.path.join(root, f), "rb") as fh:
                    if fh.read(1):
                        seen.append(os.path.join(root, f))
            except OSError:
                pass
    time.sleep(0.001)
print(made, len(set(seen)), sorted(set(seen))[:5], flush=True)
"""

# One rank of a traced job as the tracer starts it: the settings the plugin gave the task, the real RingWriter
# (a directory it does not accept turns tracing off; the job goes on). System Python: see USER_PYTHON.
TRACER_STEP = """srun -N1 -n1 env PYTHONPATH={pkg} {python} -c '
from megatrace.trace.settings import TracerSettings
from megatrace.trace.ring_writer import RingIdentity, RingWriter
s = TracerSettings.from_env()
try:
    w = RingWriter(s.directory, RingIdentity(rank=0, world_size=1, job_id=s.job_id, step_id=s.step_id))
    w.write_meta("env", vars={{"NCCL_DEBUG": "INFO"}})
    w.complete(w.begin(1, 1, 1, 4))
    w.close()
    print("traced into", s.directory)
except OSError as exc:
    print("not traced:", exc)
print("trained")'
"""


def _owned_by(root: Path, uid: int) -> list[Path]:
    return [p for p in [root, *root.rglob("*")] if p.lstat().st_uid == uid] if root.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("base_mode", [0o755, 0o1777], ids=["base-0755", "old-base-1777"])
def test_another_user_racing_the_prolog_for_the_node_directory_gets_nothing_of_the_victims(
        lab, test_user, attacker, user_dir, user_pkg, protected_symlinks, base_mode):
    """Item 1: the attacker's loop runs while the victim's prolog makes the node directory. The base is root's
    0755 (as the plugin and prolog make it now: nobody else can make a name in it) or an old 1777 one."""
    target = _victims_file(user_dir, test_user)
    _product_bases(user_dir)
    product_mode = SHM_BASE.stat().st_mode & 0o7777
    if base_mode == 0o755:
        assert (SHM_BASE.stat().st_uid, product_mode) == (0, 0o755)  # as the plugin and prolog make it
    SHM_BASE.chmod(base_mode)
    stop = Path(f"/tmp/megatrace-attack-stop-{os.getpid()}")
    running = Path(f"{stop}.running")
    running.unlink(missing_ok=True)
    job = submit(TRACER_STEP.format(pkg=user_pkg, python=USER_PYTHON), user_dir, "--megatrace=check=off", "-N1",
                 "-w", "n1", "--hold", user=TEST_USER)
    node_dir = SHM_BASE / f"job-{job}.n1"
    loop = subprocess.Popen(["runuser", "-u", ATTACKER, "--", USER_PYTHON, "-c", ATTACK_LOOP, str(node_dir),
                             str(target), str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        wait_for(running.exists, timeout=30, step=0.05)  # the loop is running (a timeout fails below)
        _run(["scontrol", "release", job])
        info = wait_job(job, timeout=180)
    finally:
        stop.touch()
        said = loop.communicate(timeout=60)[0]
        stop.unlink()
        running.unlink(missing_ok=True)
        SHM_BASE.chmod(product_mode)
    made, reads = said.split()[:2]
    text = output(user_dir, job)
    assert info["JobState"] == "COMPLETED" and "trained" in text, text  # traced or not, training went on
    assert target.read_text() == "victim's notes\n"  # nothing written through the planted link
    assert reads == "0", f"the attacker read the victim's files: {said}"
    if base_mode == 0o755:  # nobody but root can make a name in the base: the attack cannot even start
        assert made == "0" and "traced into" in text, (said, text)
        rings = user_dir / f"megatrace-{job}" / "step-0" / "rings"
        assert sorted(p.name for p in rings.iterdir()) == ["rank-00000.meta.jsonl", "rank-00000.ring"]
        for p in rings.iterdir():
            st = p.stat()
            assert st.st_uid == test_user.pw_uid and st.st_mode & 0o777 == 0o600, (p, oct(st.st_mode))
    # Whoever won, nothing of the victim's lies in a directory of the attacker's.
    for d in SHM_BASE.glob(f"job-{job}.*"):
        if d.lstat().st_uid == attacker.pw_uid:
            assert not _owned_by(d, test_user.pw_uid), list(d.rglob("*"))
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
def test_a_job_directory_and_fallback_another_user_planted_are_never_used(
        lab, test_user, attacker, user_dir, shared_dir, protected_symlinks):
    """Item 3: the attacker makes the victim's job directory (in a shared sticky directory) and the old fallback
    name first, world-writable, with .agents/exits/<node> as a link to a file of the victim's."""
    target = _victims_file(user_dir, test_user)
    work = shared_dir / "victim"
    work.mkdir()
    os.chown(work, test_user.pw_uid, test_user.pw_gid)
    script = ("echo out=$MEGATRACE_OUT_DIR\n"
              "srun -N1 -n1 bash -c 'mkdir -p $MEGATRACE_DIR && echo x > $MEGATRACE_DIR/rank-00000.ring'\n")
    job = submit(script, work, f"--megatrace=dir={shared_dir}/megatrace-run", "-N1", "-w", "n1", "--hold",
                 user=TEST_USER)
    _product_bases(work)
    planted = [shared_dir / "megatrace-run", FALLBACK_BASE / f"megatrace-{job}",
               FALLBACK_BASE / str(test_user.pw_uid)]
    plant = ("import os, sys\nfor d in sys.argv[2:]:\n    try:\n        os.makedirs(d + '/.agents/exits', 0o777)\n"
             "        for x in (d, d + '/.agents', d + '/.agents/exits'): os.chmod(x, 0o777)\n"
             "        os.symlink(sys.argv[1], d + '/.agents/exits/n1'); print('planted', d)\n"
             "    except OSError as e: print('refused', d, e.strerror)\n")
    done = _as(ATTACKER, [USER_PYTHON, "-c", plant, str(target), *map(str, planted)])
    assert f"planted {planted[0]}" in done.stdout, done.stdout + done.stderr
    assert f"refused {planted[2]}" in done.stdout  # the fallback base is root's 0755: no name of the attacker's
    try:
        _run(["scontrol", "release", job])
        info = wait_job(job)
        text = output(work, job)
        assert info["JobState"] == "COMPLETED", text
        fallback = FALLBACK_BASE / str(test_user.pw_uid) / f"megatrace-{job}"
        assert f"out={fallback}" in text and f"job directory {planted[0]} belongs to another user" in text, text
        assert target.read_text() == "victim's notes\n"
        for d in planted[:2]:
            assert not _owned_by(d, test_user.pw_uid), f"the victim wrote into the attacker's {d}"
        assert (fallback / "step-0" / "rings" / "rank-00000.ring").exists()
        assert {p.lstat().st_uid for p in [fallback, *fallback.rglob("*")]} == {test_user.pw_uid}
        assert fallback.stat().st_mode & 0o777 == 0o700
    finally:
        for d in planted[:2]:
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(FALLBACK_BASE / str(test_user.pw_uid) / f"megatrace-{job}", ignore_errors=True)


@pytest.mark.slow
def test_an_untraced_jobs_epilog_never_copies_a_node_directory_another_user_planted(
        lab, test_user, attacker, user_dir, protected_symlinks):
    """Item 4: in an old 1777 base the attacker makes job-<id>.<node> for the victim's untraced job; the epilog
    copied it into the victim's directory with its modes (0666), where the attacker could still edit it."""
    _product_bases(user_dir)
    product_mode = SHM_BASE.stat().st_mode & 0o7777
    SHM_BASE.chmod(0o1777)
    try:
        job = submit("true\n", user_dir, "-N1", "-w", "n1", "--hold", user=TEST_USER)
        node_dir = SHM_BASE / f"job-{job}.n1"
        plant = (f"import os\nos.makedirs({str(node_dir / 'step-0')!r}, 0o777)\n"
                 f"p = {str(node_dir / 'step-0' / 'rank-00000.ring')!r}\nopen(p, 'w').write('x')\nos.chmod(p, 0o666)\n")
        assert _as(ATTACKER, [USER_PYTHON, "-c", plant]).returncode == 0
        _run(["scontrol", "release", job])
        assert wait_job(job)["JobState"] == "COMPLETED"
    finally:
        SHM_BASE.chmod(product_mode)
    assert not (user_dir / f"megatrace-{job}").exists()
    assert (node_dir / "step-0" / "rank-00000.ring").exists()  # not the epilog's to remove either
    shutil.rmtree(node_dir, ignore_errors=True)


def test_outside_slurm_each_user_traces_into_a_base_of_their_own(test_user, attacker, user_pkg):
    """Item 6: the first user made /dev/shm/megatrace 0755; the second could read the first one's meta (the
    environment) and could not trace at all. Both here trace job "local" on the same node."""
    code = ("import os\nfrom megatrace.trace.ring_writer import RingIdentity, RingWriter\n"
            "from megatrace.trace.settings import TracerSettings\n"
            "s = TracerSettings.from_env({'MEGATRACE_JOB_ID': 'local'})\n"
            "w = RingWriter(s.directory, RingIdentity(rank=0, world_size=1))\n"
            "w.write_meta('env', vars={'NCCL_SOCKET_IFNAME': os.environ['USER']}); w.close(); print(w.meta_path)\n")
    metas = []
    for user in (TEST_USER, ATTACKER):
        done = _as(user, ["env", f"USER={user}", f"PYTHONPATH={user_pkg}", USER_PYTHON, "-c", code], cwd="/")
        assert done.returncode == 0 and "tracing is off" not in done.stderr, done.stderr
        metas.append(Path(done.stdout.strip()))
    try:
        mine, theirs = metas
        assert mine.parent.parent.name == f"megatrace-{test_user.pw_uid}"
        assert theirs.parent.parent.name == f"megatrace-{attacker.pw_uid}"
        for meta, owner in ((mine, test_user), (theirs, attacker)):
            assert meta.stat().st_uid == owner.pw_uid and meta.stat().st_mode & 0o777 == 0o600
            assert meta.parent.parent.stat().st_mode & 0o777 == 0o700
        peek = _as(ATTACKER, ["cat", str(mine)])
        assert peek.returncode != 0 and TEST_USER not in peek.stdout
    finally:
        for meta in metas:
            shutil.rmtree(meta.parent.parent, ignore_errors=True)


def test_a_long_ld_preload_of_the_user_is_kept_behind_the_interposer(lab, tmp_path):
    """Item 9: an LD_PRELOAD longer than 8,191 bytes made spank_getenv fail and was replaced by the interposer."""
    lib = "/lib/x86_64-linux-gnu/libm.so.6"
    if not Path(lib).exists():
        pytest.skip(f"no {lib}")
    preload = ":".join([lib] * 700)  # about 20 KB of real, loadable entries
    script = "srun -N1 -n1 bash -c 'echo \"${#LD_PRELOAD}\"; echo \"${LD_PRELOAD%%:*}\"'\n"
    job = submit(script, tmp_path, "--megatrace=check=off", "-N1", env=_clean_env(LD_PRELOAD=preload))
    info = wait_job(job)
    lines = output(tmp_path, job).splitlines()
    assert info["JobState"] == "COMPLETED", lines
    length, first = lines[-2], lines[-1]
    assert first.endswith("libmegatrace_nccl.so"), first
    assert int(length) == len(first) + 1 + len(preload)


def test_the_epilog_finds_a_working_directory_with_blanks_in_its_name(lab, tmp_path):
    """Item 9: the epilog cut WorkDir at its first blank (a MEGATRACE=1 job: no submit directory from the plugin)."""
    work = tmp_path / "run 1 of 3"
    work.mkdir()
    job = submit("srun -N1 -n1 bash -c 'mkdir -p $MEGATRACE_DIR && echo x > $MEGATRACE_DIR/rank-00000.ring'\n",
                 work, "-N1", "--export=ALL,MEGATRACE=1")
    wait_job(job)
    assert (work / f"megatrace-{job}" / "step-0" / "rings" / "rank-00000.ring").exists(), list(tmp_path.rglob("*"))


# -- the demo job under sbatch --megatrace ----------------------------------------------------

def _last_activity_wall_s(ring: Path) -> float:
    """When the ring's rank last started or finished an operation, in Unix seconds."""
    from megatrace.trace.ring_reader import read_ring

    snap = read_ring(ring)
    h, recs = snap.header, snap.records
    last = max(int(recs["t_enqueue"].max()), int(recs["t_complete"].max()))
    return (h.anchor_wall_ns + (last - h.anchor_mono_ns)) / 1e9


def _timeline(step_dir: Path, onset: float) -> str:
    """What a late report's test prints: the agents' logs, the hang collector's run, the collection's times."""
    bundle = step_dir.parent
    parts = [f"onset {time.strftime('%H:%M:%S', time.gmtime(onset))}Z"]
    for log in sorted(bundle.glob("agent-*.log")):
        parts.append(f"== {log.name}\n{log.read_text(errors='replace')[-3000:]}")
    for run in sorted(bundle.glob(f".agents/{step_dir.name}/collect-*.json")):
        try:
            doc = json.loads(run.read_text())
        except (OSError, ValueError) as exc:
            parts.append(f"== {run.name}: {exc}")
            continue
        parts.append(f"== {run.name}: rc {doc.get('rc')} after {doc.get('seconds')} s {doc.get('error') or ''}\n"
                     f"{str(doc.get('stderr'))[-3000:]}")
    try:
        doc = json.loads((step_dir / "collection.json").read_text())
        parts.append("== collection.json: trigger {} from {:.1f} to {:.1f} s after the onset".format(
            doc.get("trigger"), doc["started_wall_ns"] / 1e9 - onset, doc["finished_wall_ns"] / 1e9 - onset))
    except (OSError, ValueError, KeyError) as exc:
        parts.append(f"== collection.json: {exc}")
    return "\n".join(parts)


def _top_finding(step_dir: Path) -> dict:
    return json.loads((step_dir / "findings.json").read_text())["findings"][0]


def _sacct_state(job: str) -> str:
    """The job's state as `sacct --completion` (the lab's jobcomp/filetxt) records it."""

    def states() -> list[str]:
        rows = _run(["sacct", "-c", "-n", "-P", "-j", job, "-o", "JobID,State"]).stdout.split()
        return [r.split("|")[1] for r in rows if r.split("|")[0] == job]

    found = wait_for(states, timeout=30, step=1)
    return found[-1] if found else ""


@pytest.mark.slow
def test_the_agents_catch_the_demo_hang_report_it_within_90_s_and_cancel_the_job(lab, tmp_path):
    """hang-timeout=30, on-hang=cancel, gloo's own timeout 15 minutes: only the agents can end this job."""
    from megatrace.lab.demo import LabDemo, run

    demo = LabDemo(nodes=4, ranks=8, steps=200, fault="hang:rank=5,step=3", hang_timeout_s=30, on_hang="cancel",
                   comm_timeout_s=900, time_limit_min=10, timeout_s=300)
    # The site's Slurm comes first (SLURM_BIN): its scancel is the one the agent runs.
    site_bin = tmp_path / "site-slurm" / "bin"
    site_bin.mkdir(parents=True)
    for d in (site_bin.parent, site_bin):
        os.chmod(d, 0o755)
    called = site_bin / "called"
    (site_bin / "scancel").write_text(f'#!/bin/sh\necho "$@" >>{called}\nexec {shutil.which("scancel")} "$@"\n')
    os.chmod(site_bin / "scancel", 0o755)
    site = Path("/etc/megatrace/slurm.conf")
    site_text = site.read_text()
    lab_bins = lab["slurm"]["bin_dirs"]  # (a lab on a source build: the rest of the site's Slurm is there)
    site.write_text(site_text + f"SLURM_BIN={site_bin}{':' + lab_bins if lab_bins else ''}\n")
    try:
        report = run(demo, tmp_path, log=lambda m: None)
    finally:
        site.write_text(site_text)
    step = report.parent
    assert report.name == "report.html" and step.name == "step-0"
    job = step.parent.name.removeprefix("megatrace-")
    collection = json.loads((step / "collection.json").read_text())
    assert collection["trigger"]["reason"] == "hang"
    top = _top_finding(step)
    assert top["severity"] == "critical" and top["subject"]["rank"] == 5, top
    assert top["subject"]["host"] == "n3"  # ranks 4 and 5 run on the third virtual node
    assert len(list((step / "rings").glob("rank-*.ring"))) == 8
    onset = _last_activity_wall_s(step / "rings" / "rank-00005.ring")
    assert report.stat().st_mtime - onset <= 90, (report.stat().st_mtime - onset, _timeline(step, onset))
    # on-hang=cancel: cancelled, and why, in the job's output, its comment and sacct's state.
    info = job_info(job)
    assert info["JobState"] == "CANCELLED"
    text = (tmp_path / f"megatrace-demo-{job}.out").read_text()
    assert "megatrace: hang confirmed" in text and "rank 5 (host n3" in text and "on-hang=cancel" in text
    assert str(report) in text
    comment = _run(["scontrol", "show", "job", job]).stdout
    assert "Comment=megatrace: hang confirmed" in comment
    assert _sacct_state(job) == "CANCELLED"
    assert not agents_of(job)
    assert job in called.read_text().split(), "the agent did not cancel with the site's scancel"


@pytest.fixture
def venv_for_test_user(test_user):
    """This test environment's interpreter, runnable by the test user for the test's length.

    The venv's base interpreter may sit under root's home (0700, e.g. a pyenv build): the directories on the
    way that the user cannot traverse get o+x (traverse, not list) until the test ends, then their mode back.
    """
    opened: list[tuple[Path, int]] = []
    for path in [*reversed(Path(os.path.realpath(PYTHON)).parents), *reversed(Path(PYTHON).parents)]:
        mode = path.stat().st_mode
        if not mode & 0o001 and path.stat().st_uid == 0 and all(p != path for p, _ in opened):
            opened.append((path, mode))
            path.chmod((mode & 0o7777) | 0o001)
    try:
        probe = _as(TEST_USER, [PYTHON, "-c", "import torch.distributed, megatrace.demo"], timeout=120)
        if probe.returncode != 0:
            pytest.fail(f"the test user cannot run {PYTHON} with torch and megatrace: {probe.stderr[-500:]}")
        yield PYTHON
    finally:
        for path, mode in reversed(opened):
            path.chmod(mode & 0o7777)


@pytest.mark.slow
def test_the_readmes_srun_line_runs_in_the_lab_as_written(lab, test_user, user_dir, venv_for_test_user):
    """An ordinary user's job with no MASTER_ADDR: the demo takes the first node's name, which the lab resolves
    to this host, as a job written for a real cluster does; the injected hang is reported within hang
    timeout + 60 s, in the user's own directory."""
    script = "srun -n 8 python -m megatrace.demo --tp 2 --pp 2 --dp 2 --steps 12 --fault hang:rank=4,step=5\n"
    env = _clean_env(PATH=f"{Path(PYTHON).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}", HOME=str(user_dir))
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    job = submit(script, user_dir, "--megatrace=hang-timeout=30,on-hang=cancel", "-N4", "-n8", "--overcommit",
                 "-t", "10", env=env, user=TEST_USER)
    info = wait_job(job, timeout=400)
    text = output(user_dir, job)
    assert "cannot be retrieved" not in text and "does not resolve" not in text, text[-2000:]
    assert info["JobState"] == "CANCELLED" and info["UserId"].startswith(TEST_USER), text[-2000:]
    step = user_dir / f"megatrace-{job}" / "step-0"
    assert (step / "report.html").stat().st_uid == test_user.pw_uid
    top = _top_finding(step)
    assert top["severity"] == "critical" and top["subject"]["rank"] == 4 and top["subject"]["host"] == "n3", top
    onset = _last_activity_wall_s(step / "rings" / "rank-00004.ring")
    late = (step / "report.html").stat().st_mtime - onset
    assert late <= 30 + 60, (late, _timeline(step, onset), text[-2000:])


@pytest.mark.slow
def test_a_hang_in_the_training_step_after_a_setup_step_is_reported_in_its_folder(lab, tmp_path):
    """The common batch script: a short traced setup step, then training as the second step, which hangs."""
    script = f"""export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)) OMP_NUM_THREADS=1
srun -N4 -n8 --overcommit {PYTHON} -c 'import torch.distributed'
srun -N4 -n8 --overcommit {PYTHON} -m megatrace.demo --tp 2 --pp 2 --dp 2 --steps 12 \\
    --fault hang:rank=4,step=5 -o "$MEGATRACE_OUT_DIR/step-1"
"""
    job = submit(script, tmp_path, "--megatrace=hang-timeout=30,on-hang=cancel", "-N4", "-n8", "--overcommit",
                 "-t", "10")
    info = wait_job(job, timeout=400)
    assert info["JobState"] == "CANCELLED", output(tmp_path, job)[-2000:]
    step = tmp_path / f"megatrace-{job}" / "step-1"
    assert json.loads((step / "collection.json").read_text())["trigger"]["reason"] == "hang"
    top = _top_finding(step)
    assert top["severity"] == "critical" and top["subject"]["rank"] == 4 and top["subject"]["host"] == "n3", top
    onset = _last_activity_wall_s(step / "rings" / "rank-00004.ring")
    late = (step / "report.html").stat().st_mtime - onset
    assert late <= 30 + 60, (late, _timeline(step, onset), output(tmp_path, job)[-2000:])


STUCK_TRAINER = """
import datetime, os, time
import torch.distributed as dist
if os.environ["RANK"] == os.environ.get("BLOCK_RANK"):
    time.sleep(3600)  # stuck in its own start-up (a lock, a slow load): never reaches init_process_group
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
"""


def _stuck_job(tmp_path: Path, master_addr: str, block_rank: int | None) -> tuple[str, Path]:
    """8 ranks of an unmodified env:// trainer whose rendezvous never completes; returns (job id, step dir)."""
    (tmp_path / "train.py").write_text(STUCK_TRAINER)
    script = f"""export MASTER_ADDR={master_addr} MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)) OMP_NUM_THREADS=1
export BLOCK_RANK={block_rank if block_rank is not None else ""}
srun -N4 -n8 --overcommit bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS exec {PYTHON} {tmp_path}/train.py'
"""
    job = submit(script, tmp_path, "--megatrace=hang-timeout=30,on-hang=cancel", "-N4", "-n8", "--overcommit",
                 "-t", "10")
    info = wait_job(job, timeout=400)
    assert info["JobState"] == "CANCELLED", output(tmp_path, job)[-2000:]
    return job, tmp_path / f"megatrace-{job}" / "step-0"


def _entered_init_wall_s(step: Path) -> float:
    """When the last rank entered init_process_group (its start marker), in Unix seconds."""
    return max(json.loads(p.read_text())["t_wall_ns"] for p in (step / "rings").glob("rank-*.init")) / 1e9


@pytest.mark.slow
def test_a_job_whose_rendezvous_address_does_not_resolve_is_reported_stuck_before_communication(lab, tmp_path):
    job, step = _stuck_job(tmp_path, "no-such-node.invalid", None)
    top = _top_finding(step)
    assert top["kind"] == "startup-hang" and top["severity"] == "critical", top
    assert "the rendezvous address no-such-node.invalid does not resolve on 4 nodes" in top["verdict"], top
    assert sorted(top["subject"]["ranks"]) == list(range(8))
    assert (step / "report.html").stat().st_mtime - _entered_init_wall_s(step) <= 30 + 60
    assert "megatrace: hang confirmed" in output(tmp_path, job)


@pytest.mark.slow
def test_a_rank_blocked_before_init_process_group_is_named_by_the_report(lab, tmp_path):
    job, step = _stuck_job(tmp_path, "127.0.0.1", 3)
    top = _top_finding(step)
    assert top["kind"] == "startup-hang" and top["subject"]["rank"] == 3, top
    assert "rank 3 never reached init_process_group; 7 ranks wait there for it" in top["verdict"], top
    assert (step / "report.html").stat().st_mtime - _entered_init_wall_s(step) <= 30 + 60
    assert not list((step / "rings").glob("rank-*.ring"))


def _demo_job(tmp_path: Path, fault: str, option: str, steps: int, *args: str, kill_on_bad_exit: bool = True) -> str:
    """Submit the demo (4 nodes, 8 ranks) with ``fault`` ('' for none); returns the job id."""
    fault_arg = f"--fault {fault}" if fault else ""
    script = f"""export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)) OMP_NUM_THREADS=1
srun -N4 -n8 --overcommit --kill-on-bad-exit={int(kill_on_bad_exit)} {PYTHON} -m megatrace.demo --tp 2 --pp 2 \
    --dp 2 --steps {steps} {fault_arg} --comm-timeout 900 -o "$MEGATRACE_OUT_DIR/step-0"
"""
    return submit(script, tmp_path, option, "-N4", "-n8", "--overcommit", *args)


@pytest.mark.slow
def test_a_hung_job_with_on_hang_requeue_restarts_without_the_culprit_node_and_completes(lab, tmp_path):
    """n3 plays a bad GPU: whichever rank runs there hangs. Node weights steer the first attempt onto n3 and n4;
    the agents confirm the hang, the report names n3, and the requeued attempt runs without it."""
    script = f"""export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000 + ${{SLURM_RESTART_COUNT:-0}}))
idx=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | grep -nx n3 | cut -d: -f1)
fault=""
[ -n "$idx" ] && fault="--fault hang:rank=$(( (idx - 1) * 2 )),step=3"
echo "attempt ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST: ${{fault:-no fault}}"
srun -N2 -n4 --overcommit --kill-on-bad-exit=1 {PYTHON} -m megatrace.demo --tp 2 --pp 2 --dp 1 --steps 8 \\
    $fault --comm-timeout 900 -o "$MEGATRACE_OUT_DIR/step-0"
"""
    _run(["scontrol", "update", "NodeName=n1,n2", "Weight=100"])
    try:
        job = submit(script, tmp_path, "--megatrace=hang-timeout=20,on-hang=requeue", "-N2", "-n4", "--overcommit")
        # Slurm holds a requeued job back for two minutes; the test does not wait for that.
        assert wait_for(lambda: job_info(job).get("Restarts") == "1", timeout=180), job_info(job)
        wait_for(lambda: job_info(job).get("JobState") == "PENDING", timeout=30)
        _run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
        info = wait_job(job, timeout=240)
    finally:
        _run(["scontrol", "update", "NodeName=n1,n2", "Weight=1"])
    assert info["JobState"] == "COMPLETED", info
    assert "n3" in info.get("ExcNodeList", ""), info
    assert "n3" not in _run(["scontrol", "show", "hostnames", info["NodeList"]]).stdout.split()
    first = tmp_path / f"megatrace-{job}" / "step-0"
    assert json.loads((first / "collection.json").read_text())["trigger"]["reason"] == "hang"
    top = _top_finding(first)
    assert top["severity"] == "critical" and top["subject"]["host"] == "n3", top
    assert "Comment=megatrace: hang confirmed" in _run(["scontrol", "show", "job", job]).stdout
    second = tmp_path / f"megatrace-{job}.r1" / "step-0"
    findings = json.loads((second / "findings.json").read_text())["findings"]
    assert "healthy" in [f["kind"] for f in findings] and not [f for f in findings if f["severity"] == "critical"]
    from megatrace.trace.ring_reader import read_ring

    assert "n3" not in {read_ring(p).header.host for p in (second / "rings").glob("rank-*.ring")}


@pytest.mark.slow
def test_a_healthy_traced_job_gets_a_healthy_report_with_its_step_times(lab, tmp_path):
    job = _demo_job(tmp_path, "", "--megatrace=hang-timeout=60", 8)
    info = wait_job(job, timeout=240)
    assert info["JobState"] == "COMPLETED", output(tmp_path, job)
    step = tmp_path / f"megatrace-{job}" / "step-0"
    rings = sorted((step / "rings").glob("rank-*.ring"))
    assert len(rings) == 8
    from megatrace.trace.ring_reader import read_ring

    assert sorted({read_ring(p).header.host for p in rings}) == ["n1", "n2", "n3", "n4"]
    assert not (step / "collection.json").exists()  # no collection ran: the epilog's job-end analysed
    doc = json.loads((step / "findings.json").read_text())
    assert doc["findings"][0]["kind"] == "healthy", doc["verdict"]
    html = (step / "report.html").read_text()
    assert "Step time" in html and "Per iteration: measured step time" in html


@pytest.mark.slow
def test_a_crashed_rank_is_named_by_the_report_at_job_end(lab, tmp_path):
    job = _demo_job(tmp_path, "crash:rank=2,step=3", "--megatrace=hang-timeout=60", 20)
    info = wait_job(job, timeout=240)
    assert info["JobState"] == "FAILED", output(tmp_path, job)
    top = _top_finding(tmp_path / f"megatrace-{job}" / "step-0")
    assert top["subject"]["rank"] == 2 and top["subject"]["host"] == "n2", top
    assert top["kind"] == "crashed-process", top


@pytest.mark.slow
def test_a_rank_without_a_ring_is_named_from_the_jobs_output(lab, tmp_path):
    """Rank 2 runs untraced (MEGATRACE_ENABLE=0 in its task) and crashes: the epilog's report reads slurm-<id>.out
    (found through scontrol, as the user) for the rank without a ring; ``megatrace analyze --job`` finds the same
    file, and a job Slurm does not know is said so."""
    script = f"""export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)) OMP_NUM_THREADS=1
srun -N4 -n8 --overcommit --kill-on-bad-exit=1 bash -c '[ "$SLURM_PROCID" = 2 ] && export MEGATRACE_ENABLE=0; \
exec {PYTHON} -m megatrace.demo --tp 2 --pp 2 --dp 2 --steps 20 --fault crash:rank=2,step=3 --comm-timeout 900 \
-o "$MEGATRACE_OUT_DIR/step-0"'
"""
    job = submit(script, tmp_path, "--megatrace=hang-timeout=60", "-N4", "-n8", "--overcommit")
    info = wait_job(job, timeout=240)
    assert info["JobState"] == "FAILED", output(tmp_path, job)
    step = tmp_path / f"megatrace-{job}" / "step-0"
    assert len(list((step / "rings").glob("rank-*.ring"))) == 7 and not (step / "rings" / "rank-00002.ring").exists()
    top = _top_finding(step)
    assert top["kind"] == "crashed-process" and top["subject"]["rank"] == 2, top
    assert f"no ring; Slurm (out-{job}.txt:" in json.dumps(top["evidence"]), top["evidence"]
    by_job = _run([PYTHON, "-m", "megatrace.cli", "analyze", "--job", job, "-o", str(tmp_path / "by-job"),
                   "--no-report"], timeout=120, cwd="/")
    assert by_job.returncode == 0, by_job.stderr
    assert f"job {job}: its output: {tmp_path / f'out-{job}.txt'} (from scontrol)" in by_job.stderr, by_job.stderr
    assert by_job.stdout.startswith("VERDICT [critical] rank 2") and "crashed" in by_job.stdout.splitlines()[0]
    unknown = _run([PYTHON, "-m", "megatrace.cli", "analyze", "--job", "99999999"], timeout=120)
    assert unknown.returncode == 1 and "job 99999999: Slurm does not know it" in unknown.stderr, unknown.stderr
    assert "Traceback" not in unknown.stderr


@pytest.mark.slow
def test_a_job_reaching_its_time_limit_is_reported_before_the_kill(lab, tmp_path):
    """The agents collect 90 s before the 2-minute limit; Slurm kills the job at the limit."""
    job = _demo_job(tmp_path, "slow:rank=3,factor=2", "--megatrace=hang-timeout=60", 100000, "--time=2")
    info = wait_job(job, timeout=300)
    assert info["JobState"] == "TIMEOUT", output(tmp_path, job)
    step = tmp_path / f"megatrace-{job}" / "step-0"
    collection = json.loads((step / "collection.json").read_text())
    assert collection["trigger"]["reason"] == "timelimit"
    end = time.mktime(time.strptime(info["EndTime"], "%Y-%m-%dT%H:%M:%S"))
    assert (step / "report.html").stat().st_mtime < end
    top = _top_finding(step)
    assert top["subject"]["rank"] == 3, top


# -- the lab itself ----------------------------------------------------------------------------

def test_lab_up_again_changes_nothing(lab):
    before = json.loads(_run([MEGATRACE, "lab", "status", "--json"]).stdout)
    proc = _run([MEGATRACE, "lab", "up", "--nodes", "4", "--skip-install"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    after = json.loads(_run([MEGATRACE, "lab", "status", "--json"]).stdout)
    assert before["daemons"] == after["daemons"]


def test_lab_down_leaves_no_daemon_running(lab):
    daemons = json.loads(_run([MEGATRACE, "lab", "status", "--json"]).stdout)["daemons"]
    assert {d["name"] for d in daemons} >= {"slurmctld", "slurmd-n1", "slurmd-n4"}
    proc = _run([MEGATRACE, "lab", "down"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    for d in daemons:
        assert not Path(f"/proc/{d['pid']}").exists() or \
            Path(f"/proc/{d['pid']}/stat").read_text().split(") ")[1].startswith("Z"), d
    status = _run([MEGATRACE, "lab", "status", "--json"])
    assert status.returncode == 1 and json.loads(status.stdout)["up"] is False
