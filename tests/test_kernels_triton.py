"""Triton-specific checks of sparse_kl_loss under TRITON_INTERPRET=1 (set by conftest).

The shared numerical tests live in test_kernels.py (parametrised over every impl), the
problems and the ground truth in dflash.testing.builders; here:
tile sizes and chunkings, each mode of the Triton path (stored dX, sparse dX for renorm,
dW recompute, forward only; KL and TV) with a non-unit grad_output, argmax ties, config validation,
the error on CPU tensors without the interpreter, and a compile of the kernel for a Hopper
GPU (the interpreter never compiles it).
"""

import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from dflash.kernels.loss import sparse_kl_loss
from dflash.kernels.sparse_kl import INTERPRETED, TritonConfig, _to_storage
from dflash.testing.builders import (
    FP32_TOL,
    SHAPES,
    loss_and_grads,
    make_problem,
    rel_err,
    row_weights_and_grads,
    truth,
)


def test_runs_interpreted():
    assert INTERPRETED, "conftest sets TRITON_INTERPRET=1 before the kernels are imported"


@pytest.mark.parametrize(
    "config, workspace_rows",
    [
        (TritonConfig(block_v=16), 37),  # 65 tiles per sweep, one chunk
        (TritonConfig(block_v=2048), 5),  # one tile wider than V, eight chunks
        (TritonConfig(block_v=64), 1),  # one row per chunk
        (TritonConfig(block_v=128, programs_per_sm=3), 16),  # persistent: 3 programs over 13 rows
    ],
)
@pytest.mark.e2e  # the kernel in the CPU interpreter: seconds per case, outside the quick loop
def test_tiles_and_chunks(config, workspace_rows):
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=11)
    ref, ref_dx, _ = loss_and_grads(lambda x, w: truth(x, w, ids, logprobs), hidden, weight)
    x = hidden.clone().requires_grad_(True)
    out, argmax = sparse_kl_loss(x, weight, ids, logprobs, impl="triton", triton_config=config,
                                 workspace_bytes=workspace_rows * v * 4, return_argmax=True)
    out.backward()
    assert abs(out.item() - ref.item()) <= FP32_TOL * abs(ref.item())
    assert rel_err(x.grad, ref_dx) <= FP32_TOL
    assert torch.equal(argmax, (hidden.double() @ weight.double().T).argmax(1))


# Which inputs need a gradient picks the mode: "x" stores dX in the forward (G @ W, or the
# sparse sum for renorm without CE), "w" and "xw" recompute each chunk in the backward
# with G scaled by the upstream row gradients.
@pytest.mark.parametrize("grads", ["x", "w", "xw"])
@pytest.mark.parametrize("tail, ce_weight, divergence", [("bucket", 0.0, "kl"), ("renorm", 0.0, "kl"),
                                                         ("renorm", 0.5, "kl"), ("bucket", 0.0, "tv"),
                                                         ("bucket", 0.5, "tv")])
@pytest.mark.e2e  # the kernel in the CPU interpreter: seconds per case, outside the quick loop
def test_modes_with_row_gradients(grads, tail, ce_weight, divergence):
    """reduction="none" with a partly zero grad_output, row weights and return_argmax (so
    that renorm runs the kernel), against the fp64 truth."""
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=13)
    weights, grad_output, g = row_weights_and_grads(n, torch.Generator().manual_seed(13))
    targets = torch.randint(0, v, (n,), generator=g)
    kw = dict(tail=tail, reduction="none", ce_targets=targets, ce_weight=ce_weight, divergence=divergence)

    def run(fn, grad_output):
        x = hidden.detach().clone().requires_grad_("x" in grads)
        w = weight.detach().clone().requires_grad_("w" in grads)
        loss = fn(x, w)
        loss.backward(grad_output)
        return loss.detach(), x.grad, w.grad

    ref, ref_dx, ref_dw = run(lambda x, w: truth(x, w, ids, logprobs, weights, **kw), grad_output.double())
    out, dx, dw = run(lambda x, w: sparse_kl_loss(x, w, ids, logprobs, weights, impl="triton", return_argmax=True,
                                                  workspace_bytes=16 * v * 4, triton_config=TritonConfig(block_v=128),
                                                  **kw)[0], grad_output)
    assert rel_err(out, ref) <= FP32_TOL
    for mine, theirs in ((dx, ref_dx), (dw, ref_dw)):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert rel_err(mine, theirs) <= FP32_TOL
    if dx is not None:
        assert torch.equal(dx[::4], torch.zeros_like(dx[::4]))


