"""Stage one's two engines on the same target and records: `--engine transformers` against
`--engine vllm`, tokens per second and where the time goes.

Builds a random Llama (head size 64, which vLLM's CPU attention takes) and synthetic text
records, runs `run_precompute` once per engine (fp8 features, top-32) and reports per engine:
the wall time, the load (target, engine start, reading the inputs: wall minus the main
pass), the forward (for vLLM: prefill, capture, the worker's top-k and fp8 encoding, and
reading the worker's files), the host side (the cache writer), tokens per second of the
main pass and of the whole run, the bytes a token that left the forward, and how far the
two caches' features and log-probs are apart. Runs in the engine venv (vLLM installed).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-engine/bin/python -m bench.stage_one_engines [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.stage_one import build_random_llama, synthetic_records

ENGINES = ("transformers", "vllm")


def run_engines(args: argparse.Namespace) -> dict:
    from dflash.precompute.config import PrecomputeConfig
    from dflash.precompute.run import run_precompute
    from dflash.precompute.vllm_engine import vllm_version

    work = Path(tempfile.mkdtemp(prefix="stage_one_engines-", dir=args.work_dir))
    try:
        params = build_random_llama(work / "target", hidden_size=args.hidden_size, num_layers=args.num_layers,
                                    num_heads=args.hidden_size // 64, num_kv_heads=max(1, args.hidden_size // 128),
                                    intermediate_size=2 * args.hidden_size, vocab_size=8192, dtype=torch.float32)
        data = synthetic_records(work / "records.jsonl", num_records=args.num_records, words_per_record=(60, 240))
        runs = {}
        for engine in ENGINES:
            config = PrecomputeConfig(target=work / "target", data=[data], out=work / f"cache-{engine}",
                                      num_feature_layers=3, top_k=32, feature_codec="fp8", max_length=1024,
                                      batch_tokens=args.batch_tokens, device=args.device, dtype=args.dtype,
                                      engine=engine, progress=False)
            summary = run_precompute(config)
            runs[engine] = {
                "wall_s": summary.wall_s, "load_s": summary.wall_s - summary.pass_s, "pass_s": summary.pass_s,
                "forward_s": summary.forward_s, "host_s": summary.host_s, "tokens": summary.written_tokens,
                "tokens_per_s": summary.tokens_per_s,
                "pass_tokens_per_s": summary.written_tokens / summary.pass_s,
                "cache_bytes_per_token": summary.bytes_per_token["total"],
            }
        runs["vllm"]["worker_bytes_per_token"] = worker_bytes_per_token(work / "cache-vllm")
        runs["transformers"]["worker_bytes_per_token"] = forward_bytes_per_token(work / "cache-transformers")
        agreement = compare(work / "cache-transformers", work / "cache-vllm")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"target": f"random Llama, {params / 1e6:.0f} M parameters, {args.num_layers} layers x "
                      f"{args.hidden_size}, 3 feature layers in fp8, top-32 of 8192, {args.dtype} on {args.device}",
            "vllm": vllm_version(), "device": args.device, "dtype": args.dtype,
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "runs": runs, **agreement}


def worker_bytes_per_token(cache: Path) -> float:
    """Bytes a token that leave vLLM's worker with the fp8 codec: codes, scales, top-k ids and
    log-probs (the npz headers aside)."""
    from dflash.shards import open_cache

    spec = open_cache(cache).spec
    layers = len(spec.layer_ids)
    return layers * spec.hidden_size + 4 * layers + 8 * spec.top_k


def forward_bytes_per_token(cache: Path) -> float:
    """Bytes a token the transformers engine hands its writer on a CPU: float32 features (it
    encodes on the host there) and the top-k."""
    from dflash.shards import open_cache

    spec = open_cache(cache).spec
    return 4 * len(spec.layer_ids) * spec.hidden_size + 8 * spec.top_k


def compare(reference: Path, candidate: Path) -> dict:
    """The largest feature error (over the reference's max) and log-prob difference between the caches."""
    from dflash.shards import open_cache

    a, b = open_cache(reference), open_cache(candidate)
    feature_err = logprob_err = 0.0
    same_ids = len(a) == len(b)
    for i in range(min(len(a), len(b))):
        x, y = a[i], b[i]
        same_ids &= np.array_equal(x.input_ids, y.input_ids)
        feature_err = max(feature_err, float(np.abs(x.features - y.features).max() / np.abs(x.features).max()))
        logprob_err = max(logprob_err, float(np.abs(np.exp(x.topk_logprobs) - np.exp(y.topk_logprobs)).max()))
    return {"same_token_ids": bool(same_ids), "feature_err": feature_err, "prob_err": logprob_err}


def print_table(result: dict) -> None:
    print(f"stage_one_engines: {result['target']}; vLLM {result['vllm']}, {result['cpus']} CPUs")
    print(f"  {'engine':<13}{'tokens':>8}{'wall s':>8}{'load s':>8}{'forward s':>10}{'host s':>8}"
          f"{'tok/s pass':>11}{'tok/s run':>10}{'B/tok out':>10}{'B/tok cache':>12}")
    for name, r in result["runs"].items():
        print(f"  {name:<13}{r['tokens']:>8,}{r['wall_s']:>8.1f}{r['load_s']:>8.1f}{r['forward_s']:>10.1f}"
              f"{r['host_s']:>8.2f}{r['pass_tokens_per_s']:>11.1f}{r['tokens_per_s']:>10.1f}"
              f"{r['worker_bytes_per_token']:>10,.0f}{r['cache_bytes_per_token']:>12,.1f}")
    print(f"  same token ids: {result['same_token_ids']}; features within {result['feature_err']:.2e} of the max, "
          f"top-k probabilities within {result['prob_err']:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=1024, help="the random Llama's width (heads of 64)")
    parser.add_argument("--num-layers", type=int, default=8, help="its decoder layers")
    parser.add_argument("--num-records", type=int, default=48, help="synthetic text records")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="tokens per planned batch")
    parser.add_argument("--device", default="cpu", help="the transformers engine's device (vLLM uses its platform's)")
    parser.add_argument("--dtype", default="float32", help="the target's dtype in both engines")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the caches go (default: temp)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    result = run_engines(args)
    print_table(result)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
