"""GPU preflight through the real pynvml, over a test double of libnvidia-ml.so.1 (this machine has no GPU).

The double (tests/nvml_double/fake_nvml.c) is built here with the system compiler and found by
the dynamic loader through LD_LIBRARY_PATH, as NVIDIA's library would be. Its GPUs come from a JSON
fixture (a flat object of the double's dotted keys) named by FAKE_NVML_CONFIG.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from megatrace.check.gpu import GpuThresholds, judge_gpus, probe_gpus
from megatrace.check.results import Status, worst

pytest.importorskip("pynvml")
DOUBLE = Path(__file__).parent / "nvml_double" / "fake_nvml.c"


@pytest.fixture(scope="module")
def nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed to build the NVML test double"
    out = tmp_path_factory.mktemp("nvml")
    subprocess.run([cc, "-O2", "-fPIC", "-shared", "-Wall", "-Werror", "-Wl,-soname,libnvidia-ml.so.1",
                    "-o", str(out / "libnvidia-ml.so.1"), str(DOUBLE)], check=True)
    return out


@pytest.fixture
def node(nvml_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Returns a function: write the fake node's GPUs (a JSON fixture), run the probe, return the results."""
    monkeypatch.setenv("LD_LIBRARY_PATH", str(nvml_dir))

    def run(fixture: dict[str, Any], expected: int | None = 8, timeout_s: float = 20.0,
            thresholds: GpuThresholds | None = None):
        path = tmp_path / "nvml.json"
        path.write_text(json.dumps(fixture))
        monkeypatch.setenv("FAKE_NVML_CONFIG", str(path))
        return probe_gpus("n7", expected, timeout_s, thresholds or GpuThresholds())
    return run


UNKNOWN = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE: a process's memory NVML cannot report (pynvml: None)
HEALTHY: dict[str, Any] = {"gpus": 8, "driver": "550.54.15", "cuda": 12040, **{f"gpu{i}.nvlinks": 18 for i in range(8)}}


def by_probe(results, gpu=None):
    return {r.probe: r for r in results if r.subject.gpu == gpu}


def test_a_healthy_node_passes_every_check(node) -> None:
    results = node(HEALTHY)
    assert worst(results) == Status.OK, [r.message for r in results if r.status != Status.OK]
    node_level = by_probe(results)
    assert node_level["gpu.count"].value == 8
    assert node_level["gpu.driver"].message == "driver 550.54.15, CUDA 12.4"
    assert {r.subject.gpu for r in results} == {None, *range(8)}
    gpu5 = by_probe(results, 5)
    assert set(gpu5) >= {"gpu.temperature", "gpu.clocks", "gpu.ecc", "gpu.remap", "gpu.power", "gpu.pcie",
                         "gpu.memory", "gpu.nvlink"}
    assert gpu5["gpu.nvlink"].message == "18 NVLinks up"
    assert gpu5["gpu.temperature"].subject.pci_bus == "00000000:1D:00.0"
    assert gpu5["gpu.temperature"].subject.uuid.startswith("GPU-")


