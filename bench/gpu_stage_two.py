"""Stage two on a GPU, in one call: the two shapes of issue 42 and a bitwise kill-and-resume.

1. small: a 2-layer drafter on an fp8 cache of 5 x 2048 features (V 32,000, top-32; 64
   sequences of 1,024 tokens, anchors_per_seq 128), `--num-drafts 15 --tokens-per-step
   8192`, 80 steps, a checkpoint every 25 (1.3 GiB);
2. qwen3-8b: Qwen3-8B's drafter shape as `bench/train_step.py --sections gpu` (5 layers, H
   4096, V 151,936, 32/8 heads of 128, FFN 12,288, block 16, 16,384 block tokens a step, bf16
   features; 16 sequences of 2,048 tokens), 30 steps, one checkpoint at step 15 (12 GiB) and
   the final one;
3. kill-and-resume: a short CUDA fit (the small shape cut down) killed by SIGKILL right
   after its first checkpoint is written, resumed by the same call; its final weights,
   optimizer state and loss trace equal an uninterrupted run's (torch.equal).

For each shape it prints tokens/s, MFU (against --peak-tflops; the model FLOPs of
bench/train_step.py), the GPU's data wait (CUDA events: the device idle while the host read
and while the step waited for its copy) as a share of the step, the host's read time, and
the checkpoint block: the training thread's time blocked by the mid-run checkpoint (waiting
for the previous write plus queueing the snapshot) in median steps, beside the snapshot
step's time over the median; and, for three steps of the 8B fit (torch.profiler), where the
device time goes (matmul, attention, the loss's Triton rows, optimizer, copies, the rest),
the top kernels, and the share of the step in which some kernel ran. Goals are PASS/FAIL
lines (GPU data wait <= 5% of the step at both shapes, MFU >= 50% at Qwen3-8B's shape,
checkpoint block <= 1 median step); the exit status is non-zero only on a correctness
failure (the resume differs, or a section fails). The profiled steps (6-8) are among the
30 that the figures read; the profiler's own cost on them is small beside a 0.3 s step.

Sizing (H200, about 180 s): caches are built from two random rows written again and again
(contents do not matter to the timings), about 10 s each; the small fit about 30 s
(compilation included), the 8B fit about 50 s (caches and checkpoints go to /dev/shm when it
has room: a 12 GiB write to a slow disk would hold the final drain for 20 s, and a write
slower than the checkpoint interval makes the next snapshot wait for it), the
kill-and-resume about 40 s (one fresh process). --budget-s skips the sections that no longer fit their estimate
(printed as SKIPPED); --quick runs tiny shapes (with --device cpu: the CPU check of the
script itself, tests/test_gpu_stage_two.py).

    python -m bench.gpu_stage_two [--json] [--budget-s 180] [--device cuda] [--quick]   # from the repo root
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.train_step import PEAK_TFLOPS, SHAPES, analyse, mfu, write_bench_cache
from dflash.train.config import FitConfig
from dflash.train.fit import fit

SMALL = dict(vocab_size=32000, hidden_size=2048, num_layers=24, layer_ids=(1, 6, 11, 16, 21),
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=5632, top_k=32)
TINY = dict(vocab_size=512, hidden_size=64, num_layers=8, layer_ids=(1, 2, 3, 5, 6), num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, top_k=8)

# (shape, cache, fit) per section; quick: tiny shapes that run on a CPU in seconds.
SECTIONS = {
    "small": dict(shape=SMALL, feature_codec="fp8", num_sequences=64, length=1024,
                  fit=dict(num_layers=2, num_drafts=15, tokens_per_step=8192, anchors_per_seq=128, max_steps=80,
                           checkpoint_every=25), estimate_s=45),
    "qwen3-8b": dict(shape=SHAPES["gpu"], feature_codec="bf16", num_sequences=16, length=2048,
                     fit=dict(num_layers=5, num_drafts=15, tokens_per_step=16384, anchors_per_seq=512,
                              max_steps=30, checkpoint_every=15), estimate_s=75, profile=(6, 3)),
}
QUICK = {
    "small": dict(shape=TINY, feature_codec="fp8", num_sequences=12, length=96,
                  fit=dict(num_layers=2, num_drafts=15, tokens_per_step=256, anchors_per_seq=8, max_steps=12,
                           checkpoint_every=4), estimate_s=30),
    "qwen3-8b": dict(shape=TINY, feature_codec="bf16", num_sequences=12, length=96,
                     fit=dict(num_layers=2, num_drafts=15, tokens_per_step=256, anchors_per_seq=8, max_steps=12,
                              checkpoint_every=6), estimate_s=30, profile=(3, 2)),
}
RESUME_STEPS, RESUME_EVERY, RESUME_KILL_AT = 8, 4, 4  # the kill-and-resume fit: killed after step 4's write
GOAL_DATA_WAIT, GOAL_MFU, GOAL_BLOCK_STEPS = 0.05, 0.50, 1.0


def fit_config(workdir: Path, cache: Path, name: str, device: str, **fit_options) -> FitConfig:
    return FitConfig.from_dict(dict(
        cache=[str(cache)], out=str(workdir / f"run-{name}"), keep_checkpoints=1, eval_every=0, eval_fraction=0.0,
        device=device, wandb=False, log_every=10**9, spike_warmup_steps=10**9, epochs=1000, seed=0) | fit_options)


def run_shape(name: str, section: dict, workdir: Path, device: str) -> dict:
    """Build the section's cache in `workdir`, fit there, and read the metrics and events."""
    cache = workdir / f"cache-{name}"
    t0 = time.perf_counter()
    write_bench_cache(cache, section["shape"], num_sequences=section["num_sequences"], length=section["length"],
                      feature_codec=section["feature_codec"])
    cache_s = time.perf_counter() - t0
    config = fit_config(workdir, cache, name, device, **section["fit"])
    t0 = time.perf_counter()
    profiler = None
    if "profile" in section:
        profiler, sync_sites = _profiled_fit(config, device, *section["profile"])
    else:
        fit(config)
    fit_s = time.perf_counter() - t0
    run_dir = Path(config.out)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    result = analyse(metrics, events)
    if profiler is not None:
        first, count = section["profile"]
        wall_s = sum(m["step_time_s"] for m in metrics if first <= m["step"] < first + count)
        result["profile"] = _kernel_profile(profiler, device, count, wall_s, first)
        result["profile"]["host_syncs_per_step"] = None if sync_sites is None else len(sync_sites) / count
        result["profile"]["host_sync_sites"] = None if sync_sites is None else dict(
            sorted(collections.Counter(sync_sites).items(), key=lambda item: -item[1]))
    step_s = {m["step"]: m["step_time_s"] for m in metrics}
    mid = [e for e in events if e["event"] == "checkpoint" and e["step"] < len(metrics)]  # not the final drain
    result.update(
        name=name, device=device, cache_write_s=cache_s, fit_s=fit_s, steps=len(metrics),
        median_data_fraction=statistics.median(m["data_time_s"] / m["step_time_s"] for m in metrics[1:]),
        mid_checkpoint_block_steps=max(((e["wait_s"] + e["snapshot_s"]) / result["median_step_s"] for e in mid),
                                       default=None),
        mid_snapshot_step_ratio=max((step_s[e["step"]] / result["median_step_s"] for e in mid), default=None),
        checkpoint_gib=max((e["bytes"] for e in events if e["event"] == "checkpoint"), default=0) / 2**30,
        shape={k: v for k, v in section["shape"].items() if k != "layer_ids"}, fit=section["fit"])
    if device == "cuda":
        result.update(mfu(config, cache, result["median_step_s"], metrics))
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return result


