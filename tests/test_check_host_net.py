"""megatrace-check: NIC ports as subjects (table, drain reason, Prometheus series), ports a site does not use,
port error counters, and the latency half of the node x node matrix.

Ports come from sysfs-like trees under tmp_path read by the real reader; the matrix from a real mpiexec.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from megatrace.check.host import HostThresholds, judge_allocation, judge_host, read_ib_ports
from megatrace.check.network import NetThresholds, judge_matrix
from megatrace.check.output import prom_textfile, table
from megatrace.check.results import ProbeResult, Status, Subject, worst
from megatrace.check.runner import CheckReport
from megatrace.check.thresholds import ThresholdsError, calibrated, load_thresholds, save_thresholds

BIN = Path(sys.executable).parent


def port(root: Path, dev: str, num: int, state: str = "4: ACTIVE", rate: int = 400, hca: str = "MT4129",
         **counters: int) -> None:
    """One port of a /sys/class/infiniband-like tree under ``root``."""
    p = root / dev / "ports" / str(num)
    (p / "counters").mkdir(parents=True, exist_ok=True)
    (p / "state").write_text(state + "\n")
    (p / "rate").write_text(f"{rate} Gb/sec (4X)\n")
    (p / "link_layer").write_text("InfiniBand\n")
    (root / dev / "hca_type").write_text(hca + "\n")
    for name in ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors",
                 "local_link_integrity_errors", "excessive_buffer_overrun_errors", "port_xmit_discards"):
        (p / "counters" / name).write_text(f"{counters.get(name, 0)}\n")


def by_port(results: list[ProbeResult], probe: str = "node.ib") -> dict[str, ProbeResult]:
    return {r.subject.port: r for r in results if r.probe == probe}


# -- 1. a NIC port is a subject --------------------------------------------------------------------------------
PROM_LINE = re.compile(r'^(\w+)\{(.*)\} (\S+)$')
PROM_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def prom_series(text: str) -> list[tuple[str, frozenset[tuple[str, str]], float]]:
    """(metric, label set, value) of every sample line of a textfile."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = PROM_LINE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = PROM_LABEL.findall(m.group(2))
        assert ",".join(f'{k}="{v}"' for k, v in labels) == m.group(2), line
        out.append((m.group(1), frozenset(labels), float(m.group(3))))
    return out


def _allocation(tmp_path: Path) -> dict[str, dict]:
    """Three nodes of three ports: n1's second port down and its third flapped, n2's first at half rate."""
    hosts = {}
    for node, rate in (("n1", 400), ("n2", 200), ("n3", 400)):
        root = tmp_path / node
        port(root, "mlx5_0", 1, rate=rate)
        port(root, "mlx5_1", 1, state="1: DOWN" if node == "n1" else "4: ACTIVE")
        port(root, "mlx5_2", 1, link_downed=2 if node == "n1" else 0)
        hosts[node] = {"ib_ports": read_ib_ports(root)}
    return hosts


def test_the_prometheus_textfile_has_no_two_series_of_the_same_labels(tmp_path: Path) -> None:
    hosts = _allocation(tmp_path)
    results = [r for node, f in hosts.items() for r in judge_host(f, node)] + judge_allocation(hosts)
    # several findings of one GPU (DCGM reports one per failed test), and links of one node to two peers
    results += [ProbeResult("gpu.dcgm", Status.WARN, Subject("n1", 1), "DCGM memory: warning"),
                ProbeResult("gpu.dcgm", Status.FAIL, Subject("n1", 1), "DCGM pcie: failed"),
                ProbeResult("net.link", Status.WARN, Subject("n1", peer="n3"), "link n1 ↔ n3: slow"),
                ProbeResult("net.link", Status.OK, Subject("n1", peer="n2"), "link n1 ↔ n2: fine")]
    prom_textfile(CheckReport(["n1", "n2", "n3"], results), tmp_path / "check.prom")
    series = prom_series((tmp_path / "check.prom").read_text())
    dup = [labels for labels, n in Counter(labels for _, labels, _ in series).items() if n > 1]
    assert not dup, f"node_exporter rejects duplicate series: {sorted(map(sorted, dup))}"
    value = {labels: v for _, labels, v in series}
    assert value[frozenset({("node", "n1"), ("probe", "node.ib"), ("port", "mlx5_1/1")})] == 2
    assert value[frozenset({("node", "n1"), ("probe", "node.ib"), ("port", "mlx5_0/1")})] == 0
    assert value[frozenset({("node", "n1"), ("probe", "node.ib_errors"), ("port", "mlx5_2/1")})] == 1
    assert value[frozenset({("node", "n2"), ("probe", "node.ib_rate"), ("port", "mlx5_0/1")})] == 1
    assert value[frozenset({("node", "n1"), ("probe", "gpu.dcgm"), ("gpu", "1")})] == 2  # the worst of the two
    assert value[frozenset({("node", "n1"), ("probe", "net.link"), ("peer", "n3")})] == 1
    assert value[frozenset({("node", "n1"), ("probe", "net.link"), ("peer", "n2")})] == 0


