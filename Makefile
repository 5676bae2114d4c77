# Every target installs what it needs into .venv first, so each works on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Where a CPU build of torch lies on disk (/opt/wheels here), it is installed from there first
# (--no-index: never from the network), so the `torch` extra, already satisfied, fetches nothing.
WHEELS := $(wildcard /opt/wheels)
LOCAL_TORCH := $(if $(WHEELS),$(wildcard $(WHEELS)/torch-2.13.0*.whl))
PIP_FLAGS := $(if $(WHEELS),--find-links $(WHEELS),)
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
BENCH_OUT := build/bench

.PHONY: install demo test test-fast test-python-engine test-hosts test-gpu test-torch-suite bench bench-init bench-calls lint typecheck clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard aiodist/*.pyx aiodist/*/*.pyx aiodist/*/*.pxd)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(LOCAL_TORCH),$(PY) -m pip install -q --no-index --find-links $(WHEELS) --no-deps 'torch==2.13.0')
	$(PY) -m pip install -q $(PIP_FLAGS) -e '.[torch,test,dev]'
	touch $(STAMP)

demo: install
	$(PY) examples/demo.py

test: install
	$(PY) -m pytest -q

# The unit and in-memory tiers (tests/unit, tests/collectives and the memory cases of the
# every-operation suite): under a minute. They are CPU-bound and share nothing, so they run on
# one worker per core (work stealing evens out the long parametrised cases); the other tiers run
# processes of their own and stay serial in `make test`.
test-fast: install
	$(PY) -m pytest -q -m "unit or collectives" -n auto --dist worksteal

# The Python twins of the compiled parts (AIODIST_NATIVE=0; aiodist.native), in about two
# minutes: the unit tier, which gives both twins the same inputs, the in-memory tier (every
# operation through the Python matcher and Work), and the tests of the shared-memory transport
# and the sync face they serve (there the blocking calls take the loop thread's way). CI runs
# the whole suite both ways: `AIODIST_NATIVE=1 make test`, `AIODIST_NATIVE=0 make test`.
test-python-engine: install
	AIODIST_NATIVE=0 $(PY) -m pytest -q tests/unit tests/collectives tests/integration/test_shm.py \
		tests/integration/test_transport_conformance.py tests/integration/test_sync_facade.py \
		tests/faults/test_faults_shm.py tests/faults/test_faults_stall.py

# Multi-host jobs on this machine: each host a network namespace on a bridge (tests/hosts/netbed.py),
# one aiodist-run per host. Needs root; elsewhere the tier is skipped, saying why. About a minute.
test-hosts: install
	$(PY) -m pytest -q -rs tests/hosts

# The staging and NCCL tests (the torch backend's CUDA tensors too), for a machine with GPUs;
# elsewhere the CUDA ones skip, saying why.
test-gpu: install
	@$(PY) -c "import torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; print(f'test-gpu: {n} CUDA device(s) (torch {torch.__version__})' if n else f'test-gpu: no CUDA device (torch {torch.__version__}): the GPU tests will be skipped')"
	$(PY) -m pytest -q -rs tests/integration/test_cuda.py tests/integration/test_every_operation.py tests/collectives/test_staging.py tests/integration/test_engine.py tests/integration/test_torch_backend_cuda.py

# PyTorch's own distributed test suite (shipped in the torch wheel) on real gloo, then on aiodist two
# ways: through aiodist.sync (facade) and unmodified on the torch backend "aiodist" (backend), world
# sizes 2 and 3; its test harness needs expecttest. Options go through ARGS, e.g.
# ARGS="--mode gloo --mode backend -k test_all_reduce*".
test-torch-suite: install
	$(PY) -m pip install -q $(PIP_FLAGS) expecttest
	$(PY) tests/torch_suite/run.py -j 2 $(ARGS)

# The bench extra (matplotlib for the plot; mpi4py and Open MPI for the MPI peer) on top of what
# `install` put in. `make test` needs none of it.
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q $(PIP_FLAGS) -e '.[torch,test,dev,bench]'
	touch $(BENCH_STAMP)

# nccl-tests style tables, aiodist (both faces; told to use TCP only, and with its default transport)
# vs gloo and MPI (Open MPI's shared memory), 2 and 4 ranks, with the memory probe; then the
# verdicts of the targets of BENCHMARKS.md on that run (repository tooling: tools/bench_targets.py);
# then the DDP step benchmark: aiodist.parallel's DDP, torch's DDP on gloo and torch's DDP on the
# backend "aiodist", in the same run.
bench: $(BENCH_STAMP)
	mkdir -p $(BENCH_OUT)
	$(PY) -m aiodist.bench --compare gloo,mpi --aiodist-transports tcp,shm --memory \
		--json $(BENCH_OUT)/bench.json --markdown $(BENCH_OUT)/bench.md --plot $(BENCH_OUT)/algbw.png
	$(PY) tools/bench_targets.py $(BENCH_OUT)/bench.json --markdown $(BENCH_OUT)/targets.md
	$(PY) -m aiodist.parallel.bench_ddp --json $(BENCH_OUT)/ddp.json

# How long 16, 32 and 64 ranks of this host take to join a job, aiodist beside gloo (minutes:
# 64 processes import torch for gloo's runs).
bench-init: install
	mkdir -p $(BENCH_OUT)
	$(PY) tools/bench_init.py -np 16,32,64 -r 2 --json $(BENCH_OUT)/init.json

# Function calls per small operation and rank (deterministic, unlike timings on a shared machine).
bench-calls: install
	mkdir -p $(BENCH_OUT)
	$(PY) tools/bench_calls.py --json $(BENCH_OUT)/calls.json

lint: install
	$(PY) -m ruff check aiodist tests examples tools setup.py
	$(PY) -m ruff format --check aiodist tests examples tools setup.py

typecheck: install
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
