"""`sparse_kl_loss`: the drafter's loss against a cached teacher top-k, LM head fused in.

This file is the public entry point: it checks the inputs, picks the implementation at call
time (never at import: a macOS install without triton still imports this package), gets
the per-row losses (naive/torch: a vocabulary pass in `reference.py`, then
`reference.row_losses`; triton: `sparse_kl.triton_sparse_kl_rows`, which computes the rows
and their gradient in one fused pass per row chunk) and applies the row weights and the
reduction. The math and the gradient split are documented in `reference.py`; the Triton
path, its FLOP count, memory traffic and bounded workspace in `sparse_kl.py`.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from .reference import (
    chunked_lse_gather,
    default_workspace_bytes,
    naive_lse_gather,
    row_losses,
    teacher_logprobs,
    teacher_tail,
)

IMPLS = ("auto", "triton", "torch", "naive")
TAILS = ("bucket", "renorm")
DIVERGENCES = ("kl", "tv")
REDUCTIONS = ("mean", "sum", "none")


# The return type follows return_argmax: the loss alone, or (loss, argmax).
@overload
def sparse_kl_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    tail: str = "bucket",
    divergence: str = "kl",
    impl: str = "auto",
    reduction: str = "mean",
    ce_targets: torch.Tensor | None = None,
    ce_weight: float = 0.0,
    return_argmax: Literal[False] = False,
    tail_mass: torch.Tensor | None = None,
    workspace_bytes: int | None = None,
    triton_config=None,
    weight_grad_from: int = 0,
) -> torch.Tensor: ...


@overload
def sparse_kl_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    tail: str = "bucket",
    divergence: str = "kl",
    impl: str = "auto",
    reduction: str = "mean",
    ce_targets: torch.Tensor | None = None,
    ce_weight: float = 0.0,
    return_argmax: Literal[True],
    tail_mass: torch.Tensor | None = None,
    workspace_bytes: int | None = None,
    triton_config=None,
    weight_grad_from: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def sparse_kl_loss(
    hidden: torch.Tensor,  # [N, H] fp32/bf16: the drafter's final hidden states
    weight: torch.Tensor,  # [V, H] same dtype: the LM head (dW only if it requires grad)
    topk_ids: torch.Tensor,  # [N, k] integer: the teacher's top-k ids, distinct per row
    topk_logprobs: torch.Tensor,  # [N, k] float: teacher log-probs over the full vocabulary
    weights: torch.Tensor | None = None,  # [N] float >= 0: per-row weight; None = ones
    *,
    tail: str = "bucket",
    divergence: str = "kl",
    impl: str = "auto",
    reduction: str = "mean",
    ce_targets: torch.Tensor | None = None,  # [N] integer: hard labels for the CE term
    ce_weight: float = 0.0,
    return_argmax: bool = False,
    tail_mass: torch.Tensor | None = None,  # [N] float: teacher tail; None = max(0, 1 - sum q)
    workspace_bytes: int | None = None,
    triton_config=None,
    weight_grad_from: int = 0,  # the first column of weight that gets a gradient
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse KL (or TV) of the student softmax(hidden @ weight.T) to the teacher's top-k (+ tail).

    Row loss: tail="bucket" treats the teacher's tail mass as one extra class against the
    student's mass outside the ids; tail="renorm" renormalises both over the ids.
    divergence="kl" is KL(teacher || student); divergence="tv" (tail="bucket" only) the total
    variation 0.5 * (sum_ids |p_i - q_i| + |p_tail - q_tail|), a lower bound of the
    full-vocabulary TV, equal to it when the two tails are proportional (reference.py: the
    bound, the gradient, sign(0) = 0). With ce_weight != 0,
    `ce_weight * cross_entropy(logits, ce_targets)` is added to each row.
    reduction="mean" returns sum(w * row) / sum(w) (0 when all weights are 0), "sum" returns
    sum(w * row), "none" the [N] rows w * row (rows of weight 0 are exactly 0 and get zero
    gradient whatever their teacher values). Ids must lie in [0, V).

    impl: "naive" materialises the [N, V] logits; "torch" is chunked over rows (peak extra
    memory one [C, V] fp32 buffer of `workspace_bytes`, default 128 MiB on CPU, 256 MiB on
    CUDA); "triton" is chunked the same way, with cuBLAS for the two GEMMs and one fused
    Triton kernel per chunk for everything else, dX formed in the forward when the head is
    frozen (kept in hidden's dtype, already weighted, for bf16/fp32 and reduction "mean" or
    "sum"; CUDA, or
    CPU tensors under TRITON_INTERPRET=1); "auto" is triton for CUDA
    tensors, torch otherwise. tail="renorm" without CE or argmax has no vocabulary work at
    all and takes the torch path's N*k'*H gather whatever impl says. divergence="tv" runs the
    same passes as "kl" (the same gradient form, one more mode of the Triton row kernel): the
    same extra memory, nothing more.

    weight_grad_from c: when weight requires grad, only its columns c: get one; the columns
    before c are frozen (their gradient is 0). DSpark's head [W_head; markov_w2] trains its
    last r columns: the torch path's dW is then dz.T @ hidden[:, c:] ([V, r], not [V, H]);
    naive and triton detach the frozen columns (the same gradient, no saving). When weight
    requires grad and all N rows fit one workspace chunk, the torch path keeps the forward's
    logits for dW (a second [N, V] fp32 buffer until the backward; reference.py).

    Returns the loss (a scalar, or [N] for reduction="none"), and with return_argmax=True
    a tuple (loss, argmax) where argmax [N] int64 is the student's greedy token per row,
    found in the same vocabulary pass (first index among exact ties).
    """
    _check_inputs(hidden, weight, topk_ids, topk_logprobs, weights, ce_targets, tail_mass)
    _check_options(tail=tail, divergence=divergence, reduction=reduction, impl=impl, ce_weight=ce_weight,
                   ce_targets=ce_targets)
    if not 0 <= weight_grad_from <= hidden.shape[1]:
        raise ValueError(f"sparse_kl_loss: weight_grad_from={weight_grad_from} must lie in [0, {hidden.shape[1]}] "
                         "(a column of weight)")
    use_ce = ce_weight != 0.0
    impl = ("triton" if hidden.is_cuda else "torch") if impl == "auto" else impl
    if workspace_bytes is None:
        workspace_bytes = default_workspace_bytes(hidden.device)

    ids = topk_ids.long()  # [N, k] int64
    if use_ce:
        ids = torch.cat([ids, ce_targets.long()[:, None]], 1)  # [N, k + 1]
    # lse reaches the loss through the tail bucket and the CE term; renorm alone needs only
    # the logits at the ids, so the whole vocabulary pass is skipped unless argmax is wanted.
    # With no vocabulary pass there is nothing for a Triton kernel to do: the torch path's
    # N*k'*H gather is the whole computation, whatever impl was asked for.
    vocab_pass = tail == "bucket" or use_ce or return_argmax
    if impl == "triton" and not vocab_pass:
        impl = "torch"
    if weight_grad_from and impl != "torch" and weight.requires_grad:
        weight = _FrozenColumns.apply(weight, weight_grad_from)

    n = hidden.shape[0]
    w = torch.ones(n, dtype=torch.float32, device=hidden.device) if weights is None else weights.float()
    live = w != 0  # [N] bool
    # Rows of weight 0 (padding) may hold anything in their teacher values; give them a
    # harmless teacher (all mass in the tail) so that no NaN can reach the gradient through
    # a 0 * NaN in the row's backward.
    topk_logprobs = torch.where(live[:, None], topk_logprobs.float(), -torch.inf)
    if tail_mass is not None:
        tail_mass = torch.where(live, tail_mass.float(), 1.0)

    if impl == "triton" and reduction != "none" and _stores_dx(hidden, weight):
        # Training with a frozen head: the kernel returns the reduced loss and keeps dX,
        # scaled by each row's weight, in hidden's dtype (sparse_kl.py, "Workspace").
        denominator = w.sum().clamp(min=torch.finfo(torch.float32).tiny) if reduction == "mean" else w.new_ones(())
        loss, argmax = _triton_reduced(hidden, weight, ids, topk_logprobs, tail_mass, torch.where(live, w, 0.0),
                                       denominator, tail=tail, divergence=divergence, ce_weight=ce_weight,
                                       workspace_bytes=workspace_bytes, config=triton_config)
        return (loss, argmax) if return_argmax else loss
    if impl == "triton":
        rows, argmax = _triton_rows(hidden, weight, ids, topk_logprobs, tail_mass, tail=tail, divergence=divergence,
                                    ce_weight=ce_weight, workspace_bytes=workspace_bytes, config=triton_config)
    else:
        rows, argmax = _torch_rows(hidden, weight, ids, topk_logprobs, tail_mass, tail=tail, divergence=divergence,
                                   ce_weight=ce_weight, naive=impl == "naive", vocab_pass=vocab_pass,
                                   workspace_bytes=workspace_bytes, weight_grad_from=weight_grad_from)
    rows = torch.where(live, w * rows, 0.0)  # [N] fp32
    if reduction == "none":
        loss = rows
    elif reduction == "sum":
        loss = rows.sum()
    else:
        loss = rows.sum() / w.sum().clamp(min=torch.finfo(torch.float32).tiny)
    return (loss, argmax) if return_argmax else loss


