"""The built-in 3D-parallel demo job (TP x PP x DP on torch gloo) with fault injection.

``megatrace demo`` (:mod:`megatrace.demo.launcher`) starts one worker per rank
(:mod:`megatrace.demo.worker`, also ``python -m megatrace.demo`` under srun): a
real Megatron-style training loop whose every collective and point-to-point call
goes through the public ``torch.distributed`` API, so the tracer sees it. Faults
(:mod:`megatrace.demo.faults`) give tests and benchmarks a known ground truth.
Steps count from 0. See ``megatrace/demo/README.md``.
"""
