# logitless: `make setup` builds .venv, `make test` runs the linter and the whole suite (what CI runs),
# `make bench` compares logitless with the naive path and every installed peer.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
TORCH ?= torch==2.13.0
MCORE ?= 0.19.2
# An older megatron-core without the output_processor hook, for the legacy path's tests.
MCORE_LEGACY ?= 0.16.1
# verl is installed without its dependencies (see the test extra in pyproject.toml)
VERL ?= 0.9.1
DEEPSPEED ?= 0.19.8
VERL_DEPS := transformers==5.24.0 ray tensordict==0.10.0 hydra-core codetiming dill pillow accelerate
# what importing verl's Megatron engine needs besides (.venv has them through the test extra and trl)
VERL_MEGATRON_DEPS := peft mbridge==0.15.1 datasets einops
LEGACY := .venv-legacy
CACHE := .cache
# mamba-ssm's source (PyPI has no wheels; its Triton ops run megatron-core's Mamba layers in the tests, its CUDA
# extension is not built): unpacked into $(CACHE), see tests/megatron/mamba_env.py
MAMBA_SSM ?= 2.3.2.post1
MAMBA_SRC := $(CACHE)/mamba_ssm-$(MAMBA_SSM)

# The newest torch / triton pair CI runs (the oldest: .venv's TORCH with the test extra's triton 3.6.0): torch's
# own wheel, which brings its triton (2.14.1: triton~=3.8.0; the CUDA wheel, which runs on a CPU), then
# logitless[triton] over it, which must leave torch as it is (checked right after). Its tests: the kernels, ops and
# losses under triton's interpreter, the sm_90 build check and the packaging contract (NEWEST_TESTS).
NEWEST := .venv-newest
NEWEST_TORCH ?= torch==2.14.1
NEWEST_TRITON ?= triton==3.8.0
NEWEST_TESTS := tests/ops tests/losses tests/test_fused_logprobs.py tests/test_precision.py tests/test_packaging.py

.PHONY: setup test test-newest bench doctor clean gpu-check gpu-learning gpu-learning-grpo gpu-learning-distill \
	gpu-learning-grpo-more gpu-learning-distill-more gpu-wheels
setup: $(VENV)/.ready $(LEGACY)/.ready $(MAMBA_SRC)/.ready $(NEWEST)/.ready

$(VENV)/.ready: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH)"
	$(PIP) -e ".[test,bench,peers]"
	$(PIP) --no-deps verl==$(VERL)
	@# deepspeed (ZeRO-3 tests, on its CPU accelerator) ships an sdist only, whose build imports torch:
	@# built against the torch above rather than in an isolated env that would fetch another one
	DS_BUILD_OPS=0 $(PIP) --no-build-isolation deepspeed==$(DEEPSPEED)
	@# megatron-core's wheel is cp312-only; its sdist builds and runs on 3.11
	mkdir -p $(CACHE)
	$(PY) -m pip download -q --no-deps --no-binary :all: --ignore-requires-python \
		megatron-core==$(MCORE) -d $(CACHE)
	$(PIP) --ignore-requires-python $(CACHE)/megatron_core-$(MCORE).tar.gz
	touch $@

$(MAMBA_SRC)/.ready: $(VENV)/.ready
	mkdir -p $(CACHE)
	@# preparing the sdist's metadata runs its setup.py: told to skip the CUDA build, in .venv (which has torch)
	MAMBA_SKIP_CUDA_BUILD=TRUE $(PY) -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
		mamba-ssm==$(MAMBA_SSM) -d $(CACHE)
	tar -xzf $(CACHE)/mamba_ssm-$(MAMBA_SSM).tar.gz -C $(CACHE)
	touch $@

$(LEGACY)/.ready: pyproject.toml Makefile
	$(PYTHON) -m venv $(LEGACY)
	$(LEGACY)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH)" \
		megatron-core==$(MCORE_LEGACY) triton==3.6.0 numpy pytest pytest-timeout $(VERL_DEPS) $(VERL_MEGATRON_DEPS)
	$(LEGACY)/bin/python -m pip install -q --disable-pip-version-check --no-deps -e . verl==$(VERL)
	touch $@

