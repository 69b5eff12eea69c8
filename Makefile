# Developer entry points. Every target installs what it needs into .venv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.megatrace-installed
# The CPU build of torch (the tracer and the demo need torch; analysis does not).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install demo demo-local test bench clean lab-demo lab-down

install: $(STAMP)

NATIVE := megatrace/trace/native/_ringfast.c megatrace/trace/native/ring_record.h \
	megatrace/trace/native/c10d_hook.cpp megatrace/trace/nccl/*.c megatrace/trace/nccl/*.h

$(STAMP): pyproject.toml Makefile $(NATIVE)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[torch,test,mpi]"
	# The c10d dispatcher hook is compiled against the torch just installed (about 20 s).
	$(BIN)/python -m megatrace.trace.dispatch_hook --build --check
	touch $@

# The main job on its embedded default (as root): the local Slurm lab (4 virtual nodes, installed
# with apt when missing), `sbatch --megatrace` of the 8-rank TP2·PP2·DP2 demo job with an injected
# hang, its analysis, and the path of the HTML report. `make lab-down` stops the lab.
demo: $(STAMP)
	$(BIN)/megatrace lab demo --nodes 4 --ranks 8 --fault hang:rank=5,step=3 -C megatrace-demo-slurm

# The same job as local processes (no Slurm, no root), then its analysis and report.
demo-local: $(STAMP)
	$(BIN)/megatrace demo --ranks 8 --tp 2 --pp 2 --dp 2 --steps 20 \
		--fault hang:rank=5,step=3 -o megatrace-demo-hang
	$(BIN)/megatrace analyze megatrace-demo-hang

lab-demo: demo

lab-down: $(STAMP)
	$(BIN)/megatrace lab down

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Every benchmark, each printing its tables with ratios against a baseline measured in the same
# run (docs/performance.md). About 15 minutes on 2 cores; collection_lab needs root and the lab.
bench: $(STAMP)
	$(BIN)/python bench/tracer_overhead.py
	$(BIN)/python bench/nccl_interposer.py
	$(BIN)/python bench/analysis_scale.py
	$(BIN)/python bench/simulate_speed.py
	$(BIN)/python bench/accuracy.py
	$(BIN)/python bench/import_accuracy.py
	$(BIN)/python bench/collection_lab.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis megatrace-demo-*