def test_every_port_result_names_its_port(tmp_path: Path) -> None:
    hosts = _allocation(tmp_path)
    results = [r for node, f in hosts.items() for r in judge_host(f, node)] + judge_allocation(hosts)
    n1 = [r for r in results if r.subject.node == "n1" and r.probe.startswith("node.ib")]
    assert {r.subject.port for r in n1} == {"mlx5_0/1", "mlx5_1/1", "mlx5_2/1"}
    down = by_port(n1)["mlx5_1/1"]
    assert down.status == Status.FAIL and down.subject.label() == "n1 mlx5_1/1"
    assert down.drain_reason() == "megatrace: mlx5_1/1 is 1: DOWN"
    assert by_port(n1, "node.ib_errors")["mlx5_2/1"].drain_reason().startswith("megatrace: mlx5_2/1 has errors: "
                                                                                 "link_downed 2")
    (slow,) = [r for r in results if r.probe == "node.ib_rate"]
    assert (slow.subject.node, slow.subject.port, slow.status) == ("n2", "mlx5_0/1", Status.WARN)
    text = table(CheckReport(["n1", "n2", "n3"], results))
    assert "FAIL n1 mlx5_1/1" in text and "WARN n2 mlx5_0/1" in text
    assert json.loads(json.dumps(down.to_dict()))["subject"]["port"] == "mlx5_1/1"


def test_labels_of_other_subjects_are_unchanged() -> None:
    assert Subject("n1").label() == "n1" and Subject("n1", 2).label() == "n1 GPU2"
    assert Subject("n1", peer="n2").label() == "n1 ↔ n2"
    assert ProbeResult("gpu.xid", Status.FAIL, Subject("n1", 1), "XID 79").drain_reason() == "megatrace: GPU1 XID 79"
    assert ProbeResult("node.ib", Status.FAIL, Subject("n1", port="mlx5_0/1"),
                       "rate unreadable").drain_reason() == "megatrace: mlx5_0/1 rate unreadable"


