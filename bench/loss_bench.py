"""Benchmark of `sparse_kl_loss`: median time and peak extra memory of forward + backward.

The head is frozen (weight.requires_grad = False, as in DFlash) and the hidden states
require grad, so one step is the loss plus dX.

CPU (fp32, N=4096, H=576, V=49152, k=32): naive against torch, and torch with
divergence="tv" (the TV row: the same passes, a different row loss). Time is the median over
--iters steps in this process after one warm-up step. Peak extra memory is measured in a
fresh subprocess per impl, because torch's CPU allocator is invisible to tracemalloc: the
child runs a tiny warm-up step (so that mapping the BLAS code and thread pools is not
counted), builds its inputs in place (no transient copies), resets the kernel's resident-set
peak (`/proc/self/clear_refs` 5), reads its resident set (VmRSS), runs one step and reports
the new peak (VmHWM) minus that: the most the resident set rose above "inputs allocated".

GPU (bf16, (16384, 4096, 151936, 32) and (8192, 576, 49152, 32)): triton, triton with
divergence="tv" and with DSpark's 0.9 TV + 0.1 CE (fit's call), torch chunked,
torch.compile of the naive form, and naive; then the cross-entropy case k = 1 against
Liger's fused linear cross-entropy and Cut Cross-Entropy when they import. Time is the
median of CUDA-event timings; TFLOP/s counts 4*N*H*V (a frozen head: logits plus dX) per
step whatever the implementation really computes; "mm" is the ratio of that rate to a
plain bf16 torch.mm of the same [N, H] x [H, V] shape timed in the same run (2*N*H*V per
call); peak extra memory is torch.cuda.max_memory_allocated during the step minus the
memory allocated before it (dX itself, N*H, is included for every impl). The row
"chunked cuBLAS only" runs the triton path's two GEMMs per chunk (fp32 logits into the
same workspace, then dX from its bf16 view, rounded into hidden's dtype) without the
Triton kernel or any loss: the
ceiling of that design, so that triton's time minus its time is the kernel's share
(printed per shape as "Triton part", with the default's extra memory). At both shapes a
sweep of Triton launch options (tile, warps, the persistent grid) and of the workspace
size follows.

--json prints one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date

import torch

from dflash.kernels.loss import sparse_kl_loss
from dflash.kernels.reference import default_workspace_bytes, matmul_f32

CPU_SHAPE = (4096, 576, 49152, 32)
QUICK_CPU_SHAPE = (512, 64, 4096, 8)
GPU_SHAPES = [(16384, 4096, 151936, 32), (8192, 576, 49152, 32)]


def make_inputs(n, h, v, k, *, dtype=torch.float32, device="cpu", seed=0):
    """hidden [N, H] (requires grad), frozen weight [V, H], ids [N, k], logprobs [N, k].

    Built in place, so that no transient copy inflates the memory baseline. Ids are drawn
    with replacement (a row repeats an id with probability ~k^2 / 2V, ~1% here), which is
    the same work for every impl.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, device=device, dtype=dtype)
    weight = torch.randn(v, h, generator=g, device=device, dtype=dtype)
    weight.mul_(3.0 / h**0.5)  # logits of std ~3
    ids = torch.randint(0, v, (n, k), generator=g, device=device)
    logprobs = torch.randn(n, k + 1, generator=g, device=device).mul_(2.0).log_softmax(1)[:, :k].contiguous()
    return hidden.requires_grad_(True), weight, ids, logprobs


def step(loss_fn, hidden, *args):
    hidden.grad = None
    loss_fn(hidden, *args).backward()


def chunked_cublas_step(hidden, weight, workspace_bytes):
    """The triton path's GEMMs alone (its training call: a frozen head, reduction "mean" or
    "sum"): per chunk, fp32 logits into a [C, V] workspace, then dX_c from the workspace's
    bf16 view (as the Triton kernel leaves it) times W into a [C, H] fp32 buffer, rounded
    into an [N, H] dX of hidden's dtype."""
    from dflash.kernels.sparse_kl import chunk_rows

    n, h = hidden.shape
    v = weight.shape[0]
    rows = chunk_rows(n, v, workspace_bytes)
    ws = torch.empty(rows, v, dtype=torch.float32, device=hidden.device)  # [C, V]
    dx_chunk = torch.empty(rows, h, dtype=torch.float32, device=hidden.device)  # [C, H]
    dx = torch.empty(n, h, dtype=hidden.dtype, device=hidden.device)  # [N, H]
    x = hidden.detach()
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        z = ws[: r1 - r0]
        matmul_f32(x[r0:r1], weight.T, out=z)
        g = z.view(weight.dtype)[:, :v] if weight.dtype != torch.float32 else z
        dx[r0:r1].copy_(matmul_f32(g, weight, out=dx_chunk[: r1 - r0]))
    return dx


