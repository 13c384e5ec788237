# Quick start:  make demo   (set up .venv, run the main job)
#               make test   (set up .venv, run the whole test suite)
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/verispec demo

test: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest tests

.PHONY: setup demo test
