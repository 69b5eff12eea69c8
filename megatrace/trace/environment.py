"""The runtime environment worth recording: launcher, NCCL, torch and CUDA settings, never credentials.

The tracer writes it into each rank's meta file (a ``{"kind": "env", "vars": {...}}`` line);
analysis reads it back as facts for the rules engine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# Environment variables kept as facts: runtime and launcher settings only. Anything that looks like a
# credential is dropped even when its prefix matches (facts can end up quoted in findings.json).
ENV_PREFIXES = ("NCCL_", "TORCH_", "PYTORCH_", "CUDA_", "NVIDIA_", "GLOO_", "UCX_", "FI_", "MEGATRACE_", "SLURM_",
                "OMPI_", "PMI_", "PMIX_", "OMP_", "NVTE_", "CUBLAS_", "CUDNN_")
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "NODE_RANK", "OMP_NUM_THREADS")
SECRET_RE = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|(?:^|_)KEY(?:$|_)", re.IGNORECASE)
MAX_ENV_VALUE = 1024  # characters kept of one environment value


def filter_env(env: Mapping[str, Any] | None) -> dict[str, str]:
    """The runtime settings of ``env`` (see :data:`ENV_PREFIXES`), values as strings, credentials dropped."""
    out: dict[str, str] = {}
    for name, value in (env or {}).items():
        if not isinstance(name, str) or value is None or isinstance(value, (dict, list)):
            continue
        if not (name.startswith(ENV_PREFIXES) or name in ENV_NAMES) or SECRET_RE.search(name):
            continue
        out[name] = str(value)[:MAX_ENV_VALUE]
    return out
