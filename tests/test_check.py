"""megatrace-check: node and network judgement, the runner under a real mpiexec, exit codes and outputs.

GPUs come from the NVML test double (see test_check_gpu.py); the MPI runs emulate several nodes
on this host by giving each task group its own SLURMD_NODENAME (and NVML config).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.shm import mpich_segments

from megatrace.check.host import HostThresholds, judge_allocation, judge_host, read_host, read_ib_ports
from megatrace.check.network import judge_matrix, round_robin
from megatrace.check.results import Status
from megatrace.check.output import grid
from megatrace.check.results import ProbeResult, Subject
from megatrace.check.runner import CheckReport, assign_gpus

BIN = Path(sys.executable).parent
DOUBLE = Path(__file__).parent / "nvml_double" / "fake_nvml.c"


# -- judgement, no hardware --------------------------------------------------------------------------------
@pytest.mark.parametrize("n", range(2, 10))
def test_round_robin_pairs_every_two_members_once_in_disjoint_rounds(n: int) -> None:
    rounds = round_robin(n)
    seen = [tuple(sorted(p)) for r in rounds for p in r]
    assert sorted(seen) == sorted(combinations(range(n), 2))
    for r in rounds:
        members = [m for p in r for m in p]
        assert len(members) == len(set(members))


def _matrix(n: int, value: float = 10.0) -> np.ndarray:
    m = np.full((n, n), value)
    np.fill_diagonal(m, np.nan)
    return m


def test_a_slow_row_is_a_bad_node_and_a_slow_cell_a_bad_link() -> None:
    nodes = [f"n{i}" for i in range(6)]
    m = _matrix(6)
    m[4, :] = m[:, 4] = 2.0  # n4's NIC
    m[1, 3] = m[3, 1] = 3.0  # the n1-n3 route
    np.fill_diagonal(m, np.nan)
    res = judge_matrix(nodes, m)
    assert [(r.probe, r.status, r.subject.node) for r in res] == [("net.node", Status.FAIL, "n4"),
                                                                   ("net.link", Status.WARN, "n1")]
    assert "n1 ↔ n3" in res[1].message and "20% of the median node's" in res[0].message


def test_one_slow_node_of_four_is_named_though_it_is_half_the_cells() -> None:
    nodes = ["n1", "n2", "n3", "n4"]
    m = _matrix(4)
    m[2, :] = m[:, 2] = 4.0  # n3 slow: 6 of the 12 cells; the median of all cells (7.0) would hide it
    np.fill_diagonal(m, np.nan)
    assert [(r.probe, r.subject.node) for r in judge_matrix(nodes, m)] == [("net.node", "n3")]


def test_a_healthy_matrix_is_one_ok_line() -> None:
    m = _matrix(5) + np.random.default_rng(0).uniform(-1, 1, (5, 5))
    (res,) = judge_matrix([f"n{i}" for i in range(5)], m)
    assert res.status == Status.OK and res.probe == "net.matrix"


def test_allocation_comparisons_name_the_odd_node() -> None:
    base = {"cpus": 64, "mem_bytes": 512 << 30, "kernel": "6.1.0", "versions": {"torch": "2.13.0"},
            "wall_ns": 1_000_000_000_000}
    hosts = {f"n{i}": dict(base) for i in range(4)}
    hosts["n1"] = {**base, "cpus": 8}
    hosts["n2"] = {**base, "versions": {"torch": "2.9.1"}}
    hosts["n3"] = {**base, "wall_ns": base["wall_ns"] + 2_000_000_000}
    for name in hosts:
        hosts[name]["gpu_driver"] = {"driver": "550.54.15", "cuda": 12040}
    hosts["n3"]["gpu_driver"] = {"driver": "535.104.05", "cuda": 12020}
    res = {(r.probe, r.subject.node): r for r in judge_allocation(hosts)}
    assert res[("node.gpu_driver", "n3")].status == Status.WARN and "535.104.05" in res[("node.gpu_driver", "n3")].message
    assert res[("node.cpus", "n1")].status == Status.WARN and "8 CPUs" in res[("node.cpus", "n1")].message
    assert res[("node.versions", "n2")].status == Status.WARN and "2.9.1" in res[("node.versions", "n2")].message
    assert res[("node.clock", "n3")].status == Status.FAIL
    assert {node for _, node in res} == {"n1", "n2", "n3"}


def test_infiniband_ports_from_sysfs(tmp_path: Path) -> None:
    def port(dev: str, num: int, state: str, **counters: int) -> None:
        p = tmp_path / dev / "ports" / str(num)
        (p / "counters").mkdir(parents=True)
        (p / "state").write_text(state + "\n")
        (p / "rate").write_text("400 Gb/sec (4X NDR)\n")
        for k, v in counters.items():
            (p / "counters" / k).write_text(f"{v}\n")
    port("mlx5_0", 1, "4: ACTIVE", symbol_error=0, link_downed=0)
    port("mlx5_1", 1, "1: DOWN")
    port("mlx5_2", 1, "4: ACTIVE", link_downed=3)
    port("mlx5_3", 1, "4: ACTIVE")
    (tmp_path / "mlx5_3" / "ports" / "1" / "rate").write_text("200 Gb/sec (4X HDR)\n")
    for dev in ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"):
        (tmp_path / dev / "hca_type").write_text("MT4129\n")
    facts = {"ib_ports": read_ib_ports(tmp_path)}
    res = {r.message.split()[1]: r for r in judge_host(facts, "n1")}
    assert res["mlx5_0/1"].status == Status.OK
    assert res["mlx5_1/1"].status == Status.FAIL and "DOWN" in res["mlx5_1/1"].message
    assert res["mlx5_2/1"].status == Status.WARN and "link_downed 3" in res["mlx5_2/1"].message
    assert res["mlx5_3/1"].status == Status.OK  # no limit for the model: 200 Gb/s may be what it is
    limits = HostThresholds(nics=(("mt41*", 400.0),))  # a site's `nics: {"mt41*": {rate_gbps: 400}}`
    res = {r.message.split()[1]: r for r in judge_host(facts, "n1", limits)}
    assert res["mlx5_3/1"].status == Status.WARN and res["mlx5_3/1"].value == 200.0
    assert "runs at 200 Gb/s; its model (MT4129, thresholds nics 'mt41*') runs at 400" in res["mlx5_3/1"].message
    assert res["mlx5_0/1"].status == Status.OK


def test_a_port_slower_than_its_models_ports_elsewhere_is_named() -> None:
    def node(rate: int, state: str = "4: ACTIVE") -> dict:
        return {"ib_ports": [{"device": "mlx5_0", "port": "1", "state": state, "rate": f"{rate} Gb/sec (4X)",
                              "link_layer": "InfiniBand", "hca_type": "MT4129"},
                             {"device": "mlx5_1", "port": "1", "state": "4: ACTIVE", "rate": "400 Gb/sec (4X NDR)",
                              "link_layer": "InfiniBand", "hca_type": "MT4129"}]}
    hosts = {"n1": node(400), "n2": node(200), "n3": node(400), "n4": node(100, "1: DOWN")}
    res = [r for r in judge_allocation(hosts) if r.probe == "node.ib_rate"]
    assert [(r.subject.node, r.status) for r in res] == [("n2", Status.WARN)]  # (n4's port is down: judge_host)
    assert res[0].message == "port mlx5_0/1 runs at 200 Gb/s, the allocation's MT4129 InfiniBand ports at 400 (median)"


def test_the_grid_puts_the_worst_node_first_and_counts_the_healthy_rest() -> None:
    nodes = [f"n{i:02}" for i in range(40)]
    res = [ProbeResult(p, Status.OK, Subject(n, g), "fine") for n in nodes for p, g in
           (("gpu.ecc", 0), ("gpu.pcie", 0), ("node.shm", None))]
    res += [ProbeResult("net.allreduce", Status.OK, Subject("n00"), "bus bandwidth fine"),  # all nodes'
            ProbeResult("gpu.ecc", Status.FAIL, Subject("n17", 1), "2 uncorrected ECC errors"),
            ProbeResult("gpu.ecc", Status.FAIL, Subject("n17", 2), "1 uncorrected ECC error"),
            ProbeResult("net.link", Status.WARN, Subject("n21", peer="n03"), "link n21 ↔ n03: slow"),  # both ends'
            ProbeResult("node.ib", Status.SKIP, Subject("n05"), "no InfiniBand port")]
    lines = grid(CheckReport(nodes, res), ok_rows=5)
    assert lines[0].split() == ["node", "verdict", "GPU", "errors", "GPU", "links", "NIC", "node", "network"]
    assert lines[1].split() == ["n17", "FAIL", "FAIL", "2", "ok", "-", "ok", "ok"]
    assert lines[2].split() == ["n03", "WARN", "ok", "ok", "-", "ok", "WARN"]
    assert lines[3].split() == ["n21", "WARN", "ok", "ok", "-", "ok", "WARN"]
    assert [line.split()[0] for line in lines[4:9]] == ["n00", "n01", "n02", "n04", "n05"]
    assert lines[8].split() == ["n05", "OK", "ok", "ok", "-", "ok", "ok"]  # its NIC check skipped: '-'
    assert lines[9] == "... and 32 more node(s), all ok (--json lists every result)"


def test_host_facts_and_an_unusable_job_dir(tmp_path: Path) -> None:
    facts = read_host(str(tmp_path / "missing"))
    assert facts["cpus"] >= 1 and facts["mem_bytes"] > 0 and isinstance(facts["shm_free"], int)
    res = {r.probe: r for r in judge_host(facts, "n1")}
    assert res["node.job_dir"].status == Status.FAIL and "No such file" in res["node.job_dir"].message


@pytest.mark.parametrize("visible, expected", [
    ([["0"], ["1"], ["2"]], [["0"], ["1"], ["2"]]),  # bound one GPU per task: each its own
    ([["0", "1"], ["1", "2"]], [["0", "1"], ["2"]]),  # a GPU two tasks see: the first of them
    ([["0", "1"], ["0", "1"]], [["0", "1"], []]),  # all see the same GPUs: the first task checks those
    ([None, None], [None, []]),  # CUDA_VISIBLE_DEVICES unset
    ([["GPU-aa"], ["GPU-bb"]], [["GPU-aa"], ["GPU-bb"]]),  # by UUID
    ([["MIG-aa"], ["MIG-bb"]], [None, []]),  # MIG instances: the first task checks the GPUs they live on
    ([["0"], None], [None, []]),
])
def test_each_task_checks_the_gpus_it_was_given(visible, expected) -> None:
    assert assign_gpus(visible) == expected


# -- the command, on this node and under mpiexec -------------------------------------------------------------
@pytest.fixture(scope="module")
def nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nvml")
    subprocess.run([shutil.which("cc") or "gcc", "-O2", "-fPIC", "-shared", "-Wl,-soname,libnvidia-ml.so.1",
                    "-o", str(out / "libnvidia-ml.so.1"), str(DOUBLE)], check=True)
    return out


def _conf(path: Path, fixture: dict[str, Any]) -> str:
    """Write the NVML double's JSON fixture (a flat object of its dotted keys, see fake_nvml.c); its path."""
    path.write_text(json.dumps(fixture))
    return str(path)


