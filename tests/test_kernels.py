"""sparse_kl_loss against a float64 ground truth written straight from the formula.

Every implementation (naive, torch chunked, triton under TRITON_INTERPRET=1) is checked on
one odd shape and one round shape, forward and gradients, through the public function.
The ground truth (`truth` in dflash.testing.builders) materialises float64 logits and uses
autograd; it shares no code with the package (no clamps, no lse/gather split), so a
mistake in `row_losses` or in a hand-written backward shows up as a mismatch.
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dflash.kernels.loss import sparse_kl_loss
from dflash.kernels.reference import _ChunkedLseGather
from dflash.kernels.sparse_kl import TritonConfig
from dflash.testing.builders import (
    FP32_TOL,
    SHAPES,
    loss_and_grads,
    make_problem,
    rel_err,
    row_weights_and_grads,
    truth,
)

# The Triton kernel runs in its CPU interpreter here (conftest): seconds per case, so its cases
# are outside the quick loop (`pytest -m "not e2e"`); `make test` runs them.
TRITON = pytest.param("triton", marks=pytest.mark.e2e)
IMPLS = ["naive", "torch", TRITON]
# Tiles of 128 give V=1031 nine tiles, the last one partial, in each of the row kernel's
# sweeps; a workspace of 16 rows (fp32 [C, V] for both paths) splits N=37 into three
# balanced chunks of 13, 13 and 11 rows, and N=64 into four.
TRITON_TEST_CONFIG = TritonConfig(block_v=128)


def impl_kwargs(impl: str, v: int) -> dict:
    if impl == "torch":
        return {"impl": "torch", "workspace_bytes": 16 * v * 4}
    if impl == "triton":
        return {"impl": "triton", "workspace_bytes": 16 * v * 4, "triton_config": TRITON_TEST_CONFIG}
    return {"impl": impl}




@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tail", ["bucket", "renorm"])
def test_matches_fp64_truth(impl, shape, tail):
    n, h, v, k = SHAPES[shape]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k)
    ref, ref_dx, _ = loss_and_grads(lambda x, w: truth(x, w, ids, logprobs, tail=tail), hidden, weight)
    out, dx, _ = loss_and_grads(
        lambda x, w: sparse_kl_loss(x, w, ids, logprobs, tail=tail, **impl_kwargs(impl, v)), hidden, weight
    )
    assert abs(out.item() - ref.item()) <= FP32_TOL * abs(ref.item())
    assert rel_err(dx, ref_dx) <= FP32_TOL


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tail", ["bucket", "renorm"])
def test_weight_gradient(impl, tail):
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=1)
    weights = torch.rand(n, generator=torch.Generator().manual_seed(1))
    ref, ref_dx, ref_dw = loss_and_grads(
        lambda x, w: truth(x, w, ids, logprobs, weights, tail=tail), hidden, weight, grad_weight=True
    )
    out, dx, dw = loss_and_grads(
        lambda x, w: sparse_kl_loss(x, w, ids, logprobs, weights, tail=tail, **impl_kwargs(impl, v)),
        hidden, weight, grad_weight=True,
    )
    assert abs(out.item() - ref.item()) <= FP32_TOL * abs(ref.item())
    assert rel_err(dx, ref_dx) <= FP32_TOL
    assert rel_err(dw, ref_dw) <= FP32_TOL


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("workspace_rows", [16, 64], ids=["chunked", "one-chunk"])  # N = 37: 3 chunks, or 1 (kept)
@pytest.mark.parametrize("loss", ["bucket", "kl+ce", "renorm", "tv", "tv+ce"])
def test_weight_gradient_from_a_column(impl, workspace_rows, loss):
    """weight_grad_from c: dW of columns c: and dX against autograd of the fp64 formula, whose
    columns before c are a frozen constant (DSpark's [W_head; markov_w2]); those get exactly 0."""
    n, h, v, k = SHAPES["odd"]
    c = 41  # the last 7 of 48 columns train, as DSpark's last r of H + r
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=4)
    g = torch.Generator().manual_seed(4)
    weights = torch.rand(n, generator=g)
    weights[::5] = 0.0
    targets = torch.randint(0, v, (n,), generator=g)
    tail = "renorm" if loss == "renorm" else "bucket"
    ce = dict(ce_targets=targets, ce_weight=0.5) if loss.endswith("+ce") else {}
    ce["divergence"] = "tv" if loss.startswith("tv") else "kl"

    def frozen_front(w):  # the plain formula's frozen columns: a constant, no gradient
        return torch.cat([w[:, :c].detach(), w[:, c:]], 1)

    ref, ref_dx, ref_dw = loss_and_grads(
        lambda x, w: truth(x, frozen_front(w), ids, logprobs, weights, tail=tail, reduction="sum", **ce),
        hidden, weight, grad_weight=True)
    kwargs = dict(impl_kwargs(impl, v), workspace_bytes=workspace_rows * v * 4) if impl != "naive" else {"impl": impl}
    out, dx, dw = loss_and_grads(
        lambda x, w: sparse_kl_loss(x, w, ids, logprobs, weights, tail=tail, reduction="sum", weight_grad_from=c,
                                    **ce, **kwargs),
        hidden, weight, grad_weight=True)
    assert abs(out.item() - ref.item()) <= FP32_TOL * abs(ref.item())
    assert rel_err(dx, ref_dx) <= FP32_TOL
    assert torch.count_nonzero(dw[:, :c]) == 0
    assert rel_err(dw[:, c:], ref_dw[:, c:]) <= FP32_TOL


