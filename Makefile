# Two commands a new user types: `make demo` (the main job) and `make test` (the CPU test-suite).
# Both build a local virtual environment first; nothing has to be installed by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build of torch where there is no NVIDIA GPU (several GB smaller than the CUDA build).
# Set TORCH_CPU_PIP_ARGS to point pip at a CPU wheel index if yours has none; the CUDA build is the fallback.
TORCH_CPU_SPEC ?= torch==2.13.0+cpu
TORCH_CPU_PIP_ARGS ?=
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)

.PHONY: venv test test-gpu demo bench clean

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(HAS_NVIDIA),1)
	$(PIP) install -q torch
else
	$(PIP) install -q $(TORCH_CPU_PIP_ARGS) "$(TORCH_CPU_SPEC)" || $(PIP) install -q torch
endif
	touch $@

# PyLate and colpali-engine pin packages that cannot install beside this torch (see pyproject's test extra):
# the integration tests need only their Python modules, whose imports the test extra provides.
TEST_HOSTS ?= pylate==1.6.0 colpali-engine==0.3.18

$(VENV)/.lik-test: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps $(TEST_HOSTS)
	touch $@

$(VENV)/.lik-demo: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[demo]" || { echo "lik: the demo encoder could not be installed; the demo will use synthetic embeddings and say so"; $(PIP) install -q -e .; }
	touch $@

venv: $(VENV)/.lik-test

# Kernels run on the CPU through Triton's interpreter; the `gpu` marker is excluded by default (see pyproject).
# The interpreter is single-threaded Python, so pytest-xdist workers, one per core (at most 4: each holds up to
# ~2 GB), divide the suite's time; TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
test: $(VENV)/.lik-test
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

# On a machine with a CUDA GPU: real compilation, tensor cores, atomics, 64-bit offsets (workers spread over the GPUs).
test-gpu: $(VENV)/.lik-test
	PYTHON=$(PY) bash tools/test_gpu.sh $(PYTEST_ARGS)

demo: $(VENV)/.lik-demo
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m lik.cli demo $(DEMO_ARGS)

bench: $(VENV)/.lik-test
	$(PIP) install -q -e ".[bench]"
	$(PY) -m lik.cli bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
