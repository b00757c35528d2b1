"""Triton path of `sparse_kl_loss`: cuBLAS logits per row chunk, one fused Triton kernel
per chunk for the loss and its logit gradient, cuBLAS for dX; 4*N*H*V flops for a frozen head.

The loss (`reference.py` has it in PyTorch): the student p = softmax(z), z = X W^T ([N, V]),
against the teacher's top-k log-probs lq at ids S (k' = k slots, plus the CE target as one
more slot when ce_weight != 0):

    bucket:  row = sum_S q (lq - lp_S) + q_t log q_t - q_t log(1 - P_S)
             lp = z - lse(z), P_S = sum_S exp(lp_S), q_t the teacher's tail mass
    renorm:  row = KL(q_hat || p_hat), both renormalised over S
    TV:      row = 0.5 (sum_S |p_S - q| + |p_t - q_t|), p_t = 1 - P_S (divergence="tv", bucket only)
    CE:      row += ce_weight * (lse(z) - z_target)

Its gradient in the logits is one dense term plus k' sparse ones:

    G_j = d_lse * p_j + sum_{slots i with id_i = j} d_slot_i
    bucket:  a = q_t / (1 - P_S) (0 where 1 - P_S is clamped at TAIL_EPS),
             d_lse = Q - a P_S (Q = sum_S q), d_slot_i = a p_i - q_i
    renorm:  d_lse = 0, d_slot_i = p_hat_i * sum q_hat - q_hat_i
    TV:      c_i = (s_i - s_t) p_i with s_i = 0.5 sign(p_i - q_i), s_t = 0.5 sign(p_t - q_t)
             (sign(0) = 0), d_lse = -sum_S c, d_slot_i = c_i
    CE:      d_lse += ce_weight, d_slot_target = -ce_weight

The bucket form is derived line by line in `reference.py`'s module docstring: from
d log p_i / d z_j = [i = j] - p_j and d log(1 - P_S) / d z_j = -p_j ([j in S] - P_S) / (1 - P_S)
follows dL/dz_j = p_j (Q - a P_S) + [j in S] (a p_j - q_j), which is p_j - q_j at the ids
when Q + q_t = 1 (then Q - a P_S + a = 1). The TV form, its bound and its sign(0) are derived
there too. TV is one more mode of the same kernel (the constexpr TV): only the slot step
differs, so its flops, traffic, workspace and determinism are the KL's below, to the byte.

How (one chunk of C rows at a time, C = workspace_bytes // (4 V), balanced over N):

1. cuBLAS: z_c = X_c W^T into the fp32 [C, V] workspace (bf16 operands, fp32 accumulation
   and fp32 output). Not a bf16 output: rounding logits to bf16 before the exp is the trap
   of Liger 1432 (4-23% gradient error): at |z| ~ 20 a bf16 logit is off by up to 0.04,
   so p by 4%, while the fp32 store costs 2 more bytes per logit (below).
2. `_chunk_rows_kernel`, one program per row, all in fp32: sweep 1 over the row's vocabulary
   tiles keeps an online max, sum of exp and first argmax; then the k' slot logits are
   gathered from the row, and the row loss, d_lse and d_slot computed as above; sweep 2
   writes G = d_lse * exp(z - lse) over the row in W's dtype, in place (the bf16 row
   occupies the first half of its own fp32 bytes), and finally the k' exact values at the
   ids: each slot's total sum_{same id} d_slot + d_lse p_i, formed in fp32 and rounded once,
   so the p_j - q_j cancellation happens before any rounding (Liger 1329). The dense part
   is all of one sign per row: rounding it to bf16 is a 2^-9 relative error, no cancellation.
3. cuBLAS: dX_c = G_c W, fp32 out.

The loss is a sum of rows, so d loss / d X_n = d_row_n * dX_n exactly. For reduction "mean"
or "sum" (training: `_TritonSparseKLReduced`) d_row_n = g * s_n with s_n = w_n / sum w (or
w_n) known in the forward and g the upstream scalar: the kernel multiplies G by s_n in fp32
before G's rounding, dX_c goes through a per-chunk [C, H] fp32 buffer into an [N, H] tensor
of X's dtype (one rounding, as before), and the backward is g * dX (exact for g = 1). For
reduction "none" (`_TritonSparseKL`) the rows' gradients are known only in the backward:
dX is kept [N, H] fp32 and the backward multiplies and casts in one op. Nothing is ever
[N, V].

Modes (chosen per call):
- hidden needs grad, weight frozen (DFlash): the above, 4NHV flops. tail="renorm" without
  CE has no dense term: the kernel writes no G and dX is the N*k'*H sparse sum instead.
  With reduction "mean"/"sum" dX is stored weighted, in X's dtype (above).
- forward only (torch.no_grad(), or nothing needs grad): sweep 1, gather, loss; no G, no
  dX: 2NHV flops.
- weight needs grad: the forward is forward-only; the backward recomputes each chunk with
  G scaled by d_row (it is not known before) and forms dX_c = G_c W and dW += G_c^T X_c:
  8NHV flops, dW accumulated in fp32 over chunks in a fixed order.

Memory traffic per logit (bf16 inputs; fp32 adds 4 bytes for G written and read): the
logits GEMM writes 4 bytes, sweep 1 reads 4, sweep 2 reads 4 and writes 2, the dX GEMM
reads 2 (at least once; its re-reads of G tiles mostly hit L2): 16 bytes. At
(N, H, V) = (16384, 4096, 151936) that is 2.49e9 logits x 16 B = 40 GB, about 8-10 ms at
4-4.8 TB/s, beside 4NHV = 40.8 TFLOP of GEMM, ~52 ms at ~790 TFLOP/s: the expected ceiling
is ~0.84 of the bf16 matmul rate (counted as 4NHV), ~0.80 if the kernel reaches only 3 TB/s.
A row is V * 4 = 608 KB, so with hundreds of rows in flight sweep 2 re-reads from HBM, not
L2; a single sweep would need the final lse before writing G.

Workspace (beyond inputs and outputs): the [C, V] fp32 chunk (workspace_bytes, 256 MiB by
default on CUDA: at most 441 rows at V = 151936, i.e. 38 chunks of 432 rows at N = 16384,
250 MiB; 1365 rows at V = 49152, 7 chunks of 1171 at N = 8192), dX [N, H] in X's dtype
(128 MiB in bf16 at N = 16384, H = 4096; fp32, 256 MiB, for reduction "none") and a
[C, H] fp32 chunk of it (7 MiB), per-slot coefficients [N, k'] fp32, and dW's fp32 [V, H]
accumulator plus one [V, H] fp32 product per chunk when W requires grad. At the 8B shape
that is ~390 MiB of extra memory in training (was 2,034 MiB measured on an H200 with the
2 GiB workspace and an fp32 dX). Smaller chunks mean more GEMM launches of smaller M: at
M ~ 430, K = 4096 the logits GEMM still has ~13 waves of 128 x 256 tiles on 132 SMs, and
the dX GEMM (M ~ 430, N = H, K = V) leans on cuBLAS's split-K; bench/loss_bench.py sweeps
the workspace to show what that costs on a GPU.

Races and determinism: one program per row, no atomics; the result is the same on every
run (cuBLAS is deterministic for a fixed shape and stream). Sweep 2 stores a bf16 tile over
bytes that earlier tiles (and, for tile 0, this one) were read from by other warps, so a
`tl.debug_barrier()` separates each tile's loads from its stores, and another orders the
dense stores before the stores at the ids. Stores only ever land below the next tile's
bytes, so loads hoisted by software pipelining stay safe.

Under TRITON_INTERPRET=1 (CPU tests) the kernel runs on CPU tensors with the GEMMs in fp32
on the CPU. The interpreter's fp32 -> bf16 cast truncates (triton 3.9: half the values one
ulp off), so there G is rounded to nearest even with integer ops (`ROUND_BY_BITS`), which is
what the GPU's cvt.rn.bf16.f32 does; the in-place bf16-over-fp32 layout is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .reference import TAIL_EPS, matmul_f32, sparse_rows_f32


@triton.jit
def _to_storage(x, G_DTYPE: tl.constexpr, ROUND_BY_BITS: tl.constexpr):
    """fp32 -> G_DTYPE, round to nearest even (by integer ops when ROUND_BY_BITS: bf16 only)."""
    if ROUND_BY_BITS:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(G_DTYPE)
    return out


@triton.jit
def _one_row(
    row,  # int64: the row of the chunk
    z_ptr,  # [C, V] fp32 (row stride stride_z): the chunk's logits; G is written over them
    ids_ptr,  # [C, K] int64: the teacher's ids, then the CE target when USE_CE
    lq_ptr,  # [C, KT] fp32: teacher log-probs, floored (finite)
    qtail_ptr,  # [C] fp32: teacher tail mass (read when TAIL_BUCKET or TV)
    scale_ptr,  # [C] fp32: factor on G (read when HAS_SCALE)
    row_ptr,  # [C] fp32 out: the row loss
    arg_ptr,  # [C] int64 out: first index of the row's max logit
    coef_ptr,  # [C, K] fp32 out: the logit gradient at each slot's id, 0 at a repeated id's later slots
    V,
    K,
    KT,
    stride_z,  # in fp32 elements
    stride_g,  # in G_DTYPE elements: stride_z * 4 / sizeof(G_DTYPE)
    ce_weight,
    tail_eps,
    TAIL_BUCKET: tl.constexpr,
    TV: tl.constexpr,  # total variation instead of KL (with TAIL_BUCKET)
    USE_CE: tl.constexpr,
    WRITE_G: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ROUND_BY_BITS: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One row: the loss, its slot coefficients and argmax, then G over the row (see the
    module docstring, "How", step 2)."""
    z_row = z_ptr + row * stride_z
    g_row = z_ptr.to(tl.pointer_type(G_DTYPE), bitcast=True) + row * stride_g

    # Sweep 1: online max, sum of exp and first argmax over the row.
    run_max = float("-inf")
    run_sum = 0.0
    run_arg = 0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
        tile_max, tile_arg = tl.max(z, 0, return_indices=True, return_indices_tie_break_left=True)
        new_max = tl.maximum(run_max, tile_max)
        # Every tile holds a real column, so new_max is finite and the first rescale is 0.
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(z - new_max), 0)
        # Strictly greater: on a tie the earlier tile (smaller index) keeps the argmax.
        run_arg = tl.where(tile_max > run_max, v0 + tile_arg, run_arg)
        run_max = new_max
    lse = run_max + tl.log(run_sum)

    # The slots: logits at the ids, the row loss and its gradient in (lse, slot logits).
    slots = tl.arange(0, K_PAD)
    valid = slots < K
    teacher = slots < KT
    ids = tl.load(ids_ptr + row * K + slots, mask=valid, other=0)  # [K_PAD] int64
    zs = tl.load(z_row + ids, mask=valid, other=0.0)  # [K_PAD] fp32
    lq = tl.load(lq_ptr + row * KT + slots, mask=teacher, other=0.0)  # [K_PAD] fp32
    p = tl.where(valid, tl.exp(zs - lse), 0.0)  # student probabilities at the ids
    if TV:
        q = tl.where(teacher, tl.exp(lq), 0.0)
        diff = tl.where(teacher, p - q, 0.0)
        diff_t = 1.0 - tl.sum(tl.where(teacher, p, 0.0), 0) - tl.load(qtail_ptr + row)  # p_t - q_t, unclamped
        half_sign = tl.where(diff > 0.0, 0.5, tl.where(diff < 0.0, -0.5, 0.0))  # sign(0) = 0
        half_sign_t = tl.where(diff_t > 0.0, 0.5, tl.where(diff_t < 0.0, -0.5, 0.0))
        loss = 0.5 * (tl.sum(tl.abs(diff), 0) + tl.abs(diff_t))
        d_slot = tl.where(teacher, (half_sign - half_sign_t) * p, 0.0)
        d_lse = -tl.sum(d_slot, 0)
    elif TAIL_BUCKET:
        q = tl.where(teacher, tl.exp(lq), 0.0)
        q_t = tl.load(qtail_ptr + row)
        p_s = tl.sum(tl.where(teacher, p, 0.0), 0)
        tail_raw = 1.0 - p_s
        tail_s = tl.maximum(tail_raw, tail_eps)
        # Clamped: the tail term's gradient is dropped, as torch.clamp's backward does.
        a = tl.where(tail_raw >= tail_eps, q_t / tail_s, 0.0)
        xlogx = tl.where(q_t > 0.0, q_t * tl.log(tl.maximum(q_t, 1e-30)), 0.0)
        loss = tl.sum(tl.where(teacher, q * (lq - (zs - lse)), 0.0), 0) + xlogx - q_t * tl.log(tail_s)
        d_lse = tl.sum(q, 0) - a * p_s
        d_slot = tl.where(teacher, a * p - q, 0.0)
    else:
        lq_m = tl.where(teacher, lq, float("-inf"))
        lq_max = tl.max(lq_m, 0)
        lq_hat = lq - (lq_max + tl.log(tl.sum(tl.exp(lq_m - lq_max), 0)))
        q_hat = tl.where(teacher, tl.exp(lq_hat), 0.0)
        zs_m = tl.where(teacher, zs, float("-inf"))
        zs_max = tl.max(zs_m, 0)
        ls = zs - (zs_max + tl.log(tl.sum(tl.exp(zs_m - zs_max), 0)))
        p_hat = tl.where(teacher, tl.exp(ls), 0.0)
        loss = tl.sum(tl.where(teacher, q_hat * (lq_hat - ls), 0.0), 0)
        d_lse = 0.0
        d_slot = tl.where(teacher, p_hat * tl.sum(q_hat, 0) - q_hat, 0.0)
    if USE_CE:
        is_ce = slots == KT
        loss += ce_weight * (lse - tl.sum(tl.where(is_ce, zs, 0.0), 0))
        d_lse += ce_weight
        d_slot = tl.where(is_ce, -ce_weight, d_slot)
    # Slots sharing an id (the CE target among the teacher's ids) carry the same, complete
    # gradient of that id, so the scatter below writes equal values whatever the order.
    same = (ids[:, None] == ids[None, :]) & valid[:, None] & valid[None, :]  # [K_PAD, K_PAD]
    total = tl.sum(tl.where(same, d_slot[None, :], 0.0), 1) + d_lse * p  # [K_PAD] fp32
    repeats = tl.sum((same & (slots[None, :] < slots[:, None])).to(tl.int32), 1)
    tl.store(coef_ptr + row * K + slots, tl.where(repeats == 0, total, 0.0), mask=valid)
    tl.store(row_ptr + row, loss)
    tl.store(arg_ptr + row, run_arg)

    if WRITE_G:
        if HAS_SCALE:
            scale = tl.load(scale_ptr + row)
        else:
            scale = 1.0
        dense = d_lse * scale
        # Sweep 2: the dense gradient over the row, in place.
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(z_row + cols, mask=cols < V, other=0.0)
            g = _to_storage(tl.exp(z - lse) * dense, G_DTYPE, ROUND_BY_BITS)
            tl.debug_barrier()  # this tile's stores overwrite bytes other warps read
            tl.store(g_row + cols, g, mask=cols < V)
        tl.debug_barrier()  # the dense stores land before the exact values at the ids
        tl.store(g_row + ids, _to_storage(total * scale, G_DTYPE, ROUND_BY_BITS), mask=valid)



