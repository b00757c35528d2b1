"""Training-step benchmark: throughput, data time, and step time while a checkpoint is written.

Runs `dflash.train.fit.fit` itself (not a copy of its step) on a synthetic cache, then reads
the run's metrics.jsonl and events.jsonl:

- tokens/s: block tokens per second at the median step time (the first step, which pays
  for allocation and warm-up, is left out of the medians);
- data time: time spent asking the plan and reading the step's rows from the memory-mapped
  shards, as a fraction of step time (total, and the worst single step);
- checkpoints: the step that takes the host snapshot, and the steps that run while the
  background thread writes, against the median of the nearest other steps; the same ratio
  for every step is printed beside it, as the noise floor of the machine.

CPU section: the SmolLM2-135M shape (H 576, V 49152, 5 target features, 9/3 heads of 64,
FFN 1536), a 2-layer drafter, block 16. GPU section (when CUDA is available): a
Qwen3-8B-shaped drafter (5 layers, H 4096, V 151936, 32/8 heads of 128, FFN 12288, block
16, 5 features) in bf16, with model-FLOPs utilisation against --peak-tflops.

Demo section (`--sections demo`): the demo's fit (demo/run.py's defaults: a 1-layer drafter,
block 3, 32 anchors a sequence, 510 block tokens a step, lr 1e-3, a 4,096-token draft
vocabulary, float32 on CPU) on a synthetic basis-fp8 cache at SmolLM2-135M's widths (48
sequences of 256 tokens, Zipf-distributed ids as in text), once per
drafter in `--drafters` and `--repeats` times over, interleaved so that a shared machine's
drift hits every drafter alike: each drafter's CPU seconds a step (this process's CPU time
for the run less that of a 2-step run of the same settings, over the steps between: the
per-core cost, which other work on a shared machine inflates far less than wall time; the
median over repeats), its median wall-clock step (full steps only: an epoch's last step is
partial), the DSpark/DFlash ratios, and every step's loss (the JSON line carries them, to
compare two versions of the code textually).

    python bench/train_step.py [--steps 24] [--json] [--sections cpu,gpu,demo]
        [--drafters dflash,dspark --repeats 3]
        [--smollm2-cache CACHE --smollm2-steps 300]   # a real run: does the loss fall?
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from dflash.train import drafters as kinds
from dflash.train.config import FitConfig
from dflash.train.data import eligible_anchors
from dflash.train.fit import fit
from dflash.train.model import DrafterConfig, model_flops_per_token
from dflash.train.synthetic import write_synthetic_training_cache

SHAPES = {
    "cpu": dict(vocab_size=49152, hidden_size=576, num_layers=30, layer_ids=(1, 8, 14, 20, 27),
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                top_k=32),
    "gpu": dict(vocab_size=151936, hidden_size=4096, num_layers=36, layer_ids=(1, 9, 17, 25, 33),
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                top_k=32),
}


def write_bench_cache(path: Path, shape: dict, *, num_sequences: int, length: int, feature_codec: str = "bf16",
                      distinct: int = 2, seed: int = 0) -> None:
    """A finalized cache of `num_sequences` rows of `length` tokens at `shape`'s widths, plus
    its target/ folder, built from `distinct` random rows written again and again: the
    benchmarks time bytes, not contents, and shards/synthetic draws top-k ids token by token
    (minutes per row at V 151,936). Loss mask: a third of prompt, then the reply."""
    from dflash.shards import CacheSpec, codecs
    from dflash.shards.layout import TARGET_DIR
    from dflash.shards.writer import CacheWriter, finalize_cache
    from dflash.train.synthetic import write_synthetic_target

    V, k = shape["vocab_size"], shape["top_k"]
    spec = CacheSpec(vocab_size=V, hidden_size=shape["hidden_size"], layer_ids=list(shape["layer_ids"]), top_k=k,
                     feature_codec=feature_codec, max_length=length,
                     target={"name": "synthetic", "model_type": "qwen3", "num_layers": shape["num_layers"],
                             "config_sha256": "synthetic", "dtype": "bfloat16"})
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(distinct):
        features = rng.standard_normal((length, len(shape["layer_ids"]), shape["hidden_size"]), dtype=np.float32)
        logits = -np.sort(rng.exponential(2.0, size=(length, k)), axis=1)  # [T, k] descending
        rows.append(dict(
            input_ids=rng.integers(0, V, size=length), loss_mask=np.arange(length) >= length // 3,
            features=codecs.f32_to_bf16(features) if feature_codec == "bf16" else features,
            topk_ids=((rng.integers(0, V, size=(length, 1)) + 7919 * np.arange(k)) % V).astype(np.int32),  # distinct
            topk_logprobs=(logits - np.logaddexp.reduce(logits, axis=1, keepdims=True) - 0.1).astype(np.float32)))
    writer = CacheWriter(path, spec)
    for index in range(num_sequences):
        writer.add(**rows[index % distinct], source={"file": "synthetic.jsonl", "index": index})
    writer.close()
    finalize_cache(path, spec, 1)
    write_synthetic_target(path / TARGET_DIR, vocab_size=V, hidden_size=shape["hidden_size"],
                           num_layers=shape["num_layers"], layer_ids=list(shape["layer_ids"]),
                           num_attention_heads=shape["num_attention_heads"],
                           num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
                           intermediate_size=shape["intermediate_size"], seed=seed, distinct_rows=4096)


def read_rate(workdir: Path, feature_codec: str, num_sequences: int = 16, length: int = 2048,
              anchors_per_seq: int = 512, tokens_per_step: int = 16384) -> dict:
    """The host's read rate at Qwen3-8B's widths, as fit reads (read_batch into two reused
    staging buffers, crc32 checked at a row's first read): two sequences of 2,048 tokens a
    step, the page cache warm (the cache was just written). Epoch 0 is read once unchecked to
    size the two staging buffers (they grow by a quarter when a step needs more, which a long
    run does only in its first steps: a fresh buffer costs its first-touch page faults), then
    again through a freshly opened cache, every row read for the first time (checked), then
    epoch 1 (not re-checked). GB are the step's context features in bf16 (5 x 4096 x 2 bytes a
    token; fp8 caches store half), per second of this process's CPU time (one core's cost; the
    machine may be shared) and of wall time. The rows' crc32 is ISA-L's (`isal`) or, where
    that is missing, zlib's: `crc32` says which."""
    from dflash.shards import open_cache
    from dflash.shards.rows import CRC32_IMPL
    from dflash.train.data import Corpus, DataPlan, Staging, read_batch

    cache_dir = workdir / f"cache-read-{feature_codec}"
    t0 = time.perf_counter()
    write_bench_cache(cache_dir, SHAPES["gpu"], num_sequences=num_sequences, length=length,
                      feature_codec=feature_codec)
    cache_s = time.perf_counter() - t0
    warm = Corpus([open_cache(cache_dir, check_rows=False)])
    plan = DataPlan(num_eligible=warm.num_eligible, held_out=np.zeros(len(warm), dtype=bool), block_size=16,
                    anchors_per_seq=anchors_per_seq, tokens_per_step=tokens_per_step, seed=0, world_size=1)
    slots = [Staging(), Staging()]
    for step in range(plan.steps_per_epoch):  # sizes the staging buffers; not timed
        read_batch(warm, plan.segments(0, step, 0), stream=0, plan_anchors=anchors_per_seq, seed=0, block_size=16,
                   gamma=7.0, mask_token_id=0, staging=slots[step % 2])
    corpus = Corpus([open_cache(cache_dir, check_rows=True, check_once=True)])
    bytes_per_row = 2 * len(SHAPES["gpu"]["layer_ids"]) * SHAPES["gpu"]["hidden_size"]
    result = {"feature_codec": feature_codec, "crc32": CRC32_IMPL, "cache_write_s": cache_s,
              "steps_per_epoch": plan.steps_per_epoch}
    for epoch, name in ((0, "first_read"), (1, "reread")):
        cpu, wall, gb = [], [], []
        for step in range(plan.steps_per_epoch):
            c0, w0 = time.process_time(), time.perf_counter()
            batch = read_batch(corpus, plan.segments(epoch, step, 0), stream=epoch, plan_anchors=anchors_per_seq,
                               seed=0, block_size=16, gamma=7.0, mask_token_id=0, staging=slots[step % 2])
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
            gb.append(sum(run.codes.shape[0] for run in batch.features) * bytes_per_row / 1e9)
        result[name] = {"gb_per_step": statistics.mean(gb), "median_cpu_s": statistics.median(cpu), "cpu_s": cpu,
                        "gb_per_cpu_s": sum(gb) / sum(cpu), "gb_per_s_wall": sum(gb) / sum(wall)}
    shutil.rmtree(cache_dir)
    return result


