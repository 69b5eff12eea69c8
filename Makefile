# Developer entry points. Every target installs what it needs into .venv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.megatrace-installed
# The CPU build of torch (the tracer and the demo need torch; analysis does not).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install demo demo-local test test-slurm-release bench clean lab-demo lab-down

install: $(STAMP)

NATIVE := megatrace/trace/native/_ringfast.c megatrace/trace/native/ring_record.h \
	megatrace/analyze/native/_kernels.c megatrace/trace/native/c10d_hook.cpp \
	megatrace/trace/nccl/*.c megatrace/trace/nccl/*.h

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

# The lab's end-to-end tests again on a current Slurm release built from source (about 5 minutes the
# first time, kept in /opt/megatrace-slurm): hang with cancel, crash, time limit, an ordinary user's job,
# requeue, srun megatrace-check, a plugin of the other release. As root; CI runs it after `make test`.
SLURM_SOURCE ?= ../shared/slurm/slurm-26.05.3.tar.gz
RELEASE_SELECT ?= sbatch_help or every_tasks_ring or agents_catch or crashed_rank or time_limit or users_job_dir \
	or requeue or srun_n4 or rank_without_a_ring or plugin
test-slurm-release: $(STAMP)
	$(BIN)/megatrace lab down
	$(BIN)/megatrace lab up --nodes 4 --slurm-source $(SLURM_SOURCE)
	$(BIN)/python -m pytest tests/test_slurm_lab.py tests/test_slurm_plugin_release.py -k "$(RELEASE_SELECT)"; \
		rc=$$?; $(BIN)/megatrace lab down; exit $$rc

# Every benchmark, each printing its tables with ratios against a baseline measured in the same
# run (docs/performance.md). About 15 minutes on 2 cores; collection_lab needs root and the lab.
bench: $(STAMP)
	$(BIN)/python bench/tracer_overhead.py
	$(BIN)/python bench/nccl_interposer.py
	$(BIN)/python bench/analysis_scale.py
	$(BIN)/python bench/simulate_speed.py
	$(BIN)/python bench/accuracy.py
	$(BIN)/python bench/import_accuracy.py
	$(BIN)/python bench/collection_scale.py
	$(BIN)/python bench/collection_lab.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis megatrace-demo-*