@triton.jit
def _chunk_rows_kernel(
    z_ptr,  # [C, V] fp32 (row stride stride_z): the chunk's logits; G is written over them
    ids_ptr,  # [C, K] int64: the teacher's ids, then the CE target when USE_CE
    lq_ptr,  # [C, KT] fp32: teacher log-probs, floored (finite)
    qtail_ptr,  # [C] fp32: teacher tail mass (read when TAIL_BUCKET or TV)
    scale_ptr,  # [C] fp32: factor on G (read when HAS_SCALE)
    row_ptr,  # [C] fp32 out: the row loss
    arg_ptr,  # [C] int64 out: first index of the row's max logit
    coef_ptr,  # [C, K] fp32 out: the logit gradient at each slot's id, 0 at a repeated id's later slots
    n_rows,  # rows in the chunk
    V,
    K,
    KT,
    stride_z,  # in fp32 elements
    stride_g,  # in G_DTYPE elements: stride_z * 4 / sizeof(G_DTYPE)
    ce_weight,
    tail_eps,
    TAIL_BUCKET: tl.constexpr,
    TV: tl.constexpr,  # total variation instead of KL (with TAIL_BUCKET)
    USE_CE: tl.constexpr,
    WRITE_G: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ROUND_BY_BITS: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # A program per row (grid = n_rows), or a persistent grid of fewer programs that each
    # take every num_programs-th row (TritonConfig.programs_per_sm): fewer rows in flight,
    # so that a row's second sweep finds its logits still in L2.
    # int64 rows: row * stride_z passes 2^31 at 3533 rows of V = 151936.
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        _one_row(
            row, z_ptr, ids_ptr, lq_ptr, qtail_ptr, scale_ptr, row_ptr, arg_ptr, coef_ptr, V, K, KT,
            stride_z, stride_g, ce_weight, tail_eps, TAIL_BUCKET, TV, USE_CE, WRITE_G, HAS_SCALE, G_DTYPE,
            ROUND_BY_BITS, K_PAD, BLOCK_V,
        )


# Decided by triton.jit when this module was imported: an interpreted kernel is not a
# JITFunction. Interpreted kernels run on CPU tensors.
INTERPRETED = not isinstance(_chunk_rows_kernel, JITFunction)

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(kw_only=True)
class TritonConfig:
    """Launch options of the Triton row kernel (the GEMMs are cuBLAS's)."""

    block_v: int = 4096
    """Vocabulary entries per tile of a row's sweeps (power of two >= 16)."""
    num_warps: int = 8
    """Warps per program, i.e. per row (power of two; ignored by the interpreter)."""
    programs_per_sm: int = 0
    """0: one program per row of the chunk. n > 0: a persistent grid of n programs per
    streaming multiprocessor (one per CPU under the interpreter), each taking every
    grid-th row, so that fewer rows are in flight and a row's second sweep can find its
    logits in L2 (at V = 49152 a row is 192 KiB: 132 SMs x 1 row = 25 MiB)."""

    def __post_init__(self):
        if self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"TritonConfig.block_v={self.block_v}: use a power of two >= 16")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"TritonConfig.num_warps={self.num_warps}: use a power of two")
        if self.programs_per_sm < 0:
            raise ValueError(f"TritonConfig.programs_per_sm={self.programs_per_sm}: use 0 (a program per row) "
                             "or a positive count")


