"""Helpers shared by the test modules (tests/ is on ``sys.path``: ``from helpers.outside import wait_for``).

Test modules import from here, never from each other or from conftest (tests/test_architecture.py checks it).
Programs the tests run as separate processes stay beside the tests: tests/torch_scenarios.py,
tests/dcgmi_double.py, tests/programs/, tests/nccl_double/.

- ``analysis_factory``: hand-built traces (real ring and meta files) for the analysis tests: ``TraceBuilder``.
- ``browser``: headless Chromium over the DevTools protocol (``Browser``, the ``browser`` session fixture, which
  tests/conftest.py provides, and ``check_page``) for the report tests.
- ``comm_counts``: a job's collectives and point-to-point calls counted in its rings and by torch's own
  instruments (Flight Recorder, profiler; tests/programs/reference/sitecustomize.py).
- ``inspector_logs``: ``write_inspector``, NCCL Inspector JSON lines written from a trace.
- ``nccl_logs``: ``write_nccl_logs``, Megatrace NCCL-patch logs written from a trace.
- ``outside``: faults done to a process from outside (``Throttle``) and ``wait_for`` (poll a condition, no fixed
  sleeps).
- ``pipeline_sim``: a deterministic simulator of the demo's 1F1B training step, written as rings.
- ``planted``: what another user plants before a victim's tracer starts (issue 20).
- ``memory``: ``PEAK_KIB``, a child program's own peak memory (``VmHWM``; ``ru_maxrss`` counts its parent too).
- ``ring_stream``: the ring tests' writers and their deterministic record stream (``write_gen``,
  ``check_against_gen``, ``writer_child``).
- ``scenarios``: checked-in demo runs (tests/data/scenarios/<name>/, gzipped rings and Flight Recorder dumps) that
  importer and bad-input tests read without torch: ``unpack``; run the module to regenerate them.
- ``slurm_lab``: the local Slurm lab: ``lab_unavailable`` and submitting jobs (``sbatch``, ``submit``,
  ``job_info``).
- ``torch_ranks``: ranks of tests/torch_scenarios.py on real gloo groups (``launch``, ``finish``) and what they
  wrote (``records``, ``groups``).
- ``torchrun_job``: a real gloo program under torchrun, its output in one file as Slurm writes it, with a fault
  from outside.
"""