# Where a step's device time goes (the profile of a few steps of the 8B fit): kernel name
# patterns, lower case, first match wins; on a CPU (the script's own check) aten ops instead.
KERNEL_KINDS = (
    ("loss (Triton rows)", ("_chunk_rows_kernel",)),
    ("attention", ("flex", "attention", "fmha", "flash", "triton_tem")),
    ("matmul", ("gemm", "matmul", "cutlass", "xmma", "nvjet", "aten::mm", "aten::addmm", "aten::bmm")),
    ("optimizer", ("adam", "multi_tensor")),
    ("copy", ("memcpy", "memset", "copy")),
)


def _profiled_fit(config: FitConfig, device: str, first: int, count: int):
    """fit(config) with torch.profiler recording training steps first .. first + count - 1
    (1-based, as metrics.jsonl numbers them), and on CUDA the host's synchronizing calls in
    those steps (torch.cuda.set_sync_debug_mode, each warning's file:line); returns (the
    profiler, those call sites or None). The profiler steps after each logged step, through
    fit's own per-step logging (bench only, restored after)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from dflash.train import fit as fit_module

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    log_step = fit_module._log_step
    # Profiler step i is the work after step i's log line: training step i + 1.
    window = schedule(wait=first - 2, warmup=1, active=count, repeat=1)
    with profile(activities=activities, schedule=window) as profiler, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def log_and_step(run, *args, **kwargs):
            log_step(run, *args, **kwargs)
            if device == "cuda":  # warn on every sync while steps first .. first + count - 1 run
                with contextlib.suppress(Exception):  # a diagnostic never fails the fit it watches
                    torch.cuda.set_sync_debug_mode("warn" if first - 1 <= run.step < first + count - 1 else 0)
            profiler.step()

        fit_module._log_step = log_and_step
        try:
            fit(config)
        finally:
            fit_module._log_step = log_step
            if device == "cuda":
                with contextlib.suppress(Exception):
                    torch.cuda.set_sync_debug_mode(0)
    sites = []
    for w in caught:
        if "synchroniz" in str(w.message):
            sites.append(f"{Path(w.filename).name}:{w.lineno}")
        else:  # the fit's other warnings, as they would have shown
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return profiler, (sites if device == "cuda" else None)


def _kernel_profile(profiler, device: str, steps: int, wall_s: float, first: int) -> dict:
    """Per step of the profiled window: device time by kind of kernel (KERNEL_KINDS; the
    rest is "other": element-wise ops, norms, reductions, indexing), the top kernels, and on a
    GPU the share of the steps' wall time in which some kernel ran (the union of kernel
    intervals over all streams; what is not covered is the device waiting for the host)."""
    from torch.autograd import DeviceType

    try:
        if device == "cuda":
            spans = [(e.name, e.time_range.start, e.time_range.end) for e in profiler.events()
                     if e.device_type == DeviceType.CUDA]
            times = [(name, end - start) for name, start, end in spans]
        else:
            spans = []
            times = [(e.name, e.self_cpu_time_total) for e in profiler.events()
                     if e.device_type == DeviceType.CPU and not e.name.startswith("ProfilerStep")]
        by_kind: dict[str, float] = {}
        by_name: dict[str, float] = {}
        for name, us in times:
            lower = name.lower()
            kind = next((k for k, patterns in KERNEL_KINDS if any(p in lower for p in patterns)), "other")
            by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e3 / steps
            by_name[name] = by_name.get(name, 0.0) + us / 1e3 / steps
        busy_ms = 0.0
        end = float("-inf")
        for _, start, stop in sorted(spans, key=lambda span: span[1]):
            busy_ms += max(0.0, stop - max(start, end)) / 1e3
            end = max(end, stop)
        top = sorted(by_name.items(), key=lambda item: -item[1])[:12]
        return {"steps": list(range(first, first + steps)), "wall_ms_per_step": 1e3 * wall_s / steps,
                "ms_per_step": dict(sorted(by_kind.items(), key=lambda item: -item[1])),
                "device_busy_fraction": busy_ms / steps / (1e3 * wall_s / steps) if spans and wall_s else None,
                "top": [{"name": name[:120], "ms_per_step": ms} for name, ms in top]}
    except Exception as error:  # noqa: BLE001 - a diagnostic: its failure is reported, not fatal
        return {"error": f"{type(error).__name__}: {error}"}


# The killed run: a fresh process that SIGKILLs itself once step RESUME_KILL_AT is logged and
# its checkpoint is written (the writer's `start` waits for the write, a timing change only).
DRIVER = r"""
import json, os, signal, sys
from dflash.train import checkpoint, fit as fit_module
from dflash.train.config import FitConfig
config, kill_at = FitConfig.from_dict(json.loads(sys.argv[1])), int(sys.argv[2])
start = checkpoint.CheckpointWriter.start
def start_and_wait(self, snapshot):
    start(self, snapshot)
    self.wait()
    if snapshot.step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.CheckpointWriter.start = start_and_wait
