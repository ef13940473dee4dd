# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/slacktier: pyproject.toml
	$(PY) -m venv $(VENV)
	# The CPU build of torch, chosen deliberately (an unpinned torch is a multi-GB CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $(BIN)/slacktier

.PHONY: setup demo test bench
setup: $(BIN)/slacktier

demo: setup
	$(BIN)/slacktier demo

test: setup
	bash scripts/test.sh

