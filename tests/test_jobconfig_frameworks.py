"""The trainer's own configuration: realistic Megatron-LM, DeepSpeed and torchtitan command lines and files.

Flag and key names follow each framework's documentation (see megatrace/analyze/jobconfig/frameworks.py).
Config files are real files read by the tracer's capture (``job_inputs``), then parsed.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatrace.analyze.jobconfig.checks import check, derive, job_layout
from megatrace.analyze.jobconfig.frameworks import read_trainer
from megatrace.analyze.jobconfig.groups import Inference
from megatrace.analyze.jobconfig.model import JobConfig
from megatrace.trace.environment import MAX_CONFIG_BYTES, job_inputs, referenced_config_files

MEGATRON_GPT = """pretrain_gpt.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096
 --max-position-embeddings 4096 --tensor-model-parallel-size 4 --pipeline-model-parallel-size 4
 --context-parallel-size 2 --expert-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2
 --micro-batch-size 1 --global-batch-size 512 --sequence-parallel --use-distributed-optimizer
 --overlap-grad-reduce --overlap-param-gather --recompute-granularity full --recompute-method uniform
 --recompute-num-layers 1 --bf16 --lr 3.0e-4 --train-iters 500000 --data-path /data/gpt_text_document
 --tokenizer-type GPT2BPETokenizer --save /ckpt --load /ckpt""".split()


def captured(argv: list[str], cwd: Path, world: int = 64) -> JobConfig:
    """Capture like the tracer does, parse, derive and check (no groups)."""
    inputs = job_inputs(argv, str(cwd))
    job = JobConfig()
    read_trainer(job, inputs["argv"], inputs["files"])
    job.offer("world_size", world, "environment", "ring headers")
    derive(job)
    check(job, Inference(world))
    return job


def values(job: JobConfig, *names: str) -> dict:
    return {n: job.get(n) for n in names}


def test_megatron_gpt_command_line(tmp_path: Path) -> None:
    job = captured(MEGATRON_GPT, tmp_path, world=256)
    assert values(job, "framework", "tp", "pp", "cp", "ep", "vpp", "dp", "micro_batch", "global_batch",
                  "microbatches", "order") == {
        "framework": "megatron-lm", "tp": 4, "pp": 4, "cp": 2, "ep": 2, "vpp": 4, "dp": 8, "micro_batch": 1,
        "global_batch": 512, "microbatches": 64, "order": "tp-dp-pp"}
    assert values(job, "sequence_parallel", "distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                  "recompute", "recompute_method") == {
        "sequence_parallel": True, "distributed_optimizer": True, "overlap_grad_reduce": True,
        "overlap_param_gather": True, "recompute": "full", "recompute_method": "uniform"}
    assert job.chosen("tp").source == "Megatron-LM --tensor-model-parallel-size"
    assert job.chosen("dp").kind == "derived"
    assert job.issues == []
    layout = job_layout(job)
    assert (layout.tp, layout.pp, layout.dp, layout.order) == (4, 4, 16, "tp-dp-pp")  # CP folded into DP


def test_megatron_defaults_mapping_flag_and_newer_vpp_flag(tmp_path: Path) -> None:
    argv = ["pretrain_gpt.py", "--pipeline-model-parallel-size=2", "--num-virtual-stages-per-pipeline-rank=3",
            "--use-tp-pp-dp-mapping", "--micro-batch-size", "2", "--global-batch-size", "30",
            "--recompute-activations"]
    job = captured(argv, tmp_path, world=8)
    assert values(job, "tp", "pp", "vpp", "dp", "order", "recompute", "sequence_parallel") == {
        "tp": 1, "pp": 2, "vpp": 3, "dp": 4, "order": "tp-pp-dp", "recompute": "selective",
        "sequence_parallel": False}
    assert "absent" in job.chosen("tp").source
    (issue,) = [i for i in job.issues if i.code == "batch"]
    assert "30" in issue.message and "2 x 4 = 8" in issue.message


def test_deepspeed_json_from_megatron_deepspeed_command_line(tmp_path: Path) -> None:
    (tmp_path / "ds_config.json").write_text(json.dumps({
        "train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}, "bf16": {"enabled": True},
        "pipeline": {"stages": 2, "partition": "best"}, "activation_checkpointing": {"partition_activations": True},
        "steps_per_print": 10}))
    argv = ["pretrain_gpt.py", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--deepspeed", "--deepspeed_config", "ds_config.json", "--zero-stage", "1"]
    job = captured(argv, tmp_path, world=32)
    assert values(job, "framework", "tp", "pp", "dp", "micro_batch", "grad_accum", "global_batch", "zero_stage",
                  "microbatches", "recompute") == {
        "framework": "megatron-lm", "tp": 2, "pp": 2, "dp": 8, "micro_batch": 4, "grad_accum": 8,
        "global_batch": 256, "zero_stage": 1, "microbatches": 8, "recompute": "full"}
    assert job.chosen("micro_batch").source == "DeepSpeed ds_config.json: train_micro_batch_size_per_gpu"
    assert job.issues == []


def test_deepspeed_hf_trainer_style_and_inconsistent_train_batch(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_batch_size": 100, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 3}}))
    job = captured(["train.py", "--deepspeed", "ds.json", "--output_dir", "out"], tmp_path, world=8)
    assert values(job, "framework", "micro_batch", "zero_stage", "global_batch", "grad_accum") == {
        "framework": "deepspeed", "micro_batch": 2, "zero_stage": 3, "global_batch": 100, "grad_accum": None}
    (tmp_path / "ds2.json").write_text(json.dumps({"train_batch_size": 96, "train_micro_batch_size_per_gpu": 2,
                                                    "gradient_accumulation_steps": 4}))
    job = captured(["train.py", "--tensor-model-parallel-size", "1", "--deepspeed_config=ds2.json"], tmp_path, world=8)
    (issue,) = [i for i in job.issues if i.code == "batch"]
    assert "2 x 4 x 8 = 64" in issue.message


TITAN_TOML = """
[job]
dump_folder = "./outputs"
description = "Llama 3 70B training"