def run(section: str, workdir: Path, steps: int, num_sequences: int, length: int, drafter_layers: int,
        anchors_per_seq: int, tokens_per_step: int, checkpoint_every: int) -> dict:
    shape = SHAPES[section]
    cache = workdir / f"cache-{section}"
    t0 = time.perf_counter()
    if section == "gpu":  # V 151,936: shards/synthetic's per-token top-k draw would take minutes
        write_bench_cache(cache, shape, num_sequences=num_sequences, length=length)
    else:
        write_synthetic_training_cache(cache, lengths=[length] * num_sequences, seed=0, **shape)
    cache_s = time.perf_counter() - t0
    config = FitConfig.from_dict(dict(
        cache=[str(cache)], out=str(workdir / f"run-{section}"), num_layers=drafter_layers, num_drafts=15,
        anchors_per_seq=anchors_per_seq, tokens_per_step=tokens_per_step, max_steps=steps,
        checkpoint_every=checkpoint_every, keep_checkpoints=1, eval_every=0, eval_fraction=0.0,
        device="cuda" if section == "gpu" else "cpu", wandb=False, log_every=10**9, spike_warmup_steps=10**9))
    fit(config)
    metrics = [json.loads(line) for line in (Path(config.out) / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (Path(config.out) / "events.jsonl").read_text().splitlines()]
    result = analyse(metrics, events)
    result.update(section=section, cache_write_s=cache_s, steps=steps, drafter_layers=drafter_layers,
                  tokens_per_step=tokens_per_step, sequence_length=length, anchors_per_seq=anchors_per_seq,
                  **{k: v for k, v in shape.items() if k != "layer_ids"})
    if section == "gpu":
        result.update(mfu(config, cache, result["median_step_s"], metrics))
    return result


DEMO_BLOCK_ROWS = 3  # the demo's drafter rows per block, whichever the kind (demo/run.py)
DEMO_FIT = dict(num_layers=1, anchors_per_seq=32, tokens_per_step=510, lr=1e-3, draft_vocab=4096,
                dtype="float32", device="cpu")
DEMO_MARKOV_RANK = 64


def run_demo(workdir: Path, steps: int, drafters: list[str], repeats: int) -> dict:
    """The demo's fit per drafter, `repeats` times interleaved (module docstring)."""
    cache = workdir / "cache-demo"
    if not cache.exists():
        write_synthetic_training_cache(cache, lengths=[256] * 48, seed=0, feature_codec="basis-fp8",
                                       feature_rank=SHAPES["cpu"]["hidden_size"], zipf=True, **SHAPES["cpu"])
    short_steps = 2
    assert steps > short_steps, "the demo section needs more than 2 steps"
    runs: dict[str, list[dict]] = {d: [] for d in drafters}
    cpu_per_step: dict[str, list[float]] = {d: [] for d in drafters}
    # A first, unmeasured pass (both runs) per drafter pays the process's one-off costs (imports, first allocations).
    for repeat in [-1] + list(range(repeats)):
        for drafter in drafters:
            cpu_s = {}
            for max_steps in (short_steps, steps):
                out = workdir / f"run-demo-{drafter}-{repeat}-{max_steps}"
                shutil.rmtree(out, ignore_errors=True)
                config = FitConfig.from_dict(dict(
                    DEMO_FIT, cache=[str(cache)], out=str(out), drafter=drafter, max_steps=max_steps,
                    num_drafts=kinds.get(drafter).num_drafts(DEMO_BLOCK_ROWS),
                    **({"markov_rank": DEMO_MARKOV_RANK} if drafter == "dspark" else {}),
                    checkpoint_every=10**9, keep_checkpoints=1, eval_every=0, eval_fraction=0.1, wandb=False,
                    log_every=10**9, spike_warmup_steps=20))
                c0 = time.process_time()
                fit(config)
                cpu_s[max_steps] = time.process_time() - c0
            if repeat < 0:
                continue
            cpu_per_step[drafter].append((cpu_s[steps] - cpu_s[short_steps]) / (steps - short_steps))
            runs[drafter].append([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    result = {"steps": steps, "repeats": repeats, "threads": torch.get_num_threads(), "drafters": {}}
    for drafter, metrics in runs.items():
        medians = [statistics.median(m["step_time_s"] for m in run[1:] if m["tokens"] == DEMO_FIT["tokens_per_step"])
                   for run in metrics]
        result["drafters"][drafter] = {
            "cpu_s_per_step": statistics.median(cpu_per_step[drafter]), "run_cpu_s_per_step": cpu_per_step[drafter],
            "median_step_s": statistics.median(medians), "run_median_step_s": medians,
            "tokens_per_s": DEMO_FIT["tokens_per_step"] / statistics.median(medians),
            # Every repeat runs the same seed: its losses are the first run's, or the code is not deterministic.
            "losses": [m["loss"] for m in metrics[0]], "grad_norms": [m["grad_norm"] for m in metrics[0]],
            "repeats_agree": all([m["loss"] for m in run] == [m["loss"] for m in metrics[0]] for run in metrics),
        }
    if {"dflash", "dspark"} <= set(drafters):
        d = result["drafters"]
        result["dspark_over_dflash_cpu"] = d["dspark"]["cpu_s_per_step"] / d["dflash"]["cpu_s_per_step"]
        result["dspark_over_dflash_wall"] = d["dspark"]["median_step_s"] / d["dflash"]["median_step_s"]
    return result


def demo_table(demo: dict) -> str:
    lines = ["| drafter | CPU s a step | runs' CPU s a step | median wall step | runs' medians | loss first -> last "
             "| repeats agree |", "|---|---|---|---|---|---|---|"]
    for drafter, r in demo["drafters"].items():
        lines.append(f"| {drafter} | {r['cpu_s_per_step']:.3f} | "
                     + ", ".join(f"{c:.3f}" for c in r["run_cpu_s_per_step"])
                     + f" | {r['median_step_s']:.3f} s | " + ", ".join(f"{m:.3f}" for m in r["run_median_step_s"])
                     + f" | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | {r['repeats_agree']} |")
    if "dspark_over_dflash_cpu" in demo:
        lines.append(f"\nDSpark step / DFlash step: {demo['dspark_over_dflash_cpu']:.2f}x CPU, "
                     f"{demo['dspark_over_dflash_wall']:.2f}x wall "
                     f"({demo['steps']} steps, {demo['repeats']} interleaved repeats, {demo['threads']} threads)")
    return "\n".join(lines)


def analyse(metrics: list[dict], events: list[dict]) -> dict:
    step_s = {m["step"]: m["step_time_s"] for m in metrics}
    data_s = {m["step"]: m["data_time_s"] for m in metrics}
    wait_s = {m["step"]: m["gpu_data_wait_s"] for m in metrics}
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    snapshot_steps = {e["step"] for e in checkpoints}
    during_write: set[int] = set()
    for event in checkpoints:  # the write starts as step s ends and runs for write_s
        elapsed, s = 0.0, event["step"] + 1
        while s in step_s and elapsed < event["write_s"]:
            during_write.add(s)
            elapsed += step_s[s]
            s += 1
    steady = [s for s in step_s if s > 1]
    quiet_steps = [s for s in steady if s not in during_write and s not in snapshot_steps]
    median = statistics.median(step_s[s] for s in quiet_steps)

    def local_ratio(s: int) -> float:
        """Step time over the median of the 6 nearest quiet steps: on a shared machine the
        load drifts (2-5x over minutes), so a run-wide median would measure the drift."""
        near = sorted(quiet_steps, key=lambda q: abs(q - s))[:6]
        return step_s[s] / statistics.median(step_s[q] for q in near)

    tokens = metrics[-1]["tokens"]
    return {
        "median_step_s": median,
        "first_step_s": step_s[1],
        "tokens_per_s": tokens / median,
        "data_fraction": sum(data_s[s] for s in steady) / sum(step_s[s] for s in steady),
        "max_step_data_fraction": max(data_s[s] / step_s[s] for s in steady),
        "median_data_s": statistics.median(data_s[s] for s in steady),
        # The device's idle time for data (CUDA events; None on a CPU), against the step.
        "gpu_data_wait_fraction": None if wait_s[steady[0]] is None
        else sum(wait_s[s] for s in steady) / sum(step_s[s] for s in steady),
        "max_step_gpu_data_wait_fraction": None if wait_s[steady[0]] is None
        else max(wait_s[s] / step_s[s] for s in steady),
        # The training thread's time blocked by a checkpoint (waiting for the previous write,
        # queueing the snapshot's copy), in median steps.
        "checkpoint_block_steps": max(((e["wait_s"] + e["snapshot_s"]) / median for e in checkpoints), default=None),
        "snapshot_to": sorted({e["snapshot_to"] for e in checkpoints}),
        "checkpoints": len(checkpoints),
        "checkpoint_write_s": max((e["write_s"] for e in checkpoints), default=0.0),
        "checkpoint_snapshot_s": max((e["snapshot_s"] for e in checkpoints), default=0.0),
        "checkpoint_bytes": max((e["bytes"] for e in checkpoints), default=0),
        "steps_during_write": len(during_write),
        "max_snapshot_step_ratio": max((local_ratio(s) for s in snapshot_steps if s > 1), default=None),
        "max_during_write_ratio": max((local_ratio(s) for s in during_write), default=None),
        "max_step_ratio_anywhere": max(local_ratio(s) for s in steady),
        "first_loss": metrics[0]["loss"],
        "last_loss": metrics[-1]["loss"],
    }


def mfu(config: FitConfig, cache: Path, step_s: float, metrics: list[dict]) -> dict:
    """Model FLOPs per step / (step time x peak): drafter layers on block tokens, attention over
    the mean visible context, the frozen LM head inside the loss (forward + dX), fc and the
    per-layer context keys/values (forward + dW)."""
    from dflash.shards import open_cache

    c = open_cache(cache)
    B = config.block_rows
    drafter = DrafterConfig.from_target(c.target_dir, num_hidden_layers=config.model.num_layers,
                                        num_drafts=config.model.num_drafts)
    anchors = np.concatenate([eligible_anchors(c.raw(i).loss_mask) for i in range(len(c))])
    mean_anchor = float(anchors.mean())  # visible context per query
    tokens = metrics[-1]["tokens"]
    rows = tokens * (B - 1) / B
    h, v, L = drafter.hidden_size, drafter.vocab_size, drafter.num_target_features
    per_step = tokens * model_flops_per_token(drafter, mean_anchor, B)
    per_step += 4.0 * rows * h * v
    context_rows = tokens / B * mean_anchor  # upper bound: one context per block
    context_rows = min(context_rows, metrics[-1]["tokens"] / config.data.anchors_per_seq / B
                       * float(np.mean(c.lengths)))  # each sequence's context is read once per step
    kv = 2 * drafter.num_key_value_heads * drafter.head_dim
    per_step += context_rows * (4.0 * L * h * h + drafter.num_hidden_layers * 4.0 * h * kv)
    return {"model_tflops_per_step": per_step / 1e12, "mfu": per_step / step_s / (PEAK_TFLOPS * 1e12)}


PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16


def run_smollm2(cache: Path, workdir: Path, steps: int, tokens_per_step: int) -> dict:
    """A short real run on a SmolLM2-135M cache: does the loss fall? First/last metrics lines."""
    config = FitConfig.from_dict(dict(
        cache=[str(cache)], out=str(workdir / "run-smollm2"), num_layers=2, num_drafts=15, anchors_per_seq=32,
        tokens_per_step=tokens_per_step, max_steps=steps, epochs=1000, checkpoint_every=steps,
        keep_checkpoints=1, eval_every=max(1, steps // 4), eval_fraction=0.05, device="cpu", wandb=False,
        log_every=25))
    fit(config)
    run_dir = Path(config.out)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    evals = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
             if json.loads(line)["event"] == "eval"]
    tenth = max(1, len(metrics) // 10)
    return {
        "steps": len(metrics),
        "mean_loss_first_tenth": statistics.mean(m["loss"] for m in metrics[:tenth]),
        "mean_loss_last_tenth": statistics.mean(m["loss"] for m in metrics[-tenth:]),
        "held_out": [{"step": e["step"], "loss": e["loss"], "tau": e["tau"]} for e in evals],
        "first_line": lines[0],
        "last_line": lines[-1],
    }


def table(results: list[dict]) -> str:
    rows = [
        ("shape", lambda r: f"H {r['hidden_size']} V {r['vocab_size']} L {r['drafter_layers']} layers"),
        ("tokens/step", lambda r: f"{r['tokens_per_step']}"),
        ("median step", lambda r: f"{r['median_step_s']:.3f} s (first {r['first_step_s']:.2f} s)"),
        ("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}"),
        ("host read time / step time", lambda r: f"{100 * r['data_fraction']:.2f}% (worst step "
                                                 f"{100 * r['max_step_data_fraction']:.2f}%)"),
        ("GPU data wait / step time", lambda r: "- (CPU)" if r["gpu_data_wait_fraction"] is None else
         f"{100 * r['gpu_data_wait_fraction']:.2f}% (worst step {100 * r['max_step_gpu_data_wait_fraction']:.2f}%)"),
        ("checkpoint block / median step", lambda r: f"{_ratio(r['checkpoint_block_steps'])} "
                                                     f"(snapshot to {', '.join(r['snapshot_to'])})"),
        ("checkpoint", lambda r: f"{r['checkpoints']} x {r['checkpoint_bytes'] / 2**20:.0f} MiB, write "
                                 f"{r['checkpoint_write_s']:.2f} s, snapshot {r['checkpoint_snapshot_s']:.3f} s"),
        ("snapshot step / local median", lambda r: _ratio(r["max_snapshot_step_ratio"])),
        ("steps during write / local median", lambda r: f"{_ratio(r['max_during_write_ratio'])} (max of "
                                                        f"{r['steps_during_write']} steps)"),
        ("any step / local median (noise)", lambda r: _ratio(r["max_step_ratio_anywhere"])),
        ("loss first -> last", lambda r: f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}"),
        ("MFU", lambda r: f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"),
    ]
    header = "| metric | " + " | ".join(r["section"] for r in results) + " |"
    lines = [header, "|---" * (len(results) + 1) + "|"]
    for name, fmt in rows:
        lines.append(f"| {name} | " + " | ".join(fmt(r) for r in results) + " |")
    return "\n".join(lines)


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--sections", default="cpu,gpu",
                        help="sections to run: cpu, gpu (skipped without CUDA), read (the host's read rate "
                             "at Qwen3-8B's widths), demo (the demo's fit per drafter), or none")
    parser.add_argument("--drafters", default="dflash,dspark",
                        help="demo section: the fit --drafter values to time, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="demo section: interleaved runs per drafter")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the caches and runs here")
    parser.add_argument("--smollm2-cache", type=Path, default=None,
                        help="also train on this real SmolLM2-135M cache (from dflash-precompute)")
    parser.add_argument("--smollm2-steps", type=int, default=300)
    parser.add_argument("--smollm2-tokens-per-step", type=int, default=256)
    args = parser.parse_args()
    globals()["PEAK_TFLOPS"] = args.peak_tflops
    results, reads, demo = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        sections = args.sections.split(",")
        if "cpu" in sections:
            results.append(run("cpu", workdir, args.steps, num_sequences=24, length=512, drafter_layers=2,
                               anchors_per_seq=32, tokens_per_step=1024, checkpoint_every=6))
        if "demo" in sections:
            demo = run_demo(workdir, args.steps, args.drafters.split(","), args.repeats)
        if "read" in sections:
            reads = [read_rate(workdir, codec) for codec in ("bf16", "fp8")]
        if "gpu" in sections and torch.cuda.is_available():
            results.append(run("gpu", workdir, args.steps, num_sequences=16, length=2048, drafter_layers=5,
                               anchors_per_seq=512, tokens_per_step=16384, checkpoint_every=8))
        smollm2 = run_smollm2(args.smollm2_cache, workdir, args.smollm2_steps,
                                                   args.smollm2_tokens_per_step) if args.smollm2_cache else None
    if results:
        print(table(results))
    for r in reads:
        print(f"host read at Qwen3-8B's widths, {r['feature_codec']} cache, crc32 {r['crc32']}, "
              f"{r['first_read']['gb_per_step']:.3f} GB of bf16 features a step: "
              + "; ".join(f"{name.replace('_', ' ')} {r[name]['gb_per_cpu_s']:.2f} GB/CPU-s "
                          f"({1e3 * r[name]['median_cpu_s']:.0f} ms CPU a step), "
                          f"{r[name]['gb_per_s_wall']:.2f} GB/s wall" for name in ("first_read", "reread")))
    if smollm2:
        print(f"SmolLM2 run, {smollm2['steps']} steps: mean loss first tenth "
              f"{smollm2['mean_loss_first_tenth']:.3f} -> last tenth {smollm2['mean_loss_last_tenth']:.3f}")
        for e in smollm2["held_out"]:
            print(f"  held-out step {e['step']}: loss {e['loss']:.3f} tau {e['tau']:.2f}")
        print("  first metrics line:", smollm2["first_line"])
        print("  last metrics line: ", smollm2["last_line"])
    if demo:
        print(demo_table(demo))
    if args.json:
        print(json.dumps({"results": results, "reads": reads, "smollm2": smollm2, "demo": demo}))


if __name__ == "__main__":
    main()
