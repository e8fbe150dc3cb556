# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install the project with the exact versions of constraints.txt.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: help install demo test test-fast test-compat test-gpu test-slurm lint docs format bench bench-quick clean bench-extra

help:
	@echo "make demo   - set up .venv, train the CIFAR-10 example on 2 CPU processes with SafeDDPStrategy"
	@echo "make test   - set up .venv, run lint (ruff, mypy) and the whole test suite"
	@echo "make test-compat - the tests marked compat on the lowest and newest declared Lightning/torchmetrics (own venvs)"
	@echo "make test-gpu - the GPU/NCCL tests (marker gpu; 1 or 2 CUDA devices each, skipped with a reason when fewer)"
	@echo "make test-slurm - the SLURM tests (marker slurm): installs SLURM + MUNGE (Debian, root) and runs jobs on a one-node cluster"
	@echo "make lint   - ruff + mypy only"
	@echo "make docs   - build the documentation site into site/ (mkdocs, warnings are errors)"
	@echo "make bench  - the benchmark suite (vs stock Lightning and a raw DDP loop), handshake, callback, callback-loop, strategy, weight-check, trainable-set-test, per-step-hook and desync-detection costs, instructions per step (callgrind), control plane at scale, tiny-model step"
	@echo "make bench-quick - CI smoke run of the benchmark suite (about 2 minutes; fails on a wide target miss)"
	@echo "make bench-extra - checkpoint-save and exact-evaluation benchmarks"

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install --upgrade-strategy only-if-needed -c constraints.txt -e ".[dev,examples,plots]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/cifar10/train.py --devices 2 --accelerator cpu --max-epochs 3
	$(PY) examples/cifar10/evaluate.py

lint: $(STAMP)
	$(PY) -m ruff check src tests examples bench
	$(PY) -m ruff format --check src tests examples bench
	$(PY) -m mypy

# Most tests run 2 at a time (pytest-xdist): a run's ranks import Lightning one after the other and then wait in
# collectives, so one test at a time leaves about half of the 2 cores idle. The tests marked serial assert a bound of
# seconds (or that a timing alarm stays silent) and run alone afterwards.
test: $(STAMP) lint docs
	$(PY) -m pytest -n 2 -m "not serial" $(PYTEST_ARGS)
	$(PY) -m pytest -m serial $(PYTEST_ARGS)

docs: $(STAMP)
	$(PY) -m mkdocs build --strict -d site

test-fast: $(STAMP)
	$(PY) -m pytest -n 2 -m "not slow and not serial" $(PYTEST_ARGS)
	$(PY) -m pytest -m "serial and not slow" $(PYTEST_ARGS)

# The tests marked gpu (tests/test_gpu.py), with the reason of every skip; .github/workflows/gpu.yml runs this on a
# self-hosted GPU runner. GPU_TESTS_REQUIRE=N makes it fail instead of skipping when fewer than N GPUs are visible.
GPU_TESTS_REQUIRE ?= 0
test-gpu: $(STAMP)
	DDP_STRATEGY_REQUIRE_GPUS=$(GPU_TESTS_REQUIRE) $(PY) -m pytest -m gpu -rs $(PYTEST_ARGS)

# The tests marked slurm (tests/test_slurm.py) on a one-node SLURM cluster on localhost that the tests start and stop
# (.ci/slurm-cluster.sh; config and state in a pytest tmp dir). The install needs root and apt-get: without them
# (exit code 3 or 4) the tests are skipped with the reason. `make test` skips them.
test-slurm: $(STAMP)
	bash .ci/slurm-cluster.sh install || { status=$$?; [ $$status -eq 3 ] || [ $$status -eq 4 ] || exit $$status; }
	DDP_STRATEGY_SLURM_TESTS=1 $(PY) -m pytest -m slurm -rs $(PYTEST_ARGS)

# Own virtual environments under build/compat (see .ci/compat.sh and .ci/compat/*.txt); needs no .venv.
test-compat:
	bash .ci/compat.sh

format: $(STAMP)
	$(PY) -m ruff format src tests examples bench
	$(PY) -m ruff check --fix src tests examples bench

bench: $(STAMP)
	$(PY) bench/suite.py
	$(PY) bench/handshake.py
	$(PY) bench/callback_cost.py
	$(PY) bench/strategy_cost.py
	$(PY) bench/call_count.py
	$(PY) bench/callback_turns.py
	$(PY) bench/instructions_per_step.py
	$(PY) bench/consistency_cost.py
	$(PY) bench/trainable_test.py
	$(PY) bench/step_hooks.py
	$(PY) bench/desync_cost.py
	$(PY) bench/flight_recorder_cost.py
	$(PY) bench/recorder_dump_cost.py
	$(PY) bench/control_plane_scale.py --worlds 8,64,256,512 --label after
	$(PY) bench/tiny_step.py

bench-extra: $(STAMP)
	$(PY) bench/checkpoint_save.py
	$(PY) bench/exact_eval.py

bench-quick: $(STAMP)
	$(PY) bench/suite.py --quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
