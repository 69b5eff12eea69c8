"""The trainer's own configuration: Megatron-LM arguments, DeepSpeed JSON, torchtitan TOML.

The tracer records the trainer's ``sys.argv`` and copies the config files it
names (:func:`megatrace.trace.environment.job_inputs`); this module reads them
into job fields of kind ``arguments``. A file that is missing, truncated or not
valid JSON/TOML, or a value of the wrong type, becomes an :class:`Issue` and the
rest is still used.

Flag and key names follow each framework's documentation:

* Megatron-LM (``megatron/training/arguments.py``): ``--tensor-model-parallel-size``,
  ``--pipeline-model-parallel-size``, ``--context-parallel-size``,
  ``--expert-model-parallel-size``, ``--num-layers-per-virtual-pipeline-stage`` (with
  ``--num-layers``) or ``--num-virtual-stages-per-pipeline-rank``, ``--micro-batch-size``,
  ``--global-batch-size``, ``--sequence-parallel``, ``--use-distributed-optimizer``,
  ``--recompute-granularity``/``--recompute-method``/``--recompute-activations``,
  ``--overlap-grad-reduce``, ``--overlap-param-gather``, ``--use-tp-pp-dp-mapping``.
* DeepSpeed JSON: ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps``, ``zero_optimization.stage``, ``pipeline.stages``,
  ``activation_checkpointing``.
* torchtitan TOML: ``[parallelism]`` ``data_parallel_replicate_degree``,
  ``data_parallel_shard_degree`` (-1: the rest of the world), ``tensor_parallel_degree``,
  ``pipeline_parallel_degree``, ``context_parallel_degree``, ``expert_parallel_degree``,
  ``pipeline_parallel_schedule``; ``[training]`` ``local_batch_size`` (or ``batch_size``),
  ``global_batch_size``; ``[activation_checkpoint] mode``; command-line overrides
  ``--parallelism.tensor_parallel_degree 4``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from megatrace.analyze.jobconfig.model import JobConfig

# Megatron-LM integer arguments -> job field.
MEGATRON_INTS = {
    "--tensor-model-parallel-size": "tp", "--pipeline-model-parallel-size": "pp", "--context-parallel-size": "cp",
    "--expert-model-parallel-size": "ep", "--virtual-pipeline-model-parallel-size": "vpp",
    "--num-virtual-stages-per-pipeline-rank": "vpp", "--micro-batch-size": "micro_batch",
    "--global-batch-size": "global_batch",
}
MEGATRON_AUX_INTS = ("--num-layers", "--num-layers-per-virtual-pipeline-stage")  # give vpp together
# Megatron-LM switches -> job field (true when present; false when absent from a Megatron command line).
MEGATRON_SWITCHES = {"--sequence-parallel": "sequence_parallel", "--use-distributed-optimizer": "distributed_optimizer",
                     "--overlap-grad-reduce": "overlap_grad_reduce", "--overlap-param-gather": "overlap_param_gather"}
MEGATRON_STRINGS = {"--recompute-granularity": "recompute", "--recompute-method": "recompute_method"}
# Megatron-LM's rank orders ("tp-cp-ep-dp-pp", or "tp-cp-ep-pp-dp" with --use-tp-pp-dp-mapping), in layout terms.
MEGATRON_ORDER, MEGATRON_TP_PP_DP = "tp-dp-pp", "tp-pp-dp"
# Arguments that mark a command line as Megatron-LM's (pretrain_gpt.py and friends).
MEGATRON_MARKERS = tuple(MEGATRON_INTS) + MEGATRON_AUX_INTS + tuple(MEGATRON_SWITCHES) + (
    "--use-tp-pp-dp-mapping", "--recompute-activations", "--use-mcore-models", "--transformer-impl")

DEEPSPEED_OPTIONS = ("--deepspeed_config", "--deepspeed-config", "--deepspeed")
TORCHTITAN_OPTIONS = ("--job.config_file", "--job.config-file")
TORCHTITAN_SIZES = {"tensor_parallel_degree": "tp", "pipeline_parallel_degree": "pp",
                    "context_parallel_degree": "cp", "expert_parallel_degree": "ep",
                    "data_parallel_replicate_degree": "dp_replicate", "data_parallel_shard_degree": "dp_shard"}
# torchtitan's device mesh is ["pp", "dp_replicate", "dp_shard", "cp", "tp"], outermost first.
TORCHTITAN_ORDER = "tp-dp-pp"


def parse_argv(argv: list[str]) -> dict[str, str | None]:
    """``--name value`` / ``--name=value`` / ``--switch`` pairs of a command line (the last one wins)."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        arg = str(argv[i])
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            if eq:
                out[name] = value
            elif i + 1 < len(argv) and not str(argv[i + 1]).startswith("--"):
                out[name] = str(argv[i + 1])
                i += 1
            else:
                out[name] = None
        i += 1
    return out


