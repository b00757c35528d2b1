"""GPU check of dflash.kernels.sparse_kl_loss: parity at full size, then timing and memory.

1. Parity of the Triton path at (N, H, V, k) = (16384, 4096, 151936, 32) (the checks and
   limits bench/gpu_check.sh always ran): bf16 Triton against the torch chunked path in fp32
   (IEEE matmuls) on the same bf16 values, and against the plain bf16 PyTorch form (the Cut
   Cross-Entropy criterion); bitwise determinism of two runs; the training call (reduction
   "sum", a third of the row weights 0); at N = 2048 the dW (recompute) path in bf16 and fp32.
   Then the same for divergence="tv" at the same shape: TV alone against the fp32 torch
   reference and the plain bf16 form, bitwise determinism, and DSpark's 0.9 TV + 0.1 CE as
   fit calls it (row weights x 0.9, a third 0, CE weight 1/9, reduction "sum").
   A failed parity check fails the script.
2. Timing and memory, one forward + backward (dX) step with a frozen head, at the 8B shape
   above and SmolLM2's (8192, 576, 49152, 32): a bf16 torch.mm of the logits' shape, the
   Triton path with its defaults, "chunked cuBLAS only" (the same chunks' two GEMMs without
   the Triton kernel: the design's ceiling), the old 2 GiB workspace, the persistent-grid
   option (TritonConfig.programs_per_sm), smaller workspaces at SmolLM2's shape, and k = 1
   against Liger's fused linear cross-entropy where it imports; beside "triton (defaults)"
   (KL), "triton tv" and "triton 0.9tv+0.1ce" with the same defaults. TV's extra memory is
   checked equal to KL's (the same buffers: kernels/sparse_kl.py), its time reported. Extra memory is
   torch.cuda.max_memory_allocated during the step minus what was allocated before it.
   The Triton part's share of a step is 1 - (chunked cuBLAS only) / (triton), same chunks.
   Goals (issue 42), reported and not failed on: extra memory at the 8B shape <= 512 MiB
   (is a check: it holds by construction), no slower than the old 2 GiB workspace, the
   Triton part <= 30% of the step at SmolLM2's shape.

    python -m bench.gpu_kernel_check [--json] [--budget-s 150]      # CUDA, about 2 minutes
    TRITON_INTERPRET=1 python -m bench.gpu_kernel_check --device cpu --quick   # CPU smoke (tests)

Exit status 0 when every check passed, 1 otherwise. --json prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.loss_bench import chunked_cublas_step, make_inputs
from dflash.kernels.loss import sparse_kl_loss
from dflash.kernels.reference import default_workspace_bytes

FULL = (16384, 4096, 151936, 32)
SMOLLM2 = (8192, 576, 49152, 32)
QUICK = (24, 32, 259, 4)  # CPU smoke: the same code paths at a size the interpreter runs
QUICK_SMALL = (16, 16, 130, 4)
MEMORY_GOAL_MIB = 512
SHARE_GOAL = 0.30
OLD_WORKSPACE = 2 * 2**30  # the default before issue 42


class Checks:
    def __init__(self):
        self.results: list[dict] = []

    def check(self, name: str, value: float, limit: float) -> None:
        ok = bool(value == value and value <= limit)
        self.results.append({"check": name, "value": float(value), "limit": limit, "ok": ok})
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {value:.3e} (limit {limit:.3e})", flush=True)

    @property
    def failed(self) -> list[str]:
        return [r["check"] for r in self.results if not r["ok"]]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Frobenius-norm relative difference, in fp64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(impl, hidden, weight, ids, logprobs, **kw):
    """(loss, argmax, dX, dW or None, seconds) of one forward + backward."""
    sync(hidden.device)
    t0 = time.perf_counter()
    x = hidden.detach().clone().requires_grad_(True)
    loss, argmax = sparse_kl_loss(x, weight, ids, logprobs, impl=impl, return_argmax=True, **kw)
    loss.backward()
    sync(hidden.device)
    return loss.detach(), argmax, x.grad, weight.grad, time.perf_counter() - t0


def parity(checks: Checks, device: torch.device, shape, kw: dict) -> None:
    # Tolerances. bf16 products are exact in fp32, so the bf16 cuBLAS GEMM with fp32 accumulation
    # and output differs from the fp32 reference on the same values only by summation order over
    # H = 4096: ~1e-6 relative on logits, lse and the loss; 1e-4 is the loss limit. dX is rounded
    # to bf16 twice (the logit gradient G in the workspace, then dX itself), 2^-9 relative each at
    # worst per element and less in norm; 1e-2 in Frobenius norm is a 2.5x margin over two
    # worst-case roundings. The bf16 run must also be no worse than the plain bf16 PyTorch form,
    # whose logits are rounded to bf16 before the softmax (error ~2^-9 * |z| on every logit),
    # plus 2^-9. A race in the kernel's in-place bf16 write would show as a parity failure or
    # as differing bits between the two runs.
    n_full = shape[0]
    hidden, weight, ids, logprobs = make_inputs(*shape, dtype=torch.bfloat16, device=device)
    hidden = hidden.detach()
    ref_loss, ref_arg, ref_dx, _, t_ref = run("torch", hidden.float(), weight.float(), ids, logprobs)
    print(f"  fp32 torch reference: loss {ref_loss.item():.6f} in {t_ref:.1f} s", flush=True)
    loss, arg, dx, _, t_tri = run("triton", hidden, weight, ids, logprobs, **kw)
    print(f"  bf16 triton: loss {loss.item():.6f} in {t_tri:.1f} s (first call compiles)", flush=True)
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    checks.check("bf16 triton loss vs fp32 reference (relative)", loss_err, 1e-4)
    checks.check("bf16 triton dX vs fp32 reference (relative Frobenius)", rel(dx, ref_dx), 1e-2)
    checks.check("bf16 triton argmax disagreement with fp32 reference (fraction)",
                 (arg != ref_arg).float().mean().item(), 1e-3)
    loss2, arg2, dx2, _, _ = run("triton", hidden, weight, ids, logprobs, **kw)
    checks.check("triton determinism: differing bits between two runs (count)",
                 float((loss2 != loss).sum() + (arg2 != arg).sum() + (dx2 != dx).sum()), 0.0)
    del dx2
    base_loss, _, base_dx, _, _ = run("naive", hidden, weight, ids, logprobs)
    base_loss_err = abs(base_loss.item() - ref_loss.item()) / abs(ref_loss.item())
    print(f"  plain bf16 form: loss error {base_loss_err:.3e}, dX error {rel(base_dx, ref_dx):.3e}", flush=True)
    checks.check("bf16 triton loss error minus bf16 form's", loss_err - base_loss_err, 2.0**-9)
    checks.check("bf16 triton dX error minus bf16 form's", rel(dx, ref_dx) - rel(base_dx, ref_dx), 2.0**-9)
    del ref_dx, dx, base_dx
    # The training call: reduction "sum" with row weights, a third of them 0 (dX stored
    # weighted, in bf16: kernels/sparse_kl.py, _TritonSparseKLReduced).
    weights = torch.rand(n_full, generator=torch.Generator().manual_seed(1)).to(device) + 0.5
    weights[1::3] = 0.0
    ref_loss, _, ref_dx, _, _ = run("torch", hidden.float(), weight.float(), ids, logprobs, weights=weights,
                                    reduction="sum")
    loss, _, dx, _, _ = run("triton", hidden, weight, ids, logprobs, weights=weights, reduction="sum", **kw)
    checks.check("bf16 triton, weighted sum: loss vs fp32 reference (relative)",
                 abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), 1e-4)
    checks.check("bf16 triton, weighted sum: dX vs fp32 reference (relative Frobenius)", rel(dx, ref_dx), 1e-2)
    checks.check("bf16 triton, weighted sum: nonzero dX entries in weight-0 rows (count)",
                 float((dx[1::3] != 0).sum()), 0.0)
    del ref_dx, dx
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # The dW path (the head requires grad: forward only, then each chunk recomputed with G scaled
    # by the row gradients) at N = 2048, against the fp32 torch path. In fp32 end to end (IEEE
    # GEMMs) the limits are fp32 summation-order limits, 1e-5 on the loss and 1e-4 on the
    # gradients; in bf16 G, dX and dW are each rounded to bf16 (the same 1e-2 as dX above).
    n = min(2048, n_full)
    x32, w32, ids_s, lq_s = hidden[:n].float(), weight.float(), ids[:n], logprobs[:n]
    w32.requires_grad_(True)
    ref_loss, _, ref_dx, ref_dw, _ = run("torch", x32, w32, ids_s, lq_s)
    w32.grad = None
    loss, _, dx, dw, _ = run("triton", x32, w32, ids_s, lq_s, **kw)
    checks.check("fp32 triton loss vs torch (relative)", abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                 1e-5)
    checks.check("fp32 triton dX vs torch (relative Frobenius)", rel(dx, ref_dx), 1e-4)
    checks.check("fp32 triton dW vs torch (relative Frobenius)", rel(dw, ref_dw), 1e-4)
    w16 = weight.detach().clone().requires_grad_(True)
    loss, _, dx, dw, _ = run("triton", hidden[:n], w16, ids_s, lq_s, **kw)
    checks.check("bf16 triton dW-path loss vs fp32 torch (relative)",
                 abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), 1e-4)
    checks.check("bf16 triton dW-path dX vs fp32 torch (relative Frobenius)", rel(dx, ref_dx), 1e-2)
    checks.check("bf16 triton dW vs fp32 torch (relative Frobenius)", rel(dw, ref_dw), 1e-2)
    del hidden, weight, ids, logprobs, x32, w32, w16, ref_dx, ref_dw, dx, dw
    if device.type == "cuda":
        torch.cuda.empty_cache()


def preset_args(ids: torch.Tensor, logprobs: torch.Tensor, weights: torch.Tensor) -> dict:
    """sparse_kl_loss options of fit's `--loss 0.9tv+0.1ce` call (train/fit.py, _distill):
    0.9 (tv + ce / 9) with the 0.9 on the row weights, CE to the teacher's top-1."""
    top1 = ids.gather(1, logprobs.argmax(1, keepdim=True))[:, 0]  # [N]
    return {"weights": 0.9 * weights, "divergence": "tv", "ce_targets": top1, "ce_weight": 0.1 / 0.9,
            "reduction": "sum"}


