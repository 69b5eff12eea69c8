"""Job configuration capture: GPUs, TP/PP/DP/CP/EP, batch sizes and training features, with their sources.

:func:`build_job_config` reads a loaded trace (the tracer's meta lines: the
trainer's command line and config files, the environment, library versions,
the process groups) plus an explicit layout when one was given, and returns a
:class:`JobConfig`: every field with its value and source, the rank placement,
and the consistency issues. :func:`job_layout` turns it into the
:class:`~megatrace.config.Layout` analysis uses when no layout was given;
:func:`write_job_yaml` writes ``job.yaml``. Modules, one concern each:

``model``       fields, values, sources and precedence
``frameworks``  Megatron-LM arguments, DeepSpeed JSON, torchtitan TOML
``runtime``     environment, ring headers, placement, NCCL settings, versions
``groups``      sizes and rank order inferred from the process groups
``checks``      derived fields and consistency checks
``jobfile``     job.yaml
``build``       the whole thing from a loaded trace, and the findings
``stage``       the analysis's first stage: the layout it gives the trace, job.yaml
"""

from megatrace.analyze.jobconfig.build import build_job_config, config_findings, describe, job_facts
from megatrace.analyze.jobconfig.checks import job_layout
from megatrace.analyze.jobconfig.jobfile import JobFileError, load_job_yaml, write_job_yaml
from megatrace.analyze.jobconfig.model import Issue, JobConfig, Value

__all__ = ["Issue", "JobConfig", "JobFileError", "Value", "build_job_config", "config_findings", "describe", "job_facts",
           "job_layout", "load_job_yaml", "write_job_yaml"]