def _as_int(job: JobConfig, value: Any, where: str) -> int | None:
    """A positive integer setting; anything else is an issue (and None)."""
    number = None
    if isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
    if number is None or number < 1:
        job.issue("unparseable-config", "warning", f"{where}: {value!r} is not a positive integer; ignored")
        return None
    return number


def megatron(job: JobConfig, args: Mapping[str, str | None], defaults: list[tuple[str, Any, str]]) -> bool:
    """Megatron-LM's arguments; False when the command line is not Megatron-LM's. Values of absent flags go
    to ``defaults`` (used only where no other argument or config file gives the field)."""
    if not any(name in args for name in MEGATRON_MARKERS):
        return False
    job.offer("framework", "megatron-lm", "arguments", "command line (Megatron-LM arguments)")
    for flag, name in MEGATRON_INTS.items():
        if flag in args:
            job.offer(name, _as_int(job, args[flag], f"Megatron-LM {flag}"), "arguments", f"Megatron-LM {flag}")
        elif name in ("tp", "pp", "cp", "ep"):
            defaults.append((name, 1, f"Megatron-LM default ({flag} absent)"))
    if "--num-layers-per-virtual-pipeline-stage" in args:
        per_stage = _as_int(job, args["--num-layers-per-virtual-pipeline-stage"],
                            "Megatron-LM --num-layers-per-virtual-pipeline-stage")
        layers = _as_int(job, args.get("--num-layers"), "Megatron-LM --num-layers") if "--num-layers" in args else None
        pp = job.value_of("pp", ("arguments",))
        if per_stage and layers and pp is not None and pp.value and layers % (pp.value * per_stage) == 0:
            job.offer("vpp", layers // (pp.value * per_stage), "arguments",
                      "Megatron-LM --num-layers / (--pipeline-model-parallel-size x "
                      "--num-layers-per-virtual-pipeline-stage)")
        elif per_stage:
            job.issue("unparseable-config", "warning",
                      "Megatron-LM --num-layers-per-virtual-pipeline-stage is set, but --num-layers and "
                      "--pipeline-model-parallel-size do not give a whole number of virtual stages", "vpp")
    for flag, name in MEGATRON_SWITCHES.items():
        if flag in args:
            job.offer(name, True, "arguments", f"Megatron-LM {flag}")
        else:
            defaults.append((name, False, f"Megatron-LM default ({flag} absent)"))
    for flag, name in MEGATRON_STRINGS.items():
        if args.get(flag):
            job.offer(name, args[flag], "arguments", f"Megatron-LM {flag}")
    if "--recompute-activations" in args and not args.get("--recompute-granularity"):
        job.offer("recompute", "selective", "arguments", "Megatron-LM --recompute-activations")
    if not args.get("--recompute-granularity") and "--recompute-activations" not in args:
        defaults.append(("recompute", "none", "Megatron-LM default (--recompute-granularity absent)"))
    mapping = "--use-tp-pp-dp-mapping" in args
    job.offer("order", MEGATRON_TP_PP_DP if mapping else MEGATRON_ORDER, "arguments",
              "Megatron-LM --use-tp-pp-dp-mapping" if mapping else "Megatron-LM default rank order tp-cp-ep-dp-pp")
    return True


def _config_file(job: JobConfig, args: Mapping[str, str | None], options: tuple[str, ...],
                 files: list[Mapping[str, Any]], what: str) -> tuple[str, str] | None:
    """(path, text) of the config file named by one of ``options``; an issue when it was not captured."""
    path = next((args[o] for o in options if args.get(o) and str(args[o]).endswith((".json", ".toml"))), None)
    if path is None:
        return None
    entry = next((f for f in files if isinstance(f, Mapping) and f.get("path") == path), None)
    if entry is None or not isinstance(entry.get("text"), str):
        why = entry.get("error") if entry is not None else "not recorded by the tracer"
        job.issue("unparseable-config", "warning", f"{what} config {path}: {why}; its settings are unknown")
        return None
    if entry.get("truncated"):
        job.issue("unparseable-config", "warning", f"{what} config {path} is larger than the tracer copies; "
                  "read what was copied")
    return path, entry["text"]


def _get(data: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, Mapping) or key not in data:
            return None
        data = data[key]
    return data