# Under the interpreter every program runs in turn on the CPU: small tiles, few programs.
_INTERPRETER_CONFIG = TritonConfig(block_v=256, num_warps=1)


def _processors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for CPU tensors (the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def chunk_rows(n: int, v: int, workspace_bytes: int) -> int:
    """Rows per chunk of the triton path: the most an fp32 [C, V] workspace of
    workspace_bytes holds, balanced so that the last chunk is not a sliver (each chunk is a
    GEMM that should fill the GPU)."""
    most = max(1, workspace_bytes // (4 * v))
    return triton.cdiv(n, triton.cdiv(n, most)) if n else 1


def _weight_for_matmul(weight: torch.Tensor) -> torch.Tensor:
    """W as the GEMMs take it: itself on CUDA or in fp32; upcast once on CPU, which has no
    bf16 x bf16 -> fp32 matmul (the interpreter tests only)."""
    return weight if weight.is_cuda or weight.dtype == torch.float32 else weight.float()


class _TritonSparseKL(torch.autograd.Function):
    """Rows of the loss [N] fp32 and the argmax [N] int64; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, lq, q_tail, tail, divergence, ce_weight, workspace_bytes, config, grad_x,
                grad_w):
        # hidden [N, H], weight [V, H] (same dtype, contiguous), ids [N, k'] int64, lq [N, k]
        # fp32 floored, q_tail [N] fp32; grad_x / grad_w: whether X / W need a gradient.
        n, h = hidden.shape
        dev = hidden.device
        ctx.set_materialize_grads(False)
        dense = tail == "bucket" or ce_weight != 0.0
        store_dx = grad_x and not grad_w
        rows = torch.empty(n, dtype=torch.float32, device=dev)  # [N]
        argmax = torch.empty(n, dtype=torch.int64, device=dev)  # [N]
        coef = torch.empty(ids.shape, dtype=torch.float32, device=dev)  # [N, k']
        dx = torch.empty(n, h, dtype=torch.float32, device=dev) if store_dx and dense else None  # [N, H]
        launch = _ChunkLauncher(hidden, weight, ids, lq, q_tail, tail, divergence, ce_weight, workspace_bytes, config)
        for r0, r1, z in launch.chunks():
            g = launch.rows_kernel(z, r0, r1, rows[r0:r1], argmax[r0:r1], coef[r0:r1],
                                   write_g=dx is not None, scale=None)
            if dx is not None:
                matmul_f32(g, launch.w_mm, out=dx[r0:r1])
        if store_dx and not dense:
            # renorm without CE: the gradient lives on the k' ids only (N*k'*H work).
            dx = sparse_rows_f32(coef, ids, weight, workspace_bytes)  # [N, H] fp32
        ctx.store_dx = store_dx
        ctx.hidden_dtype = hidden.dtype
        ctx.launch_args = (tail, divergence, ce_weight, workspace_bytes, config)
        if store_dx:
            ctx.save_for_backward(dx)
        elif grad_w:
            ctx.save_for_backward(hidden, weight, ids, lq, q_tail)
        ctx.mark_non_differentiable(argmax)
        return rows, argmax

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_rows, _d_argmax):
        nones = (None,) * 10
        if d_rows is None:
            return None, None, *nones
        d_rows = d_rows.float()
        if ctx.store_dx:
            (dx,) = ctx.saved_tensors
            # One fused multiply-and-cast: no [N, H] fp32 product beside the stored dX.
            out = torch.empty(dx.shape, dtype=ctx.hidden_dtype, device=dx.device)  # [N, H]
            return torch.mul(dx, d_rows[:, None], out=out), None, *nones
        hidden, weight, ids, lq, q_tail = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        n, h = hidden.shape
        launch = _ChunkLauncher(hidden, weight, ids, lq, q_tail, *ctx.launch_args)
        scale = d_rows.contiguous()  # [N]; autograd may hand an expanded view
        scratch_rows = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        scratch_arg = torch.empty(n, dtype=torch.int64, device=hidden.device)  # [N]
        scratch_coef = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)  # [N, k']
        d_hidden = torch.empty(n, h, dtype=torch.float32, device=hidden.device) if need_x else None  # [N, H]
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None  # [V, H]
        for r0, r1, z in launch.chunks():
            g = launch.rows_kernel(z, r0, r1, scratch_rows[r0:r1], scratch_arg[r0:r1], scratch_coef[r0:r1],
                                   write_g=True, scale=scale[r0:r1])
            if need_x:
                matmul_f32(g, launch.w_mm, out=d_hidden[r0:r1])
            if need_w:
                d_weight.add_(matmul_f32(g.T, launch.x_mm[r0:r1]))
        return (
            d_hidden.to(hidden.dtype) if need_x else None,
            d_weight.to(weight.dtype) if need_w else None,
            *nones,
        )


class _TritonSparseKLReduced(torch.autograd.Function):
    """The frozen-head training case: the weighted sum of the rows (a scalar) and the argmax,
    with dX formed in the forward already scaled by each row's weight and stored in X's dtype.

    The loss is sum_n s_n row_n (s = w / sum w for reduction="mean", w for "sum"), so
    d loss / d X_n = s_n dX_n: the kernel scales G by s_n in fp32 before its rounding (the
    HAS_SCALE path of the dW backward), the dX GEMM accumulates in fp32 into a per-chunk
    [C, H] buffer, and dX is rounded once into an [N, H] tensor of X's dtype (bf16: 128 MiB
    at N = 16384, H = 4096, where an fp32 dX was 256 MiB). The backward multiplies it by the
    upstream scalar (exact when that is 1, as for loss.backward()). Rows of weight 0 get
    s = 0 and so a zero gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, ids, lq, q_tail, row_weight, denominator, tail, divergence, ce_weight,
                workspace_bytes, config):
        # row_weight [N] fp32 (0 on dead rows), denominator: 0-dim fp32 (sum w, or 1 for "sum").
        n, h = hidden.shape
        dev = hidden.device
        ctx.set_materialize_grads(False)
        dense = tail == "bucket" or ce_weight != 0.0
        live = row_weight != 0  # [N] bool
        scale = row_weight / denominator  # [N] fp32
        rows = torch.empty(n, dtype=torch.float32, device=dev)  # [N]
        argmax = torch.empty(n, dtype=torch.int64, device=dev)  # [N]
        coef = torch.empty(ids.shape, dtype=torch.float32, device=dev)  # [N, k']
        launch = _ChunkLauncher(hidden, weight, ids, lq, q_tail, tail, divergence, ce_weight, workspace_bytes, config)
        if dense:
            dx = torch.empty(n, h, dtype=hidden.dtype, device=dev)  # [N, H] in X's dtype
            # fp32 GEMM output per chunk, then one rounding into dx (a bf16-output GEMM could
            # reduce split-K partial sums in bf16 under allow_bf16_reduced_precision_reduction).
            dx_chunk = None if hidden.dtype == torch.float32 else torch.empty(
                launch.rows_per_chunk, h, dtype=torch.float32, device=dev)  # [C, H]
            for r0, r1, z in launch.chunks():
                g = launch.rows_kernel(z, r0, r1, rows[r0:r1], argmax[r0:r1], coef[r0:r1], write_g=True,
                                       scale=scale[r0:r1])
                if dx_chunk is None:
                    matmul_f32(g, launch.w_mm, out=dx[r0:r1])
                else:
                    dx[r0:r1].copy_(matmul_f32(g, launch.w_mm, out=dx_chunk[: r1 - r0]))
        else:
            for r0, r1, z in launch.chunks():
                launch.rows_kernel(z, r0, r1, rows[r0:r1], argmax[r0:r1], coef[r0:r1], write_g=False, scale=None)
            # renorm without CE: the gradient lives on the k' ids only (N*k'*H work).
            dx = sparse_rows_f32(coef * scale[:, None], ids, weight, workspace_bytes).to(hidden.dtype)  # [N, H]
        del launch  # the workspace goes back to the allocator before the caller's next step
        ctx.save_for_backward(dx)
        ctx.mark_non_differentiable(argmax)
        return torch.where(live, row_weight * rows, 0.0).sum() / denominator, argmax

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_loss, _d_argmax):
        nones = (None,) * 10
        if d_loss is None:
            return None, None, *nones
        (dx,) = ctx.saved_tensors
        return dx * d_loss.float(), None, *nones  # computed in fp32, rounded once to X's dtype


