"""Triton vocabulary pass of `sparse_kl_loss`: logits never exist in the forward.

What it computes (see `reference.py` for the loss and the gradient split): for hidden X
[N, H] and head W [V, H], the row log-sum-exp `lse` [N] and argmax [N] of z = X W^T, and the
logits at a few ids `z_sel` [N, k'] (the teacher's top-k, then the CE target); backward maps
(d_lse, d_zsel) to dX = dZ W and, only when W requires grad, dW = dZ^T X, with
dZ = d_lse * softmax(z) + the exact fp32 values at the ids (`reference.slot_gradients`).

Kernels:

- `_lse_argmax_kernel`, one program per (row tile of BLOCK_N, vocabulary split): walks its
  split in [BLOCK_N, BLOCK_V] tiles, each a `tl.dot` of a [BLOCK_N, BLOCK_H] hidden tile with
  a [BLOCK_V, BLOCK_H] head tile accumulated over H in fp32, and keeps an online max, sum of
  exp and first argmax per row. The splits' partials (max, sum, arg) [N, S] are merged in
  PyTorch: no atomics, no locks, the same result on every run. Split is the fastest-varying
  program index, so the programs running together cover a few row tiles times all splits
  and reuse both the hidden and the head tiles from L2.
- `_gather_dot_kernel`: z_sel[n, i] = X[n] . W[ids[n, i]] in fp32 (N*k'*H work).
- `_dense_grad_kernel` (backward): recomputes a logits tile exactly as the forward does and
  writes d_lse * exp(z - lse) in W's dtype into a [C, V] workspace for a chunk of C rows;
  the ids' exact fp32 values are then scattered into it, and cuBLAS forms dX = ws @ W (and
  dW += ws^T X). That dense gradient is all of one sign per row, so rounding it to bf16
  loses nothing that cancels; p - q is formed in fp32 before its single rounding.

Bounded workspace (the only memory beyond inputs, outputs and [N]-sized vectors):
forward 3 * N * S * 4 bytes of split partials (S <= 64) and z_sel N * k' * 4 bytes;
backward one [C, V] buffer in W's dtype, C = workspace_bytes // (V * itemsize) rows
(default 2 GiB on CUDA, i.e. 7064 rows at V = 151936 in bf16), the slot tensors of
`slot_gradients` (N * k'^2 * 5 bytes: 89 MB at N = 16384, k' = 33), and dW's fp32 [V, H]
accumulator when W requires grad. Nothing is ever [N, V].

Cost: the forward is 2NHV flops; the backward recomputes the logits (2NHV) and multiplies
by W (2NHV), so a frozen head costs 6NHV in all, against 4NHV for a path that keeps its
logits (or the torch path, which forms dX's dense part while each chunk's logits are at
hand). Measured as 4NHV per unit time the ceiling of this design is about 2/3 of the bf16
matmul rate; its gain is memory. dW adds 2NHV through cuBLAS.

Precision: on GPU the tiles are multiplied as bf16 by `tl.dot` with fp32 accumulation
(bf16 products are exact in fp32, so only the summation order differs from an fp32
GEMM); exp, log-sum-exp and every p - q stay in fp32. fp32 inputs use IEEE fp32 dots
unless torch.backends.cuda.matmul.allow_tf32 is set, matching torch's own matmul. Under
TRITON_INTERPRET=1 (CPU tests) `tl.dot` on bf16 is silently wrong (triton-lang/triton
11584), so a constexpr CAST_DOT, set by the launcher when the kernels are interpreted,
upcasts both tiles to fp32 first: the interpreter then checks the same math with fp32
products, not the bf16 tensor-core instruction itself, which only the GPU check covers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .reference import matmul_f32, slot_gradients, sparse_rows_f32


@triton.jit
def _logits_tile(
    x_ptr,  # [*, H] bf16/fp32: hidden rows
    w_ptr,  # [V, H] same dtype: head rows
    rows,  # [BLOCK_N] int32 row indices
    cols,  # [BLOCK_V] int32 vocabulary indices
    row_ok,  # [BLOCK_N] bool
    col_ok,  # [BLOCK_V] bool
    H,
    stride_x,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """[BLOCK_N, BLOCK_V] fp32 logits tile, accumulated over H in BLOCK_H steps."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < H
        x = tl.load(x_rows + hs[None, :], mask=row_ok[:, None] & h_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_H]
        w = tl.load(w_rows + hs[None, :], mask=col_ok[:, None] & h_ok[None, :], other=0.0)  # [BLOCK_V, BLOCK_H]
        if CAST_DOT:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _lse_argmax_kernel(
    x_ptr,  # [N, H] bf16/fp32
    w_ptr,  # [V, H] same dtype
    max_ptr,  # [N, S] fp32 out: the row's max logit within the split
    sum_ptr,  # [N, S] fp32 out: sum over the split of exp(z - max)
    arg_ptr,  # [N, S] int32 out: first vocabulary index reaching the max
    N,
    V,
    H,
    num_splits,
    v_per_split,  # a multiple of BLOCK_V
    stride_x,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    split = pid % num_splits
    rows = (pid // num_splits) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    v_begin = split * v_per_split
    v_end = tl.minimum(v_begin + v_per_split, V)
    run_max = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    run_arg = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        z = _logits_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_x, stride_w,
                         BLOCK_N, BLOCK_V, BLOCK_H, CAST_DOT, DOT_PRECISION)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        tile_max, tile_arg = tl.max(z, 1, return_indices=True, return_indices_tie_break_left=True)
        new_max = tl.maximum(run_max, tile_max)
        # Every tile holds at least one real column, so new_max is finite and the first
        # rescale is exp(-inf) = 0.
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(z - new_max[:, None]), 1)
        # Strictly greater: on a tie the earlier tile (smaller index) keeps the argmax.
        run_arg = tl.where(tile_max > run_max, v0 + tile_arg, run_arg)
        run_max = new_max
    out = rows.to(tl.int64) * num_splits + split
    tl.store(max_ptr + out, run_max, mask=row_ok)
    tl.store(sum_ptr + out, run_sum, mask=row_ok)
    tl.store(arg_ptr + out, run_arg, mask=row_ok)


