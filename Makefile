# A new user's whole set-up is one of these two commands:
#   make demo   - create .venv, install a CPU torch (unless one is there) and kvtier, run the demo
#   make test   - the same set-up, then the test suite
# Override the torch requirement for a CUDA machine: make demo TORCH=torch
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# What the demo and the suite need besides kvtier itself.
EXTRAS ?= dev,hf,plot,metrics
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup demo test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py kvtier/_core.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH)"
	$(PIP) install -e ".[$(EXTRAS)]"
	touch $@

demo: setup
	$(VENV)/bin/kvtier demo

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check kvtier tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