@pytest.mark.parametrize("workspace_rows", [16, 64], ids=["chunked", "one-chunk"])
def test_weight_grad_from_matches_the_full_gradient(workspace_rows):
    """The torch path with weight_grad_from c: the loss and dX are the same bits as with 0 (c
    changes only dW's product), dW's columns c: the same dot products. Those are the same
    bits only where the BLAS runs one kernel for both widths (the demo's 64 of 640 columns
    on this machine's: bench/RESULTS.md, train_step); 7 of 48 here take another kernel, off
    by an fp32 rounding of the K-sum, so: 1e-6 relative to the largest entry."""
    n, h, v, k = SHAPES["odd"]
    c = 41
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=6)
    weights = torch.rand(n, generator=torch.Generator().manual_seed(6))

    def run(grad_from):
        return loss_and_grads(
            lambda x, w: sparse_kl_loss(x, w, ids, logprobs, weights, impl="torch", reduction="sum",
                                        workspace_bytes=workspace_rows * v * 4, weight_grad_from=grad_from),
            hidden, weight, grad_weight=True)

    (out, dx, dw), (full_out, full_dx, full_dw) = run(c), run(0)
    assert torch.equal(out, full_out) and torch.equal(dx, full_dx)
    assert rel_err(dw[:, c:], full_dw[:, c:]) <= 1e-6


def test_kept_logits_are_the_recomputed_ones():
    """One chunk: the backward's dW from the forward's kept logits equals, bit for bit, the
    dW that recomputes them (the same product, the same elementwise steps)."""
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=7)
    grad_lse, grad_zsel = torch.randn(n), torch.randn(n, k)

    def run(keep_logits):
        x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lse, z_sel, _ = _ChunkedLseGather.apply(x, w, ids, True, True, keep_logits, 0, 64 * v * 4)
        torch.autograd.backward([lse, z_sel], [grad_lse, grad_zsel])
        return lse, z_sel, x.grad, w.grad

    for kept, recomputed in zip(run(True), run(False)):
        assert torch.equal(kept, recomputed)