@pytest.mark.parametrize("fault, probe, status, words", [
    ({"gpu3.clock_events": "0x8"}, "gpu.clocks", Status.FAIL, "HW slowdown"),
    ({"gpu3.clock_events": "0x20"}, "gpu.clocks", Status.WARN, "SW thermal slowdown"),
    ({"gpu3.clock_events": "0x1"}, "gpu.clocks", Status.OK, "no slowdown"),  # idle is not a slowdown
    ({"gpu3.ecc_dbe": 2}, "gpu.ecc", Status.FAIL, "2 uncorrected ECC errors"),
    ({"gpu3.ecc_sbe": 500}, "gpu.ecc", Status.WARN, "500 corrected"),
    ({"gpu3.remap_pending": 1}, "gpu.remap", Status.WARN, "pending a GPU reset"),
    ({"gpu3.remap_failure": 1}, "gpu.remap", Status.FAIL, "row remapping failed"),
    ({"gpu3.temp": 84}, "gpu.temperature", Status.WARN, "within 5 °C of slowdown"),
    ({"gpu3.temp": 88}, "gpu.temperature", Status.FAIL, "at its slowdown temperature 87 °C"),
    ({"gpu3.power_limit": 500000}, "gpu.power", Status.WARN, "500 W below its default 700 W"),
    ({"gpu3.pcie_width": 8}, "gpu.pcie", Status.WARN, "x8 of x16"),
    ({"gpu3.procs": "4242:4294967296"}, "gpu.memory", Status.FAIL, "4096 MiB held by processes 4242"),
    ({"gpu3.procs": f"4242:{UNKNOWN}"}, "gpu.memory", Status.WARN,  # MIG, containers: NVML cannot say how much
     "process 4242 holds an unknown amount of GPU memory"),
    ({"gpu3.procs": f"4242:{UNKNOWN},5151:4294967296"}, "gpu.memory", Status.FAIL,
     "4096 MiB held by processes 4242, 5151 before the job starts (4242: amount unknown)"),
    ({"gpu3.error.nvmlDeviceGetHandleByIndex_v2": 15}, "gpu.nvml", Status.FAIL,  # NVML_ERROR_GPU_IS_LOST
     "NVML cannot open the GPU: GPU is lost"),
    ({"gpu3.error.nvmlDeviceGetRemappedRows": 3}, "gpu.remap", Status.SKIP, "Not Supported"),
    ({"gpu3.nvlink_down": 4}, "gpu.nvlink", Status.FAIL, "NVLink 4 down while 17 others are up"),
    ({"gpu3.nvlink5.crc_flit": 400}, "gpu.nvlink", Status.WARN, "NVLink 5: 400 replay/recovery/CRC errors"),
    ({"gpu3.pcie_gen_max": 4, "gpu3.pcie_gen": 1}, "gpu.pcie_gen", Status.WARN, "limited to Gen4; the GPU does Gen5"),
    ({"gpu3.pcie_gen": 1}, "gpu.pcie_gen", Status.OK, "PCIe Gen5 link"),  # an idle GPU drops its link speed
    ({"gpu3.retired_pending": 1}, "gpu.retired", Status.WARN, "page retirement is pending a GPU reset"),
    ({"gpu3.retired_sbe": 40, "gpu3.retired_dbe": 22}, "gpu.retired", Status.FAIL,
     "62 pages retired (22 for double-bit"),
    ({"gpu3.slowdown_temp": "unsupported", "gpu3.temp": 93}, "gpu.temperature", Status.FAIL,
     "93 °C at its shutdown temperature 92 °C"),  # no slowdown threshold reported: the shutdown one
    ({"gpu3.xid_event": 48}, "gpu.xid", Status.FAIL, "XID 48 from NVML"),
])
def test_each_fault_is_named_on_its_gpu(node, fault: dict[str, Any], probe: str, status: Status, words: str) -> None:
    results = node({**HEALTHY, **fault})
    hit = by_probe(results, 3)[probe]
    assert hit.status == status and words in hit.message, hit
    others = [r for r in results if r.subject.gpu != 3 and r.status != Status.OK]
    assert not others, others
    if status == Status.FAIL:
        assert hit.drain_reason().startswith("megatrace: GPU3 ")
        assert hit.remediation


