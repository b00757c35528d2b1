"""Pure-PyTorch sparse-KL loss: the row loss, the naive reference and the chunked CPU path.

The loss compares the student's next-token distribution p = softmax(z), z = hidden @ weight.T
([N, V] logits, never materialised outside `naive`), with a teacher known only through its
top-k log-probs lq over the id set S (normalised over the full vocabulary):

    tail="bucket":  sum_S q (lq - lp) + q_t (log q_t - log(1 - P_S))
                    q = exp(lq), q_t = max(0, 1 - sum q), lp = z_S - lse(z), P_S = sum_S exp(lp)
    tail="renorm":  KL(q_hat || p_hat), both renormalised over S (no dense term at all)
    divergence="tv" (tail="bucket" only):
                    0.5 * (sum_S |p_S - q| + |p_t - q_t|),  p_S = exp(lp), p_t = 1 - P_S
    optional CE:    + ce_weight * (lse(z) - z_target)

The naive and torch paths are split the same way. A vocabulary pass reduces the logits to the
row's log-sum-exp `lse` [N] and the logits at a few ids `z_sel` [N, k'] (the k teacher ids,
then the CE target), plus the argmax; `row_losses` then computes the loss from those small
tensors in fp32, and autograd differentiates it. The vocabulary pass only has to map
(d_lse [N], d_zsel [N, k']) back to the inputs, and that gradient has one dense term:

    dz_j = d_lse * p_j + sum_{slots i with id_i = j} d_zsel_i

`d_lse * p` is the cross-entropy-like dense part (all of one sign per row: safe to round),
the sum is the sparse part on at most k' ids. Where p_j and q_j nearly cancel (j in S, a
well-trained student), the two are added in fp32 before anything is rounded (Liger 1329).
Autograd derives d_lse and d_zsel from `row_losses`, so there is one source of truth for
both paths. The triton path (`sparse_kl.py`) needs the gradient while a chunk's logits are
at hand, before autograd runs, so its row kernel computes the same loss and the gradient
below by hand; the tests hold every path against an fp64 autograd ground truth that shares
no code with any of them.

The gradient of tail="bucket", derived. One row; teacher probabilities q_i on the id set S,
Q = sum_S q, tail q_t; student p = softmax(z), P_S = sum_S p, and

    L = sum_{i in S} q_i (log q_i - log p_i) + q_t (log q_t - log(1 - P_S)).

Two derivatives in the logits z_j (j any vocabulary id):

    d log p_i / d z_j = [i = j] - p_j
    d P_S / d z_j = sum_{i in S} p_i ([i = j] - p_j) = p_j [j in S] - p_j P_S
    so  d log(1 - P_S) / d z_j = -(p_j [j in S] - p_j P_S) / (1 - P_S)

Hence, with a = q_t / (1 - P_S):

    dL/dz_j = -sum_{i in S} q_i ([i = j] - p_j) + a (p_j [j in S] - p_j P_S)
            = p_j (Q - a P_S) + [j in S] (a p_j - q_j)

that is, with c = Q - a P_S = Q - q_t P_S / (1 - P_S):

    j not in S:  dL/dz_j = p_j c
    j in S:      dL/dz_j = p_j (c + a) - q_j

In the split above, d_lse = c (the dense term, through lse) and d_zsel_i = a p_i - q_i (the
sparse term at slot i, through z_S). When Q + q_t = 1 (q_t = 1 - sum q, the default),
c + a = Q + a (1 - P_S) = Q + q_t = 1, so at the ids the gradient is p_j - q_j, the plain
softmax cross-entropy form; a tail given explicitly (`tail_mass`) need not sum to 1 with Q,
hence the general form. Where 1 - P_S is clamped at TAIL_EPS its gradient is dropped: a = 0.

The total variation, divergence="tv". TV(p, q) = 0.5 sum_v |p_v - q_v| over the vocabulary
is one minus the acceptance probability of sampled speculative decoding (sum_v min(p_v, q_v)),
the quantity a drafter is judged on; DSpark's paper trains with 0.9 TV + 0.1 CE. The cache
knows the teacher on S and its tail mass q_t only, so the row is the TV of the two
distributions coarsened to S plus one tail class:

    L = 0.5 (sum_{i in S} |p_i - q_i| + |p_t - q_t|),   p_t = 1 - P_S

Coarsening never increases TV (|sum_{v not in S} (p_v - q_v)| <= sum_{v not in S} |p_v - q_v|),
so L is a lower bound of the full-vocabulary TV, equal to it when the two tails are
proportional (p_v - q_v of one sign outside S, e.g. p_v / p_t = q_v / q_t). Its gradient, with
s_i = 0.5 sign(p_i - q_i), s_t = 0.5 sign(p_t - q_t) and c_i = (s_i - s_t) p_i: from
d p_i / d z_j = p_i ([i = j] - p_j) and d p_t / d z_j = -(p_j [j in S] - p_j P_S),

    dL/dz_j = sum_{i in S} s_i p_i ([i = j] - p_j) - s_t (p_j [j in S] - p_j P_S)
            = [j in S] c_j - p_j sum_{i in S} c_i

which is the split above with d_lse = -sum_S c_i and d_zsel_i = c_i. sign(0) = 0 (torch.abs's
gradient, the subgradient of least norm): a slot whose p_i equals q_i exactly, or a tail that
matches, adds nothing. p_t is not clamped (no log: a P_S rounded past 1 gives |p_t - q_t| off by
that rounding, ~1e-6). Ids are distinct in the cache's top-k; a repeated id would count once
per slot (its p twice in P_S), in every impl alike, as in the KL. tail="renorm" has no TV: the
renormalised TV drops the student's mass outside S, which is what acceptance pays for
(`sparse_kl_loss` refuses the pair).

Implementations here:

- `naive_lse_gather`: materialises the [N, V] logits in the input dtype (as a plain
  `lm_head` would), then fp32; the reference in tests, and the baseline in benchmarks.
- `chunked_lse_gather`: a custom autograd Function over row chunks of C rows, peak extra
  memory one [C, V] fp32 buffer (`workspace_bytes`; on CUDA with bf16 inputs plus its copy
  in bf16 for the tensor-core matmul below, and on CPU with bf16 inputs an fp32 copy of
  the head, since CPU has no bf16 matmul with an fp32 result). Because the dense term is d_lse (a
  scalar per row) times p, its contribution to dX is `d_lse[n] * (p_n @ weight)`: the
  forward stores that expectation `e_out` [N, H] fp32 per row (over the vocabulary minus
  the row's ids, which the fp32 sparse part covers) while the chunk's logits are at hand,
  and the backward needs no second pass over the vocabulary for dX (N*k'*H work). The
  trade: when the caller never runs the backward the 2*N*H*V flops for `e_out` are wasted
  (skipped under `torch.no_grad()` or when hidden does not require grad). dW (a frozen
  head in DFlash) is not row-separable and recomputes each chunk in the backward, unless
  all N rows fit one chunk: then the forward keeps that chunk's logits (one [N, V] fp32
  buffer, within `workspace_bytes`, held until the backward: two such buffers at the
  forward's peak) and the backward reads them instead of a second [N, H] x [H, V] product;
  the values are the same bits either way. `weight_grad_from`
  c computes dW for the columns c: only (DSpark's head [W_head; markov_w2] trains its last
  r columns: dz.T @ x[:, c:] instead of dz.T @ x, the others are returned as zeros).
"""