def sparse_kl(impl, **kw):
    return lambda hidden, weight, ids, logprobs: sparse_kl_loss(hidden, weight, ids, logprobs, impl=impl, **kw)


# ----------------------------------------------------------------------------- CPU


def proc_status_bytes(key: str) -> int:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: resident peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def memory_child(impl: str, divergence: str, shape: tuple[int, int, int, int]) -> None:
    """Run in a fresh process: one step of impl, print the resident-set rise as JSON."""
    n, h, v, k = shape
    # A tiny step first maps the BLAS/oneDNN code and thread pools into the process, a
    # one-off cost that is not the step's memory.
    step(sparse_kl(impl, divergence=divergence), *make_inputs(64, h, 512, k))
    inputs = make_inputs(*shape)
    # Reset the peak to the current resident set (Linux >= 4.0). getrusage's ru_maxrss is
    # no use here: it keeps the parent's resident set from before the exec as a floor.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = proc_status_bytes("VmRSS")
    step(sparse_kl(impl, divergence=divergence), *inputs)
    print(json.dumps({"extra_bytes": proc_status_bytes("VmHWM") - before, "rss_before": before}))


def cpu_rows(shape, iters: int) -> list[dict]:
    n, h, v, k = shape
    inputs = make_inputs(*shape)
    rows = []
    for label, impl, divergence in (("naive", "naive", "kl"), ("torch", "torch", "kl"), ("torch tv", "torch", "tv")):
        fn = sparse_kl(impl, divergence=divergence)
        step(fn, *inputs)  # warm-up (thread pools, allocator)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step(fn, *inputs)
            times.append(time.perf_counter() - t0)
        child = subprocess.run(
            [sys.executable, __file__, "--memory-child", impl, "--divergence", divergence,
             "--shape", *map(str, shape)],
            check=True, capture_output=True, text=True,
        )
        mem = json.loads(child.stdout.strip().splitlines()[-1])
        ms = statistics.median(times) * 1e3
        rows.append({
            "impl": label, "shape": list(shape), "dtype": "float32", "median_ms": ms,
            "times_ms": [t * 1e3 for t in times], "tflops": 4 * n * h * v / (ms * 1e-3) / 1e12,
            "peak_extra_mib": mem["extra_bytes"] / 2**20,
            "memory_method": "VmHWM - VmRSS after clear_refs, fresh subprocess",
        })
    naive = rows[0]
    for row in rows:
        row["time_vs_naive"] = row["median_ms"] / naive["median_ms"]
        row["memory_vs_naive"] = row["peak_extra_mib"] / naive["peak_extra_mib"]
    return rows


# ----------------------------------------------------------------------------- GPU


def cuda_time_ms(fn, iters: int) -> list[float]:
    fn()  # warm-up: compilation, autotuning, allocator
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def cuda_peak_extra_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def k1_competitors() -> dict:
    """Fused linear cross-entropy kernels that import here: name -> fn(hidden, weight, labels)."""
    found = {}
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        found["liger_flce"] = lambda x, w, labels: liger(w, x, labels)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy

        found["cut_cross_entropy"] = lambda x, w, labels: linear_cross_entropy(x, w, labels)
    except ImportError:
        pass
    return found


