"""Job configuration end to end: hand-built traces with the tracer's meta lines, analysed, job.yaml written.

The traces are real ring and meta files (tests/helpers/analysis_factory.py); the meta lines the tracer writes at
init (process, env, job_inputs) are appended as it would write them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers.analysis_factory import TraceBuilder

from megatrace.analyze.engine import LayoutSpec, analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.config import Layout, save_layout
from megatrace.analyze.jobconfig import load_job_yaml
from megatrace.analyze.jobconfig.jobfile import field_values
from megatrace.trace import ring_format as fmt

TRUTH = Layout(8, 2, 2, 2)  # Megatron's default order: tp [0,1], dp [0,2], pp [0,4]
HOSTS = {r: "h0" if r < 4 else "h1" for r in range(8)}
MEGATRON = ["pretrain_gpt.py", "--num-layers", "8", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "16",
            "--sequence-parallel", "--use-distributed-optimizer"]


def build(root: Path, layout: Layout = TRUTH, steps: int = 3, desc: bool = False, **write: object) -> Path:
    """A healthy TP x PP x DP job: per step, PP sends, many TP all-reduces, one DP all-reduce."""
    b = TraceBuilder(world=layout.world_size, hosts=HOSTS)
    groups = {k: [b.group(k, k if desc else "", g) for g in getattr(layout, f"{k}_groups")()]
              for k in ("tp", "pp", "dp")}
    t = 1.0
    for _ in range(steps):
        for g in groups["pp"]:
            for a, c in zip(g.ranks, g.ranks[1:]):
                for _mb in range(2):
                    b.p2p(a, c, g, at=t)
                    t += 0.5
        for _ in range(4):
            for g in groups["tp"]:
                b.collective(g, at=t)
            t += 0.5
        for g in groups["dp"]:
            b.collective(g, at=t, nbytes=1 << 20)
        t += 2.0
    return b.write(root, **write)


def add_meta(root: Path, who: int, kind: str, **fields: object) -> None:
    with open(root / "rings" / fmt.meta_name(who), "a") as fh:
        fh.write(json.dumps({"kind": kind, "t_mono_ns": 1, **fields}) + "\n")


def add_job_meta(root: Path, argv: list[str], files: list[dict] | None = None, world: int = 8,
                 env: dict[int, dict] | None = None, versions: dict[int, dict] | None = None) -> None:
    for r in range(world):
        local = r % 8  # as the ring headers of the factory say
        add_meta(root, r, "process", rank=r, world_size=world, local_rank=local, host=HOSTS[r], pid=1000 + r,
                 argv=argv, torch="2.13.0", backend="nccl", **(versions or {}).get(r, {}))
        add_meta(root, r, "env", vars={"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                                       "LOCAL_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "7,6,5,4,3,2,1,0",
                                       "NCCL_DEBUG": "WARN", **(env or {}).get(r, {})})
        add_meta(root, r, "job_inputs", argv=argv, cwd="/job", files=files or [])


def config_findings(result) -> dict[str, object]:
    return {f.id: f for f in result.findings if f.kind == Kind.CONFIG}


def test_no_layout_given_the_job_config_gives_it_and_job_yaml_names_every_source(tmp_path: Path) -> None:
    root = build(tmp_path / "t")
    add_job_meta(root, MEGATRON, env={r: {"NCCL_IB_HCA": "mlx5_0" if r < 4 else "mlx5_1"} for r in range(8)},
                 versions={r: {"nccl": "2.21.5" if r < 4 else "2.19.3", "cuda": "12.4"} for r in range(8)})
    result = analyze(root)
    layout = result.trace.layout
    assert layout is not None and (layout.tp, layout.pp, layout.dp, layout.order) == (2, 2, 2, "tp-dp-pp")
    doc = load_job_yaml(root / "job.yaml")
    assert field_values(doc).items() >= {"world_size": 8, "tp": 2, "pp": 2, "dp": 2, "micro_batch": 2,
                                      "global_batch": 16, "microbatches": 4, "sequence_parallel": True,
                                      "distributed_optimizer": True, "framework": "megatron-lm", "nodes": 2,
                                      "tasks_per_node": 4}.items()
    assert doc["parallel"]["tp"]["source"] == "arguments: Megatron-LM --tensor-model-parallel-size"
    assert doc["parallel"]["dp"]["source"].startswith("groups: process groups: size 2, stride 2")
    assert doc["ranks"][5] == {"node": "h1", "local_rank": 5, "gpu": "2"}
    assert doc["gpu_sources"] == {"CUDA_VISIBLE_DEVICES[local rank]": 8}
    assert doc["environment"]["nccl"]["NCCL_DEBUG"] == "WARN"
    assert doc["environment"]["nccl"]["NCCL_IB_HCA"] == {"differs": True, "by_node": {"h0": "mlx5_0", "h1": "mlx5_1"}}
    assert doc["environment"]["versions"]["cuda"] == "12.4"
    found = config_findings(result)
    skew = [f for f in found.values() if f.data["code"] == "version-skew"]
    assert len(skew) == 1 and skew[0].severity == Severity.ERROR and "h1: 2.19.3" in skew[0].verdict
    assert not [f for f in found.values() if f.data["code"] != "version-skew"], [f.verdict for f in found.values()]
    assert any(f.id == "rule:comm-env-differs-across-ranks" for f in result.findings)  # NCCL_IB_HCA, by the rules
    facts = json.loads(json.dumps(result.document()["trace"]["job"]))
    assert facts["sizes"] == "TP2·PP2·DP2" and facts["fields"]["tp"]["value"] == 2


def test_arguments_that_disagree_with_the_groups_are_an_error_finding(tmp_path: Path) -> None:
    root = build(tmp_path / "t")
    argv = [a if a != "2" or i != 4 else "4" for i, a in enumerate(MEGATRON)]  # --tensor-model-parallel-size 4
    assert argv[3:5] == ["--tensor-model-parallel-size", "4"]
    add_job_meta(root, argv)
    result = analyze(root)
    found = config_findings(result)
    tp = found["config:groups-disagree:tp"]
    assert tp.severity == Severity.ERROR
    assert "TP is 4 by Megatron-LM --tensor-model-parallel-size" in tp.verdict and "TP = 2" in tp.verdict
    assert "config:world-size:world_size-tp-pp-dp" in found  # TP 4 x PP 2 x DP 2 (groups) != 8
    doc = load_job_yaml(root / "job.yaml")
    assert doc["parallel"]["tp"]["value"] == 4  # precedence: the arguments, as documented
    assert [a["value"] for a in doc["alternatives"]["tp"]] == [2]


def test_explicit_layout_wins_and_contradicting_sources_are_named(tmp_path: Path) -> None:
    root = build(tmp_path / "t", desc=True)
    argv = MEGATRON[:5] + ["--pipeline-model-parallel-size", "4"]
    add_job_meta(root, argv)
    save_layout(Layout(8, 2, 2, 2, microbatches=4), root / "layout.yaml")
    result = analyze(root)
    doc = load_job_yaml(root / "job.yaml")
    assert doc["parallel"]["pp"] == {"value": 2, "source": f"explicit: {root / 'layout.yaml'}"}
    found = config_findings(result)
    assert set(found) == {"config:sources-disagree:pp"}, list(found)
    assert "4 from Megatron-LM --pipeline-model-parallel-size" in found["config:sources-disagree:pp"].verdict
    spec = analyze(root, layout=LayoutSpec(tp=2, pp=2))
    assert load_job_yaml(root / "job.yaml")["parallel"]["tp"]["source"] == "explicit: --tp/--pp/--dp"
    assert spec.trace.layout.dp == 2


def test_world_size_not_the_product_and_batch_not_divisible(tmp_path: Path) -> None:
    root = build(tmp_path / "t")
    toml = "[parallelism]\ndata_parallel_shard_degree = 4\ntensor_parallel_degree = 2\npipeline_parallel_degree = 2\n" \
           "[training]\nlocal_batch_size = 3\nglobal_batch_size = 20\n"
    add_job_meta(root, ["-m", "torchtitan.train", "--job.config_file", "cfg.toml"],
                 files=[{"path": "cfg.toml", "text": toml}])
    result = analyze(root)
    found = config_findings(result)
    world = found["config:world-size:world_size-tp-pp-dp"]
    assert world.severity == Severity.ERROR and "world size 8" in world.verdict and "= 16" in world.verdict
    assert "config:batch:global_batch-micro_batch-dp" in found
    layout = result.trace.layout  # the arguments do not fit: the groups give the layout
    assert layout is not None and (layout.tp, layout.pp, layout.dp) == (2, 2, 2)


def test_bad_and_missing_inputs_still_give_a_job_yaml_and_findings_not_a_crash(tmp_path: Path) -> None:
    root = build(tmp_path / "t")
    add_job_meta(root, ["train.py", "--deepspeed_config", "ds.json"],
                 files=[{"path": "ds.json", "text": "{\"train_micro_batch_size_per_gpu\": "}])
    add_meta(root, 3, "job_inputs", argv="not a list", files=7)
    result = analyze(root)
    found = config_findings(result)
    assert any(f.data["code"] == "unparseable-config" and "ds.json" in f.verdict for f in found.values())
    assert (root / "job.yaml").exists()

    bare = build(tmp_path / "bare", no_meta=tuple(range(8)))  # no meta at all: groups from the records only
    result = analyze(bare)
    doc = load_job_yaml(bare / "job.yaml")
    assert field_values(doc)["world_size"] == 8
    assert result.trace.layout is not None and result.trace.layout.tp == 2


@pytest.mark.parametrize("order", ["tp-pp-dp", "dp-tp-pp"])
def test_another_rank_order_is_recovered_from_the_groups(tmp_path: Path, order: str) -> None:
    truth = Layout(8, 2, 2, 2, order=order)
    root = build(tmp_path / order, layout=truth)
    result = analyze(root)
    got = result.trace.layout
    assert all(getattr(got, f"{k}_groups")() == getattr(truth, f"{k}_groups")() for k in ("tp", "pp", "dp"))
    assert load_job_yaml(root / "job.yaml")["parallel"]["order"]["value"] == order


def test_slurm_environment_gives_nodes_tasks_gpus_and_placement() -> None:
    from megatrace.analyze.jobconfig.model import JobConfig
    from megatrace.analyze.jobconfig.runtime import read_runtime, slurm_tasks_per_node

    assert slurm_tasks_per_node("4(x2),2") == [4, 4, 2] and slurm_tasks_per_node("x") == []
    hosts = {r: f"n{r // 4 + 1}" for r in range(8)}
    env = {r: {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 4), "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
               "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_GPUS_PER_NODE": "h100:4", "SLURM_JOB_ID": "4242",
               "CUDA_VISIBLE_DEVICES": str(r % 4), "NCCL_SOCKET_IFNAME": "ib0"} for r in range(8)}
    job = JobConfig()
    read_runtime(job, 8, hosts, {r: -1 for r in range(8)}, {}, env)
    assert {n: job.get(n) for n in ("world_size", "nodes", "tasks_per_node", "gpus_per_node", "launcher")} == \
        {"world_size": 8, "nodes": 2, "tasks_per_node": 4, "gpus_per_node": 4, "launcher": "slurm"}
    assert job.alternatives("nodes") == [] and job.alternatives("tasks_per_node") == []
    assert job.ranks[6] == {"node": "n2", "local_rank": 2, "gpu": "2",
                            "gpu_source": "CUDA_VISIBLE_DEVICES (one device per rank)"}
    assert job.environment["nccl"] == {"NCCL_SOCKET_IFNAME": "ib0"}
    assert job.environment["slurm"]["SLURM_JOB_ID"] == "4242"


def test_quick_mode_builds_the_job_config_from_the_tails_too(tmp_path: Path) -> None:
    root = build(tmp_path / "t", steps=6)
    add_job_meta(root, MEGATRON)
    result = analyze(root, mode="hang")
    assert result.trace.tail is not None
    assert result.results["job"].sizes_label() == "TP2·PP2·DP2"
    assert load_job_yaml(root / "job.yaml")["groups"]["complete"] is True


@pytest.mark.parametrize("pipeline", [False, True], ids=["world-only", "with-p2p"])
def test_a_job_whose_only_group_is_the_world_is_data_parallel_unless_it_sends(tmp_path: Path, pipeline: bool) -> None:
    """DDP on the default group: no group reveals a dimension, yet every rank does the same work."""
    b = TraceBuilder(world=4)
    b.healthy_steps([b.world_group], steps=6)
    if pipeline:
        b.p2p(0, 1, b.world_group, at=200.0)
    b.write(tmp_path)
    result = analyze(tmp_path)
    doc = load_job_yaml(tmp_path / "job.yaml")
    if pipeline:
        assert "dp" not in doc["parallel"] or doc["parallel"]["dp"].get("value") is None
    else:
        assert doc["parallel"]["dp"]["value"] == 4 and doc["parallel"]["tp"]["value"] == 1
        assert "only the world group" in doc["parallel"]["dp"]["source"]
        assert result.results["iterations"].method == "dp-sync"


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.sampled_from(["node", "local_rank", "gpu", 'odd "key" é']),
                       st.one_of(st.text(), st.integers(-2**70, 2**70), st.none(), st.booleans(),
                                 st.floats(allow_nan=False), st.lists(st.integers(), max_size=2))))
def test_a_rank_line_of_job_yaml_is_json_dumps_of_its_row(row: dict) -> None:
    """job.yaml's rank table: each row built directly (strings, ints, None) is exactly ``json.dumps``' text."""
    from megatrace.analyze.jobconfig.jobfile import _rank_line

    assert _rank_line(row) == json.dumps(row, ensure_ascii=False)