from __future__ import annotations

import torch

# The student's tail mass 1 - P_S is clamped here before its log (and its gradient dropped
# when clamped, as verl's tail_kl does). P_S is a sum of exp(z_S - lse) in fp32, whose
# absolute error is about 1e-6 (lse ~ 10-20 has an fp32 ulp of 1-2e-6), so 1e-5 keeps the
# relative error of the clamped value within ~10% while leaving any meaningful tail alone.
TAIL_EPS = 1e-5

# Teacher log-probs are floored here: -inf (a padded or impossible top-k entry) becomes a
# finite value whose probability is exactly 0 in fp32, so q * lq is 0 rather than NaN.
LOGPROB_FLOOR = -1.0e4

# Workspace budget for one row chunk of logits: small on CPU (caches, shared machines), and
# 256 MiB on CUDA: at V = 151936 that is 441 rows a chunk (38 chunks at N = 16384), GEMMs of
# M ~ 430 whose logits GEMM still fills an H200 with ~13 waves of tiles, so that the loss's
# extra memory (this, plus dX in X's dtype) stays under 512 MiB. It was 2 GiB (5 chunks;
# 2,034 MiB of extra memory measured on an H200). kernels/sparse_kl.py, "Workspace".
_DEFAULT_WORKSPACE_BYTES_CPU = 128 * 2**20
_DEFAULT_WORKSPACE_BYTES_CUDA = 256 * 2**20

