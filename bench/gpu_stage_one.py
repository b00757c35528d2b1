"""Stage one on one GPU at the issue-41 shape: is the cache written as fast as the target runs?

Builds a random-weight Llama of 1.6 B parameters (28 layers, hidden 2048, 16/8 heads of 128,
FFN 6144, vocabulary 49,152) in bf16 on the device, saves it with a byte-level BPE tokenizer
built in code, writes synthetic `text` records sized to the time budget, and runs
`dflash-precompute`'s own code path (`run_precompute`: fp8 features encoded on the device,
the writer thread behind the forward) over them. Prints forward_s, the main pass's wall
time, tokens/s, the forward's TFLOP/s ((2 x parameters x tokens + causal attention
2 x T^2 x hidden x layers per sequence) / forward_s) and the split (device encode, host work
by part, the main loop's wait on the writer), then the goals as PASS/FAIL lines:

    wall of the main pass <= 1.3 x forward_s
    forward >= 35% of 790 TFLOP/s (a plain bf16 matmul on an H200)

Correctness checks, which alone set a non-zero exit: the device fp8 and bf16 encoders give
the numpy codecs' bytes on this device (adversarial values), and `dflash-shards verify`
passes on the cache (every shard's checksum, xxh3-128 by default, and every row's crc32).

Sizing (H200, at most about 90 s in all at the default `--budget-s 40`): model build and save
about 15 s, load about 10 s, verify about 10 s; the records hold about `--budget-s` x 5,000
tokens (200,000 by default; 5,000 tokens/s is the whole run's rate before issue 41, so even
the old path would fit the budget; at the goal the pass takes a few seconds).

    python -m bench.gpu_stage_one [--budget-s 40] [--json]
    python -m bench.gpu_stage_one --device cpu --quick      # a tiny shape: proves the script runs
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

from bench.stage_one import build_random_llama, synthetic_records

H200_BF16_TFLOPS = 790.0
GOAL_WALL_OVER_FORWARD = 1.3
GOAL_FORWARD_FRACTION = 0.35
TOKENS_PER_BUDGET_S = 5000
FULL = dict(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=6144,
            vocab_size=49_152)
QUICK = dict(hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512)


def encoder_parity(device: torch.device) -> list[str]:
    """The device encoders against the numpy codecs on adversarial values: failures."""
    from dflash.precompute.device_codecs import encode_features
    from dflash.shards import codecs

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 5, 256)).astype(np.float32)
    x[0, 0, 3] = 3.0e37  # an outlier: the rest of its vector goes subnormal or to zero
    x[1] *= np.float32(1e-39)  # float32 subnormals
    x[2, :, ::2] = np.float32(1.0 + 2.0**-8)  # bf16 ties
    x[3] = 0.0
    x[4, :, 0] = 448.0  # scale exactly 1: e4m3 ties below
    x[4, :, 1:4] = [1.0625, 2.0**-10, 3 * 2.0**-10]
    failures = []
    fp8 = encode_features(torch.from_numpy(x).to(device), "fp8")
    codes, scales = codecs.f32_to_fp8(x)
    if not (np.array_equal(fp8["features"].cpu().numpy(), codes)
            and np.array_equal(fp8["feature_scales"].cpu().numpy(), scales)):
        failures.append("fp8 device encoder differs from the numpy codec")
    bf16 = encode_features(torch.from_numpy(x).to(device), "bf16")["features"].cpu().numpy().view(np.uint16)
    if not np.array_equal(bf16, codecs.f32_to_bf16(x)):
        failures.append("bf16 device encoder differs from the numpy codec")
    return failures


def attention_flops(lengths: list[int], hidden_size: int, num_layers: int) -> float:
    """Causal attention's matmul FLOPs of a forward: QK^T and AV, half of T x T each."""
    return sum(2.0 * t * t * hidden_size * num_layers for t in lengths)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu with --quick")
    parser.add_argument("--quick", action="store_true", help="a tiny shape and a few records (CPU smoke)")
    parser.add_argument("--budget-s", type=float, default=40.0,
                        help="seconds of precompute the records are sized for (x 5,000 tokens)")
    parser.add_argument("--batch-tokens", type=int, default=32768, help="dflash-precompute --batch-tokens")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the target and cache go (default: temp)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    from transformers.utils import logging as transformers_logging

    from dflash.precompute.config import PrecomputeConfig
    from dflash.precompute.run import run_precompute
    from dflash.shards import open_cache, verify_cache

    transformers_logging.disable_progress_bar()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_stage_one: FAIL: CUDA is not available (use --device cpu --quick)", file=sys.stderr)
        return 2
    shape = QUICK if args.quick else FULL
    num_tokens = 4000 if args.quick else int(args.budget_s * TOKENS_PER_BUDGET_S)
    work = Path(tempfile.mkdtemp(prefix="gpu_stage_one-", dir=args.work_dir))
    failures = encoder_parity(device)
    try:
        began = time.perf_counter()
        params = build_random_llama(work / "target", **shape, dtype=torch.bfloat16 if device.type == "cuda"
                                    else torch.float32, device=args.device)
        build_s = time.perf_counter() - began
        # This tokenizer makes about 2.5 tokens a word: records of 100-600 words, cut at 1024 tokens.
        num_records = max(4, num_tokens // 800)
        data = synthetic_records(work / "records.jsonl", num_records=num_records, words_per_record=(100, 600))
        config = PrecomputeConfig(target=work / "target", data=[data], out=work / "cache", top_k=32,
                                  feature_codec="fp8", max_length=1024, batch_tokens=args.batch_tokens,
                                  device=args.device, progress=False)
        summary = run_precompute(config)
        report = verify_cache(work / "cache")
        if not report["ok"]:
            failures.append(f"dflash-shards verify failed: {report}")
        cache = open_cache(work / "cache")
        lengths = list(cache.manifest["sequences"]["length"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = summary.written_tokens
    flops = 2.0 * params * tokens + attention_flops(lengths, shape["hidden_size"], shape["num_layers"])
    tflops = flops / summary.forward_s / 1e12 if summary.forward_s > 0 else 0.0
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": shape, "parameters": params, "quick": args.quick, "build_s": build_s,
        "records": num_records, "tokens": tokens, "forward_s": summary.forward_s, "pass_s": summary.pass_s,
        "wall_s": summary.wall_s, "tokens_per_s": tokens / summary.pass_s if summary.pass_s else 0.0,
        "forward_tflops": tflops, "encode_s": summary.encode_s, "host_s": summary.host_s,
        "host_parts_s": summary.host_parts_s, "writer_wait_s": summary.writer_wait_s,
        "wall_over_forward": summary.pass_s / summary.forward_s if summary.forward_s else 0.0,
        "forward_fraction_of_h200": tflops / H200_BF16_TFLOPS, "failures": failures,
    }
    print(f"gpu_stage_one: {result['device']}, random Llama {params / 1e9:.3f} B parameters "
          f"({shape['num_layers']} layers, hidden {shape['hidden_size']}), fp8, {tokens:,} tokens in "
          f"{num_records:,} records")
    print(f"  forward_s {summary.forward_s:.1f}  pass wall_s {summary.pass_s:.1f}  run wall_s {summary.wall_s:.1f}  "
          f"tokens/s {result['tokens_per_s']:,.0f}  forward TFLOP/s {tflops:.1f}")
    parts = ", ".join(f"{k} {v:.2f}" for k, v in summary.host_parts_s.items())
    print(f"  split: device encode {summary.encode_s:.2f} s, host {summary.host_s:.2f} s ({parts}), "
          f"main loop waiting on the writer {summary.writer_wait_s:.2f} s")
    fraction, ratio = result["forward_fraction_of_h200"], result["wall_over_forward"]
    goals = [(f"wall of the main pass <= {GOAL_WALL_OVER_FORWARD} x forward ({ratio:.2f} x)",
              ratio <= GOAL_WALL_OVER_FORWARD),
             (f"forward >= {GOAL_FORWARD_FRACTION:.0%} of {H200_BF16_TFLOPS:.0f} TFLOP/s ({fraction:.1%})",
              fraction >= GOAL_FORWARD_FRACTION)]
    for name, ok in goals:
        print(f"  {'PASS' if ok else 'FAIL'} goal: {name}")
    for failure in failures:
        print(f"  FAIL correctness: {failure}")
    if not failures:
        print("  ok correctness: device encoders bit-equal to the numpy codecs; dflash-shards verify passes")
    if args.json:
        print(json.dumps(result))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