def test_nvml_xid_events_count_with_the_kernel_log_or_without_it(node, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRACE_KERNEL_LOG", str(tmp_path / "unreadable"))  # a container: no kernel log
    results = node({**HEALTHY, "gpu6.xid_event": "13,79"})
    xid6 = by_probe(results, 6)["gpu.xid"]
    assert xid6.status == Status.FAIL and xid6.message.startswith("XID 79 from NVML")
    assert by_probe(results, 1)["gpu.xid"].status == Status.OK  # events of GPU6 only
    log = tmp_path / "kern.log"
    log.write_text("kernel: NVRM: Xid (PCI:0000:1e:00): 31, pid=1, MMU Fault\n")  # GPU6's bus
    monkeypatch.setenv("MEGATRACE_KERNEL_LOG", str(log))
    xid6 = by_probe(node({**HEALTHY, "gpu6.xid_event": "13"}), 6)["gpu.xid"]
    assert xid6.status == Status.WARN and "XID 13, 31" in xid6.message and xid6.value == [13, 31]


def test_xid_lines_of_the_kernel_log_land_on_their_gpu(node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "kern.log"
    log.write_text("Dec  2 03:12:01 n7 kernel: [ 812.3] NVRM: Xid (PCI:0000:1a:00): 79, pid='<unknown>', "
                   "name=<unknown>, GPU has fallen off the bus.\n"
                   "Dec  2 03:12:09 n7 kernel: [ 820.0] NVRM: Xid (PCI:0000:1c:00): 13, pid=4242, Graphics Exception\n")
    monkeypatch.setenv("MEGATRACE_KERNEL_LOG", str(log))
    results = node(HEALTHY)
    xid2, xid4 = by_probe(results, 2)["gpu.xid"], by_probe(results, 4)["gpu.xid"]  # buses 0x1a and 0x1c
    assert xid2.status == Status.FAIL and xid2.drain_reason().startswith("megatrace: GPU2 XID 79")
    assert xid4.status == Status.WARN and "XID 13" in xid4.message
    assert by_probe(results, 0)["gpu.xid"].status == Status.OK


def test_a_missing_gpu_fails_the_count(node) -> None:
    results = node({**HEALTHY, "gpus": 7})
    count = by_probe(results)["gpu.count"]
    assert count.status == Status.FAIL and count.message == "7 GPUs visible, 8 allocated"


def test_a_driver_that_is_not_loaded_fails(node) -> None:
    (res,) = node({"init_error": 9})
    assert res.status == Status.FAIL and res.message == "NVML unusable: Driver Not Loaded"


def test_no_nvml_is_a_skip_without_gpus_and_a_failure_with(node, monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))  # no libnvidia-ml.so.1 here
    (skip,) = node(HEALTHY, expected=None)
    assert skip.status == Status.SKIP and "NVML Shared Library Not Found" in skip.message
    (fail,) = node(HEALTHY, expected=4)
    assert fail.status == Status.FAIL


def test_a_task_checks_only_the_gpus_it_was_given(node, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a task bound to GPUs 2 and 5 (by index, or by UUID) reads and reports; the node's count is not its."""
    faults = {**HEALTHY, "gpu5.uuid": "GPU-5f00", "gpu5.ecc_dbe": 2, "gpu1.ecc_dbe": 2}
    for select in (["2", "5"], ["2", "GPU-5f"]):
        node(faults)  # (writes the config and points the double at it)
        results = probe_gpus("n7", 8, select=select, node_level=False)
        assert {r.subject.gpu for r in results} == {2, 5}  # no node results, no GPU1 (another task's)
        assert {r.subject.gpu for r in results if r.status == Status.FAIL} == {5}
    assert by_probe(node(faults))["gpu.count"].status == Status.OK  # the node's task still counts all eight


def test_a_wedged_driver_fails_within_the_timeout_instead_of_hanging(node) -> None:
    t = time.monotonic()
    (res,) = node({**HEALTHY, "gpu2.hang_ms": 30000}, timeout_s=2.0)
    assert time.monotonic() - t < 10
    assert res.status == Status.FAIL and "did not answer within 2 s" in res.message


def test_judging_needs_no_library() -> None:
    """The rules alone, on facts as the reader returns them (with an error where a call failed)."""
    facts = {"driver": "535.1", "cuda": 12020, "gpus": [
        {"index": 0, "uuid": "GPU-a", "pci_bus": "0:1", "temp": 50, "slowdown_temp": {"error": "Not Supported"},
         "clock_events": 0x80, "ecc_dbe": 0, "ecc_sbe": 0, "remapped_rows": [0, 0, 0, 0], "power_limit": 1,
         "power_default": 1, "pcie_width": 16, "pcie_width_max": 16, "procs": [], "mig": [1, 1], "persistence": 0}]}
    res = {r.probe: r for r in judge_gpus(facts, "n1", 1)}
    assert res["gpu.clocks"].status == Status.FAIL and "HW power brake" in res["gpu.clocks"].message
    assert res["gpu.temperature"].status == Status.OK  # no threshold known: only the reading
    assert res["gpu.mig"].status == Status.WARN and res["gpu.persistence"].status == Status.WARN


def test_per_model_limits_hold_each_gpu_to_its_own_model(node, tmp_path: Path) -> None:
    """configs/thresholds.yaml's models section: an H100 SXM needs 18 NVLinks up; another model is not held to it."""
    from megatrace.check.thresholds import load_thresholds

    limits = load_thresholds(Path(__file__).resolve().parent.parent / "configs" / "thresholds.yaml").gpu
    results = node({"gpus": 2, "gpu0.nvlinks": 12, "gpu1.name": "NVIDIA A100-SXM4-80GB", "gpu1.nvlinks": 12}, 2,
                   thresholds=limits)
    h100, a100 = by_probe(results, 0)["gpu.nvlink"], by_probe(results, 1)["gpu.nvlink"]
    assert h100.status == Status.FAIL and h100.message.startswith("12 of 18 NVLinks up"), h100
    assert a100.status == Status.OK and a100.message == "12 NVLinks up", a100
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  '*H100*': {gpu: {nvlink: 18}}\n")
    with pytest.raises(ValueError, match=r"bad.yaml: models.\*H100\*.gpu.nvlink: unknown limit"):
        load_thresholds(bad)


def test_a_process_of_unknown_memory_is_read_as_none(nvml_dir: Path, tmp_path: Path) -> None:
    """The double's NVML_VALUE_NOT_AVAILABLE reaches the reader as pynvml's None (not a number)."""
    fixture = tmp_path / "nvml.json"
    fixture.write_text(json.dumps({"gpus": 1, "gpu0.procs": f"4242:{UNKNOWN},5151:2048"}))
    env = {**os.environ, "LD_LIBRARY_PATH": str(nvml_dir), "FAKE_NVML_CONFIG": str(fixture)}
    done = subprocess.run([sys.executable, "-m", "megatrace.check.gpu"], env=env, capture_output=True, text=True,
                          check=False)
    assert json.loads(done.stdout)["gpus"][0]["procs"] == [{"pid": 4242, "bytes": None}, {"pid": 5151, "bytes": 2048}]


def test_a_lost_gpu_is_named_and_the_others_are_still_checked(node) -> None:
    results = node({**HEALTHY, "gpu3.error.nvmlDeviceGetHandleByIndex_v2": 15})  # NVML_ERROR_GPU_IS_LOST
    (lost,) = [r for r in results if r.subject.gpu == 3]
    assert lost.status == Status.FAIL and lost.drain_reason() == "megatrace: GPU3 NVML cannot open the GPU: GPU is lost"
    assert "XID 79" in lost.remediation and "drain" in lost.remediation
    assert by_probe(results)["gpu.count"].status == Status.OK  # NVML still counts it
    for i in (0, 1, 2, 4, 5, 6, 7):
        assert by_probe(results, i)["gpu.memory"].status == Status.OK
    uuid = "GPU-00000000-0000-0000-0000-{:012d}".format  # the double's default UUIDs (a lost GPU has none to read)
    for own, other in ((["3"], ["2"]), ([uuid(3)], [uuid(2)])):  # tasks bound by index, or by UUID
        assert {r.subject.gpu for r in probe_gpus("n7", 8, select=own, node_level=False)} == {3}  # its task names it
        assert {r.subject.gpu for r in probe_gpus("n7", 8, select=other, node_level=False)} == {2}  # another's not


def test_kernel_xids_compare_the_pci_domain(node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Grace Hopper: one GPU per PCI domain, all on bus 01; an Xid names one of them only."""
    domains = (0x9, 0x19, 0x29, 0x39)
    log = tmp_path / "kern.log"
    log.write_text("kernel: NVRM: Xid (PCI:0019:01:00): 79, pid='<unknown>', GPU has fallen off the bus.\n")
    monkeypatch.setenv("MEGATRACE_KERNEL_LOG", str(log))
    results = node({"gpus": 4, **{f"gpu{i}.bus": f"{d:08X}:01:00.0" for i, d in enumerate(domains)}}, 4)
    assert {i: by_probe(results, i)["gpu.xid"].status for i in range(4)} == {
        0: Status.OK, 1: Status.FAIL, 2: Status.OK, 3: Status.OK}
    assert by_probe(results, 1)["gpu.xid"].subject.pci_bus == "00000019:01:00.0"


def test_a_fixture_that_is_not_json_fails_nvml_init_naming_the_byte(nvml_dir: Path, tmp_path: Path) -> None:
    fixture = tmp_path / "nvml.json"
    text = '{"gpus": 2, "gpu0.name": "H100",}'
    fixture.write_text(text)
    env = {**os.environ, "LD_LIBRARY_PATH": str(nvml_dir), "FAKE_NVML_CONFIG": str(fixture)}
    done = subprocess.run([sys.executable, "-m", "megatrace.check.gpu"], env=env, capture_output=True, text=True,
                          check=False)
    assert json.loads(done.stdout) == {"error": "Unknown Error"}
    assert f"fake_nvml: {fixture}: JSON error at byte offset {text.index('}')}: expected a key" in done.stderr


def test_a_model_entry_overrides_only_the_limits_it_sets(node, tmp_path: Path) -> None:
    """Defaults, then the site's gpu section, then the matching model entry's own fields (built in or the site's)."""
    from megatrace.check.thresholds import load_thresholds, save_thresholds

    h100 = "NVIDIA H100 80GB HBM3"
    site = tmp_path / "site.yaml"
    site.write_text("gpu: {stray_memory_mib: 4096}\n")  # no models section: the built-in ones apply
    limits = load_thresholds(site).gpu
    assert limits.for_model(h100) == GpuThresholds(stray_memory_mib=4096, nvlinks=18)
    results = node({"gpus": 1, "gpu0.name": h100, "gpu0.nvlinks": 18, "gpu0.procs": "4242:2147483648"}, 1,
                   thresholds=limits)
    memory = by_probe(results, 0)["gpu.memory"]
    assert memory.status == Status.OK and memory.threshold == 4096, memory
    site.write_text("gpu: {stray_memory_mib: 4096, ecc_sbe_warn: 10}\n"
                    "models: {'*H100*': {gpu: {ecc_sbe_warn: 500}}, '*A100*': {gpu: {nvlinks: 12}}}\n")
    full = load_thresholds(site)
    assert full.gpu.for_model(h100) == GpuThresholds(stray_memory_mib=4096, ecc_sbe_warn=500)
    assert full.gpu.for_model("NVIDIA A100-SXM4-80GB") == GpuThresholds(stray_memory_mib=4096, ecc_sbe_warn=10,
                                                                        nvlinks=12)
    assert full.gpu.for_model("Tesla T4") == GpuThresholds(stray_memory_mib=4096, ecc_sbe_warn=10)
    assert full.to_dict()["models"] == {"*H100*": {"gpu": {"ecc_sbe_warn": 500}}, "*A100*": {"gpu": {"nvlinks": 12}}}
    saved = tmp_path / "saved.yaml"
    save_thresholds(full, saved)
    assert load_thresholds(saved) == full


@pytest.mark.parametrize("text, words", [
    ("net: {slow_ratio: .nan}\n", "net.slow_ratio: expected a finite number, got nan"),
    ("node: {clock_offset_fail_ms: .inf}\n", "node.clock_offset_fail_ms: expected a finite number, got inf"),
    ("gpu: {ecc_dbe_fail: 0}\n", r"gpu.ecc_dbe_fail: must be at least 1, got 0 \(0 would flag every GPU\)"),
    ("gpu: {stray_memory_mib: 0}\n", r"gpu.stray_memory_mib: must be at least 1, got 0 \(0 would flag every GPU\)"),
    ("models: {'*H100*': {gpu: {retired_pages_fail: 0}}}\n",
     r"models.\*H100\*.gpu.retired_pages_fail: must be at least 1, got 0 \(0 would flag every GPU\)"),
    ("node: {clock_offset_warn_ms: 0}\n",
     r"node.clock_offset_warn_ms: must be positive, got 0 \(0 would flag every node\)"),
    ("node: {cpu_ratio_warn: 1.5}\n", "node.cpu_ratio_warn: expected a share of the median from 0 to 1, got 1.5"),
    ("gpu: {temp_margin_c: -1}\n", "gpu.temp_margin_c: must not be negative, got -1"),
])
def test_limits_that_would_judge_every_gpu_or_node_wrongly_are_rejected(tmp_path: Path, text: str, words: str) -> None:
    from megatrace.check.thresholds import ThresholdsError, load_thresholds

    bad = tmp_path / "t.yaml"
    bad.write_text(text)
    with pytest.raises(ThresholdsError, match=f"^{re.escape(str(bad))}: {words}$"):
        load_thresholds(bad)


def test_a_thresholds_file_that_is_not_text_is_one_error_line(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_bytes(b"\x00\xff")
    done = subprocess.run([str(Path(sys.executable).parent / "megatrace-check"), "--thresholds", str(bad)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr == f"Error: {bad}: cannot read thresholds: not UTF-8 text (byte 1 is 0xff)\n"


DCGM_DOC = {"DCGM Diagnostic": {"version": "4.2.3", "test_categories": [
    {"category": "Deployment", "tests": [{"name": "software", "results": [
        {"entity_group": "GPU", "entity_id": 0, "status": "Pass"},
        {"entity_group": "GPU", "entity_id": 1, "status": "Pass"}], "test_summary": {"status": "Pass"}}]},
    {"category": "Hardware", "tests": [{"name": "memory", "results": [
        {"entity_group": "GPU", "entity_id": 0, "status": "Pass"},
        {"entity_group": "GPU", "entity_id": 1, "status": "Fail",
         "warnings": [{"warning": "GPU 1 had uncorrectable memory errors and row remapping failed"}]}],
        "test_summary": {"status": "Fail"}}]}]}}


def test_the_dcgm_level_1_diagnostic_is_judged_per_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dcgmi diag -r 1 -j` through a stand-in for the dcgmi tool (no DCGM on this machine)."""
    import copy
    import json

    from megatrace.check.dcgm import probe_dcgm

    dcgmi = str(Path(__file__).parent / "dcgmi_double.py")
    doc = tmp_path / "diag.json"
    doc.write_text(json.dumps(DCGM_DOC))
    monkeypatch.setenv("FAKE_DCGMI_JSON", str(doc))
    (fail,) = probe_dcgm("n7", dcgmi=dcgmi)
    assert fail.status == Status.FAIL and fail.subject.gpu == 1 and "DCGM memory: GPU 1 had uncorrectable" in fail.message
    assert fail.drain_reason().startswith("megatrace: GPU1 DCGM memory")
    passing = copy.deepcopy(DCGM_DOC)
    passing["DCGM Diagnostic"]["test_categories"][1]["tests"][0]["results"][1]["status"] = "Pass"
    doc.write_text(json.dumps(passing))
    (ok,) = probe_dcgm("n7", dcgmi=dcgmi)
    assert ok.status == Status.OK and ok.message == "DCGM level-1 diagnostic passed (2 tests)"
    monkeypatch.delenv("FAKE_DCGMI_JSON")
    monkeypatch.setenv("FAKE_DCGMI_RC", "255")
    (down,) = probe_dcgm("n7", dcgmi=dcgmi)
    assert down.status == Status.WARN and "unable to establish a connection" in down.message
    monkeypatch.setenv("FAKE_DCGMI_SLEEP", "5")
    (hung,) = probe_dcgm("n7", timeout_s=1.0, dcgmi=dcgmi)
    assert hung.status == Status.FAIL and "did not finish within 1 s" in hung.message
    assert probe_dcgm("n7", dcgmi=None) == [] or shutil.which("dcgmi")  # not installed: no result at all