# The frozen-head training path (reduction "mean"/"sum", hidden requires grad, the head does
# not): the kernel returns the reduced loss and keeps dX in X's dtype, scaled by the row
# weights in the kernel. A workspace of 5 rows splits N = 37 into 8 chunks (7 of 5 rows and
# a last one of 2), so chunk boundaries fall inside N; a third of the rows have weight 0 and
# the upstream gradient is a non-unit scalar.
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("tail, ce_weight, divergence", [("bucket", 0.0, "kl"), ("bucket", 0.5, "kl"),
                                                         ("renorm", 0.0, "kl"), ("renorm", 0.5, "kl"),
                                                         ("bucket", 0.0, "tv"), ("bucket", 0.5, "tv")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.e2e  # the kernel in the CPU interpreter: seconds per case, outside the quick loop
def test_reduced_path_chunks_weights_and_scalar_grad(reduction, tail, ce_weight, divergence, dtype):
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=21, dtype=dtype)
    g = torch.Generator().manual_seed(21)
    weights = torch.rand(n, generator=g) * 2
    dead = torch.arange(n) % 3 == 1
    weights[dead] = 0.0
    targets = torch.randint(0, v, (n,), generator=g)
    kw = dict(tail=tail, reduction=reduction, ce_targets=targets, ce_weight=ce_weight, divergence=divergence)
    grad_output = torch.tensor(0.37)
    ref, ref_dx, _ = loss_and_grads(lambda x, w: truth(x, w, ids, logprobs, weights, **kw), hidden, weight,
                                    grad_output=grad_output.double())
    x = hidden.detach().clone().requires_grad_(True)
    out, argmax = sparse_kl_loss(x, weight, ids, logprobs, weights, impl="triton", return_argmax=True,
                                 workspace_bytes=5 * v * 4, triton_config=TritonConfig(block_v=128), **kw)
    assert type(out.grad_fn).__name__ == "_TritonSparseKLReducedBackward"
    (stored,) = out.grad_fn.saved_tensors
    assert stored.dtype == dtype and stored.shape == (n, h)  # dX in X's dtype: no fp32 [N, H]
    out.backward(grad_output)
    tol = FP32_TOL if dtype == torch.float32 else 2.0**-7  # bf16: G and dX each rounded once
    assert rel_err(out, ref) <= (FP32_TOL if dtype == torch.float32 else 1e-3)
    assert x.grad.dtype == dtype
    assert rel_err(x.grad, ref_dx) <= tol
    assert torch.equal(x.grad[dead], torch.zeros_like(x.grad[dead]))
    assert torch.equal(argmax, (hidden.double() @ weight.double().T).argmax(1))


@pytest.mark.e2e  # the kernel in the CPU interpreter
def test_reduced_path_all_weights_zero():
    """reduction="mean" with every weight 0: loss 0 and a zero gradient (no 0/0)."""
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=22)
    x = hidden.clone().requires_grad_(True)
    out = sparse_kl_loss(x, weight, ids, logprobs, torch.zeros(n), impl="triton", workspace_bytes=5 * v * 4,
                         triton_config=TritonConfig(block_v=128))
    out.backward()
    assert out.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x.grad))


