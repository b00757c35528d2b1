"""What stage one costs beyond the target forward, on SmolLM2-135M-Instruct on CPU.

Runs `run_precompute` over chitchat conversations (wall time of the whole command as a
user sees it: model load, input scan, forward with layer capture and chunked top-k,
encoding, shard writes, CACHE/target, manifest), then a bare `model(input_ids,
attention_mask).logits` over exactly the same batches (same plan, same padding) with the
model already loaded, and reports the overhead fraction (wall - bare) / bare, also without
the model load (which any forward needs). Repeats alternate the two and keep the fastest of
each, since the CPU is shared. Also: tokens/s, stored bytes per token by column, and the
mean KL that the packed top-k codec costs on these real distributions (the exact fp32 top-k
from the bare pass against its encoded-decoded form; the codec's budget is 1e-3 nat).

    python bench/precompute_overhead.py [--num-sequences 64] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # demo/ (not an installed package)

from demo.prepare import prepare_chitchat, prepare_smollm2  # noqa: E402

from dflash.precompute.plan import plan_batches  # noqa: E402
from dflash.precompute.run import PrecomputeConfig, run_precompute  # noqa: E402
from dflash.shards import open_cache, topk_codec_kl  # noqa: E402


def bare_forward(model, sequences: list[np.ndarray], batch_tokens: int, top_k: int):
    """Time model(...).logits over the batches run_precompute plans for these sequences
    (record order); untimed, collect the exact top-k for the codec KL. Returns
    (seconds, kl_sum, num_positions)."""
    lengths = [len(s) for s in sequences]
    seconds, kl_sum, positions = 0.0, 0.0, 0
    for batch in plan_batches(lengths, batch_tokens):
        width = max(lengths[i] for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        attention = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        for b, i in enumerate(batch):
            ids[b, : lengths[i]] = torch.from_numpy(sequences[i].astype(np.int64))
            attention[b, : lengths[i]] = 1
        with torch.inference_mode():
            began = time.perf_counter()
            logits = model(input_ids=ids, attention_mask=attention).logits  # [B, T, V]
            seconds += time.perf_counter() - began
            valid = logits[attention.bool()].float()  # [N, V]
            values, indices = torch.topk(torch.log_softmax(valid, dim=-1), top_k, dim=-1)  # [N, k]
        kl = topk_codec_kl(indices.numpy(), values.numpy(), vocab_size=logits.shape[-1], codec="packed")
        kl_sum += kl * len(valid)
        positions += len(valid)
    return seconds, kl_sum, positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-sequences", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=None, help="keep the first turns of each conversation")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=Path(".demo"), help="where prepared inputs live")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()

    target = prepare_smollm2(args.cache_dir)
    turns = "all" if args.max_turns is None else args.max_turns
    data = prepare_chitchat(args.cache_dir / "bench" / f"chitchat-{args.num_sequences}-turns-{turns}.jsonl",
                            args.num_sequences, args.max_turns)
    work = Path(tempfile.mkdtemp(prefix="precompute_overhead-"))
    config = PrecomputeConfig(target=target, data=[data], out=work / "cache", top_k=args.top_k,
                              batch_tokens=args.batch_tokens, device="cpu", dtype="float32",
                              overwrite=True, progress=False)
    from transformers import AutoModelForCausalLM

    walls, bares, forwards, loads = [], [], [], []
    kl_mean = None
    try:
        for _ in range(args.repeats):
            began = time.perf_counter()
            summary = run_precompute(config)
            walls.append(time.perf_counter() - began)
            forwards.append(summary.forward_s)
            cache = open_cache(config.out)
            order = sorted(range(len(cache)), key=lambda i: cache.source(i)["index"])  # record order
            sequences = [cache[i].input_ids for i in order]
            began = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
            loads.append(time.perf_counter() - began)
            seconds, kl_sum, positions = bare_forward(model, sequences, args.batch_tokens, args.top_k)
            bares.append(seconds)
            kl_mean = kl_sum / positions
            del model
    finally:
        manifest = json.loads((config.out / "manifest.json").read_text()) if (config.out / "manifest.json").exists() else None
        shutil.rmtree(work, ignore_errors=True)
    wall, bare, load = min(walls), min(bares), min(loads)
    tokens = summary.num_tokens
    bytes_per_token = {name: size / tokens for name, size in sorted(manifest["column_bytes"].items())}
    bytes_per_token["total (shard files)"] = sum(s["num_bytes"] for s in manifest["shards"]) / tokens
    result = {
        "target": "SmolLM2-135M-Instruct", "device": "cpu", "dtype": "float32",
        "threads": torch.get_num_threads(), "num_sequences": summary.num_sequences, "num_tokens": tokens,
        "batch_tokens": args.batch_tokens, "top_k": args.top_k, "repeats": args.repeats,
        "precompute_wall_s": wall, "bare_forward_s": bare, "model_load_s": load,
        "precompute_forward_s": min(forwards),
        "overhead_fraction": (wall - bare) / bare,
        "overhead_fraction_excluding_load": (wall - load - bare) / bare,
        "tokens_per_s": tokens / wall, "bare_tokens_per_s": tokens / bare,
        "bytes_per_token": bytes_per_token, "topk_codec_mean_kl_nat": kl_mean,
        "all_walls_s": walls, "all_bares_s": bares,
    }
    print(f"precompute_overhead: {result['target']} on CPU ({result['threads']} threads, float32), "
          f"{summary.num_sequences} chitchat conversations, {tokens:,} tokens, batch_tokens "
          f"{args.batch_tokens}, top-k {args.top_k}, best of {args.repeats}")
    rows = [
        ("precompute wall (load, scan, forward + capture + top-k, encode, write, manifest)", f"{wall:.1f} s"),
        ("  of which the forward with capture and chunked top-k", f"{result['precompute_forward_s']:.1f} s"),
        ("bare target forward, same batches", f"{bare:.1f} s"),
        ("model load (any forward needs it)", f"{load:.1f} s"),
        ("overhead (wall - bare) / bare", f"{100 * result['overhead_fraction']:.1f}%"),
        ("overhead without the model load", f"{100 * result['overhead_fraction_excluding_load']:.1f}%"),
        ("precompute tokens/s", f"{result['tokens_per_s']:.1f}"),
        ("bare forward tokens/s", f"{result['bare_tokens_per_s']:.1f}"),
        ("top-k codec mean KL (packed)", f"{kl_mean:.2e} nat"),
    ] + [(f"bytes/token {name}", f"{value:,.1f}") for name, value in bytes_per_token.items()]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
