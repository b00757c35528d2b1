"""What stage one costs beyond the target forward, on SmolLM2-135M-Instruct on CPU.

Runs `run_precompute` over chitchat conversations (the whole command as a user sees it:
model load, input scan, forward with layer capture and chunked top-k, encoding, shard
writes, CACHE/target, manifest), then a bare `model(input_ids, attention_mask).logits` over
exactly the same batches (same plan, same padding) with the model already loaded, and
reports the overhead fraction (precompute - bare) / bare, also without the model load
(which any forward needs). Both are timed in process CPU time as well as wall time: on a
CPU shared with other jobs the wall clock measures the neighbours as much as the code, while
CPU time on one thread (the default here) does not depend on them. Repeats alternate the
two and keep the fastest of each. Also: tokens/s, stored bytes per token by column, and
the mean KL that the packed top-k codec costs on these real distributions (the exact fp32
top-k from the bare pass against its encoded-decoded form; the codec's budget is 1e-3 nat).
The target and records are the demo's, prepared by `dflash.testing.prepare`.

    python -m bench.precompute_overhead [--num-sequences 64] [--threads 1] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

from dflash.precompute.config import PrecomputeConfig
from dflash.precompute.plan import plan_batches
from dflash.precompute.run import run_precompute
from dflash.shards import open_cache, topk_codec_kl
from dflash.testing.prepare import prepare_chitchat, prepare_smollm2


class Clock:
    """Wall and process CPU seconds of a block."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def bare_forward(model, sequences: list[np.ndarray], batch_tokens: int, top_k: int):
    """Time model(...).logits over the batches run_precompute plans for these sequences
    (record order); untimed, collect the exact top-k for the codec KL. Returns
    (wall_s, cpu_s, mean_kl)."""
    lengths = [len(s) for s in sequences]
    wall, cpu, kl_sum, positions = 0.0, 0.0, 0.0, 0
    for batch in plan_batches(lengths, batch_tokens):
        width = max(lengths[i] for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        attention = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        for b, i in enumerate(batch):
            ids[b, : lengths[i]] = torch.from_numpy(sequences[i].astype(np.int64))
            attention[b, : lengths[i]] = 1
        with torch.inference_mode():
            with Clock() as clock:
                logits = model(input_ids=ids, attention_mask=attention).logits  # [B, T, V]
            wall, cpu = wall + clock.wall, cpu + clock.cpu
            valid = logits[attention.bool()].float()  # [N, V]
            values, indices = torch.topk(torch.log_softmax(valid, dim=-1), top_k, dim=-1)  # [N, k]
        kl = topk_codec_kl(indices.numpy(), values.numpy(), vocab_size=logits.shape[-1], codec="packed")
        kl_sum += kl * len(valid)
        positions += len(valid)
    return wall, cpu, kl_sum / positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-sequences", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=None, help="keep the first turns of each conversation")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=Path(".demo"), help="where prepared inputs live")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()

    target = prepare_smollm2(args.cache_dir)
    turns = "all" if args.max_turns is None else args.max_turns
    data = prepare_chitchat(args.cache_dir / "bench" / f"chitchat-{args.num_sequences}-turns-{turns}.jsonl",
                            args.num_sequences, args.max_turns)
    work = Path(tempfile.mkdtemp(prefix="precompute_overhead-"))
    config = PrecomputeConfig(target=target, data=[data], out=work / "cache", top_k=args.top_k,
                              max_length=args.max_length, batch_tokens=args.batch_tokens,
                              forward_batch_tokens=args.batch_tokens,
                              device="cpu", dtype="float32", overwrite=True, progress=False)
    runs: dict[str, list[float]] = {name: [] for name in (
        "precompute_wall_s", "precompute_cpu_s", "precompute_forward_wall_s", "bare_wall_s", "bare_cpu_s",
        "load_wall_s", "load_cpu_s")}
    try:
        for _ in range(args.repeats):
            with Clock() as clock:
                summary = run_precompute(config)
            runs["precompute_wall_s"].append(clock.wall)
            runs["precompute_cpu_s"].append(clock.cpu)
            runs["precompute_forward_wall_s"].append(summary.forward_s)
            cache = open_cache(config.out)
            order = sorted(range(len(cache)), key=lambda i: cache.source(i)["index"])  # record order
            sequences = [cache[i].input_ids for i in order]
            manifest = cache.manifest
            with Clock() as clock:
                model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
            runs["load_wall_s"].append(clock.wall)
            runs["load_cpu_s"].append(clock.cpu)
            wall, cpu, kl_mean = bare_forward(model, sequences, args.batch_tokens, args.top_k)
            runs["bare_wall_s"].append(wall)
            runs["bare_cpu_s"].append(cpu)
            del model
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = {name: min(values) for name, values in runs.items()}
    tokens = summary.num_tokens
    bytes_per_token = {name: size / tokens for name, size in sorted(manifest["column_bytes"].items())}
    bytes_per_token["total (shard files)"] = sum(s["num_bytes"] for s in manifest["shards"]) / tokens
    result = {
        "target": "SmolLM2-135M-Instruct", "device": "cpu", "dtype": "float32", "threads": args.threads,
        "num_sequences": summary.num_sequences, "num_tokens": tokens, "max_length": args.max_length,
        "batch_tokens": args.batch_tokens, "top_k": args.top_k, "repeats": args.repeats, **best,
        "overhead_fraction_cpu": (best["precompute_cpu_s"] - best["bare_cpu_s"]) / best["bare_cpu_s"],
        "overhead_fraction_cpu_excluding_load":
            (best["precompute_cpu_s"] - best["load_cpu_s"] - best["bare_cpu_s"]) / best["bare_cpu_s"],
        "overhead_fraction_wall": (best["precompute_wall_s"] - best["bare_wall_s"]) / best["bare_wall_s"],
        "tokens_per_s": tokens / best["precompute_wall_s"], "bare_tokens_per_s": tokens / best["bare_wall_s"],
        "bytes_per_token": bytes_per_token, "topk_codec_mean_kl_nat": kl_mean, "runs": runs,
    }
    print(f"precompute_overhead: {result['target']} on CPU ({args.threads} thread(s), float32), "
          f"{summary.num_sequences} chitchat conversations, {tokens:,} tokens, max_length {args.max_length}, "
          f"batch_tokens {args.batch_tokens}, top-k {args.top_k}, best of {args.repeats}")
    rows = [
        ("", "CPU s", "wall s"),
        ("precompute, whole command", f"{best['precompute_cpu_s']:.1f}", f"{best['precompute_wall_s']:.1f}"),
        ("  its forward with capture and chunked top-k", "", f"{best['precompute_forward_wall_s']:.1f}"),
        ("bare target forward, same batches", f"{best['bare_cpu_s']:.1f}", f"{best['bare_wall_s']:.1f}"),
        ("model load (any forward needs it)", f"{best['load_cpu_s']:.1f}", f"{best['load_wall_s']:.1f}"),
        ("overhead (precompute - bare) / bare", f"{100 * result['overhead_fraction_cpu']:.1f}%",
         f"{100 * result['overhead_fraction_wall']:.1f}%"),
        ("  without the model load", f"{100 * result['overhead_fraction_cpu_excluding_load']:.1f}%", ""),
        ("tokens/s: precompute, bare forward", "",
         f"{result['tokens_per_s']:.1f}, {result['bare_tokens_per_s']:.1f}"),
        ("top-k codec mean KL (packed)", f"{kl_mean:.2e} nat", ""),
    ] + [(f"bytes/token {name}", f"{value:,.1f}", "") for name, value in bytes_per_token.items()]
    width = max(len(row[0]) for row in rows)
    for name, cpu, wall in rows:
        print(f"  {name:<{width}}  {cpu:>14}  {wall:>14}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