class _ChunkLauncher:
    """The per-chunk steps shared by the forward and the dW backward: the logits GEMM into
    the workspace and the row kernel over it."""

    def __init__(self, hidden, weight, ids, lq, q_tail, tail, divergence, ce_weight, workspace_bytes, config):
        self.hidden, self.ids, self.lq, self.q_tail = hidden, ids, lq, q_tail
        self.tail_bucket = tail == "bucket"
        self.tv = divergence == "tv"
        self.ce_weight = float(ce_weight)
        self.config = config
        self.w_mm = _weight_for_matmul(weight)  # [V, H]
        self.x_mm = hidden if hidden.is_cuda else hidden.to(self.w_mm.dtype)  # [N, H]
        self.g_dtype = weight.dtype
        n, v = hidden.shape[0], weight.shape[0]
        self.rows_per_chunk = chunk_rows(n, v, workspace_bytes)
        self.ws = torch.empty(min(self.rows_per_chunk, n), v, dtype=torch.float32, device=hidden.device)  # [C, V]

    def chunks(self):
        """(r0, r1, z) per chunk, z [r1 - r0, V] fp32 holding that chunk's logits."""
        n = self.hidden.shape[0]
        for r0 in range(0, n, self.rows_per_chunk):
            r1 = min(r0 + self.rows_per_chunk, n)
            z = self.ws[: r1 - r0]
            matmul_f32(self.x_mm[r0:r1], self.w_mm.T, out=z)
            yield r0, r1, z

    def rows_kernel(self, z, r0, r1, rows, argmax, coef, *, write_g, scale):
        """Run the row kernel on chunk [r0, r1); returns G [C, V] (a view of z's bytes)."""
        c, v = z.shape
        k = self.ids.shape[1]
        grid = c if not self.config.programs_per_sm else min(c, self.config.programs_per_sm * _processors(z.device))
        _chunk_rows_kernel[(grid,)](
            z, self.ids[r0:r1], self.lq[r0:r1], self.q_tail[r0:r1],
            scale if scale is not None else rows, rows, argmax, coef,
            c, v, k, self.lq.shape[1], z.stride(0), z.stride(0) * 4 // self.g_dtype.itemsize, self.ce_weight, TAIL_EPS,
            TAIL_BUCKET=self.tail_bucket, TV=self.tv, USE_CE=self.ce_weight != 0.0, WRITE_G=write_g,
            HAS_SCALE=scale is not None, G_DTYPE=_TL_DTYPES[self.g_dtype],
            ROUND_BY_BITS=INTERPRETED and self.g_dtype == torch.bfloat16,
            K_PAD=max(2, triton.next_power_of_2(k)), BLOCK_V=self.config.block_v,
            num_warps=self.config.num_warps,
        )
        # The bf16 (fp16) G of row r is the first half of row r's fp32 bytes: a [C, V] view
        # with row stride 2V, which cuBLAS takes as is (leading dimension 2V, no copy).
        return z.view(self.g_dtype)[:, :v] if self.g_dtype != torch.float32 else z