$(NEWEST)/.ready: pyproject.toml Makefile
	$(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --disable-pip-version-check "$(NEWEST_TORCH)" "$(NEWEST_TRITON)" \
		pytest pytest-timeout
	$(NEWEST)/bin/python -m pip freeze | grep -i -E "^(torch|triton)==" > $(NEWEST)/before.txt
	$(NEWEST)/bin/python -m pip install -q --disable-pip-version-check -e ".[triton]"
	@# the install check: logitless[triton] changed neither torch nor triton
	$(NEWEST)/bin/python -m pip freeze | grep -i -E "^(torch|triton)==" | diff $(NEWEST)/before.txt -
	touch $@

test: setup
	$(PY) -m ruff check .
	LOGITLESS_REQUIRE_INTEGRATIONS=1 $(PY) -m pytest -q tests
	$(MAKE) test-newest

test-newest: $(NEWEST)/.ready
	$(NEWEST)/bin/python -m pytest -q $(NEWEST_TESTS)

# On CUDA: the three GPU shapes of docs/performance.md (bf16); elsewhere one CPU shape (minutes: README.md).
GPU_SHAPES ?= 16384,4096,151936 8192,4096,131072 1024,4096,151936
bench: setup
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		for s in $(GPU_SHAPES); do \
			$(VENV)/bin/logitless bench --device cuda --shape $$s --json benchmarks/results/latest-$$s.json || exit 1; \
		done; \
	else \
		$(VENV)/bin/logitless bench --json benchmarks/results/latest.json; \
	fi

doctor: setup
	$(VENV)/bin/logitless doctor

# On a machine with one CUDA GPU whose python has torch and triton (no .venv, no package index needed):
# `make gpu-check` times every headline figure against its floor, target and the committed baseline, then runs
# the GPU-only tests, within 450 s (--budget; benchmarks/gpu_check.py; GPU_OUT gets gpu-check.md / .json, rewritten
# as each figure and test file ends); `make gpu-learning` runs the
# two TRL learning runs at their GPU size. What they need beyond torch and triton (pytest, the peers, TRL and its
# dependencies) comes from wheels: `make gpu-wheels` downloads them (for GPU_PYVER) into .whl/ on a machine with
# a package index; copy .whl/ along; the targets install them into GPU_SITE first.
GPU_PY ?= python3
GPU_OUT ?= gpu-out
# "site-packages" in the path: dill (datasets' fingerprints) pickles a module by value when its file's path has none
# of a sys prefix, an extension suffix or "site-packages", and pyarrow by value fails (PicklingError: MonthDayNano):
# TRL's trainers died so before their first step under a --target folder named otherwise
GPU_SITE ?= .cache/gpu/site-packages
GPU_PYVER ?= 3.12
GPU_WHEELS := pytest pluggy iniconfig pytest-timeout trl==1.16.0 transformers==5.24.0 datasets liger-kernel \
	cut-cross-entropy pyarrow pandas dill xxhash "multiprocess<0.70.20" "fsspec<=2026.9.0" psutil jinja2 regex typer
GPU_ENV = PYTHONPATH=src:$(GPU_SITE):$$PYTHONPATH PYTHONUNBUFFERED=1
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYVER) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

$(GPU_SITE)/.ready:
	mkdir -p $(GPU_SITE)
	if ls .whl/*.whl >/dev/null 2>&1; then \
		$(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) .whl/*.whl; fi
	touch $@

gpu-check: $(GPU_SITE)/.ready
	$(GPU_ENV) $(GPU_PY) benchmarks/gpu_check.py --out $(GPU_OUT) $(GPU_CHECK_ARGS)

# in four parts, each within 10 minutes on one H100 (measured 2026-12-07: a GRPO run 2-3 minutes with its start, the
# distillation's teacher 40 s, a student run 2-3 minutes): TRL's loss against logitless' from one seed, then Liger's
# loss and the noise seeds into the same folders (each part's plot and table show every run there so far)
gpu-learning: gpu-learning-grpo gpu-learning-distill gpu-learning-grpo-more gpu-learning-distill-more
gpu-learning-grpo: $(GPU_SITE)/.ready
	$(GPU_ENV) $(GPU_PY) examples/trl_grpo_learning.py --size gpu --modes trl,fused --noise-seeds "" \
		--out $(GPU_OUT)/grpo --plot
gpu-learning-grpo-more: $(GPU_SITE)/.ready
	$(GPU_ENV) $(GPU_PY) examples/trl_grpo_learning.py --size gpu --modes liger --noise-seeds 1 \
		--out $(GPU_OUT)/grpo --plot
gpu-learning-distill: $(GPU_SITE)/.ready
	$(GPU_ENV) $(GPU_PY) examples/trl_distillation_learning.py --size gpu --noise-seeds "" --out $(GPU_OUT)/distill --plot
gpu-learning-distill-more: $(GPU_SITE)/.ready
	$(GPU_ENV) $(GPU_PY) examples/trl_distillation_learning.py --size gpu --modes "" --noise-seeds 1 \
		--out $(GPU_OUT)/distill --plot

clean:
	rm -rf $(VENV) $(LEGACY) $(NEWEST) $(CACHE)
