# Two entry points: `make train` and `make test`. Each creates .venv if it is
# missing and installs what it needs first.
#
# TORCH_SPEC pins the torch build CI uses (the CPU wheel). Bring your own:
#   make test TORCH_SPEC=          (keep the torch already in .venv)
#   make test TORCH_SPEC='torch==2.13.0+cu126' ...
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The default run: LocalAdamS at density 0.01 on 4 workers + 1 spare, one worker killed at step 150,
# checked against a failure-free reference run (override: make train TRAIN_ARGS="...").
TRAIN_ARGS ?= --optimizer local-adams --density 0.01 --spares 1 --kill 2@150
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= mpi,dev,trainers,bench,etcd
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
PYTEST_ARGS ?=
# `make test` runs the test files on this many pytest-xdist workers, each file on one worker: most of a
# multi-rank test is waiting on heartbeats, deadlines and process starts. TEST_JOBS=0 runs them one after
# another in this process.
TEST_JOBS ?= 3

.PHONY: train test test-fast setup bench gpu-check lint clean

train: $(STAMP)
	$(BIN)/sparsecomm train $(TRAIN_ARGS)

test: $(STAMP)
	sh tests/install_debian.sh tests/slurm slurmd slurmctld slurmd slurm-client munge
	sh tests/install_debian.sh tests/resilient/test_etcd.py etcd etcd-server
	$(BIN)/python -m pytest $(if $(filter-out 0,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile) $(PYTEST_ARGS)

# The inner loop: everything that starts no rank processes and no mpirun (unit tests), in under a minute.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not dist and not mpi" $(PYTEST_ARGS)

setup: $(STAMP)

bench: $(STAMP)
	$(BIN)/sparsecomm bench collectives --backend gloo,mpi --nproc 4 --json runs/bench/collectives.json

# On a machine with one or more GPUs: the GPU test tier and the pack/unpack
# kernel benchmark (fp32, bf16), in a few minutes.
gpu-check:
	$(MAKE) setup EXTRAS=mpi,dev,cuda
	$(BIN)/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
	$(BIN)/python -m pytest tests/gpu -v -rs
	$(BIN)/sparsecomm bench pack --device cuda --json runs/gpu/pack.json

lint: $(STAMP)
	$(BIN)/ruff check bindings sparsecomm resilient_comm optim tests
	$(BIN)/mypy

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_SPEC),$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)")
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

clean:
	rm -rf $(VENV) runs .pytest_cache