def _env(nvml_dir: Path, conf: str) -> dict[str, str]:
    """The test's NVML double, and limits that this machine's small /dev/shm (a container's 64 MiB) passes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "SLURM_", "OMPI_", "MPI_"))}
    limits = Path(conf).with_name("limits.yaml")
    # More busy-polling MPI tasks than cores: a single round trip can take ms; a latency floor above that noise.
    limits.write_text("node: {min_free_shm_mib: 0, min_free_job_mib: 0}\nnet: {latency_floor_us: 10000}\n")
    return {**env, "LD_LIBRARY_PATH": str(nvml_dir), "FAKE_NVML_CONFIG": conf, "MEGATRACE_THRESHOLDS": str(limits)}


def test_exit_codes_json_and_prometheus_on_one_node(nvml_dir: Path, tmp_path: Path) -> None:
    cmd = [str(BIN / "megatrace-check"), "--expect-gpus", "2", "--node", "n9"]
    ok = subprocess.run(cmd, env=_env(nvml_dir, _conf(tmp_path / "a", {"gpus": 2})), capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines()[-1].startswith("verdict: ok")
    warn = subprocess.run(cmd + ["--json", str(tmp_path / "w.json"), "--prom-textfile", str(tmp_path / "w.prom")],
                          env=_env(nvml_dir, _conf(tmp_path / "b", {"gpus": 2, "gpu1.pcie_width": 4})),
                          capture_output=True, text=True)
    assert warn.returncode == 3, warn.stdout + warn.stderr
    assert "WARN n9 GPU1" in warn.stdout and "PCIe link x4 of x16" in warn.stdout
    doc = json.loads((tmp_path / "w.json").read_text())
    assert doc["status"] == "warn" and doc["exit_code"] == 3
    assert 'megatrace_check_status{node="n9",probe="gpu.pcie",gpu="1"} 1' in (tmp_path / "w.prom").read_text()
    only = subprocess.run(cmd + ["--only", "gpu.ecc"], env=_env(nvml_dir, _conf(tmp_path / "c", {
        "gpus": 2, "gpu1.pcie_width": 4, "gpu0.ecc_dbe": 1})),
                          capture_output=True, text=True)
    assert only.returncode == 4 and "gpu.ecc" in only.stdout and "gpu.pcie" not in only.stdout


def test_a_hung_probe_is_a_failure_not_a_hung_prolog(nvml_dir: Path, tmp_path: Path) -> None:
    t = time.monotonic()
    done = subprocess.run([str(BIN / "megatrace-check"), "--expect-gpus", "1", "--timeout", "4"],
                          env=_env(nvml_dir, _conf(tmp_path / "h", {"gpus": 1, "gpu0.hang_ms": 60000})),
                          capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t < 30
    assert done.returncode == 4 and "NVML did not answer within 2 s" in done.stdout


def test_a_peer_hung_in_the_network_test_fails_that_probe_and_still_reports(nvml_dir: Path, tmp_path: Path) -> None:
    """The watchdog: the all-reduce hangs on a node (a 10 s wait before each message it sends, by the site's
    drill file): the run ends at --timeout with exit 4, naming the probe that hung, and the table, the JSON
    and the drain reason still hold what was found until then."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "slow-net-n2").write_text("10000\n")
    env = {**_env(nvml_dir, _conf(tmp_path / "c", {"gpus": 0})), "MEGATRACE_SITE_DIR": str(site)}
    cmd = [str(BIN / "megatrace-check"), "--only", "node", "--only", "net", "--timeout", "5"]
    argv = [str(BIN / "mpiexec"), "-n", "1", "-env", "SLURMD_NODENAME", "n1", *cmd, "--json", str(tmp_path / "o.json"),
            "--reason-file", str(tmp_path / "reason"), ":", "-n", "1", "-env", "SLURMD_NODENAME", "n2", *cmd]
    t, before = time.monotonic(), mpich_segments()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t < 60
    assert mpich_segments() - before == set()  # (ended by the watchdog, no MPI_Finalize: unlinked after MPI_Init)
    assert done.returncode == 4, done.stdout + done.stderr
    assert done.stdout.startswith("FAIL n1") and "net.allreduce did not finish within 5 s" in done.stdout, done.stdout
    assert "verdict: fail (2 node(s)" in done.stdout
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["exit_code"] == 4 and doc["results"][-1]["probe"] == "net.allreduce"
    assert any(r["probe"] == "node.shm" for r in doc["results"])  # found before the hang: kept
    assert (tmp_path / "reason").read_text().startswith("megatrace: net.allreduce did not finish within 5 s")


