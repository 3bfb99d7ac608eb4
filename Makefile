# Quick start: `make demo` (set-up + the CPU demo run) and `make test` (set-up + the test suite).
# Both create .venv on first use. On a GPU cluster, install into your container's Python instead
# (pip install -e '.[gpu,vllm]') and launch with torchrun/srun (see slurm/README.md).

VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# The CPU build of torch (a CUDA build is several GB); override for another build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: setup
	$(BIN)/dapo-mcore train examples/smoke_cpu.yaml

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest

clean:
	rm -rf runs .pytest_cache .ruff_cache