def gpu_rows(iters: int, triton_sweep: dict, budget_s: float, on_row) -> list[dict]:
    """Rows of the GPU table, most important first; candidates left when budget_s has run
    out are recorded as skipped, so that a time limit still gets a table and its JSON."""
    start = time.monotonic()
    rows = []

    def emit(row):
        rows.append(row)
        on_row(row)

    for shape in GPU_SHAPES:
        n, h, v, k = shape
        hidden, weight, ids, logprobs = make_inputs(*shape, dtype=torch.bfloat16, device="cuda")
        flops = 4 * n * h * v
        w_t = weight.T
        mm_ms = statistics.median(cuda_time_ms(lambda hidden=hidden, w_t=w_t: torch.mm(hidden.detach(), w_t), iters))
        mm_tflops = 2 * n * h * v / (mm_ms * 1e-3) / 1e12
        emit({"impl": "torch.mm bf16 [N,H]x[H,V]", "shape": list(shape), "k": k, "median_ms": mm_ms,
              "tflops": mm_tflops, "mm_ratio": 1.0, "peak_extra_mib": None})

        labels = ids[:, :1].contiguous()  # [N, 1]
        zeros = torch.zeros(n, 1, device=hidden.device)
        top1 = ids.gather(1, logprobs.argmax(1, keepdim=True))[:, 0]  # [N]
        preset_weights = torch.full((n,), 0.9, device=hidden.device)  # [N]: fit's preset puts 0.9 on the row weights
        # Each candidate runs one whole step: the loss and dX (hidden.grad).
        candidates = {
            "triton": sparse_kl("triton"),
            "triton tv": sparse_kl("triton", divergence="tv"),
            "triton 0.9tv+0.1ce": lambda x, w, i, lq, top1=top1, preset_weights=preset_weights: sparse_kl_loss(
                x, w, i, lq, preset_weights, divergence="tv", ce_targets=top1, ce_weight=0.1 / 0.9, reduction="sum",
                impl="triton"),
            "chunked cuBLAS only": None,
            "torch": sparse_kl("torch"),
            "naive": sparse_kl("naive"),
            "triton k=1": lambda x, w, _ids, _lq, labels=labels, zeros=zeros: sparse_kl_loss(
                x, w, labels, zeros, impl="triton"),
        }
        for name, fn in k1_competitors().items():
            candidates[f"{name} k=1"] = lambda x, w, _ids, _lq, fn=fn, labels=labels: fn(x, w, labels[:, 0])
        for label, kw in triton_sweep.items():  # launch options and workspaces, at both shapes
            candidates[label] = sparse_kl("triton", **kw)
        # Last: its compilation alone can take a minute, and the budget skips what is left.
        candidates["torch.compile(naive)"] = torch.compile(sparse_kl("naive"))
        workspace_bytes = default_workspace_bytes(hidden.device)

        for name, fn in candidates.items():
            row = {"impl": name, "shape": list(shape), "k": 1 if "k=1" in name else k}
            if time.monotonic() - start > budget_s:
                row["error"] = f"skipped: time budget of {budget_s:.0f} s spent"
                emit(row)
                continue

            # run is called only in this iteration, and must not keep this shape's tensors
            # alive past the `del` below (default arguments would): hence the noqa.
            def run(fn=fn):
                if fn is None:
                    chunked_cublas_step(hidden, weight, workspace_bytes)  # noqa: B023, F821
                else:
                    step(fn, hidden, weight, ids, logprobs)  # noqa: B023, F821

            try:
                times = cuda_time_ms(run, iters)
                ms = statistics.median(times)
                row.update(median_ms=ms, times_ms=times, tflops=flops / (ms * 1e-3) / 1e12,
                           peak_extra_mib=cuda_peak_extra_mib(run))
                row["mm_ratio"] = row["tflops"] / mm_tflops
            except Exception as err:  # noqa: BLE001  a failing competitor (OOM, compile error) is a row, not a crash
                first_line = (str(err).splitlines() or [""])[0][:200]
                row["error"] = f"{type(err).__name__}: {first_line}"
            emit(row)
            torch.cuda.empty_cache()
        triton_share(rows, shape)
        del hidden, weight, ids, logprobs, labels, zeros, top1, preset_weights, candidates
        torch.cuda.empty_cache()
    return rows