@pytest.mark.parametrize("impl", IMPLS)
def test_k1_is_cross_entropy(impl):
    """k = 1 with teacher log-prob 0: no tail, the loss is the CE of the teacher's token."""
    n, h, v, _ = SHAPES["odd"]
    hidden, weight, _, _ = make_problem(n, h, v, 1, seed=2)
    labels = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(2))
    ref, ref_dx, _ = loss_and_grads(lambda x, w: F.cross_entropy(x @ w.T, labels), hidden, weight)
    out, dx, _ = loss_and_grads(
        lambda x, w: sparse_kl_loss(x, w, labels[:, None], torch.zeros(n, 1), **impl_kwargs(impl, v)),
        hidden, weight,
    )
    assert abs(out.item() - ref.item()) <= FP32_TOL * abs(ref.item())
    assert rel_err(dx, ref_dx) <= FP32_TOL


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tail_level", [1e-7, 0.5, 1 - 1e-6])
def test_teacher_tail_extremes(impl, tail_level):
    """Teacher tail mass near 0 (q_t log q_t -> 0, 1 - sum q cancels) and near 1 (q -> 0)."""
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, _ = make_problem(n, h, v, k, seed=3)
    shares = torch.softmax(torch.randn(n, k, generator=torch.Generator().manual_seed(3)), 1)
    logprobs = (shares.double() * (1 - tail_level)).log().float()  # [N, k]: sum q = 1 - tail_level
    ref, ref_dx, _ = loss_and_grads(lambda x, w: truth(x, w, ids, logprobs), hidden, weight)
    out, dx, _ = loss_and_grads(lambda x, w: sparse_kl_loss(x, w, ids, logprobs, **impl_kwargs(impl, v)),
                                hidden, weight)
    # The fp32 log-probs carry ~6e-8 relative error, so the teacher tail is known only to
    # ~k * 6e-8 absolute: the loss is compared with that much slack on top.
    assert abs(out.item() - ref.item()) <= FP32_TOL * abs(ref.item()) + 1e-6
    assert rel_err(dx, ref_dx) <= FP32_TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_weight_rows_are_inert(impl):
    """Rows of weight 0 contribute exactly 0 to loss and gradient, even with NaN teachers."""
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=4)
    weights = torch.rand(n, generator=torch.Generator().manual_seed(4)) + 0.5
    dead = torch.arange(n) % 3 == 0
    weights[dead] = 0.0
    garbage = logprobs.clone()
    garbage[dead] = torch.nan
    ref, ref_dx, _ = loss_and_grads(lambda x, w: truth(x, w, ids, logprobs, weights), hidden, weight)
    out, dx, _ = loss_and_grads(
        lambda x, w: sparse_kl_loss(x, w, ids, garbage, weights, **impl_kwargs(impl, v)), hidden, weight
    )
    assert abs(out.item() - ref.item()) <= FP32_TOL * abs(ref.item())
    assert torch.equal(dx[dead], torch.zeros_like(dx[dead]))
    assert rel_err(dx, ref_dx) <= FP32_TOL


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tail", ["bucket", "renorm"])
def test_reduction_none_with_partly_zero_grad_output(impl, tail):
    n, h, v, k = SHAPES["round"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=5)
    weights, grad_output, _ = row_weights_and_grads(n, torch.Generator().manual_seed(5))
    ref, ref_dx, _ = loss_and_grads(
        lambda x, w: truth(x, w, ids, logprobs, weights, tail=tail, reduction="none"), hidden, weight,
        grad_output=grad_output.double(),
    )
    out, dx, _ = loss_and_grads(
        lambda x, w: sparse_kl_loss(x, w, ids, logprobs, weights, tail=tail, reduction="none", **impl_kwargs(impl, v)),
        hidden, weight, grad_output=grad_output,
    )
    assert out.shape == (n,)
    assert rel_err(out, ref) <= FP32_TOL
    assert torch.equal(dx[::4], torch.zeros_like(dx[::4]))
    assert rel_err(dx, ref_dx) <= FP32_TOL


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tail", ["bucket", "renorm"])
def test_cross_entropy_term(impl, tail):
    """CE targets inside the teacher's ids (one id in two slots) and outside them."""
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=6)
    targets = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(6))
    targets[::2] = ids[::2, 0]
    kw = dict(tail=tail, ce_targets=targets, ce_weight=0.3)
    ref, ref_dx, ref_dw = loss_and_grads(lambda x, w: truth(x, w, ids, logprobs, **kw), hidden, weight,
                                         grad_weight=True)
    out, dx, dw = loss_and_grads(
        lambda x, w: sparse_kl_loss(x, w, ids, logprobs, **kw, **impl_kwargs(impl, v)), hidden, weight, grad_weight=True
    )
    assert abs(out.item() - ref.item()) <= FP32_TOL * abs(ref.item())
    assert rel_err(dx, ref_dx) <= FP32_TOL
    assert rel_err(dw, ref_dw) <= FP32_TOL


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tail", ["bucket", "renorm"])
def test_argmax_is_logits_argmax(impl, tail):
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=7)
    loss, argmax = sparse_kl_loss(hidden, weight, ids, logprobs, tail=tail, return_argmax=True, **impl_kwargs(impl, v))
    assert argmax.dtype == torch.int64
    assert torch.equal(argmax, (hidden.double() @ weight.double().T).argmax(1))
    assert loss.item() == pytest.approx(truth(hidden, weight, ids, logprobs, tail=tail).item(), rel=FP32_TOL)


