# logitless: `make setup` builds .venv, `make test` runs the whole suite (what CI runs),
# `make bench` compares logitless with the naive path and every installed peer.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
TORCH ?= torch==2.13.0
MCORE ?= 0.19.2
# An older megatron-core without the output_processor hook, for the legacy path's tests.
MCORE_LEGACY ?= 0.16.1
LEGACY := .venv-legacy
CACHE := .cache

.PHONY: setup test bench doctor clean
setup: $(VENV)/.ready $(LEGACY)/.ready

$(VENV)/.ready: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH)"
	$(PIP) -e ".[test,bench]"
	@# megatron-core's wheel is cp312-only; its sdist builds and runs on 3.11
	mkdir -p $(CACHE)
	$(PY) -m pip download -q --no-deps --no-binary :all: --ignore-requires-python \
		megatron-core==$(MCORE) -d $(CACHE)
	$(PIP) --ignore-requires-python $(CACHE)/megatron_core-$(MCORE).tar.gz
	touch $@

$(LEGACY)/.ready: pyproject.toml Makefile
	$(PYTHON) -m venv $(LEGACY)
	$(LEGACY)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH)" \
		megatron-core==$(MCORE_LEGACY) triton==3.6.0 numpy pytest pytest-timeout
	$(LEGACY)/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(VENV)/bin/logitless bench --json benchmarks/results/latest.json

doctor: setup
	$(VENV)/bin/logitless doctor

clean:
	rm -rf $(VENV) $(LEGACY) $(CACHE)
