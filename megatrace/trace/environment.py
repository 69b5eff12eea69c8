"""The runtime environment worth recording: launcher, NCCL, torch and CUDA settings, never credentials.

The tracer writes it into each rank's meta file (a ``{"kind": "env", "vars": {...}}`` line);
analysis reads it back as facts for the rules engine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from megatrace.redact import redact_argv, redact_text, secret_name

# Environment variables kept as facts: runtime and launcher settings only. Anything that looks like a
# credential is dropped even when its prefix matches (facts can end up quoted in findings.json).
ENV_PREFIXES = ("NCCL_", "TORCH_", "PYTORCH_", "CUDA_", "NVIDIA_", "GLOO_", "UCX_", "FI_", "MEGATRACE_", "SLURM_",
                "OMPI_", "PMI_", "PMIX_", "OMP_", "NVTE_", "CUBLAS_", "CUDNN_")
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "NODE_RANK", "OMP_NUM_THREADS")
MAX_ENV_VALUE = 1024  # characters kept of one environment value


def filter_env(env: Mapping[str, Any] | None) -> dict[str, str]:
    """The runtime settings of ``env`` (see :data:`ENV_PREFIXES`), values as strings, credentials dropped.

    A variable named like a credential (``SLURM_JWT``, ``SLURM_OIDC_*``, ``*_TOKEN``, see
    :data:`megatrace.redact.SECRET_NAME_RE`) is left out; any other value loses what a credential
    looks like (URL paths and user:password@, JWTs, bearer values: :func:`megatrace.redact.redact_text`).
    Applied by the tracer when it records and again by the analysis when it reads (older traces too).
    """
    out: dict[str, str] = {}
    for name, value in (env or {}).items():
        if not isinstance(name, str) or value is None or isinstance(value, (dict, list)):
            continue
        if not (name.startswith(ENV_PREFIXES) or name in ENV_NAMES) or secret_name(name):
            continue
        out[name] = redact_text(str(value)[:MAX_ENV_VALUE])
    return out


# -- the trainer's own configuration (read at init, parsed at analysis time) --------------------------
# Options whose value is a framework config file the tracer copies into the meta file: DeepSpeed's JSON
# (``--deepspeed_config``; the Hugging Face Trainer's ``--deepspeed FILE.json``), torchtitan's TOML
# (``--job.config_file``) and Megatron-LM's YAML (``--yaml-cfg``).
CONFIG_FILE_OPTIONS = ("--deepspeed_config", "--deepspeed-config", "--deepspeed", "--job.config_file",
                       "--job.config-file", "--yaml-cfg")
CONFIG_FILE_SUFFIXES = (".json", ".toml", ".yaml", ".yml")
MAX_CONFIG_FILES = 4  # files copied per rank
MAX_CONFIG_BYTES = 64 * 1024  # bytes copied of one file (a truncated file is marked so)
MAX_ARGV_ITEMS = 2048  # command-line arguments kept
MAX_ARG_CHARS = 4096  # characters kept of one argument
NVIDIA_DRIVER_FILE = "/proc/driver/nvidia/version"


def referenced_config_files(argv: list[str]) -> list[str]:
    """Paths given to :data:`CONFIG_FILE_OPTIONS` in ``argv`` (``--opt PATH`` or ``--opt=PATH``), in order."""
    found: list[str] = []
    for i, arg in enumerate(argv):
        name, eq, value = str(arg).partition("=")
        if name not in CONFIG_FILE_OPTIONS:
            continue
        if not eq:
            value = str(argv[i + 1]) if i + 1 < len(argv) else ""
        if value.endswith(CONFIG_FILE_SUFFIXES) and value not in found:
            found.append(value)
    return found[:MAX_CONFIG_FILES]


def job_inputs(argv: list[str], cwd: str | None = None) -> dict[str, Any]:
    """The trainer's command line and the framework config files it names, bounded in size.

    Each file is ``{"path", "text"}`` (``"truncated": true`` past :data:`MAX_CONFIG_BYTES`) or
    ``{"path", "error"}``; relative paths are read from ``cwd`` (default: the current directory).
    Never raises for a bad file: the reason is recorded instead.
    """
    import os

    cwd = cwd if cwd is not None else os.getcwd()
    args = [str(a)[:MAX_ARG_CHARS] for a in list(argv)[:MAX_ARGV_ITEMS]]
    files_named = referenced_config_files(args)
    args = redact_argv(args)
    files: list[dict[str, Any]] = []
    for path in files_named:
        entry: dict[str, Any] = {"path": path}
        try:
            with open(os.path.join(cwd, path), "rb") as fh:
                blob = fh.read(MAX_CONFIG_BYTES + 1)
            entry["text"] = blob[:MAX_CONFIG_BYTES].decode("utf-8", errors="replace")
            if len(blob) > MAX_CONFIG_BYTES:
                entry["truncated"] = True
        except OSError as exc:
            entry["error"] = exc.strerror or str(exc)
        files.append(entry)
    return {"argv": args, "cwd": cwd, "files": files}


def library_versions(torch: Any) -> dict[str, str]:
    """torch, CUDA, NCCL and NVIDIA driver versions, each only where it can be read (never raises)."""
    out: dict[str, str] = {}
    for key, get in (("torch", lambda: torch.__version__), ("cuda", lambda: torch.version.cuda),
                     ("nccl", lambda: _nccl_version(torch.cuda.nccl.version())),
                     ("driver", _driver_version)):
        try:
            value = get()
        except Exception:  # noqa: BLE001 - a CPU build has no NCCL; no driver on a CPU node
            continue
        if value:
            out[key] = str(value)
    return out


def _nccl_version(value: Any) -> str:
    """torch's NCCL version: a tuple (2, 21, 5) in recent torch, an int (2708 = 2.7.8, 21805 = 2.18.5) before."""
    if isinstance(value, int):
        major, rest = (value // 10000, value % 10000) if value >= 10000 else (value // 1000, value % 1000)
        return f"{major}.{rest // 100}.{rest % 100}"
    return ".".join(map(str, value))


def _driver_version() -> str | None:
    """The NVIDIA kernel module version ("NVRM version: ... Kernel Module  550.54.15 ...")."""
    try:
        with open(NVIDIA_DRIVER_FILE) as fh:
            first = fh.readline()
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]*)", first)
    return m.group(1) if m else None