class _FrozenColumns(torch.autograd.Function):
    """`weight` itself in the forward (no copy: at Qwen3-8B's DSpark head, [151,936, 4,160]
    bf16, a copy would hold 1.3 GB until the backward); in the backward its gradient with the
    columns before `c` set to zero (the naive and Triton paths' weight_grad_from)."""

    @staticmethod
    def forward(ctx, weight, c):
        ctx.c = c
        return weight.view_as(weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return torch.cat([grad.new_zeros(grad.shape[0], ctx.c), grad[:, ctx.c:]], 1), None


def _check_options(*, tail: str, divergence: str, reduction: str, impl: str, ce_weight: float, ce_targets) -> None:
    if tail not in TAILS:
        raise ValueError(f"sparse_kl_loss: tail={tail!r}; use one of {TAILS}")
    if divergence not in DIVERGENCES:
        raise ValueError(f"sparse_kl_loss: divergence={divergence!r}; use one of {DIVERGENCES}")
    if divergence == "tv" and tail != "bucket":
        raise ValueError("sparse_kl_loss: divergence='tv' needs tail='bucket' (a TV renormalised over the ids "
                         "drops the student's mass outside them, which acceptance pays for)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"sparse_kl_loss: reduction={reduction!r}; use one of {REDUCTIONS}")
    if impl not in IMPLS:
        raise ValueError(f"sparse_kl_loss: impl={impl!r}; use one of {IMPLS}")
    if ce_weight != 0.0 and ce_targets is None:
        raise ValueError("sparse_kl_loss: ce_weight != 0 needs ce_targets ([N] integer labels)")


def _torch_rows(hidden, weight, ids, topk_logprobs, tail_mass, *, tail, divergence, ce_weight, naive, vocab_pass,
                workspace_bytes, weight_grad_from):
    """The naive or chunked torch impl's [N] row losses and [N] argmax (kernels/reference.py)."""
    if naive:
        lse, z_sel, argmax = naive_lse_gather(hidden, weight, ids)
    else:
        lse, z_sel, argmax = chunked_lse_gather(
            hidden, weight, ids, vocab_pass=vocab_pass, dense_grad=tail == "bucket" or ce_weight != 0.0,
            workspace_bytes=workspace_bytes, weight_grad_from=weight_grad_from,
        )
    rows = row_losses(lse, z_sel, topk_logprobs, tail=tail, ce_weight=ce_weight, tail_mass=tail_mass,
                      divergence=divergence)
    return rows, argmax


def _triton_rows(hidden, weight, ids, topk_logprobs, tail_mass, *, tail, divergence, ce_weight, workspace_bytes,
                 config):
    """The triton impl's [N] row losses and [N] argmax (kernels/sparse_kl.py)."""
    lq = teacher_logprobs(topk_logprobs)  # [N, k] fp32
    return _sparse_kl_module().triton_sparse_kl_rows(
        hidden, weight, ids, lq, teacher_tail(lq, tail_mass), tail=tail, divergence=divergence, ce_weight=ce_weight,
        workspace_bytes=workspace_bytes, config=config,
    )


def _stores_dx(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this call's backward needs dX only (hidden requires grad, the head is frozen)
    and dX may be stored weighted in hidden's dtype: bf16 or fp32, not fp16, whose range
    would flush the weighted logit gradient (p * w / sum w ~ 1e-9) to zero."""
    return (torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad
            and hidden.dtype in (torch.bfloat16, torch.float32))


def _triton_reduced(hidden, weight, ids, topk_logprobs, tail_mass, row_weight, denominator, *, tail, divergence,
                    ce_weight, workspace_bytes, config):
    """The triton impl's reduced loss and [N] argmax (kernels/sparse_kl.py, frozen head)."""
    lq = teacher_logprobs(topk_logprobs)  # [N, k] fp32
    return _sparse_kl_module().triton_sparse_kl_loss(
        hidden, weight, ids, lq, teacher_tail(lq, tail_mass), row_weight, denominator, tail=tail,
        divergence=divergence, ce_weight=ce_weight, workspace_bytes=workspace_bytes, config=config,
    )


def _sparse_kl_module():
    """kernels/sparse_kl.py, imported at call time; RuntimeError with the fix without triton."""
    try:
        from . import sparse_kl
    except ImportError as err:
        raise RuntimeError(
            "sparse_kl_loss(impl='triton') needs the triton package (Linux with CUDA); "
            "use impl='torch' on this machine"
        ) from err
    return sparse_kl


def _check_inputs(hidden, weight, topk_ids, topk_logprobs, weights, ce_targets, tail_mass) -> None:
    """Shape, dtype and device checks that need no device sync; ValueError says what to change."""
    if hidden.dim() != 2:
        raise ValueError(
            f"sparse_kl_loss: hidden must be [N, H], got shape {tuple(hidden.shape)}; "
            "flatten batch and time first (hidden.flatten(0, -2))"
        )
    n, h = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != h:
        raise ValueError(f"sparse_kl_loss: weight must be [V, {h}] to match hidden [N, {h}], got {tuple(weight.shape)}")
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise ValueError(
            f"sparse_kl_loss: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share one float "
            "dtype; cast one of them (e.g. hidden.to(weight.dtype))"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_ids.is_floating_point():
        raise ValueError(f"sparse_kl_loss: topk_ids must be [{n}, k] integer, "
                         f"got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if topk_logprobs.shape != topk_ids.shape or not topk_logprobs.is_floating_point():
        raise ValueError(
            f"sparse_kl_loss: topk_logprobs must be float of topk_ids' shape {tuple(topk_ids.shape)}, "
            f"got {tuple(topk_logprobs.shape)} {topk_logprobs.dtype}"
        )
    for name, t in (("weights", weights), ("ce_targets", ce_targets), ("tail_mass", tail_mass)):
        if t is not None and t.shape != (n,):
            raise ValueError(f"sparse_kl_loss: {name} must be [{n}], got {tuple(t.shape)}")
    if ce_targets is not None and ce_targets.is_floating_point():
        raise ValueError(f"sparse_kl_loss: ce_targets must be integer ids, got {ce_targets.dtype}")
    for name, t in (("weight", weight), ("topk_ids", topk_ids), ("topk_logprobs", topk_logprobs),
                    ("weights", weights), ("ce_targets", ce_targets), ("tail_mass", tail_mass)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"sparse_kl_loss: {name} is on {t.device} but hidden on {hidden.device}; move it")