def test_the_drain_reason_names_the_gpu_and_the_fault(nvml_dir: Path, tmp_path: Path) -> None:
    """What the prolog drains the node with (MEGATRACE_CHECK_REASON_FILE): the worst problem, GPU first."""
    env = {**_env(nvml_dir, _conf(tmp_path / "c", {"gpus": 2, "gpu1.xid_event": "79", "gpu0.pcie_width": 8})),
           "MEGATRACE_CHECK_REASON_FILE": str(tmp_path / "reason")}
    done = subprocess.run([str(BIN / "megatrace-check"), "--expect-gpus", "2"], env=env, capture_output=True, text=True)
    assert done.returncode == 4, done.stdout + done.stderr
    assert (tmp_path / "reason").read_text().startswith("megatrace: GPU1 XID 79")
    healthy = subprocess.run([str(BIN / "megatrace-check"), "--expect-gpus", "2"], capture_output=True, text=True,
                             env={**env, "FAKE_NVML_CONFIG": _conf(tmp_path / "ok", {"gpus": 2})})
    assert healthy.returncode == 0 and (tmp_path / "reason").read_text() == "\n"  # no stale reason left


def test_a_shared_node_judges_only_the_jobs_gpus(nvml_dir: Path, tmp_path: Path) -> None:
    """A job given 4 of 8 GPUs (SLURM_JOB_GPUS in the prolog, CUDA_VISIBLE_DEVICES in a step): another job's
    process on GPU 6 is not this job's problem, and 8 GPUs on the node are not 'too many'."""
    conf = _conf(tmp_path / "c", {"gpus": 8, "gpu6.procs": "99:8589934592"})
    for var in ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        env = {**_env(nvml_dir, conf), var: "0,1,2,3", "SLURM_GPUS_ON_NODE": "4"}
        done = subprocess.run([str(BIN / "megatrace-check"), "--json", str(tmp_path / "j.json")], env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0, (var, done.stdout + done.stderr)
        gpus = {r["subject"]["gpu"] for r in json.loads((tmp_path / "j.json").read_text())["results"]}
        assert gpus == {None, 0, 1, 2, 3}, var
    lost = {**_env(nvml_dir, _conf(tmp_path / "seven", {"gpus": 7})), "SLURM_JOB_GPUS": "4,7", "SLURM_GPUS_ON_NODE": "2"}
    done = subprocess.run([str(BIN / "megatrace-check")], env=lost, capture_output=True, text=True)
    assert done.returncode == 4 and "allocated GPU 7 not found among the 7 GPUs" in done.stdout, done.stdout
    exclusive = {**_env(nvml_dir, _conf(tmp_path / "e", {"gpus": 7})), "SLURM_GPUS_ON_NODE": "8"}
    done = subprocess.run([str(BIN / "megatrace-check")], env=exclusive, capture_output=True, text=True)
    assert done.returncode == 4 and "7 GPUs visible, 8 allocated" in done.stdout, done.stdout


def test_calibration_refuses_an_allocation_that_failed(nvml_dir: Path, tmp_path: Path) -> None:
    """A site's floor must come from healthy nodes: a failing check writes no thresholds file."""
    argv = [str(BIN / "mpiexec"), "-n", "2", str(BIN / "megatrace-check"), "--calibrate", str(tmp_path / "cal.yaml"),
            "--timeout", "60"]
    bad = subprocess.run(argv, env=_env(nvml_dir, _conf(tmp_path / "c", {"gpus": 1, "gpu0.ecc_dbe": 1})),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 4 and "not calibrating" in bad.stderr and not (tmp_path / "cal.yaml").exists()
    good = subprocess.run(argv, env=_env(nvml_dir, _conf(tmp_path / "g", {"gpus": 1})), capture_output=True,
                          text=True, timeout=120)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "min_busbw_gbps" in (tmp_path / "cal.yaml").read_text()


def test_only_refuses_a_name_that_is_no_probe() -> None:
    """A typo in a prolog's CHECK_CMD must not silently check nothing."""
    done = subprocess.run([str(BIN / "megatrace-check"), "--only", "gpus"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown probe 'gpus'" in done.stderr and "gpu.{nvml" in done.stderr
    assert "Traceback" not in done.stderr


def test_every_probe_a_check_reports_is_in_the_registry(nvml_dir: Path, tmp_path: Path) -> None:
    """--only and --help list the registry: every result name the checks produce must be in it."""
    from megatrace.check.probes import KNOWN

    faults = {"gpus": 3, "gpu0.ecc_dbe": 1, "gpu0.pcie_width": 8, "gpu1.temp": 90, "gpu1.procs": "5:4294967296",
              "gpu2.nvlinks": 18, "gpu2.nvlink_down": "3", "gpu2.xid_event": "13", "gpu2.mig": 1,
              "gpu2.persistence": 0, "gpu2.power_limit": 500000, "gpu0.remap_failure": 1, "gpu1.clock_events": "0x8"}
    done = subprocess.run([str(BIN / "mpiexec"), "-n", "3", str(BIN / "megatrace-check"), "--level", "full",
                           "--json", str(tmp_path / "all.json"), "--timeout", "90", "--job-dir", str(tmp_path),
                           "--ring-dir", str(tmp_path)],
                          env=_env(nvml_dir, _conf(tmp_path / "c", faults)), capture_output=True, text=True, timeout=150)
    assert done.returncode == 4, done.stdout + done.stderr
    produced = {r["probe"] for r in json.loads((tmp_path / "all.json").read_text())["results"]}
    nodes = [f"n{i}" for i in range(4)]
    slow = _matrix(4)
    slow[1, :] = slow[:, 1] = 1.0
    produced |= {r.probe for r in judge_matrix(nodes, slow)} | {r.probe for r in judge_matrix(nodes[:2], slow[:2, :2])}
    assert len(produced) > 15 and produced <= KNOWN, produced - KNOWN


def test_one_table_for_three_nodes_under_mpiexec(nvml_dir: Path, tmp_path: Path) -> None:
    mpiexec = BIN / "mpiexec"
    if not mpiexec.exists():
        pytest.fail("mpiexec (the mpich wheel) is missing from the environment: make install brings it")
    healthy = _conf(tmp_path / "ok.json", {"gpus": 2})
    broken = _conf(tmp_path / "bad.json", {"gpus": 2, "gpu1.remap_failure": 1})
    narrow = _conf(tmp_path / "narrow.json", {"gpus": 2, "gpu1.pcie_width": 8})
    cmd = [str(BIN / "megatrace-check"), "--level", "full", "--timeout", "90",
           "--json", str(tmp_path / "all.json")]  # only task 0 writes it
    argv = [str(mpiexec)]
    # n1: two tasks bound to one GPU each (as srun --gpus-per-task sets CUDA_VISIBLE_DEVICES): each checks
    # its own; n2, n3: one task, told the count, checks both.
    tasks = [("n1", narrow, ["-env", "CUDA_VISIBLE_DEVICES", "0"]), ("n1", narrow, ["-env", "CUDA_VISIBLE_DEVICES", "1"]),
             ("n2", broken, ["-env", "SLURM_GPUS_ON_NODE", "2"]), ("n3", healthy, ["-env", "SLURM_GPUS_ON_NODE", "2"])]
    for i, (name, conf, extra) in enumerate(tasks):
        argv += ([":"] if i else []) + ["-n", "1", "-env", "SLURMD_NODENAME", name,
                                        "-env", "FAKE_NVML_CONFIG", conf, *extra] + cmd
    done = subprocess.run(argv, env=_env(nvml_dir, healthy),
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 4, done.stdout + done.stderr  # every task exits with the allocation's verdict
    lines = done.stdout.splitlines()
    assert lines[0].startswith("FAIL n2 GPU1") and "row remapping failed" in lines[0]
    assert [line for line in lines if "n1 GPU" in line] == [next(x for x in lines if x.startswith("WARN n1 GPU1"))]
    assert sum(line.startswith("verdict:") for line in lines) == 1  # one table, printed by task 0
    head = next(i for i, line in enumerate(lines) if line.startswith("node "))  # the node x check grid
    assert [line.split()[:2] for line in lines[head + 1:head + 4]] == [["n2", "FAIL"], ["n1", "WARN"], ["n3", "OK"]]
    doc = json.loads((tmp_path / "all.json").read_text())
    assert doc["nodes"] == ["n1", "n2", "n3"]
    bw = np.array(doc["matrix"]["bandwidth_gbps"], dtype=float)
    assert bw.shape == (3, 3) and np.isnan(np.diag(bw)).all() and (bw[~np.eye(3, dtype=bool)] > 0).all()
    probes = [(r["probe"], r["subject"]["node"], r["subject"]["gpu"]) for r in doc["results"]]
    assert ("net.allreduce", "n1", None) in probes
    for name in ("n1", "n2", "n3"):  # the node's results once, each GPU's once (whichever task checked it)
        assert probes.count(("gpu.count", name, None)) == 1
        assert probes.count(("gpu.pcie", name, 0)) == probes.count(("gpu.pcie", name, 1)) == 1
    count = next(r for r in doc["results"] if r["probe"] == "gpu.count" and r["subject"]["node"] == "n1")
    assert count["status"] == "ok" and count["threshold"] == 2  # the two tasks' GPUs together
    assert doc["facts"]["n1"]["gpu_checks"] == {"0": 0, "1": 1} and doc["facts"]["n2"]["gpu_checks"] == {"all": 2}


@pytest.mark.parametrize("backend, via", [("torch", "gloo (torch.distributed)"), ("auto", "MPI")])
def test_the_all_reduce_through_torch_distributed(nvml_dir: Path, tmp_path: Path, backend: str, via: str) -> None:
    """On GPU nodes the all-reduce goes through NCCL; its CPU twin here is torch.distributed over gloo."""
    pytest.importorskip("torch")
    argv = [str(BIN / "mpiexec"), "-n", "3", str(BIN / "megatrace-check"), "--only", "net", "--net-backend", backend,
            "--json", str(tmp_path / "net.json"), "--timeout", "90"]
    done = subprocess.run(argv, env=_env(nvml_dir, _conf(tmp_path / "c", {"gpus": 0})), capture_output=True,
                          text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    (res,) = [r for r in json.loads((tmp_path / "net.json").read_text())["results"] if r["probe"] == "net.allreduce"]
    assert res["message"].startswith(f"all-reduce over 3 ranks through {via}: bus bandwidth ")
    assert res["value"] > 0


def test_thresholds_files_are_strict_and_calibration_writes_one(tmp_path: Path) -> None:
    from megatrace.check.thresholds import ThresholdsError, calibrated, load_thresholds, save_thresholds

    shipped = load_thresholds(Path(__file__).parent.parent / "configs" / "thresholds.yaml")
    assert shipped == load_thresholds(None)  # the shipped file lists the defaults
    bad = tmp_path / "t.yaml"
    for text, words in [("gpu: {ecc_dbe_fial: 2}\n", "gpu.ecc_dbe_fial: unknown limit"),
                        ("net: {slow_ratio: fast}\n", "net.slow_ratio: expected a float"),
                        ("gpu: {ecc_dbe_fail: 1.5}\n", "gpu.ecc_dbe_fail: expected a int"),
                        ("disk: {}\n", "unknown section 'disk'"), ("gpu: [1\n", "not valid YAML"),
                        ("nics: {MT4129: {rate: 400}}\n", r"nics.MT4129: expected \{rate_gbps: N\}"),
                        ("nics: {MT4129: {rate_gbps: -1}}\n", "nics.MT4129.rate_gbps: expected a positive"),
                        ("node: {nics: 1}\n", "node.nics: unknown limit")]:
        bad.write_text(text)
        with pytest.raises(ThresholdsError, match=words) as info:
            load_thresholds(bad)
        assert str(bad) in str(info.value)
    bad.write_text('nics: {"MT4129": {rate_gbps: 400}}\n')
    site = load_thresholds(bad)
    assert site.node.nics == (("MT4129", 400.0),)
    out = tmp_path / "cal.yaml"
    save_thresholds(calibrated(site, 12.5), out)
    assert load_thresholds(out).net.min_busbw_gbps == 10.0
    assert load_thresholds(out).node.nics == site.node.nics  # calibration keeps the site's NIC models


def test_a_bad_thresholds_file_is_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("gpu: {nope: 1}\n")
    done = subprocess.run([str(BIN / "megatrace-check"), "--thresholds", str(tmp_path / "t.yaml")],
                          capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.startswith("Error: ") and "gpu.nope" in done.stderr
    assert "Traceback" not in done.stderr