@triton.jit
def _gather_dot_kernel(
    x_ptr,  # [N, H] bf16/fp32
    w_ptr,  # [V, H] same dtype
    ids_ptr,  # [N, K] int64
    out_ptr,  # [N, K] fp32 out: x[n] . w[ids[n, i]]
    N,
    H,
    K,
    stride_x,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * stride_x
    for i in range(0, K):
        ids = tl.load(ids_ptr + rows64 * K + i, mask=row_ok, other=0)  # [BLOCK_N] int64
        w_rows = w_ptr + ids[:, None] * stride_w
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            mask = row_ok[:, None] & (hs < H)[None, :]
            x = tl.load(x_rows + hs[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_H]
            w = tl.load(w_rows + hs[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_H]
            acc += tl.sum(x * w, 1)
        tl.store(out_ptr + rows64 * K + i, acc, mask=row_ok)


@triton.jit
def _dense_grad_kernel(
    x_ptr,  # [C, H] bf16/fp32: this chunk's hidden rows
    w_ptr,  # [V, H] same dtype
    lse_ptr,  # [C] fp32
    dlse_ptr,  # [C] fp32: upstream gradient of lse
    ws_ptr,  # [C, V] W's dtype out: d_lse * softmax(z)
    C,
    V,
    H,
    stride_x,
    stride_w,
    stride_ws,
    GROUP_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Grouped order: GROUP_N row tiles sweep the vocabulary together, so a head tile is
    # read once from memory for GROUP_N programs and the hidden tiles stay in L2.
    pid = tl.program_id(0)
    num_row_tiles = tl.cdiv(C, BLOCK_N)
    num_col_tiles = tl.cdiv(V, BLOCK_V)
    tiles_per_group = GROUP_N * num_col_tiles
    first_row_tile = (pid // tiles_per_group) * GROUP_N
    group_rows = tl.minimum(num_row_tiles - first_row_tile, GROUP_N)
    row_tile = first_row_tile + (pid % tiles_per_group) % group_rows
    col_tile = (pid % tiles_per_group) // group_rows
    rows = row_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = col_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < C
    col_ok = cols < V
    z = _logits_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_x, stride_w,
                     BLOCK_N, BLOCK_V, BLOCK_H, CAST_DOT, DOT_PRECISION)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    d_lse = tl.load(dlse_ptr + rows, mask=row_ok, other=0.0)
    grad = tl.exp(z - lse[:, None]) * d_lse[:, None]  # fp32
    out = ws_ptr + rows.to(tl.int64)[:, None] * stride_ws + cols[None, :]
    tl.store(out, grad.to(ws_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# Decided by triton.jit when this module was imported: an interpreted kernel is not a
# JITFunction. Interpreted kernels run on CPU tensors and need bf16 tiles cast for tl.dot.
INTERPRETED = not isinstance(_lse_argmax_kernel, JITFunction)


@dataclass(kw_only=True)
class TritonConfig:
    """Tile sizes and launch options of the Triton path (None fields: chosen per device)."""

    block_n: int = 128
    """Rows per logits tile (power of two, >= 16: the tl.dot minimum)."""
    block_v: int = 128
    """Vocabulary entries per logits tile (power of two, >= 16)."""
    block_h: int = 64
    """Hidden-size step of the tile's dot (power of two, >= 16)."""
    num_splits: int | None = None
    """Vocabulary splits of the forward; None = enough programs to fill the GPU twice over."""
    group_n: int = 8
    """Row tiles sweeping the vocabulary together in the backward (L2 reuse)."""
    gather_block_n: int = 32
    """Rows per program of the id gather (power of two)."""
    gather_block_h: int = 128
    """Hidden-size step of the id gather (power of two)."""
    num_warps: int = 8
    """Warps per program of the tile kernels (ignored by the interpreter)."""
    num_stages: int = 3
    """Software-pipelining stages of the tile kernels (ignored by the interpreter)."""

    def __post_init__(self):
        for name in ("block_n", "block_v", "block_h"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TritonConfig.{name}={value}: use a power of two >= 16 (tl.dot tiles)")
        for name in ("gather_block_n", "gather_block_h", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"TritonConfig.{name}={value}: use a power of two")
        if self.num_splits is not None and not 1 <= self.num_splits <= 64:
            raise ValueError(f"TritonConfig.num_splits={self.num_splits}: use 1..64 or None")
        if self.group_n < 1 or self.num_stages < 1:
            raise ValueError("TritonConfig.group_n and num_stages must be >= 1")


# Under the interpreter every program runs in turn on the CPU: few, small-ish tiles.
_INTERPRETER_CONFIG = TritonConfig(block_n=32, block_v=128, block_h=32, num_splits=1, gather_block_n=32,
                                   gather_block_h=64)


def _num_splits(config: TritonConfig, n: int, v: int, device: torch.device) -> tuple[int, int]:
    """(splits, v_per_split): no empty split, v_per_split a multiple of block_v."""
    max_splits = triton.cdiv(v, config.block_v)
    if config.num_splits is not None:
        wanted = config.num_splits
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        # At least 8 splits: the programs in flight then span few row tiles (see module doc).
        wanted = max(8, triton.cdiv(2 * sms, triton.cdiv(n, config.block_n)))
    v_per_split = triton.cdiv(triton.cdiv(v, min(wanted, max_splits, 64)), config.block_v) * config.block_v
    return triton.cdiv(v, v_per_split), v_per_split


def _dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: IEEE for fp32 unless torch allows tf32 matmuls; for bf16 it
    has no effect, and "tf32" is Triton's own default there."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


class _TritonLseGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, vocab_pass, config, workspace_bytes):
        # hidden [N, H], weight [V, H] (same dtype, contiguous), ids [N, k'] int64 contiguous
        n, h = hidden.shape
        v = weight.shape[0]
        k = ids.shape[1]
        dev = hidden.device
        ctx.set_materialize_grads(False)
        z_sel = torch.empty(n, k, dtype=torch.float32, device=dev)  # [N, k']
        _gather_dot_kernel[(triton.cdiv(n, config.gather_block_n),)](
            hidden, weight, ids, z_sel, n, h, k, hidden.stride(0), weight.stride(0),
            BLOCK_N=config.gather_block_n, BLOCK_H=config.gather_block_h,
        )
        if vocab_pass:
            splits, v_per_split = _num_splits(config, n, v, dev)
            run_max = torch.empty(n, splits, dtype=torch.float32, device=dev)  # [N, S]
            run_sum = torch.empty(n, splits, dtype=torch.float32, device=dev)  # [N, S]
            run_arg = torch.empty(n, splits, dtype=torch.int32, device=dev)  # [N, S]
            _lse_argmax_kernel[(triton.cdiv(n, config.block_n) * splits,)](
                hidden, weight, run_max, run_sum, run_arg, n, v, h, splits, v_per_split,
                hidden.stride(0), weight.stride(0),
                BLOCK_N=config.block_n, BLOCK_V=config.block_v, BLOCK_H=config.block_h,
                CAST_DOT=INTERPRETED, DOT_PRECISION=_dot_precision(hidden.dtype),
                num_warps=config.num_warps, num_stages=config.num_stages,
            )
            row_max, best_split = run_max.max(1)  # first split among ties: the smallest index
            lse = row_max + (run_sum * (run_max - row_max[:, None]).exp()).sum(1).log()  # [N] fp32
            argmax = run_arg.gather(1, best_split[:, None]).squeeze(1).long()  # [N] int64
        else:
            lse = torch.zeros(n, dtype=torch.float32, device=dev)
            argmax = torch.zeros(n, dtype=torch.int64, device=dev)
        ctx.config = config
        ctx.workspace_bytes = workspace_bytes
        ctx.save_for_backward(hidden, weight, ids, lse, z_sel)
        ctx.mark_non_differentiable(argmax)
        return lse, z_sel, argmax

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_lse, d_zsel, _d_argmax):
        hidden, weight, ids, lse, z_sel = ctx.saved_tensors
        config = ctx.config
        need_x, need_w = ctx.needs_input_grad[:2]
        n, h = hidden.shape
        v = weight.shape[0]
        total, first = slot_gradients(d_lse, d_zsel, lse, z_sel, ids)  # [N, k'] fp32, bool
        if d_lse is None and not need_w:
            # renorm without CE: no dense term, only k' rows of W per row (N*k'*H work).
            d_hidden = sparse_rows_f32(total * first, ids, weight, ctx.workspace_bytes).to(hidden.dtype)
            return d_hidden, None, None, None, None, None
        if d_lse is not None:
            d_lse = d_lse.float().contiguous()  # autograd may hand an expanded view
        rows_per_chunk = max(1, ctx.workspace_bytes // (v * weight.element_size()))
        if rows_per_chunk > config.block_n:
            rows_per_chunk -= rows_per_chunk % config.block_n
        rows_per_chunk = min(rows_per_chunk, n)
        ws = torch.empty(rows_per_chunk, v, dtype=weight.dtype, device=weight.device)  # [C, V]
        d_hidden = torch.empty_like(hidden) if need_x else None  # [N, H]
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for r0 in range(0, n, rows_per_chunk):
            r1 = min(r0 + rows_per_chunk, n)
            ws_c = ws[: r1 - r0]
            x_c = hidden[r0:r1]
            if d_lse is None:
                ws_c.zero_()
            else:
                grid = (triton.cdiv(r1 - r0, config.block_n) * triton.cdiv(v, config.block_v),)
                _dense_grad_kernel[grid](
                    x_c, weight, lse[r0:r1], d_lse[r0:r1], ws_c, r1 - r0, v, h,
                    hidden.stride(0), weight.stride(0), ws_c.stride(0),
                    GROUP_N=config.group_n, BLOCK_N=config.block_n, BLOCK_V=config.block_v,
                    BLOCK_H=config.block_h, CAST_DOT=INTERPRETED, DOT_PRECISION=_dot_precision(hidden.dtype),
                    num_warps=config.num_warps, num_stages=config.num_stages,
                )
            # The ids' complete gradients, formed in fp32, replace the dense values there;
            # slots repeating an id carry equal values, so the write order does not matter.
            ws_c.scatter_(1, ids[r0:r1], total[r0:r1].to(ws.dtype))
            if need_x:
                torch.mm(ws_c, weight, out=d_hidden[r0:r1])
            if need_w:
                d_weight.add_(matmul_f32(ws_c.T, x_c))
        if need_w:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None


def triton_lse_gather(
    hidden: torch.Tensor,  # [N, H] bf16/fp32
    weight: torch.Tensor,  # [V, H] same dtype
    ids: torch.Tensor,  # [N, k'] int64
    *,
    vocab_pass: bool,
    workspace_bytes: int,
    config: TritonConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse [N] fp32, z_sel [N, k'] fp32, argmax [N] int64), as `reference.chunked_lse_gather`.

    The forward needs no dense_grad flag: nothing is stored for dX, and the backward skips
    the dense pass when d_lse arrives as None (lse did not reach the loss).
    """
    if not hidden.is_cuda and not INTERPRETED:
        raise ValueError(
            "sparse_kl_loss(impl='triton') got CPU tensors: it needs CUDA tensors, or the Triton "
            "interpreter (set TRITON_INTERPRET=1 before dflash.kernels.sparse_kl is first imported); "
            "on CPU use impl='torch'"
        )
    if config is None:
        if INTERPRETED:
            config = _INTERPRETER_CONFIG
        else:
            # fp32 tiles take twice the shared memory per pipeline stage: halve the H step
            # (3 stages of 128x32 + 128x32 fp32 tiles are 96 KiB, as bf16 at 64).
            config = TritonConfig(block_h=32) if hidden.dtype == torch.float32 else TritonConfig()
    return _TritonLseGather.apply(
        hidden.contiguous(), weight.contiguous(), ids.contiguous(), vocab_pass, config, workspace_bytes
    )