[model]
name = "llama3"
flavor = "70B"

[training]
local_batch_size = 8
global_batch_size = 256
seq_len = 8192
steps = 1000

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 8
pipeline_parallel_degree = 2
context_parallel_degree = 1
pipeline_parallel_schedule = "1F1B"

[activation_checkpoint]
mode = "selective"
"""


def test_torchtitan_toml_with_command_line_override(tmp_path: Path) -> None:
    (tmp_path / "llama3_70b.toml").write_text(TITAN_TOML)
    argv = ["-m", "torchtitan.train", "--job.config_file", "llama3_70b.toml", "--parallelism.tensor_parallel_degree",
            "4"]
    job = captured(argv, tmp_path, world=64)
    assert values(job, "framework", "tp", "pp", "cp", "dp", "micro_batch", "global_batch", "recompute",
                  "schedule", "order", "microbatches") == {
        "framework": "torchtitan", "tp": 4, "pp": 2, "cp": 1, "dp": 8, "micro_batch": 8, "global_batch": 256,
        "recompute": "selective", "schedule": "1f1b", "order": "tp-dp-pp", "microbatches": 4}
    assert job.chosen("tp").source == "torchtitan --parallelism.tensor_parallel_degree"
    assert job.chosen("pp").source == "torchtitan llama3_70b.toml: [parallelism] pipeline_parallel_degree"
    assert job.issues == []


def test_torchtitan_explicit_degrees_that_do_not_fill_the_world(tmp_path: Path) -> None:
    (tmp_path / "t.toml").write_text("[parallelism]\ndata_parallel_shard_degree = 4\ntensor_parallel_degree = 2\n"
                                     "pipeline_parallel_degree = 2\n")
    job = captured(["train.py", "--job.config_file=t.toml"], tmp_path, world=8)
    (issue,) = [i for i in job.issues if i.code == "world-size"]
    assert "world size 8" in issue.message and "16" in issue.message
    assert job_layout(job) is None


def test_unparseable_missing_and_odd_configs_give_issues_and_the_rest(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"train_micro_batch_size_per_gpu": 4,')
    (tmp_path / "bad.toml").write_text("[parallelism\ntensor_parallel_degree = 2")
    argv = ["pretrain_gpt.py", "--tensor-model-parallel-size", "two", "--pipeline-model-parallel-size", "2",
            "--deepspeed_config", "bad.json", "--job.config_file", "bad.toml"]
    job = captured(argv, tmp_path, world=8)
    codes = [i.code for i in job.issues]
    assert codes.count("unparseable-config") == 3, job.issues
    assert job.get("pp") == 2 and job.get("tp") is None
    missing = captured(["train.py", "--deepspeed_config", "nowhere.json"], tmp_path, world=8)
    assert any("nowhere.json" in i.message and "No such file" in i.message for i in missing.issues)


def test_capture_is_bounded(tmp_path: Path) -> None:
    (tmp_path / "big.json").write_text('{"x": "' + "a" * (MAX_CONFIG_BYTES + 10) + '"}')
    (tmp_path / "dir.json").mkdir()
    argv = ["t.py", "--deepspeed_config", "big.json", "--yaml-cfg", "dir.json", "--junk=" + "b" * 10_000]
    got = job_inputs(argv, str(tmp_path))
    big, folder = got["files"]
    assert big["truncated"] and len(big["text"]) == MAX_CONFIG_BYTES
    assert "error" in folder
    assert max(len(a) for a in got["argv"]) <= 4096
    assert referenced_config_files(["a.py", "--deepspeed", "--deepspeed_config", "x.json", "--job.config_file=y.toml"]) \
        == ["x.json", "y.toml"]


def test_zero_negative_and_fractional_sizes_are_issues_not_crashes(tmp_path: Path) -> None:
    argv = ["pretrain_gpt.py", "--tensor-model-parallel-size", "-2", "--pipeline-model-parallel-size", "0",
            "--micro-batch-size", "0", "--global-batch-size", "1.5"]
    job = captured(argv, tmp_path, world=8)
    assert [i.code for i in job.issues].count("unparseable-config") == 4, job.issues
    assert job.get("micro_batch") is None and job.get("global_batch") is None
    assert "Megatron-LM --tensor-model-parallel-size: '-2'" in job.issues[0].message