def triton_share(rows: list[dict], shape) -> None:
    """Adds triton_share = 1 - (chunked cuBLAS only) / (row's time) to this shape's Triton
    rows that use the default workspace (the same chunks as the cuBLAS-only row), and prints
    the default's share and extra memory: the kernel's part of a step (issue 42: <= 30% at
    SmolLM2's shape; extra memory <= 512 MiB at the 8B shape)."""
    here = [r for r in rows if r["shape"] == list(shape) and "error" not in r]
    gemms = next((r for r in here if r["impl"] == "chunked cuBLAS only"), None)
    if gemms is None:
        return
    for r in here:
        if r["impl"].startswith("triton") and "workspace" not in r["impl"] and "k=1" not in r["impl"]:
            r["triton_share"] = 1.0 - gemms["median_ms"] / r["median_ms"]
    main = next((r for r in here if r["impl"] == "triton"), None)
    if main is not None:
        print(f"triton at {','.join(map(str, shape))}: Triton part {100 * main['triton_share']:.1f}% of the step "
              f"({main['median_ms']:.2f} ms against {gemms['median_ms']:.2f} ms for the same chunks' GEMMs alone), "
              f"extra memory {main['peak_extra_mib']:.0f} MiB", flush=True)


# ----------------------------------------------------------------------------- output


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def print_cpu_table(rows: list[dict]) -> None:
    print(f"{'impl':<9} {'N,H,V,k':<22} {'median ms':>10} {'TFLOP/s':>8} {'peak extra MiB':>15} "
          f"{'time/naive':>10} {'mem/naive':>10}")
    for r in rows:
        print(f"{r['impl']:<9} {','.join(map(str, r['shape'])):<22} {r['median_ms']:>10.0f} "
              f"{r['tflops']:>8.3f} {r['peak_extra_mib']:>15.0f} {r['time_vs_naive']:>10.2f} "
              f"{r['memory_vs_naive']:>10.3f}")


GPU_HEADER = f"{'impl':<40} {'N,H,V,k':<24} {'median ms':>10} {'TFLOP/s':>8} {'vs mm':>6} {'peak extra MiB':>15}"


def print_gpu_row(r: dict) -> None:
    shape = ",".join(map(str, r["shape"][:3] + [r["k"]]))
    if "error" in r:
        print(f"{r['impl']:<40} {shape:<24} {r['error']}", flush=True)
        return
    print(f"{r['impl']:<40} {shape:<24} {r['median_ms']:>10.2f} {r['tflops']:>8.1f} "
          f"{fmt(r.get('mm_ratio'), '>6.2f')} {fmt(r.get('peak_extra_mib'), '>15.0f')}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--iters", type=int, default=None, help="timed steps per impl (default: 3 CPU, 5 GPU)")
    parser.add_argument("--quick", action="store_true", help=f"CPU only: the small shape {QUICK_CPU_SHAPE}")
    parser.add_argument("--no-sweep", action="store_true", help="GPU: only the default Triton options")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="GPU: skip the remaining candidates once this many seconds have passed")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--memory-child", choices=["naive", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--divergence", choices=["kl", "tv"], default="kl", help=argparse.SUPPRESS)
    parser.add_argument("--shape", type=int, nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child, args.divergence, tuple(args.shape))
        return

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        shape = QUICK_CPU_SHAPE if args.quick else CPU_SHAPE
        rows = cpu_rows(shape, args.iters or 3)
        machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"torch threads {torch.get_num_threads()}")
        print(f"sparse_kl_loss forward + backward (dX only), cpu: {machine}")
        print_cpu_table(rows)
    else:
        from dflash.kernels.sparse_kl import TritonConfig

        sweep = {} if args.no_sweep else {
            "triton[block_v 2048 w4]": {"triton_config": TritonConfig(block_v=2048, num_warps=4)},
            "triton[block_v 4096 w16]": {"triton_config": TritonConfig(block_v=4096, num_warps=16)},
            "triton[block_v 8192 w16]": {"triton_config": TritonConfig(block_v=8192, num_warps=16)},
            "triton[programs_per_sm 1]": {"triton_config": TritonConfig(programs_per_sm=1)},
            "triton[programs_per_sm 2]": {"triton_config": TritonConfig(programs_per_sm=2)},
            "triton[workspace 2 GiB] (before issue 42)": {"workspace_bytes": 2 * 2**30},
            "triton[workspace 64 MiB]": {"workspace_bytes": 64 * 2**20},
        }
        machine = torch.cuda.get_device_name()
        print(f"sparse_kl_loss forward + backward (dX only), cuda: {machine}, bf16")
        print(GPU_HEADER, flush=True)
        rows = gpu_rows(args.iters or 5, sweep, args.budget_s, print_gpu_row)
    if args.json:
        print(json.dumps({"bench": "loss_bench", "date": date.today().isoformat(), "device": device,
                          "machine": machine, "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