@pytest.mark.parametrize("impl", ["torch", TRITON])
@pytest.mark.parametrize("tail", ["bucket", "renorm"])
def test_bf16_no_worse_than_bf16_reference(impl, tail):
    """The Cut Cross-Entropy criterion: with bf16 inputs, the error against the fp64 truth
    (on the same bf16 values) is at most the plain bf16 PyTorch computation's error plus a
    small tolerance. The reference rounds its logits to bf16 (as a bf16 lm_head does); ours
    keep them fp32, so they should be well inside it. The one rounding we add that the
    reference also has is the final bf16 dX (2^-9 relative per element): TOL covers it."""
    n, h, v, k = SHAPES["round"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=8, dtype=torch.bfloat16)
    tol = 2.0**-9
    ref, ref_dx, _ = loss_and_grads(lambda x, w: truth(x, w, ids, logprobs, tail=tail), hidden, weight)
    base, base_dx, _ = loss_and_grads(
        lambda x, w: sparse_kl_loss(x, w, ids, logprobs, tail=tail, impl="naive"), hidden, weight
    )
    out, dx, _ = loss_and_grads(
        lambda x, w: sparse_kl_loss(x, w, ids, logprobs, tail=tail, **impl_kwargs(impl, v)), hidden, weight
    )
    assert dx.dtype == torch.bfloat16
    assert abs(out.item() - ref.item()) <= abs(base.item() - ref.item()) + tol * abs(ref.item())
    assert rel_err(dx, ref_dx) <= rel_err(base_dx, ref_dx) + tol


@pytest.mark.parametrize("impl", IMPLS)
def test_no_grad_forward(impl):
    n, h, v, k = SHAPES["round"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=9)
    with torch.no_grad():
        out = sparse_kl_loss(hidden.requires_grad_(True), weight, ids, logprobs, **impl_kwargs(impl, v))
    assert out.item() == pytest.approx(truth(hidden, weight, ids, logprobs).item(), rel=FP32_TOL)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden=torch.zeros(2, 3, 8)), "flatten"),
        (dict(weight=torch.zeros(16, 7)), "weight must be"),
        (dict(hidden=torch.zeros(4, 8, dtype=torch.bfloat16)), "cast one"),
        (dict(topk_ids=torch.zeros(4, 2)), "topk_ids must be"),
        (dict(topk_logprobs=torch.zeros(4, 3)), "topk_logprobs must be"),
        (dict(weights=torch.ones(5)), "weights must be"),
        (dict(tail="other"), "tail="),
        (dict(divergence="js"), "divergence="),
        (dict(divergence="tv", tail="renorm"), "divergence='tv' needs tail='bucket'"),
        (dict(impl="cuda"), "impl="),
        (dict(reduction="avg"), "reduction="),
        (dict(ce_weight=0.5), "needs ce_targets"),
        (dict(weight_grad_from=9), "weight_grad_from=9"),
        (dict(weight_grad_from=-1), "weight_grad_from=-1"),
    ],
)
def test_input_errors(change, message):
    args = dict(hidden=torch.zeros(4, 8), weight=torch.zeros(16, 8), topk_ids=torch.zeros(4, 2, dtype=torch.long),
                topk_logprobs=torch.zeros(4, 2))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        sparse_kl_loss(**args)


# ----------------------------------------------------------------------- divergence="tv"
# TV against the top-k + tail bucket (kernels/reference.py, "The total variation"): every impl
# against the fp64 truth, whose gradient is autograd's through abs (sign(0) = 0, as ours).
# A sign that flips between fp32 and fp64 (|p_i - q_i| below ~1e-7) would cost a gradient error
# of ~p_i; none does on these draws, so the fp32 tolerance is FP32_TOL as for the KL.

CE_TERMS = {"tv": 0.0, "tv+ce": 0.3}
# Beside the kernel tests' shapes, Liger's odd one (41 x 401 x 1271): a wider H, V in ten
# tiles of 128 (the last partial), N in three chunks of the 16-row workspace.
TV_SHAPES = {**SHAPES, "liger": (41, 401, 1271, 9)}


