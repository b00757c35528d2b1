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
# 3. parity of the Triton path at full size (N, H, V, k) = (16384, 4096, 151936, 32):
#    bf16 Triton against the torch chunked path in fp32 (IEEE matmuls) on the same bf16
#    values, and against the plain bf16 PyTorch form (the Cut Cross-Entropy criterion);
#    bitwise determinism of two runs; at N = 2048 the dW (recompute) path in bf16 and fp32;
# 4. the timing table: python bench/loss_bench.py --device cuda --json (last line JSON);
# 5. the training path: python bench/gpu_train_check.py --json (Flex vs dense attention, a
#    short bf16 fit with the Triton loss against a CPU fp32 reference).
# Exit status: 0 all checks passed, 1 a check failed, 2 no usable python/GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
TOTAL_BUDGET_S=350      # the kernel part (steps 1-4) stays under 6 minutes; step 5 has 150 s

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

echo "gpu_check: parity at full size" >&2
if ! timeout 170 "$PY" - "$REPO" <<'EOF'
import sys, time
import torch

from bench.loss_bench import make_inputs  # the script runs from the repository root
from dflash.kernels import sparse_kl_loss

torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference and fp32 Triton use IEEE fp32
failures = []


def check(name, value, limit):
    ok = value <= limit
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: {value:.3e} (limit {limit:.3e})", flush=True)
    if not ok:
        failures.append(name)


def run(impl, hidden, weight, ids, logprobs, **kw):
    """(loss, argmax, dX, dW or None, seconds) of one forward + backward."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    x = hidden.detach().clone().requires_grad_(True)
    loss, argmax = sparse_kl_loss(x, weight, ids, logprobs, impl=impl, return_argmax=True, **kw)
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), argmax, x.grad, weight.grad, time.perf_counter() - t0


def rel(a, b):
    """Frobenius-norm relative difference, in fp64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# Tolerances. bf16 products are exact in fp32, so the bf16 cuBLAS GEMM with fp32 accumulation
# and output differs from the fp32 reference on the same values only by summation order over
# H = 4096: ~1e-6 relative on logits, lse and the loss; 1e-4 is the loss limit. dX is rounded
# to bf16 twice (the logit gradient G in the workspace, then dX itself), 2^-9 relative each at
# worst per element and less in norm; 1e-2 in Frobenius norm is a 2.5x margin over two
# worst-case roundings. The bf16 run must also be no worse than the plain bf16 PyTorch form,
# whose logits are rounded to bf16 before the softmax (error ~2^-9 * |z| on every logit),
# plus 2^-9. A race in the kernel's in-place bf16 write would show as a parity failure or
# as differing bits between the two runs.
N, H, V, K = 16384, 4096, 151936, 32
hidden, weight, ids, logprobs = make_inputs(N, H, V, K, dtype=torch.bfloat16, device="cuda")
hidden = hidden.detach()
ref_loss, ref_arg, ref_dx, _, t_ref = run("torch", hidden.float(), weight.float(), ids, logprobs)
print(f"  fp32 torch reference: loss {ref_loss.item():.6f} in {t_ref:.1f} s", flush=True)
loss, arg, dx, _, t_tri = run("triton", hidden, weight, ids, logprobs)
print(f"  bf16 triton: loss {loss.item():.6f} in {t_tri:.1f} s (first call compiles)", flush=True)
check("bf16 triton loss vs fp32 reference (relative)", abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), 1e-4)
check("bf16 triton dX vs fp32 reference (relative Frobenius)", rel(dx, ref_dx), 1e-2)
check("bf16 triton argmax disagreement with fp32 reference (fraction)", (arg != ref_arg).float().mean().item(), 1e-3)
loss2, arg2, dx2, _, _ = run("triton", hidden, weight, ids, logprobs)
check("triton determinism: differing bits between two runs (count)",
      float((loss2 != loss).sum() + (arg2 != arg).sum() + (dx2 != dx).sum()), 0.0)
base_loss, _, base_dx, _, _ = run("naive", hidden, weight, ids, logprobs)
base_loss_err = abs(base_loss.item() - ref_loss.item()) / abs(ref_loss.item())
print(f"  plain bf16 form: loss error {base_loss_err:.3e}, dX error {rel(base_dx, ref_dx):.3e}", flush=True)
check("bf16 triton loss error minus bf16 form's", abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
      - base_loss_err, 2.0**-9)
check("bf16 triton dX error minus bf16 form's", rel(dx, ref_dx) - rel(base_dx, ref_dx), 2.0**-9)
del ref_dx, dx, dx2, base_dx
torch.cuda.empty_cache()

# The dW path (the head requires grad: forward only, then each chunk recomputed with G scaled
# by the row gradients) at N = 2048, against the fp32 torch path. In fp32 end to end (IEEE
# GEMMs) the limits are fp32 summation-order limits, 1e-5 on the loss and 1e-4 on the
# gradients; in bf16 G, dX and dW are each rounded to bf16 (the same 1e-2 as dX above).
n = 2048
x32, w32, ids_s, lq_s = hidden[:n].float(), weight.float(), ids[:n], logprobs[:n]
w32.requires_grad_(True)
ref_loss, _, ref_dx, ref_dw, _ = run("torch", x32, w32, ids_s, lq_s)
w32.grad = None
loss, _, dx, dw, _ = run("triton", x32, w32, ids_s, lq_s)
check("fp32 triton loss vs torch (relative)", abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), 1e-5)
check("fp32 triton dX vs torch (relative Frobenius)", rel(dx, ref_dx), 1e-4)
check("fp32 triton dW vs torch (relative Frobenius)", rel(dw, ref_dw), 1e-4)
w16 = weight.detach().clone().requires_grad_(True)
loss, _, dx, dw, _ = run("triton", hidden[:n], w16, ids_s, lq_s)
check("bf16 triton dW-path loss vs fp32 torch (relative)", abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), 1e-4)
check("bf16 triton dW-path dX vs fp32 torch (relative Frobenius)", rel(dx, ref_dx), 1e-2)
check("bf16 triton dW vs fp32 torch (relative Frobenius)", rel(dw, ref_dw), 1e-2)
if failures:
    sys.exit(f"gpu_check: FAIL: {len(failures)} parity check(s): {failures}")
print("gpu_check: parity ok", flush=True)
EOF
then
  echo "gpu_check: FAIL: parity did not pass (a failed check above, an error, or over its 170 s limit)" >&2
  exit 1
fi

LEFT=$((TOTAL_BUDGET_S - SECONDS))
echo "gpu_check: timing table (${LEFT} s left)" >&2
# The bench skips what remains once its budget is spent; the hard timeout is the backstop.
timeout $((LEFT > 60 ? LEFT : 60)) "$PY" bench/loss_bench.py --device cuda --json --budget-s $((LEFT > 100 ? LEFT - 60 : 40))

# 5. The training path on CUDA (bench/gpu_train_check.py): Flex Attention against the dense
#    path (forward and gradients), then a short bf16 fit with Flex and the Triton loss against
#    a CPU fp32 reference. Its fit part needs pyarrow and safetensors (skipped without them).
echo "gpu_check: training path (bench/gpu_train_check.py, at most 150 s)" >&2
if ! timeout 150 "$PY" bench/gpu_train_check.py --json; then
  echo "gpu_check: FAIL: the training-path check failed (a failed check above, an error, or over 150 s)" >&2
  exit 1
fi