# -- 2. ports a site does not use; the error counters ------------------------------------------------------------
def test_an_unused_port_is_skipped_not_failed(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    port(root, "mlx5_0", 1)
    port(root, "mlx5_1", 1, state="1: DOWN")  # the second port of the node: not cabled
    port(root, "mlx5_bond_0", 1, state="1: DOWN", hca="MT4125")
    facts = {"ib_ports": read_ib_ports(root)}
    plain = by_port(judge_host(facts, "n1"))
    assert plain["mlx5_1/1"].status == plain["mlx5_bond_0/1"].status == Status.FAIL  # without the setting

    site = tmp_path / "site.yaml"
    site.write_text('nics:\n  "MT4129": {rate_gbps: 400}\n  ignore: ["mlx5_1/*", "MLX5_BOND*"]\n')
    limits = load_thresholds(site)
    res = judge_host(facts, "n1", limits.node)
    got = by_port(res)
    assert got["mlx5_0/1"].status == Status.OK
    assert got["mlx5_1/1"].status == Status.SKIP and got["mlx5_bond_0/1"].status == Status.SKIP
    assert got["mlx5_1/1"].message == "port mlx5_1/1 (1: DOWN) not checked: not in use (thresholds nics 'mlx5_1/*')"
    assert worst(res) == Status.OK
    assert limits.node.nic_rate({"hca_type": "MT4129", "device": "mlx5_1", "port": "1"}) == ("MT4129", 400.0)

    # the same as `rate_gbps: 0`, which is how a saved (calibrated) file keeps it
    out = tmp_path / "calibrated.yaml"
    save_thresholds(calibrated(limits, 12.5), out)
    assert load_thresholds(out).node.nics == limits.node.nics
    site.write_text('nics: {"mlx5_1/1": {rate_gbps: 0}}\n')
    assert by_port(judge_host(facts, "n1", load_thresholds(site).node))["mlx5_1/1"].status == Status.SKIP


def test_an_unused_port_is_not_compared_with_the_others(tmp_path: Path) -> None:
    hosts = {}
    for node in ("n1", "n2", "n3"):
        root = tmp_path / node
        port(root, "mlx5_0", 1)
        port(root, "mlx5_1", 1, rate=100 if node == "n2" else 400)  # a management port that trained low
        hosts[node] = {"ib_ports": read_ib_ports(root)}
    assert [r.subject.port for r in judge_allocation(hosts) if r.probe == "node.ib_rate"] == ["mlx5_1/1"]
    ignoring = HostThresholds(nics=(("mlx5_1", 0.0),))  # a device name matches all of its ports
    assert [r for r in judge_allocation(hosts, ignoring) if r.probe == "node.ib_rate"] == []


@pytest.mark.parametrize("text, words", [
    ('nics: {ignore: "mlx5_1/*"}\n', r"nics.ignore: expected a list of port patterns"),
    ("nics: {ignore: [mlx5_1, 7]}\n", r"nics.ignore\[1\]: expected a port pattern"),
    ("nics: {ignore: [\"\"]}\n", r"nics.ignore\[0\]: expected a port pattern"),
    ("nics: {MT4129: {rate_gbps: 400, ignore_ports: [x]}}\n", r"nics.MT4129: expected \{rate_gbps: N\}"),
    ("nics: {MT4129: {rate_gbps: .nan}}\n", r"nics.MT4129.rate_gbps: expected a positive number"),
    ("node: {ib_port_rcv_errors_warn: many}\n", r"node.ib_port_rcv_errors_warn: expected a int"),
    ("net: {latency_floor_us: -1}\n", r"net.latency_floor_us: must not be negative"),
])
def test_bad_nic_and_latency_settings_name_the_file_and_field(tmp_path: Path, text: str, words: str) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text(text)
    with pytest.raises(ThresholdsError, match=words) as info:
        load_thresholds(bad)
    assert str(info.value).startswith(f"{bad}: ")


def test_each_error_counter_warns_at_its_limit(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    port(root, "mlx5_0", 1, symbol_error=99, port_rcv_errors=5, port_xmit_discards=999)  # under every limit
    port(root, "mlx5_1", 1, port_rcv_errors=150, link_error_recovery=12, local_link_integrity_errors=3)
    port(root, "mlx5_2", 1, excessive_buffer_overrun_errors=15)
    port(root, "mlx5_3", 1, port_xmit_discards=40_000, rate=200)
    facts = {"ib_ports": read_ib_ports(root)}
    assert facts["ib_ports"][3]["counters"]["port_xmit_discards"] == 40_000
    limits = HostThresholds(nics=(("MT4129", 400.0),))
    res = judge_host(facts, "n1", limits)
    errors = by_port(res, "node.ib_errors")
    assert errors["mlx5_0/1"].status == Status.OK
    assert errors["mlx5_1/1"].status == Status.WARN
    assert errors["mlx5_1/1"].message == ("port mlx5_1/1 has errors: link_error_recovery 12 (limit 10), "
                                          "port_rcv_errors 150 (limit 100)")
    assert errors["mlx5_1/1"].value == {"link_error_recovery": 12, "port_rcv_errors": 150}
    assert errors["mlx5_2/1"].status == Status.WARN
    assert "excessive_buffer_overrun_errors 15 (limit 10)" in errors["mlx5_2/1"].message
    # a port both slow and noisy shows both, each under its own probe
    assert errors["mlx5_3/1"].status == by_port(res)["mlx5_3/1"].status == Status.WARN

    site = tmp_path / "site.yaml"
    site.write_text("node: {ib_port_rcv_errors_warn: 0, ib_link_error_recovery_warn: 20}\n")
    relaxed = by_port(judge_host(facts, "n1", load_thresholds(site).node), "node.ib_errors")
    assert relaxed["mlx5_1/1"].status == Status.OK  # rcv errors not judged, 12 recoveries under 20


def test_a_down_port_has_no_counter_verdict(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    port(root, "mlx5_0", 1, state="1: DOWN", link_downed=255)
    res = judge_host({"ib_ports": read_ib_ports(root)}, "n1")
    assert [(r.probe, r.status) for r in res] == [("node.ib", Status.FAIL)]


# -- 3. latency in the node x node matrix ------------------------------------------------------------------------
def _flat(n: int, value: float) -> np.ndarray:
    m = np.full((n, n), value)
    np.fill_diagonal(m, np.nan)
    return m


def test_a_node_with_high_latency_is_named_and_a_single_slow_cell_is_a_link() -> None:
    nodes = [f"n{i}" for i in range(6)]
    bw = _flat(6, 10.0)
    lat = _flat(6, 3.0) + np.random.default_rng(1).uniform(-0.5, 0.5, (6, 6))
    lat = (lat + lat.T) / 2
    lat[2, :] = lat[:, 2] = 40.0  # n2: every link of it slow (deep C-states, a TCP fallback, ...)
    lat[0, 5] = lat[5, 0] = 30.0  # the n0-n5 route
    np.fill_diagonal(lat, np.nan)
    res = judge_matrix(nodes, bw, lat=lat)
    assert [(r.probe, r.status, r.subject.node, r.subject.peer) for r in res] == [
        ("net.latency", Status.WARN, "n2", None), ("net.latency", Status.WARN, "n0", "n5")]
    assert res[0].message.startswith("point-to-point latency to the other nodes 40.0 µs, ")
    assert res[1].message.startswith("link n0 ↔ n5: latency 30.0 µs")
    (only,) = judge_matrix(nodes, bw)  # without latencies: bandwidth only, as before
    assert only.probe == "net.matrix" and "latency" not in only.message


def test_latency_noise_on_a_fast_fabric_is_no_finding() -> None:
    nodes = [f"n{i}" for i in range(5)]
    lat = _flat(5, 2.0)
    lat[1, :] = lat[:, 1] = 9.0  # 4.5x, but 9 µs
    np.fill_diagonal(lat, np.nan)
    (ok,) = judge_matrix(nodes, _flat(5, 10.0), lat=lat)
    assert ok.probe == "net.matrix" and ok.status == Status.OK and "latency median" in ok.message
    strict = NetThresholds(latency_floor_us=5.0)
    assert [(r.probe, r.subject.node) for r in judge_matrix(nodes, _flat(5, 10.0), strict, lat)] == [
        ("net.latency", "n1")]


@pytest.mark.parametrize("slow, expected", [
    ([(1, 0), (1, 2)], [("net.latency", "n1", None)]),  # both links of n1: n1
    ([(0, 1)], [("net.latency", "n0", "n1")]),  # one link: that link, not its two ends
])
def test_three_nodes_tell_a_slow_node_from_a_slow_link(slow: list[tuple[int, int]], expected: list) -> None:
    lat = _flat(3, 5.0)
    for i, j in slow:
        lat[i, j] = lat[j, i] = 500.0
    res = judge_matrix(["n0", "n1", "n2"], _flat(3, 10.0), lat=lat)
    assert [(r.probe, r.subject.node, r.subject.peer) for r in res] == expected


SCRIPT = """
import json, sys
from mpi4py import MPI
from megatrace.check.network import NetThresholds, judge_matrix, pair_matrix
comm = MPI.COMM_WORLD
slow = int(sys.argv[1])
bw, lat = pair_matrix(comm, 1 << 16, iters=2, delay_s=0.02 if comm.Get_rank() == slow else 0.0)
if comm.Get_rank() == 0:
    nodes = [f"n{i}" for i in range(comm.Get_size())]
    # this host runs four spinning MPI tasks on few cores: ms of scheduling noise, hence a site's higher floor
    limits = NetThresholds(latency_floor_us=5000.0)
    print(json.dumps({"lat": lat.tolist(), "results": [r.to_dict() for r in judge_matrix(nodes, bw, limits, lat)]}))
"""


def test_an_injected_slow_node_shows_in_the_measured_latency(tmp_path: Path) -> None:
    """pair_matrix under a real mpiexec, n1 waiting 20 ms before each message it sends (as slow-net-n1 does)."""
    mpiexec = BIN / "mpiexec"
    if not mpiexec.exists():
        pytest.fail("mpiexec (the mpich wheel) is missing from the environment: make install brings it")
    (tmp_path / "m.py").write_text(SCRIPT)
    done = subprocess.run([str(mpiexec), "-n", "4", sys.executable, str(tmp_path / "m.py"), "1"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(done.stdout.splitlines()[-1])
    lat = np.array(doc["lat"], dtype=float)
    assert (lat[1, [0, 2, 3]] >= 9_000).all(), lat  # half of the 20 ms each round trip waited
    assert (lat[np.ix_([0, 2, 3], [0, 2, 3])][~np.eye(3, dtype=bool)] < 5_000).all(), lat
    latency = [(r["status"], r["subject"]["node"], r["subject"]["peer"]) for r in doc["results"]
               if r["probe"] == "net.latency"]
    assert latency == [("warn", "n1", None)], doc["results"]