def triton_sparse_kl_rows(
    hidden: torch.Tensor,  # [N, H] bf16/fp16/fp32
    weight: torch.Tensor,  # [V, H] same dtype
    ids: torch.Tensor,  # [N, k'] integer: teacher ids, then the CE target when ce_weight != 0
    lq: torch.Tensor,  # [N, k] fp32: teacher log-probs, floored (`reference.teacher_logprobs`)
    q_tail: torch.Tensor,  # [N] fp32: teacher tail mass (`reference.teacher_tail`)
    *,
    tail: str,
    divergence: str = "kl",
    ce_weight: float,
    workspace_bytes: int,
    config: TritonConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [N] fp32, argmax [N] int64): each row's loss (unweighted) and greedy token,
    differentiable in hidden and weight. The mode (forward only, stored dX, dW recompute)
    is chosen here from torch.is_grad_enabled() and the inputs' requires_grad."""
    if not hidden.is_cuda and not INTERPRETED:
        raise ValueError(
            "sparse_kl_loss(impl='triton') got CPU tensors: it needs CUDA tensors, or the Triton "
            "interpreter (set TRITON_INTERPRET=1 before dflash.kernels.sparse_kl is first imported); "
            "on CPU use impl='torch'"
        )
    if config is None:
        config = _INTERPRETER_CONFIG if INTERPRETED else TritonConfig()
    grad_x = torch.is_grad_enabled() and hidden.requires_grad
    grad_w = torch.is_grad_enabled() and weight.requires_grad
    return _TritonSparseKL.apply(
        hidden.contiguous(), weight.contiguous(), ids.long().contiguous(), lq.float().contiguous(),
        q_tail.float().contiguous(), tail, divergence, float(ce_weight), workspace_bytes, config, grad_x, grad_w,
    )