def parity_tv(checks: Checks, device: torch.device, shape, kw: dict) -> None:
    # The same tolerances as parity() above: TV's rows are sums of |p - q| formed in fp32 from
    # the same fp32 logits, so the loss is off by summation order only (1e-4), and dX carries
    # the same two bf16 roundings (1e-2 Frobenius). A sign(p_i - q_i) that flips between the
    # two runs (|p_i - q_i| below ~1e-6) moves one logit gradient by ~p_i: nothing in norm.
    n_full = shape[0]
    hidden, weight, ids, logprobs = make_inputs(*shape, dtype=torch.bfloat16, device=device)
    hidden = hidden.detach()
    tv = {"divergence": "tv"}
    ref_loss, _, ref_dx, _, t_ref = run("torch", hidden.float(), weight.float(), ids, logprobs, **tv)
    print(f"  tv: fp32 torch reference: loss {ref_loss.item():.6f} in {t_ref:.1f} s", flush=True)
    loss, arg, dx, _, t_tri = run("triton", hidden, weight, ids, logprobs, **tv, **kw)
    print(f"  tv: bf16 triton: loss {loss.item():.6f} in {t_tri:.1f} s (first TV call compiles)", flush=True)
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    checks.check("tv: bf16 triton loss vs fp32 reference (relative)", loss_err, 1e-4)
    checks.check("tv: bf16 triton dX vs fp32 reference (relative Frobenius)", rel(dx, ref_dx), 1e-2)
    loss2, arg2, dx2, _, _ = run("triton", hidden, weight, ids, logprobs, **tv, **kw)
    checks.check("tv: triton determinism: differing bits between two runs (count)",
                 float((loss2 != loss).sum() + (arg2 != arg).sum() + (dx2 != dx).sum()), 0.0)
    del dx2
    base_loss, _, base_dx, _, _ = run("naive", hidden, weight, ids, logprobs, **tv)
    base_loss_err = abs(base_loss.item() - ref_loss.item()) / abs(ref_loss.item())
    print(f"  tv: plain bf16 form: loss error {base_loss_err:.3e}, dX error {rel(base_dx, ref_dx):.3e}", flush=True)
    checks.check("tv: bf16 triton loss error minus bf16 form's", loss_err - base_loss_err, 2.0**-9)
    checks.check("tv: bf16 triton dX error minus bf16 form's", rel(dx, ref_dx) - rel(base_dx, ref_dx), 2.0**-9)
    del ref_dx, dx, base_dx
    weights = torch.rand(n_full, generator=torch.Generator().manual_seed(1)).to(device) + 0.5
    weights[1::3] = 0.0
    preset = preset_args(ids, logprobs, weights)
    ref_loss, _, ref_dx, _, _ = run("torch", hidden.float(), weight.float(), ids, logprobs, **preset)
    loss, _, dx, _, _ = run("triton", hidden, weight, ids, logprobs, **preset, **kw)
    checks.check("0.9tv+0.1ce: bf16 triton, weighted sum: loss vs fp32 reference (relative)",
                 abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), 1e-4)
    checks.check("0.9tv+0.1ce: bf16 triton, weighted sum: dX vs fp32 reference (relative Frobenius)",
                 rel(dx, ref_dx), 1e-2)
    checks.check("0.9tv+0.1ce: nonzero dX entries in weight-0 rows (count)", float((dx[1::3] != 0).sum()), 0.0)
    del hidden, weight, ids, logprobs, ref_dx, dx
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- timing