def deepspeed(job: JobConfig, args: Mapping[str, str | None], files: list[Mapping[str, Any]]) -> bool:
    """The DeepSpeed JSON named on the command line; False when there is none."""
    found = _config_file(job, args, DEEPSPEED_OPTIONS, files, "DeepSpeed")
    if found is None:
        return any(o in args for o in DEEPSPEED_OPTIONS[:2])
    path, text = found
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        job.issue("unparseable-config", "warning", f"DeepSpeed config {path} is not valid JSON ({exc}); "
                  "its settings are unknown")
        return True
    if not job.has("framework"):
        job.offer("framework", "deepspeed", "arguments", f"DeepSpeed config {path}")
    for keys, name in ((("train_micro_batch_size_per_gpu",), "micro_batch"), (("train_batch_size",), "global_batch"),
                       (("gradient_accumulation_steps",), "grad_accum"), (("zero_optimization", "stage"), "zero_stage"),
                       (("pipeline", "stages"), "pp")):
        value = _get(data, *keys)
        if value is None or value == "auto":  # "auto": filled in by the Hugging Face Trainer at start-up
            continue
        where = f"DeepSpeed {path}: {'.'.join(keys)}"
        job.offer(name, _as_int(job, value, where), "arguments", where)
    if isinstance(data.get("activation_checkpointing"), Mapping):
        job.offer("recompute", "full", "arguments", f"DeepSpeed {path}: activation_checkpointing")
    return True


def torchtitan(job: JobConfig, args: Mapping[str, str | None], files: list[Mapping[str, Any]],
               defaults: list[tuple[str, Any, str]]) -> bool:
    """torchtitan's TOML (``--job.config_file``) with its ``--section.key`` overrides; False without one."""
    overrides = {k[len("--parallelism."):]: v for k, v in args.items() if k.startswith("--parallelism.")}
    found = _config_file(job, args, TORCHTITAN_OPTIONS, files, "torchtitan")
    if found is None and not overrides:
        return any(o in args for o in TORCHTITAN_OPTIONS)
    data: dict[str, Any] = {}
    path = "command line"
    if found is not None:
        import tomllib  # (here: most jobs are not torchtitan's, and the parser costs 5 ms to import)

        path, text = found
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            job.issue("unparseable-config", "warning", f"torchtitan config {path} is not valid TOML ({exc}); "
                      "its settings are unknown")
            return True
    job.offer("framework", "torchtitan", "arguments", f"torchtitan config {path}")
    parallel = dict(data.get("parallelism") or {})
    sources = {key: f"torchtitan {path}: [parallelism] {key}" for key in parallel}
    for key, value in overrides.items():
        parallel[key] = value
        sources[key] = f"torchtitan --parallelism.{key}"
    for key, name in TORCHTITAN_SIZES.items():
        if key not in parallel and name != "dp_shard":
            defaults.append((name, 1, f"torchtitan default ([parallelism] {key} absent)"))
        if key in parallel and str(parallel[key]).strip() != "-1":  # -1: the rest of the world (derived later)
            job.offer(name, _as_int(job, parallel[key], sources[key]), "arguments", sources[key])
    shard, replicate = job.value_of("dp_shard", ("arguments",)), job.value_of("dp_replicate", ("arguments",))
    if shard is not None:  # (-1, the rest of the world, is derived once the world size is known)
        job.offer("dp", shard.value * (replicate.value if replicate is not None else 1), "arguments",
                  "torchtitan data_parallel_replicate_degree x data_parallel_shard_degree")
    if parallel.get("pipeline_parallel_schedule"):
        job.offer("schedule", str(parallel["pipeline_parallel_schedule"]).lower(), "arguments",
                  sources["pipeline_parallel_schedule"])
    training = data.get("training") or {}
    for key, name in (("local_batch_size", "micro_batch"), ("batch_size", "micro_batch"),
                      ("global_batch_size", "global_batch")):
        value = training.get(key)
        if value is not None and not (isinstance(value, int) and value < 0):
            job.offer(name, _as_int(job, value, f"torchtitan {path}: [training] {key}"), "arguments",
                      f"torchtitan {path}: [training] {key}")
    mode = (data.get("activation_checkpoint") or {}).get("mode")
    if mode:
        job.offer("recompute", str(mode), "arguments", f"torchtitan {path}: [activation_checkpoint] mode")
    job.offer("order", TORCHTITAN_ORDER, "arguments", "torchtitan device mesh [pp, dp_replicate, dp_shard, cp, tp]")
    return True


def read_trainer(job: JobConfig, argv: list[str], files: list[Mapping[str, Any]]) -> str | None:
    """Offer every setting the trainer's command line and config files give; the framework found, if any."""
    args = parse_argv([str(a) for a in argv])
    defaults: list[tuple[str, Any, str]] = []
    found = None
    for name, reader in (("megatron-lm", lambda: megatron(job, args, defaults)),
                         ("deepspeed", lambda: deepspeed(job, args, files)),
                         ("torchtitan", lambda: torchtitan(job, args, files, defaults))):
        if reader() and found is None:
            found = name
    for name, value, source in defaults:
        if not job.has(name, kinds=("arguments",)):
            job.offer(name, value, "arguments", source)
    return found