@pytest.mark.e2e  # the kernel in the CPU interpreter
def test_reduced_path_unit_grad_is_exact_and_matches_per_row_path():
    """bf16: the reduced path's dX for loss.backward() is the stored bf16 dX itself (the
    upstream 1 multiplies exactly), and the per-row path (reduction="none", fp32 dX scaled in
    the backward) gives the same gradient to bf16 rounding: both round G and dX once."""
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=23, dtype=torch.bfloat16)
    weights = torch.rand(n, generator=torch.Generator().manual_seed(23)) + 0.5
    common = dict(impl="triton", workspace_bytes=5 * v * 4, triton_config=TritonConfig(block_v=128))
    x = hidden.clone().requires_grad_(True)
    out = sparse_kl_loss(x, weight, ids, logprobs, weights, reduction="sum", **common)
    (stored,) = out.grad_fn.saved_tensors
    out.backward()
    assert torch.equal(x.grad, stored)
    y = hidden.clone().requires_grad_(True)
    rows = sparse_kl_loss(y, weight, ids, logprobs, weights, reduction="none", **common)
    rows.sum().backward()
    assert rel_err(rows.sum(), out) <= 1e-6
    assert rel_err(y.grad, x.grad) <= 2.0**-7


@pytest.mark.e2e  # the kernel in the CPU interpreter
def test_fp16_keeps_the_per_row_path():
    """fp16 cannot hold the weighted logit gradient (p * w / sum w underflows), so an fp16
    call keeps dX in fp32 and scales it in the backward (the per-row Function)."""
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=24, dtype=torch.float16)
    ref, ref_dx, _ = loss_and_grads(lambda x, w: truth(x, w, ids, logprobs), hidden, weight)
    x = hidden.clone().requires_grad_(True)
    out = sparse_kl_loss(x, weight, ids, logprobs, impl="triton", workspace_bytes=5 * v * 4,
                         triton_config=TritonConfig(block_v=128))
    assert "Reduced" not in type(out.grad_fn).__name__
    out.backward()
    assert rel_err(out, ref) <= 1e-3 and rel_err(x.grad, ref_dx) <= 2.0**-7


@pytest.mark.parametrize("impl", ["naive", "torch", pytest.param("triton", marks=pytest.mark.e2e)])
def test_argmax_ties_take_the_first_index(impl):
    """Exact ties within a tile and across tiles resolve to the smallest id, as torch.argmax
    does. Small integer inputs make every logit exact in any summation order (so ties are
    real ties) and make ties common."""
    n, h, v, k = SHAPES["odd"]
    g = torch.Generator().manual_seed(12)
    hidden = torch.randint(-2, 3, (n, h), generator=g).float()  # [N, H]
    weight = torch.randint(-1, 2, (v, h), generator=g).float()  # [V, H]
    ids = torch.rand(n, v, generator=g).argsort(1)[:, :k]
    logprobs = torch.full((n, k), -3.0)
    logits = hidden @ weight.T  # [N, V], integers
    assert ((logits == logits.max(1, keepdim=True).values).sum(1) > 1).float().mean() > 0.3
    kw = {"triton_config": TritonConfig(block_v=64)} if impl == "triton" else {}
    _, argmax = sparse_kl_loss(hidden, weight, ids, logprobs, impl=impl, return_argmax=True, **kw)
    assert torch.equal(argmax, logits.argmax(1))


@triton.jit
def _round_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _to_storage(tl.load(x_ptr + offs), tl.bfloat16, True))


def test_bf16_rounding_is_nearest_even():
    """G's bf16 rounding under the interpreter (integer ops; the interpreter's own cast
    truncates) equals torch's fp32 -> bf16, ties to even included."""
    g = torch.Generator().manual_seed(15)
    x = torch.cat([
        torch.randn(4000, generator=g) * 10.0 ** torch.randint(-30, 30, (4000,), generator=g),
        torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, 3.3e38, 0.0, -0.0]),  # ties, subnormal, near max
    ])  # [4007] fp32
    x = torch.nn.functional.pad(x, (0, 4096 - len(x)))
    out = torch.empty(4096, dtype=torch.bfloat16)
    _round_kernel[(1,)](x, out, N=4096)
    assert torch.equal(out.view(torch.int16), x.bfloat16().view(torch.int16))