def time_ms(fn, device: torch.device, iters: int) -> float:
    """Median of iters timed calls (CUDA events on a GPU, after one warm-up call that compiles
    and fills caches; the CPU smoke's interpreter has nothing to warm, so it times at once)."""
    if device.type == "cuda":
        fn()
        sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def peak_extra_mib(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def liger():
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda x, w, labels: loss(w, x, labels)


def timing(device: torch.device, shapes, iters: int, deadline: float, small_workspaces: list[int], kw: dict,
           cfg: dict) -> list[dict]:
    """Rows of the timing table: impl, shape, median_ms, peak_extra_mib, and for Triton rows
    the cuBLAS-only time of the same chunks and the Triton part's share. kw: sparse_kl_loss
    options of every Triton row; cfg: TritonConfig fields under the programs_per_sm rows."""
    rows = []
    for index, shape in enumerate(shapes):
        rows += time_shape(device, shape, iters, deadline, small_workspaces if index == 1 else [], kw, cfg)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 2**20 else f"{nbytes >> 10} KiB"


def time_shape(device: torch.device, shape, iters: int, deadline: float, workspaces: list[int], kw: dict,
               cfg: dict) -> list[dict]:
    from dflash.kernels.sparse_kl import TritonConfig

    n, h, v, k = shape
    hidden, weight, ids, logprobs = make_inputs(*shape, dtype=torch.bfloat16, device=device)
    labels = ids[:, :1].contiguous()
    zeros = torch.zeros(n, 1, device=device)
    default = kw.get("workspace_bytes", default_workspace_bytes(device))

    def step(**options):
        def go():
            hidden.grad = None
            sparse_kl_loss(hidden, weight, ids, logprobs, impl="triton", **{**kw, **options}).backward()
        return go

    def step_k1():
        hidden.grad = None
        sparse_kl_loss(hidden, weight, labels, zeros, impl="triton", **kw).backward()

    weights = torch.rand(n, generator=torch.Generator().manual_seed(1)).to(device) + 0.5  # [N]
    preset = preset_args(ids, logprobs, weights)

    # (label, fn, workspace of its chunks for the cuBLAS-only comparison, or None)
    candidates = [
        ("torch.mm bf16 [N,H]x[H,V]", lambda: torch.mm(hidden.detach(), weight.T), None),
        ("triton (defaults)", step(), default),
        ("triton tv", step(divergence="tv"), default),
        ("triton 0.9tv+0.1ce", step(**preset), default),
        (f"triton[workspace {size_label(OLD_WORKSPACE)}] (before)", step(workspace_bytes=OLD_WORKSPACE),
         OLD_WORKSPACE),
        *[(f"triton[programs_per_sm {p}]", step(triton_config=TritonConfig(**cfg, programs_per_sm=p)), default)
          for p in (1, 2)],
        *[(f"triton[workspace {size_label(b)}]", step(workspace_bytes=b), b) for b in workspaces],
        ("triton k=1", step_k1, None),
    ]
    flce = liger()
    if flce is not None:
        def step_liger():
            hidden.grad = None
            flce(hidden, weight, labels[:, 0]).backward()
        candidates.append(("liger_flce k=1", step_liger, None))
    rows = []
    cublas_ms: dict[int, float] = {}
    for label, fn, workspace in candidates:
        row = {"impl": label, "shape": list(shape), "k": 1 if "k=1" in label else k}
        if time.monotonic() > deadline:
            row["error"] = "skipped: time budget spent"
        else:
            try:
                row["median_ms"] = time_ms(fn, device, iters)
                row["peak_extra_mib"] = None if "torch.mm" in label else peak_extra_mib(fn, device)
                if workspace is not None:
                    if workspace not in cublas_ms:
                        cublas_ms[workspace] = time_ms(lambda b=workspace: chunked_cublas_step(hidden, weight, b),
                                                       device, iters)
                    row["cublas_only_ms"] = cublas_ms[workspace]
                    row["triton_share"] = 1.0 - cublas_ms[workspace] / row["median_ms"]
            except Exception as err:  # noqa: BLE001  a failing candidate (OOM, missing package) is a row
                row["error"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
        rows.append(row)
        print_row(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_row(r: dict) -> None:
    shape = ",".join(map(str, r["shape"][:3] + [r["k"]]))
    if "error" in r:
        print(f"  {r['impl']:<36} {shape:<24} {r['error']}", flush=True)
        return
    share = r.get("triton_share")
    print(f"  {r['impl']:<36} {shape:<24} {r['median_ms']:>9.2f} {fmt(r.get('cublas_only_ms'), '>9.2f')} "
          f"{fmt(None if share is None else 100 * share, '>6.1f')} {fmt(r.get('peak_extra_mib'), '>9.0f')}",
          flush=True)


def goals(rows: list[dict], shapes) -> dict:
    def find(impl, shape):
        return next((r for r in rows if r["impl"] == impl and r["shape"] == list(shape) and "error" not in r), None)

    out = {}
    big, small = shapes
    new, old = find("triton (defaults)", big), find(f"triton[workspace {size_label(OLD_WORKSPACE)}] (before)", big)
    if new is not None:
        out["extra_mib_8b"] = new["peak_extra_mib"]
        if old is not None:
            out["time_vs_before_8b"] = new["median_ms"] / old["median_ms"]
    tv = find("triton tv", big)
    if new is not None and tv is not None:
        out["tv_time_vs_kl_8b"] = tv["median_ms"] / new["median_ms"]
        if tv["peak_extra_mib"] is not None:
            out["tv_extra_mib_minus_kl_8b"] = tv["peak_extra_mib"] - new["peak_extra_mib"]
    best = [r for r in rows if r["shape"] == list(small) and "triton_share" in r and "error" not in r
            and r["impl"] not in ("triton tv", "triton 0.9tv+0.1ce")]
    new_small = find("triton (defaults)", small)
    if new_small is not None:
        out["triton_share_smollm2_defaults"] = new_small["triton_share"]
    if best:
        top = min(best, key=lambda r: r["median_ms"])
        out["fastest_smollm2"] = {key: top[key] for key in ("impl", "median_ms", "triton_share")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run under TRITON_INTERPRET=1)")
    parser.add_argument("--iters", type=int, default=None, help="timed steps per row (default 5 on CUDA, 1 quick)")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="timing rows left when this many seconds have passed are skipped (parity always runs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    device = torch.device(args.device)
    from dflash.kernels.sparse_kl import INTERPRETED, TritonConfig

    if device.type == "cpu" and not INTERPRETED:
        sys.exit("gpu_kernel_check: on CPU the Triton path needs TRITON_INTERPRET=1 (and --quick)")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference and fp32 Triton use IEEE fp32
    shapes = [QUICK, QUICK_SMALL] if args.quick else [FULL, SMOLLM2]
    # --quick: small tiles and workspaces so that the interpreter meets several chunks and tiles.
    kw = {"triton_config": TritonConfig(block_v=64), "workspace_bytes": 10 * 259 * 4} if args.quick else {}
    cfg = {"block_v": 64} if args.quick else {}
    small_workspaces = [6 * 130 * 4] if args.quick else [32 * 2**20, 64 * 2**20, 128 * 2**20]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"gpu_kernel_check: torch {torch.__version__}, {name}", flush=True)
    checks = Checks()
    print(f"gpu_kernel_check: parity at {shapes[0]}", flush=True)
    parity(checks, device, shapes[0], kw)
    print(f"gpu_kernel_check: parity of divergence='tv' at {shapes[0]}", flush=True)
    parity_tv(checks, device, shapes[0], kw)
    print(f"gpu_kernel_check: timing and memory (budget {args.budget_s:.0f} s from the start; ms, cuBLAS-only ms "
          "of the same chunks, Triton part %, peak extra MiB)", flush=True)
    rows = timing(device, shapes, args.iters or (1 if args.quick else 5), deadline, small_workspaces, kw, cfg)
    report = {"bench": "gpu_kernel_check", "device": name, "torch": torch.__version__, "rows": rows,
              "goals": goals(rows, shapes)}
    g = report["goals"]
    if device.type == "cuda" and g.get("extra_mib_8b") is not None:
        checks.check(f"extra memory of a training step at {FULL} (MiB)", g["extra_mib_8b"], MEMORY_GOAL_MIB)
    if g.get("tv_extra_mib_minus_kl_8b") is not None:
        checks.check(f"extra memory of a TV training step minus KL's at {FULL} (MiB)", g["tv_extra_mib_minus_kl_8b"],
                     1.0)
    if "tv_time_vs_kl_8b" in g:
        print(f"gpu_kernel_check: TV against KL at {shapes[0]}, defaults: time {g['tv_time_vs_kl_8b']:.3f}x",
              flush=True)
    if "time_vs_before_8b" in g:
        print(f"gpu_kernel_check: goal: time vs the 2 GiB workspace at {shapes[0]}: {g['time_vs_before_8b']:.3f} "
              f"(goal <= 1.0: {'met' if g['time_vs_before_8b'] <= 1.0 else 'NOT met'})", flush=True)
    if "triton_share_smollm2_defaults" in g:
        share = g["triton_share_smollm2_defaults"]
        print(f"gpu_kernel_check: goal: Triton part of the step at {shapes[1]}, defaults: {100 * share:.1f}% "
              f"(goal <= {100 * SHARE_GOAL:.0f}%: {'met' if share <= SHARE_GOAL else 'NOT met'}); fastest: "
              f"{g['fastest_smollm2']['impl']} {g['fastest_smollm2']['median_ms']:.2f} ms, "
              f"{100 * g['fastest_smollm2']['triton_share']:.1f}%", flush=True)
    report["checks"] = checks.results
    report["failed"] = checks.failed
    print(f"gpu_kernel_check: {'FAIL: ' + ', '.join(checks.failed) if checks.failed else 'all checks passed'}",
          flush=True)
    if args.json:
        print(json.dumps(report))
    sys.exit(1 if checks.failed else 0)


if __name__ == "__main__":
    main()
