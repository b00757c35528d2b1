#!/usr/bin/env bash
# Every GPU check and figure of dflash in one call (written for one H200; at most 9 minutes).
#
#   bash bench/gpu_check.sh [--json]     # from any directory
#
# A lent device gives 15 minutes in all, start-up included, so everything that needs CUDA runs
# here, in one call, each section under its own time limit (seconds, in SECTIONS below):
#
#   kernel       bench/gpu_kernel_check.py: the loss kernel's parity at (16384, 4096, 151936, 32)
#                (fp32 reference, the plain bf16 form, bitwise determinism, the dW path), the same
#                for divergence="tv" and DSpark's 0.9 TV + 0.1 CE, its time against one bf16
#                matmul, its extra memory (TV's checked equal to KL's), and the Triton part's
#                share at SmolLM2's shape (8192, 576, 49152, 32)
#   train_path   bench/gpu_train_check.py: Flex Attention against the dense path and a float64
#                reference (forward and every parameter's gradient), a short bf16 fit
#   stage_one    bench/gpu_stage_one.py: dflash-precompute on a 1.6 B random Llama in bf16, fp8
#                features: forward_s, wall_s, tokens/s, the forward's TFLOP/s, the split
#   stage_two    bench/gpu_stage_two.py: fit on a real cache with a small drafter, and Qwen3-8B's
#                drafter shape: tokens/s, MFU, the GPU's wait for data, the checkpoint's block;
#                a bitwise kill-and-resume of a short CUDA fit
#   online_eval  bench/gpu_online_eval.py: online eval on a random target in bf16 and float32:
#                time per token, near-ties and real mismatches
#
# Then bench/gpu_report.py prints one table (every check PASS/FAIL, every figure) and, with
# --json, one JSON object as the last line. Each section's log is kept in a temporary folder
# named at the end; where $OUT is set (the device tool's output folder, which returns at most
# 8 files) the report goes to $OUT/gpu_check.txt and the logs to $OUT/gpu_check_logs.tgz.
#
# 1. finds a python with torch (CUDA) and triton; installs nothing from a network (the device
#    machine has none): set PYTHON=/path/to/python to choose one. Wheels found in .whl/ at the
#    repository root are installed into a temporary folder put on PYTHONPATH (no dependencies,
#    no index): that is how Liger and Cut Cross-Entropy (the k = 1 comparison) travel. Prepare
#    them once where pip has a network, then carry .whl with the run:
#      echo /.whl/ >> .git/info/exclude
#      python3 -m pip download --no-deps --only-binary=:all: -d .whl \
#          liger-kernel==0.8.5 cut-cross-entropy==25.1.1      # pure Python, ~1 MB
#    and the rows' fast crc32 (a dependency of dflash; without it the reads use zlib's, 2-4
#    GB/s of one core instead of ~27, and the first line below says "crc32 zlib"):
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#          --implementation cp --platform manylinux_2_28_x86_64 -d .whl isal==1.9.1   # 0.3 MB
# 2. makes this checkout's dflash.* importable (installed, or through a namespace shim).
# Exit status: 0 every section ran and no correctness check failed (a missed speed or memory
# goal is reported, not fatal), 1 a section failed, 2 no usable python/GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
JSON=""
[ "${1:-}" = "--json" ] && JSON="--json"
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# name:limit_s, in order: hard limits that add up to 530 s, leaving 10 s of the 9 minutes for
# the set-up above. Each script's --budget-s sits below its limit: the scripts skip the parts
# that no longer fit (printed as SKIPPED) so that they still print their JSON; a section killed
# at its limit is reported as a failure.
SECTIONS="kernel:135 train_path:80 stage_one:85 stage_two:180 online_eval:50"

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

# dflash.* is a namespace of top-level folders mapped by pyproject.toml; without an install, a
# directory holding dflash/<name> -> this checkout's folders gives the same import names.
if ! "$PY" -c "import dflash.common, dflash.kernels.loss, dflash.train, dflash.testing" >/dev/null 2>&1; then
  SHIM="$(mktemp -d)"
  mkdir -p "$SHIM/dflash"
  for part in common shards kernels train precompute testing; do ln -s "$REPO/$part" "$SHIM/dflash/$part"; done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" - "$REPO" <<'PYEOF' || exit 2
import os, sys, torch, triton
import dflash.kernels.loss
from dflash.shards.rows import CRC32_IMPL
where = os.path.realpath(os.path.dirname(dflash.kernels.loss.__file__))
if where != os.path.realpath(os.path.join(sys.argv[1], "kernels")):
    sys.exit(f"gpu_check: FAIL: dflash.kernels imports from {where}, not this checkout; "
             "uninstall that copy or run from it")
print(f"gpu_check: python {sys.executable}, torch {torch.__version__}, triton {triton.__version__}, "
      f"{torch.cuda.get_device_name()}, rows' crc32 {CRC32_IMPL}, dflash from {os.path.dirname(where)}", flush=True)
PYEOF

LOGS="$(mktemp -d)"
: > "$LOGS/sections"
for entry in $SECTIONS; do
  name="${entry%%:*}"
  limit="${entry##*:}"
  case "$name" in
    kernel) cmd=(-m bench.gpu_kernel_check --json --budget-s $((limit - 15))) ;;
    train_path) cmd=(-m bench.gpu_train_check --json) ;;
    # --budget-s here sizes the records (the forward's time); building the 1.6 B target comes on top
    stage_one) cmd=(-m bench.gpu_stage_one --json --budget-s 30) ;;
    stage_two) cmd=(-m bench.gpu_stage_two --json --budget-s $((limit - 10))) ;;
    online_eval) cmd=(-m bench.gpu_online_eval --json --budget-s $((limit - 10))) ;;
  esac
  echo "$name" >> "$LOGS/sections"
  echo "gpu_check: == $name (at most $limit s): ${cmd[*]}" >&2
  start=$SECONDS
  timeout --kill-after=10 "$limit" "$PY" "${cmd[@]}" 2>&1 | tee "$LOGS/$name.log"
  echo "${PIPESTATUS[0]}" > "$LOGS/$name.rc"
  echo $((SECONDS - start)) > "$LOGS/$name.seconds"
done
echo "gpu_check: section logs in $LOGS" >&2
"$PY" -m bench.gpu_report --logs "$LOGS" $JSON | tee "$LOGS/report.txt"
status=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  cp "$LOGS/report.txt" "$OUT/gpu_check.txt"
  tar czf "$OUT/gpu_check_logs.tgz" -C "$LOGS" .
fi
exit "$status"