def tv_problem(n, h, v, k, *, seed, dtype=torch.float32):
    """make_problem plus row weights (a fifth of them 0) and CE targets (every other one among
    the teacher's ids, so that an id sits in two slots)."""
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(n, generator=g) + 0.5
    weights[::5] = 0.0
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::2] = ids[::2, 0]
    return hidden, weight, ids, logprobs, weights, targets


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", TV_SHAPES)
@pytest.mark.parametrize("loss", CE_TERMS)
@pytest.mark.parametrize("grad_weight", [False, True], ids=["dx", "dx-dw"])
def test_tv_matches_fp64_truth(impl, shape, loss, grad_weight):
    """Loss, dX and dW (the Triton path: dX stored in the forward, or the dW recompute)."""
    n, h, v, k = TV_SHAPES[shape]
    hidden, weight, ids, logprobs, weights, targets = tv_problem(n, h, v, k, seed=31)
    kw = dict(divergence="tv", ce_targets=targets, ce_weight=CE_TERMS[loss])
    ref, ref_dx, ref_dw = loss_and_grads(lambda x, w: truth(x, w, ids, logprobs, weights, **kw), hidden, weight,
                                         grad_weight=grad_weight)
    out, dx, dw = loss_and_grads(
        lambda x, w: sparse_kl_loss(x, w, ids, logprobs, weights, **kw, **impl_kwargs(impl, v)), hidden, weight,
        grad_weight=grad_weight)
    assert 0.1 < ref.item()  # a live loss: the student is far from the teacher
    assert abs(out.item() - ref.item()) <= FP32_TOL * abs(ref.item())
    assert rel_err(dx, ref_dx) <= FP32_TOL
    assert torch.equal(dx[::5], torch.zeros_like(dx[::5]))
    if grad_weight:
        assert rel_err(dw, ref_dw) <= FP32_TOL


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss", CE_TERMS)
def test_tv_reduction_none_with_partly_zero_grad_output(impl, loss):
    n, h, v, k = SHAPES["round"]
    hidden, weight, ids, logprobs, _, targets = tv_problem(n, h, v, k, seed=32)
    weights, grad_output, _ = row_weights_and_grads(n, torch.Generator().manual_seed(32))
    kw = dict(divergence="tv", reduction="none", ce_targets=targets, ce_weight=CE_TERMS[loss])
    ref, ref_dx, ref_dw = loss_and_grads(lambda x, w: truth(x, w, ids, logprobs, weights, **kw), hidden, weight,
                                         grad_weight=True, grad_output=grad_output.double())
    out, dx, dw = loss_and_grads(
        lambda x, w: sparse_kl_loss(x, w, ids, logprobs, weights, **kw, **impl_kwargs(impl, v)), hidden, weight,
        grad_weight=True, grad_output=grad_output)
    assert out.shape == (n,)
    assert rel_err(out, ref) <= FP32_TOL
    assert torch.equal(dx[::4], torch.zeros_like(dx[::4]))
    assert rel_err(dx, ref_dx) <= FP32_TOL
    assert rel_err(dw, ref_dw) <= FP32_TOL


@pytest.mark.parametrize("impl", ["torch", TRITON])
@pytest.mark.parametrize("loss", CE_TERMS)
def test_tv_bf16_no_worse_than_bf16_reference(impl, loss):
    """The numerics rule of test_bf16_no_worse_than_bf16_reference, for TV (+ CE) with row
    weights, the training call's reduction "sum"."""
    n, h, v, k = SHAPES["round"]
    hidden, weight, ids, logprobs, weights, targets = tv_problem(n, h, v, k, seed=33, dtype=torch.bfloat16)
    kw = dict(divergence="tv", reduction="sum", ce_targets=targets, ce_weight=CE_TERMS[loss])
    tol = 2.0**-9
    ref, ref_dx, _ = loss_and_grads(lambda x, w: truth(x, w, ids, logprobs, weights, **kw), hidden, weight)
    base, base_dx, _ = loss_and_grads(
        lambda x, w: sparse_kl_loss(x, w, ids, logprobs, weights, impl="naive", **kw), hidden, weight)
    out, dx, _ = loss_and_grads(
        lambda x, w: sparse_kl_loss(x, w, ids, logprobs, weights, **kw, **impl_kwargs(impl, v)), hidden, weight)
    assert dx.dtype == torch.bfloat16
    assert abs(out.item() - ref.item()) <= abs(base.item() - ref.item()) + tol * abs(ref.item())
    assert rel_err(dx, ref_dx) <= rel_err(base_dx, ref_dx) + tol


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_weight", [False, True], ids=["dx", "dx-dw"])
def test_tv_is_deterministic(impl, dtype, grad_weight):
    """Two runs give the same bits: loss, argmax, dX and dW (no atomics, fixed chunk order)."""
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, logprobs, weights, targets = tv_problem(n, h, v, k, seed=34, dtype=dtype)

    def run():
        x = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(grad_weight)
        loss, argmax = sparse_kl_loss(x, w, ids, logprobs, weights, divergence="tv", ce_targets=targets,
                                      ce_weight=0.1, reduction="sum", return_argmax=True, **impl_kwargs(impl, v))
        loss.backward()
        return loss.detach(), argmax, x.grad, w.grad

    for first, second in zip(run(), run()):
        assert (first is None and second is None) or torch.equal(first, second)


