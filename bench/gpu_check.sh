#!/usr/bin/env bash
# GPU check of dflash.kernels.sparse_kl_loss on one CUDA device (written for an H200).
#
#   bash bench/gpu_check.sh            # from any directory; about 6 minutes, at most 8.5
#
# 1. finds a python with torch (CUDA) and triton; installs nothing from a network (the
#    device machine has none): set PYTHON=/path/to/python to choose one. Wheels found in
#    .whl/ at the repository root are installed into a temporary folder put on PYTHONPATH
#    (no dependencies, no index): that is how Liger and Cut Cross-Entropy, which the k = 1
#    comparison needs and the device image lacks, travel. Prepare them once where pip has
#    a network, then carry .whl with the run:
#      echo /.whl/ >> .git/info/exclude
#      python3 -m pip download --no-deps --only-binary=:all: -d .whl \
#          liger-kernel==0.8.5 cut-cross-entropy==25.1.1      # pure Python, ~1 MB
# 2. makes this checkout's dflash.kernels importable (installed, or through a namespace shim);
# 3-4. python bench/gpu_kernel_check.py --json: parity of the Triton path at full size
#    (N, H, V, k) = (16384, 4096, 151936, 32), bf16 Triton against the torch chunked path in
#    fp32 (IEEE matmuls) on the same bf16 values and against the plain bf16 PyTorch form (the
#    Cut Cross-Entropy criterion), bitwise determinism of two runs, the weighted training
#    call, at N = 2048 the dW (recompute) path in bf16 and fp32; then a slim timing and
#    memory table at that shape and SmolLM2's (extra memory, the Triton part's share, the old
#    2 GiB workspace, k = 1 against Liger). The full table: python bench/loss_bench.py;
# 5. the training path: python bench/gpu_train_check.py --json (Flex vs dense attention, a
#    short bf16 fit with the Triton loss against a CPU fp32 reference).
# Exit status: 0 all checks passed, 1 a check failed, 2 no usable python/GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
# The kernel part (steps 1-4) takes at most 210 s; step 5 has 150 s.

PY=""
for cand in "${PYTHON:-}" "$REPO/.venv/bin/python" python3 python; do
  [ -n "$cand" ] || continue
  command -v "$cand" >/dev/null 2>&1 || continue
  if "$cand" -c "import torch, triton; assert torch.cuda.is_available()" >/dev/null 2>&1; then
    PY="$cand"
    break
  fi
done
if [ -z "$PY" ]; then
  echo "gpu_check: FAIL: no python here imports torch with CUDA and triton" >&2
  echo "  tried: \${PYTHON} '$REPO/.venv/bin/python' python3 python; set PYTHON=/path/to/python" >&2
  exit 2
fi

if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
  SITE="$(mktemp -d)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$REPO"/.whl/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: installed $(ls "$REPO"/.whl | tr '\n' ' ')into $SITE" >&2
fi

# dflash.* is a namespace of top-level folders mapped by pyproject.toml; without an install,
# a directory holding dflash/kernels -> this checkout's kernel/ gives the same import name.
if ! "$PY" -c "import dflash.kernels, dflash.train" >/dev/null 2>&1; then
  SHIM="$(mktemp -d)"
  mkdir -p "$SHIM/dflash"
  for part in shards train precompute; do ln -s "$REPO/$part" "$SHIM/dflash/$part"; done
  ln -s "$REPO/kernel" "$SHIM/dflash/kernels"
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" - "$REPO" <<'EOF'
import os, sys, torch, triton
import dflash.kernels
where = os.path.realpath(os.path.dirname(dflash.kernels.__file__))
if where != os.path.realpath(os.path.join(sys.argv[1], "kernel")):
    sys.exit(f"gpu_check: FAIL: dflash.kernels imports from {where}, not this checkout; "
             "uninstall that copy or run from it")
print(f"gpu_check: python {sys.executable}, torch {torch.__version__}, triton {triton.__version__}, "
      f"{torch.cuda.get_device_name()}, dflash.kernels from {where}", flush=True)
EOF

echo "gpu_check: loss kernel: parity, timing and memory (bench/gpu_kernel_check.py, at most 210 s)" >&2
# Parity first (a failed check fails the script); the timing rows left when its budget is
# spent are skipped, and the hard timeout is the backstop.
if ! timeout 210 "$PY" bench/gpu_kernel_check.py --json --budget-s 150; then
  echo "gpu_check: FAIL: the loss kernel check failed (a failed check above, an error, or over 210 s)" >&2
  exit 1
fi

# 5. The training path on CUDA (bench/gpu_train_check.py): Flex Attention against the dense
#    path (forward and gradients), then a short bf16 fit with Flex and the Triton loss against
#    a CPU fp32 reference. Its fit part needs pyarrow and safetensors (skipped without them).
echo "gpu_check: training path (bench/gpu_train_check.py, at most 150 s)" >&2
if ! timeout 150 "$PY" bench/gpu_train_check.py --json; then
  echo "gpu_check: FAIL: the training-path check failed (a failed check above, an error, or over 150 s)" >&2
  exit 1
fi