# The [C, k', H] gathers of `gather_dot_f32` and `sparse_rows_f32` on CPU: a chunk of this
# size stays in cache, where one fresh buffer of the whole workspace (tens of MB at N ~ 500,
# k' 33, H 640) is written and read back from memory at about 3x the time. The result is the
# same bits: each row's product is its own batch entry of the bmm.
_GATHER_CHUNK_BYTES_CPU = 4 * 2**20


def default_workspace_bytes(device: torch.device) -> int:
    """Bytes of the per-chunk [C, V] buffer when the caller gives none."""
    return _DEFAULT_WORKSPACE_BYTES_CUDA if device.type == "cuda" else _DEFAULT_WORKSPACE_BYTES_CPU


def teacher_logprobs(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """[N, k] fp32 teacher log-probs, floored at LOGPROB_FLOOR (-inf becomes a zero probability)."""
    return topk_logprobs.float().clamp(min=LOGPROB_FLOOR)


def teacher_tail(lq: torch.Tensor, tail_mass: torch.Tensor | None) -> torch.Tensor:
    """[N] fp32 teacher tail mass: the given one clamped at 0, or max(0, 1 - sum exp(lq))."""
    if tail_mass is not None:
        return tail_mass.float().clamp(min=0.0)
    # fp64: 1 - sum q cancels when the tail is near 0; [N, k] so the cost is nil.
    return (1.0 - lq.double().exp().sum(1)).clamp(min=0.0).float()


def row_losses(
    lse: torch.Tensor,  # [N] fp32: log-sum-exp of the student's logits
    z_sel: torch.Tensor,  # [N, k (+1)] fp32: student logits at the teacher ids (then the CE target)
    topk_logprobs: torch.Tensor,  # [N, k] float: teacher log-probs, full-vocabulary normalised
    *,
    tail: str,
    ce_weight: float = 0.0,
    tail_mass: torch.Tensor | None = None,  # [N] float: teacher tail; None = max(0, 1 - sum q)
    divergence: str = "kl",
) -> torch.Tensor:
    """Per-row loss [N] fp32 from the vocabulary pass's small outputs (see module docstring)."""
    k = topk_logprobs.shape[1]
    lq = teacher_logprobs(topk_logprobs)  # [N, k]
    z_s = z_sel[:, :k]  # [N, k]
    if divergence == "tv":
        assert tail == "bucket", "sparse_kl_loss refuses divergence='tv' with tail='renorm'"
        p = (z_s - lse[:, None]).exp()  # [N, k] student probabilities at S
        # p - q and 1 - P_S in fp32, unclamped; abs's gradient is sign(.) with sign(0) = 0.
        row = 0.5 * ((p - lq.exp()).abs().sum(1) + (1.0 - p.sum(1) - teacher_tail(lq, tail_mass)).abs())
    elif tail == "bucket":
        q = lq.exp()  # [N, k]
        q_tail = teacher_tail(lq, tail_mass)  # [N]
        lp = z_s - lse[:, None]  # [N, k] student log-probs at S
        student_tail = (1.0 - lp.exp().sum(1)).clamp(min=TAIL_EPS)  # [N]
        row = (q * (lq - lp)).sum(1) + torch.special.xlogy(q_tail, q_tail) - q_tail * student_tail.log()
    elif tail == "renorm":
        lq_hat = lq.log_softmax(1)  # [N, k]
        row = (lq_hat.exp() * (lq_hat - z_s.log_softmax(1))).sum(1)
    else:
        raise ValueError(f"tail={tail!r}: use 'bucket' or 'renorm'")
    if ce_weight != 0.0:
        row = row + ce_weight * (lse - z_sel[:, k])
    return row


def naive_lse_gather(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    ids: torch.Tensor,  # [N, k'] int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse [N] fp32, z_sel [N, k'] fp32, argmax [N] int64) from materialised logits.

    The logits are computed in the input dtype and only then cast to fp32, exactly as a
    model with a bf16 `lm_head` followed by an fp32 loss would: this is the same-dtype
    reference whose error the fused paths are held against.
    """
    logits = (hidden @ weight.T).float()  # [N, V] fp32
    return logits.logsumexp(1), logits.gather(1, ids), logits.argmax(1)


_CUDA_MM_OUT_DTYPE: bool | None = None  # whether torch.mm(..., out_dtype=) works on CUDA


def matmul_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b with fp32 accumulation and an fp32 result (into `out` when given), never
    rounding the product.

    On CUDA low-precision inputs use tensor cores with an fp32 output (torch >= 2.8);
    elsewhere the operands are upcast (CPU has no bf16 x bf16 -> fp32 matmul).
    """
    global _CUDA_MM_OUT_DTYPE
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if a.is_cuda and a.dtype == b.dtype:
        if _CUDA_MM_OUT_DTYPE is None:
            try:
                torch.mm(a[:1, :1], b[:1, :1], out_dtype=torch.float32)
                _CUDA_MM_OUT_DTYPE = True
            except (TypeError, RuntimeError):
                _CUDA_MM_OUT_DTYPE = False
        if _CUDA_MM_OUT_DTYPE:
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


def slot_gradients(
    d_lse: torch.Tensor | None,  # [N] fp32, None when lse did not reach the loss
    d_zsel: torch.Tensor | None,  # [N, k'] fp32
    lse: torch.Tensor,  # [N] fp32
    z_sel: torch.Tensor,  # [N, k'] fp32
    ids: torch.Tensor,  # [N, k'] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total [N, k'] fp32, first [N, k'] bool): the exact logit gradient at each slot's id.

    total_i = d_lse * p_{id_i} + sum of d_zsel over the slots holding the same id, so slots
    that repeat an id (the CE target is usually one of the teacher's ids) all carry the
    same, complete value: writing them to the same place is order-independent, and summing
    only the `first` slot of each id counts it once. This is where p - q cancels, in fp32.
    """
    same = ids[:, :, None] == ids[:, None, :]  # [N, k', k'] bool
    if d_zsel is None:
        total = torch.zeros(z_sel.shape, dtype=torch.float32, device=z_sel.device)
    else:
        total = torch.bmm(same.float(), d_zsel.float()[:, :, None]).squeeze(2)  # [N, k']
    if d_lse is not None:
        total = total + d_lse[:, None] * (z_sel - lse[:, None]).exp()
    first = ~same.tril(-1).any(2)  # [N, k']
    return total, first


def _gather_bytes(workspace_bytes: int, device: torch.device) -> int:
    """Bytes of one [C, k', H] fp32 gather chunk: the workspace, capped on CPU."""
    return min(workspace_bytes, _GATHER_CHUNK_BYTES_CPU) if device.type == "cpu" else workspace_bytes


def gather_dot_f32(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    ids: torch.Tensor,  # [N, k'] int64
    workspace_bytes: int,
) -> torch.Tensor:
    """z_sel [N, k'] fp32: hidden[n] . weight[ids[n, i]], chunked to bound the [C, k', H] gather."""
    n, h = hidden.shape
    rows_per_chunk = max(1, _gather_bytes(workspace_bytes, hidden.device) // (4 * h * ids.shape[1]))
    out = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)  # [N, k']
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, n)
        rows = weight[ids[r0:r1]].float()  # [C, k', H]
        out[r0:r1] = torch.bmm(rows, hidden[r0:r1, :, None].float()).squeeze(2)
    return out


def sparse_rows_f32(
    coef: torch.Tensor,  # [N, k'] fp32
    ids: torch.Tensor,  # [N, k'] int64
    weight: torch.Tensor,  # [V, H]
    workspace_bytes: int,
) -> torch.Tensor:
    """[N, H] fp32: sum_i coef[n, i] * weight[ids[n, i]] (the sparse part of dX), chunked."""
    n, k = ids.shape
    h = weight.shape[1]
    rows_per_chunk = max(1, _gather_bytes(workspace_bytes, weight.device) // (4 * h * k))
    out = torch.empty(n, h, dtype=torch.float32, device=weight.device)  # [N, H]
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, n)
        rows = weight[ids[r0:r1]].float()  # [C, k', H]
        out[r0:r1] = torch.bmm(coef[r0:r1, None, :], rows).squeeze(1)
    return out


class _ChunkedLseGather(torch.autograd.Function):
    """Vocabulary pass over row chunks; see the module docstring for the gradient split."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, vocab_pass, save_expectation, keep_logits, weight_grad_from,
                workspace_bytes):
        # hidden [N, H], weight [V, H] (same dtype), ids [N, k'] int64; keep_logits: one chunk,
        # whose logits the backward's dW reads instead of recomputing them
        n, h = hidden.shape
        v = weight.shape[0]
        dev = hidden.device
        ctx.set_materialize_grads(False)
        # CPU has no low-precision matmul with fp32 output: upcast the head once per call
        # (an extra V*H*4 bytes, only for bf16/fp16 inputs on CPU).
        w_mm = weight if weight.dtype == torch.float32 or weight.is_cuda else weight.float()
        rows_per_chunk = max(1, workspace_bytes // (4 * v))
        lse = torch.zeros(n, dtype=torch.float32, device=dev)  # [N]
        argmax = torch.zeros(n, dtype=torch.int64, device=dev)  # [N]
        e_out = torch.zeros(n, h, dtype=torch.float32, device=dev) if save_expectation else None  # [N, H]
        logits = None  # [N, V] fp32 when keep_logits
        assert not keep_logits or (vocab_pass and n <= rows_per_chunk), "kept logits must be one chunk"
        if vocab_pass:
            z_sel = torch.empty(ids.shape, dtype=torch.float32, device=dev)  # [N, k']
            for r0 in range(0, n, rows_per_chunk):
                r1 = min(r0 + rows_per_chunk, n)
                ids_c = ids[r0:r1]
                z = matmul_f32(hidden[r0:r1], w_mm.T)  # [C, V] fp32, the only big buffer
                z_sel[r0:r1] = z.gather(1, ids_c)
                m, am = z.max(1)  # first index among ties, like torch.argmax
                if keep_logits:
                    logits, z = z, z - m[:, None]  # the same values as the in-place sub_ below
                else:
                    z.sub_(m[:, None])
                z.exp_()
                s = z.sum(1)  # [C]
                lse[r0:r1] = m + s.log()
                argmax[r0:r1] = am
                if save_expectation:
                    # p over the vocabulary minus the row's ids; the ids go to the fp32
                    # sparse part of the backward, where p_j - q_j is formed exactly.
                    z.div_(s[:, None]).scatter_(1, ids_c, 0.0)
                    e_out[r0:r1] = matmul_f32(z.to(w_mm.dtype), w_mm)
                del z
        else:
            z_sel = gather_dot_f32(hidden, weight, ids, workspace_bytes)
        ctx.rows_per_chunk = rows_per_chunk
        ctx.workspace_bytes = workspace_bytes
        ctx.weight_grad_from = weight_grad_from
        ctx.save_for_backward(hidden, weight, ids, lse, z_sel, e_out, logits)
        ctx.mark_non_differentiable(argmax)
        return lse, z_sel, argmax

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_lse, d_zsel, _d_argmax):
        hidden, weight, ids, lse, z_sel, e_out, logits = ctx.saved_tensors
        n = hidden.shape[0]
        total, first = slot_gradients(d_lse, d_zsel, lse, z_sel, ids)  # [N, k'] fp32, bool
        d_hidden = d_weight = None
        if ctx.needs_input_grad[0]:
            d_hidden = sparse_rows_f32(total * first, ids, weight, ctx.workspace_bytes)  # [N, H] fp32
            if d_lse is not None:
                assert e_out is not None, "lse reached the loss but the forward skipped e_out"
                d_hidden.add_(d_lse[:, None] * e_out)
            d_hidden = d_hidden.to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            w_mm = weight if weight.dtype == torch.float32 or weight.is_cuda else weight.float()
            c0 = ctx.weight_grad_from  # columns before c0 are frozen: their gradient stays 0
            d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # [V, H]
            for r0 in range(0, n, ctx.rows_per_chunk):
                r1 = min(r0 + ctx.rows_per_chunk, n)
                x_c = hidden[r0:r1]
                if d_lse is None:
                    dz = torch.zeros(r1 - r0, weight.shape[0], dtype=torch.float32, device=weight.device)
                elif logits is not None:
                    dz = logits[r0:r1] - lse[r0:r1, None]  # [C, V] fp32, kept by the forward
                    dz.exp_().mul_(d_lse[r0:r1, None])
                else:
                    dz = matmul_f32(x_c, w_mm.T)  # [C, V] fp32, recomputed
                    dz.sub_(lse[r0:r1, None]).exp_().mul_(d_lse[r0:r1, None])
                dz.scatter_(1, ids[r0:r1], total[r0:r1])  # exact values at the ids
                d_weight[:, c0:].add_(matmul_f32(dz.T.to(w_mm.dtype), x_c[:, c0:].to(w_mm.dtype)))
                del dz
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None, None, None


def chunked_lse_gather(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    ids: torch.Tensor,  # [N, k'] int64
    *,
    vocab_pass: bool,
    dense_grad: bool,
    workspace_bytes: int,
    weight_grad_from: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse [N] fp32, z_sel [N, k'] fp32, argmax [N] int64) without materialising [N, V]
    (except as the one chunk kept for dW, see the module docstring).

    vocab_pass False skips the vocabulary (lse and argmax are then zeros: renorm without
    CE needs only z_sel). dense_grad says whether lse reaches the loss, hence whether the
    forward must store `e_out` for dX. weight_grad_from: the first column of weight whose
    gradient is computed; the columns before it get a zero gradient.
    """
    grad = torch.is_grad_enabled()
    save_expectation = vocab_pass and dense_grad and grad and hidden.requires_grad
    keep_logits = (vocab_pass and dense_grad and grad and weight.requires_grad
                   and 4 * hidden.shape[0] * weight.shape[0] <= workspace_bytes)
    return _ChunkedLseGather.apply(hidden, weight, ids, vocab_pass, save_expectation, keep_logits,
                                   weight_grad_from, workspace_bytes)