@pytest.mark.parametrize("proportional", [True, False], ids=["proportional-tails", "any-tails"])
def test_tv_bounds_the_full_vocabulary_tv(proportional):
    """Against a teacher known over the whole vocabulary: the top-k + tail TV is at most the
    full TV, per row, and equal when the teacher's tail is the student's, rescaled."""
    n, h, v, k = SHAPES["odd"]
    hidden, weight, _, _ = make_problem(n, h, v, k, seed=35)
    g = torch.Generator().manual_seed(35)
    p = (hidden.double() @ weight.double().T).softmax(1)  # [N, V] the student
    r = torch.softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * 2, 1)  # [N, V] the teacher
    ids = r.topk(k, 1).indices  # [N, k]
    in_s = torch.zeros(n, v, dtype=torch.bool).scatter_(1, ids, True)
    if proportional:  # the teacher's tail mass spread as the student's
        tail = 1 - r.gather(1, ids).sum(1, keepdim=True)
        r = torch.where(in_s, r, p * tail / p.masked_fill(in_s, 0).sum(1, keepdim=True))
    full = 0.5 * (p - r).abs().sum(1)  # [N]
    rows = sparse_kl_loss(hidden.double(), weight.double(), ids, r.gather(1, ids).log(), divergence="tv",
                          reduction="none", impl="torch")
    # The rows are fp32 (float64 inputs give fp32 row losses): 1e-6 absolute on values < 1.
    if proportional:
        torch.testing.assert_close(rows.double(), full, rtol=0, atol=1e-6)
    else:
        assert (rows <= full + 1e-6).all() and (rows < full - 1e-2).any()


def test_tv_sign_of_zero_is_zero():
    """row_losses at p = q on every slot and the tail (the same fp32 values): the loss is 0 and
    so is its gradient in (lse, z_sel), sign(0) = 0. One slot moved up (s = 0.5 there, 0 on
    the other slots, s_t = -0.5: the tail is now short) gives c = p on it and 0.5 p on the
    others: d_zsel = c, d_lse = -sum c."""
    from dflash.kernels.reference import row_losses

    z_sel = torch.log_softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(36)), 1) - 0.5  # [3, 5]
    lse = torch.zeros(3, requires_grad=True)
    tail = 1.0 - z_sel.exp().sum(1)  # [3] fp32, the student's tail to the bit
    for bump in (0.0, 1e-3):
        z = z_sel.clone()
        z[:, 0] += bump
        z.requires_grad_(True)
        row = row_losses(lse, z, z_sel, tail="bucket", tail_mass=tail, divergence="tv")
        d_lse, d_z = torch.autograd.grad(row.sum(), [lse, z])
        if bump == 0.0:
            assert torch.equal(row, torch.zeros(3)) and torch.equal(d_z, torch.zeros_like(d_z))
            assert torch.equal(d_lse, torch.zeros(3))
        else:
            p = z.detach().exp()  # [3, 5]
            c = torch.cat([p[:, :1], 0.5 * p[:, 1:]], 1)
            torch.testing.assert_close(d_z, c)
            torch.testing.assert_close(d_lse, -c.sum(1))


@pytest.mark.e2e  # a subprocess
def test_imports_and_runs_without_triton():
    """macOS installs have no triton: the package imports, torch works, triton says why not."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from dflash.kernels.loss import sparse_kl_loss\n"
        "x, w = torch.randn(4, 8), torch.randn(16, 8)\n"
        "ids, lq = torch.tensor([[1, 2]] * 4), torch.full((4, 2), -1.0)\n"
        "sparse_kl_loss(x, w, ids, lq)\n"
        "try:\n"
        "    sparse_kl_loss(x, w, ids, lq, impl='triton')\n"
        "except RuntimeError as err:\n"
        "    assert 'triton package' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('impl=triton ran without triton')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
