# Two commands a new user types: `make demo` (the main job) and `make test` (the CPU test-suite); `make quick` is
# a few minutes' subset of the tests. All build a local virtual environment first; nothing has to be installed by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build of torch where there is no NVIDIA GPU (several GB smaller than the CUDA build).
# Set TORCH_CPU_PIP_ARGS to point pip at a CPU wheel index if yours has none; the CUDA build is the fallback.
TORCH_CPU_SPEC ?= torch==2.13.0+cpu
TORCH_CPU_PIP_ARGS ?=
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)

.PHONY: venv lint quick test test-all fuzz test-gpu demo bench clean

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
# colpali-engine's package imports torchvision, whose build must match torch's. pip's index has the CUDA build only,
# which does not load beside the CPU torch: there the CPU build comes from the index in TORCH_CPU_PIP_ARGS (e.g.
# --index-url https://download.pytorch.org/whl/cpu), and without one lik.integrations.colpali.enable() cannot run
# (it raises an ImportError naming torchvision; the drop-in scoring functions work either way).
TORCHVISION_CPU_SPEC ?= torchvision==0.28.0+cpu

$(VENV)/.lik-test: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps $(TEST_HOSTS)
ifeq ($(HAS_NVIDIA),1)
	$(PIP) install -q torchvision "torch==$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])')" \
	|| echo "lik: no torchvision for this torch: lik.integrations.colpali.enable() will raise an ImportError naming it"
else
	$(PIP) install -q --no-deps $(TORCH_CPU_PIP_ARGS) "$(TORCHVISION_CPU_SPEC)" 2>/dev/null || echo "lik: no CPU build \
	of torchvision on this index (set TORCH_CPU_PIP_ARGS to the PyTorch CPU index for one): lik.integrations.colpali.enable() \
	will raise an ImportError naming torchvision here; its tests of colpali-engine's scoring still run"
endif
	touch $@

$(VENV)/.lik-demo: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[demo]" || { echo "lik: the demo encoder could not be installed; the demo will use synthetic embeddings and say so"; $(PIP) install -q -e .; }
	touch $@

venv: $(VENV)/.lik-test

lint: $(VENV)/.lik-test
	$(PY) -m ruff check .

# Kernels run on the CPU through Triton's interpreter. pyproject's addopts deselect the `gpu` tests (they need a
# CUDA GPU: `make test-gpu`) and the `slow` ones (larger cases of paths that faster tests cover: `make test-all`).
# The interpreter is single-threaded Python, so pytest-xdist workers, one per core (at most 4: each holds up to
# ~2 GB), divide the suite's time; TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
DESELECTED_NOTE := echo "lik: the GPU tests (-m gpu) were deselected: run them with \`make test-gpu\` on a CUDA machine"
test: $(VENV)/.lik-test
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS); status=$$?; $(DESELECTED_NOTE); \
	echo "lik: so were the slow interpreter cases (-m slow): \`make test-all\` runs them too"; exit $$status

test-all: $(VENV)/.lik-test
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not gpu" $(PYTEST_ARGS); status=$$?; \
	$(DESELECTED_NOTE); exit $$status

# The fuzz campaign (tests/fuzz) in its long profile: every property on many fresh random examples against its
# float64 brute force (`make test` runs the same properties on a few fixed ones). A failure prints the blob that
# reproduces it; LIK_FUZZ_EXAMPLES sets the examples per property. It also runs the index durability
# module (tests/index/test_durability.py) at its long profile: every byte flipped, hundreds of kills and races.
fuzz: $(VENV)/.lik-test
	LIK_FUZZ_PROFILE=long TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(TEST_WORKERS) tests/fuzz tests/index/test_durability.py $(PYTEST_ARGS)

# A few minutes: each op's kernels on a few shapes through the interpreter (MaxSim padded and packed, deformable
# attention, Chamfer, 8-bit quantization), empty and masked sides, search, the index format, the CLI, the docs.
QUICK_TESTS ?= tests/docs tests/test_packaging.py tests/ops/maxsim/test_maxsim.py::test_shared_documents \
	tests/ops/maxsim/test_varlen.py::test_corpus_matches_reference tests/ops/maxsim/test_varlen.py::test_pairs_match_reference \
	tests/ops/maxsim/test_empty_sides.py tests/ops/msda/test_msda.py tests/ops/chamfer/test_chamfer.py::test_chamfer_matches_dense_model \
	tests/ops/quantization tests/retrieval tests/index/test_format.py tests/test_cli.py
quick: $(VENV)/.lik-test
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(TEST_WORKERS) $(QUICK_TESTS) $(PYTEST_ARGS); status=$$?; \
	$(DESELECTED_NOTE); echo "lik: this was a subset: \`make test\` runs the whole CPU suite"; exit $$status

# On a machine with a CUDA GPU: real compilation, tensor cores, atomics, 64-bit offsets (workers spread over the GPUs).
test-gpu: $(VENV)/.lik-test
	PYTHON=$(PY) bash tools/test_gpu.sh $(PYTEST_ARGS)

demo: $(VENV)/.lik-demo
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m lik.cli demo $(DEMO_ARGS)

# GPU: every table of BENCHMARKS.md (printed, and in $(BENCH_OUT)/bench.md), the JSON, and one plot per table in
# $(BENCH_PLOTS). --quick (the default) fits one run in ~8 minutes; BENCH_ARGS="" runs every cell. The peers are
# installed when pip can get them; otherwise their columns read n/a and the run says why. Where python already
# has torch and there is no network (a lent GPU machine), BENCH_PYTHON=python3 runs it without the venv.
BENCH_ARGS ?= --quick
BENCH_PEERS ?= flash-maxsim==0.3.0 late-interaction-kernels==0.4.5
BENCH_OUT ?= $(if $(OUT),$(OUT),bench_out)
BENCH_PLOTS ?= $(if $(OUT),$(OUT)/plots,benchmarks/results/plots)

$(VENV)/.lik-bench: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[bench]"
	$(PIP) install -q $(BENCH_PEERS) || echo "lik: the peers ($(BENCH_PEERS)) did not install: their columns will read n/a"
	touch $@

ifdef BENCH_PYTHON
bench:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(BENCH_PYTHON) -m lik.bench --out $(BENCH_OUT) --plots $(BENCH_PLOTS) \
	$(BENCH_ARGS)
else
bench: $(VENV)/.lik-bench
	$(PY) -m lik.bench --out $(BENCH_OUT) --plots $(BENCH_PLOTS) $(BENCH_ARGS)
endif

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