def triton_sparse_kl_loss(
    hidden: torch.Tensor,  # [N, H] bf16/fp16/fp32, requires grad
    weight: torch.Tensor,  # [V, H] same dtype, frozen
    ids: torch.Tensor,  # [N, k'] integer
    lq: torch.Tensor,  # [N, k] fp32 floored
    q_tail: torch.Tensor,  # [N] fp32
    row_weight: torch.Tensor,  # [N] fp32, 0 on rows that do not count
    denominator: torch.Tensor,  # 0-dim fp32: sum of the weights ("mean") or 1 ("sum")
    *,
    tail: str,
    divergence: str = "kl",
    ce_weight: float,
    workspace_bytes: int,
    config: TritonConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, argmax [N] int64): sum_n row_weight_n * row_n / denominator, differentiable in
    hidden (the head frozen), with dX stored in hidden's dtype (`_TritonSparseKLReduced`)."""
    if not hidden.is_cuda and not INTERPRETED:
        raise ValueError(
            "sparse_kl_loss(impl='triton') got CPU tensors: it needs CUDA tensors, or the Triton "
            "interpreter (set TRITON_INTERPRET=1 before dflash.kernels.sparse_kl is first imported); "
            "on CPU use impl='torch'"
        )
    if config is None:
        config = _INTERPRETER_CONFIG if INTERPRETED else TritonConfig()
    return _TritonSparseKLReduced.apply(
        hidden.contiguous(), weight.contiguous(), ids.long().contiguous(), lq.float().contiguous(),
        q_tail.float().contiguous(), row_weight.float().contiguous(), denominator.float(), tail, divergence,
        float(ce_weight), workspace_bytes, config,
    )