fit_module.fit(config)
"""


def kill_and_resume(workdir: Path, device: str, section: dict) -> dict:
    """An uninterrupted short fit against one killed after its first checkpoint and resumed:
    final weights, optimizer state and loss trace compared with torch.equal."""
    from dflash.train.checkpoint import latest_checkpoint, load_checkpoint

    cache = workdir / "cache-resume"
    shape = dict(section["shape"])
    write_bench_cache(cache, shape, num_sequences=min(16, section["num_sequences"]), length=section["length"],
                      feature_codec=section["feature_codec"])
    options = dict(section["fit"], max_steps=RESUME_STEPS, checkpoint_every=RESUME_EVERY, keep_checkpoints=2)
    options["tokens_per_step"] = min(options["tokens_per_step"], 2048)
    straight = fit_config(workdir, cache, "straight", device, **options)
    resumed = fit_config(workdir, cache, "resumed", device, **options)
    t0 = time.perf_counter()
    fit(straight)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(resumed.to_dict()), str(RESUME_KILL_AT)],
                            env=env, capture_output=True, text=True, timeout=600)
    left = latest_checkpoint(Path(resumed.out))
    fit(resumed)
    seconds = time.perf_counter() - t0
    problems = []
    if killed.returncode != -signal.SIGKILL:
        problems.append(f"the killed run ended with {killed.returncode}, not SIGKILL: {killed.stderr[-2000:]}")
    if left is None or left.name != f"step-{RESUME_KILL_AT:08d}":
        problems.append(f"the killed run left {left}, not step-{RESUME_KILL_AT:08d}")
    a, b = (load_checkpoint(latest_checkpoint(Path(c.out))) for c in (straight, resumed))
    for name, value in a[0].items():
        if not torch.equal(value, b[0][name]):
            diff = (value.float() - b[0][name].float()).abs().max()
            problems.append(f"weight {name} differs (max |diff| {diff:.3g})")
    for index, state in a[1]["state"].items():
        for key, value in state.items():
            if not torch.equal(value, b[1]["state"][index][key]):
                problems.append(f"optimizer state {index}.{key} differs")
    if a[2]["step"] != b[2]["step"] or a[2]["gate"] != b[2]["gate"]:
        problems.append("step or gate state differs")
    losses = [[json.loads(line)["loss"] for line in (Path(c.out) / "metrics.jsonl").read_text().splitlines()]
              for c in (straight, resumed)]
    if losses[0] != losses[1]:
        problems.append(f"loss traces differ: {losses[0]} vs {losses[1]}")
    for c in (straight, resumed):
        shutil.rmtree(c.out, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return {"steps": RESUME_STEPS, "killed_after_step": RESUME_KILL_AT, "seconds": seconds,
            "final_loss": losses[0][-1], "equal": not problems, "problems": problems[:10]}


def goal_lines(results: dict, device: str) -> list[str]:
    """PASS/FAIL (or n/a) per goal."""
    lines = []
    for name in ("small", "qwen3-8b"):
        r = results.get(name)
        if r is None:
            continue
        wait = r["gpu_data_wait_fraction"]
        lines.append(_goal(f"GPU data wait <= {GOAL_DATA_WAIT:.0%} of the step ({name})", wait,
                           None if wait is None else wait <= GOAL_DATA_WAIT, "{:.2%}"))
        block = r["mid_checkpoint_block_steps"]
        lines.append(_goal(f"checkpoint block <= {GOAL_BLOCK_STEPS:g} median step ({name})", block,
                           None if block is None else block <= GOAL_BLOCK_STEPS, "{:.2f} steps"))
    r = results.get("qwen3-8b")
    if r is not None:
        value = r.get("mfu")
        lines.append(_goal(f"MFU >= {GOAL_MFU:.0%} (qwen3-8b)", value, None if value is None else value >= GOAL_MFU,
                           "{:.1%}"))
    resume = results.get("kill_and_resume")
    if resume is not None:
        lines.append(f"{'PASS' if resume['equal'] else 'FAIL'} kill-and-resume on {device}: final weights, "
                     f"optimizer state and loss trace equal an uninterrupted run"
                     + ("" if resume["equal"] else f": {'; '.join(resume['problems'])}"))
    return lines


def _goal(text: str, value, ok: bool | None, fmt: str) -> str:
    if ok is None:
        return f"n/a  {text}: not measured on this device"
    return f"{'PASS' if ok else 'FAIL'} {text}: {fmt.format(value)}"


def table(results: dict) -> str:
    shapes = [results[n] for n in ("small", "qwen3-8b") if n in results]
    rows = [
        ("shape", lambda r: f"H {r['shape']['hidden_size']} V {r['shape']['vocab_size']}, "
                            f"{r['fit']['num_layers']} layers"),
        ("tokens/step, steps", lambda r: f"{r['fit']['tokens_per_step']}, {r['steps']}"),
        ("median step", lambda r: f"{r['median_step_s'] * 1e3:.1f} ms"),
        ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
        ("MFU", lambda r: f"{r['mfu']:.1%}" if "mfu" in r else "-"),
        ("GPU data wait / step", lambda r: "-" if r["gpu_data_wait_fraction"] is None
         else f"{r['gpu_data_wait_fraction']:.2%} (worst {r['max_step_gpu_data_wait_fraction']:.2%})"),
        ("host read / step (median)", lambda r: f"{r['median_data_fraction']:.1%} ({r['median_data_s'] * 1e3:.1f} ms)"),
        ("checkpoint", lambda r: f"{r['checkpoint_gib']:.2f} GiB, snapshot to {', '.join(r['snapshot_to'])}"),
        ("checkpoint block (mid-run)", lambda r: "-" if r["mid_checkpoint_block_steps"] is None
         else f"{r['mid_checkpoint_block_steps']:.3f} median steps (that step {r['mid_snapshot_step_ratio']:.2f}x)"),
        ("steps during a write", lambda r: "-" if r["max_during_write_ratio"] is None
         else f"worst {r['max_during_write_ratio']:.2f}x the local median"),
    ]
    lines = ["| | " + " | ".join(r["name"] for r in shapes) + " |", "|---" * (len(shapes) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(fmt(r) for r in shapes) + " |" for label, fmt in rows]
    return "\n".join(lines)


def profile_lines(results: dict) -> list[str]:
    """Where the profiled steps' device time went (CPU time of aten ops on a CPU)."""
    lines = []
    for name in ("small", "qwen3-8b"):
        p = results.get(name, {}).get("profile")
        if p is None:
            continue
        if "error" in p:
            lines.append(f"profile ({name}): not read: {p['error']}")
            continue
        busy = p["device_busy_fraction"]
        lines.append(f"profile ({name}), steps {p['steps'][0]}-{p['steps'][-1]}, {p['wall_ms_per_step']:.1f} ms a step"
                     + ("" if busy is None else f", some kernel running {busy:.1%} of it") + ": "
                     + ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in p["ms_per_step"].items()))
        lines += [f"  {t['ms_per_step']:8.2f} ms  {t['name']}" for t in p["top"]]
        if p.get("host_syncs_per_step") is not None:
            lines.append(f"  host syncs a step: {p['host_syncs_per_step']:.1f} ("
                         + ", ".join(f"{site} x{n}" for site, n in p["host_sync_sites"].items()) + ")")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--budget-s", type=float, default=180.0,
                        help="wall-clock budget in seconds: a section whose estimate no longer fits is skipped")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="where to train (cuda: the figures of the issue; cpu: the script's own check)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (seconds; with --device cpu in the tests)")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="dense bf16 peak for MFU (H200: 989)")
    parser.add_argument("--workdir", type=Path, default=None, help="caches and runs here (default: a temporary folder)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (use --device cpu --quick for the CPU check)")
    import bench.train_step as train_step

    train_step.PEAK_TFLOPS = args.peak_tflops
    started = time.perf_counter()
    sections = QUICK if args.quick else SECTIONS
    from dflash.shards.rows import CRC32_IMPL

    results: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                     "quick": args.quick, "budget_s": args.budget_s, "crc32": CRC32_IMPL}
    failures = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        workdir = Path(tmp)
        for name, section in sections.items():
            root = workdir
            if not args.quick and _shm_room_gib() >= 48:  # the 8B section: 2 x 12 GiB checkpoints, a 4 GiB cache
                root = Path(tempfile.mkdtemp(prefix="gpu_stage_two-", dir="/dev/shm"))
            if time.perf_counter() - started + section["estimate_s"] > args.budget_s:
                print(f"SKIPPED {name}: its estimate ({section['estimate_s']} s) exceeds the budget left", flush=True)
                continue
            try:
                results[name] = run_shape(name, section, root, args.device)
            except Exception as error:  # noqa: BLE001 - reported, and the exit status says so
                failures.append(f"{name}: {type(error).__name__}: {error}")
            finally:
                if root != workdir:
                    shutil.rmtree(root, ignore_errors=True)
        if time.perf_counter() - started + 40 > args.budget_s:
            print("SKIPPED kill-and-resume: the budget is spent", flush=True)
        else:
            try:
                results["kill_and_resume"] = kill_and_resume(workdir, args.device, sections["small"])
            except Exception as error:  # noqa: BLE001
                failures.append(f"kill-and-resume: {type(error).__name__}: {error}")
    results["seconds"] = time.perf_counter() - started
    print(f"stage two on {results['device']}{' (quick shapes)' if args.quick else ''}, "
          f"{results['seconds']:.0f} s")
    print(table(results))
    print("\n".join(profile_lines(results)))
    lines = goal_lines(results, args.device)
    for line in lines + [f"FAIL {failure}" for failure in failures]:
        print(line)
    results["goals"] = lines
    results["failures"] = failures
    if args.json:
        print(json.dumps(results))
    resume = results.get("kill_and_resume")
    return 1 if failures or (resume is not None and not resume["equal"]) else 0


def _shm_room_gib() -> float:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return 0.0
    return stats.f_bavail * stats.f_frsize / 2**30


if __name__ == "__main__":
    sys.exit(main())