@pytest.mark.parametrize("field, value", [("block_v", 8), ("block_v", 100), ("num_warps", 6), ("num_warps", 0),
                                          ("programs_per_sm", -1)])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=f"TritonConfig.{field}"):
        TritonConfig(**{field: value})


@pytest.mark.e2e  # a subprocess
def test_cpu_tensors_without_interpreter_raise():
    code = (
        "import torch\n"
        "from dflash.kernels.loss import sparse_kl_loss\n"
        "x, w = torch.randn(4, 16), torch.randn(32, 16)\n"
        "ids, lq = torch.tensor([[1, 2]] * 4), torch.full((4, 2), -1.0)\n"
        "try:\n"
        "    sparse_kl_loss(x, w, ids, lq, impl='triton')\n"
        "except ValueError as err:\n"
        "    assert 'TRITON_INTERPRET=1' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('impl=triton ran on CPU tensors without the interpreter')\n"
        "assert sparse_kl_loss(x, w, ids, lq, impl='auto').isfinite()\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


# Compiles the kernel to a cubin for sm_90 with the ptxas that ships in the triton wheel
# (no GPU or driver needed): the code the GPU runs (the hardware bf16 cast, the barriers)
# is never compiled by the interpreter. The variants: the DFlash case (bucket, bf16 G scaled
# by the row weights), fp32 G with CE and a row scale (the dW recompute), forward only
# (renorm), and TV + CE with bf16 G (DSpark's 0.9 TV + 0.1 CE in training).
COMPILE_CODE = r"""
import os, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dflash.kernels.sparse_kl import INTERPRETED, _chunk_rows_kernel
assert not INTERPRETED
args = {"z_ptr": "*fp32", "ids_ptr": "*i64", "lq_ptr": "*fp32", "qtail_ptr": "*fp32", "scale_ptr": "*fp32",
        "row_ptr": "*fp32", "arg_ptr": "*i64", "coef_ptr": "*fp32", "n_rows": "i32", "V": "i32", "K": "i32",
        "KT": "i32",
        "stride_z": "i32", "stride_g": "i32", "ce_weight": "fp32", "tail_eps": "fp32"}
variants = [
    dict(TAIL_BUCKET=True, TV=False, USE_CE=False, WRITE_G=True, HAS_SCALE=True, G_DTYPE=tl.bfloat16),
    dict(TAIL_BUCKET=True, TV=False, USE_CE=True, WRITE_G=True, HAS_SCALE=True, G_DTYPE=tl.float32),
    dict(TAIL_BUCKET=False, TV=False, USE_CE=False, WRITE_G=False, HAS_SCALE=False, G_DTYPE=tl.bfloat16),
    dict(TAIL_BUCKET=True, TV=True, USE_CE=True, WRITE_G=True, HAS_SCALE=True, G_DTYPE=tl.bfloat16),
]
for variant in variants:
    const = dict(variant, ROUND_BY_BITS=False, K_PAD=64, BLOCK_V=4096)
    signature = dict(args, **{name: "constexpr" for name in const})
    names = list(signature)
    # What the JIT specialises at run time for V = 151936: 16-divisible pointers and strides.
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("z_ptr", "V", "stride_z", "stride_g")}
    src = ASTSource(fn=_chunk_rows_kernel, signature=signature, attrs=attrs,
                    constexprs={(names.index(name),): value for name, value in const.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    ptx = kernel.asm["ptx"]
    assert kernel.asm["cubin"]
    assert ("st.global.v" in ptx) == variant["WRITE_G"], "G stores should be vectorised"
    assert "ld.global.v4" in ptx, "row loads should be 128-bit"
print("compiled", len(variants))
"""


@pytest.mark.e2e  # a subprocess that compiles the kernel
def test_compiles_for_hopper():
    ptxas = os.path.join(os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip(f"no ptxas in the triton wheel at {ptxas}")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", COMPILE_CODE], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled 4" in done.stdout
