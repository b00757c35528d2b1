"""Stage one's target forward at several forward budgets (`--forward-batch-tokens`), on
SmolLM2-135M-Instruct on CPU.

Runs `run_precompute` (forward only: the conversations' own replies, bf16 features, so no
basis fit and no generation) over the first exchange of chitchat conversations once per
budget, and reports the forward's wall time (`PrecomputeSummary.forward_s`: the target
forward with layer capture and chunked top-k), the whole command's, tokens per second of
forward, and how far each cache's rows are from the first budget's (features' largest
relative difference, top-k ids that differ): the budget changes the batches' shapes, not
the values beyond matmul rounding. Every budget runs in the same process with the model
loaded afresh, one after the other; on a shared machine run it with nothing beside it.

    python -m bench.precompute_batch [--num-conversations 400] [--budgets 16384,4096,2048,1024]
        [--dtype float32] [--threads 2] [--json]
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
from dflash.precompute.run import run_precompute
from dflash.shards import open_cache
from dflash.testing.prepare import prepare_chitchat, prepare_smollm2


def rows_by_source(cache_dir: Path) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{record index: (features [T, L, H] fp32, top-k ids [T, k])}."""
    cache = open_cache(cache_dir)
    return {cache.source(i)["index"]: (cache[i].features.astype(np.float32), cache[i].topk_ids)
            for i in range(len(cache))}


def difference(reference: dict, other: dict) -> tuple[float, float]:
    """(largest |a - b| / max|a| over rows, share of top-k ids that differ)."""
    worst, differ, total = 0.0, 0, 0
    for index, (features, ids) in reference.items():
        other_features, other_ids = other[index]
        worst = max(worst, float(np.abs(features - other_features).max() / max(np.abs(features).max(), 1e-30)))
        differ += int((ids != other_ids).sum())
        total += ids.size
    return worst, differ / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-conversations", type=int, default=400)
    parser.add_argument("--budgets", default="16384,4096,2048,1024",
                        help="comma-separated --forward-batch-tokens values (the first is the reference)")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="the planned batches' budget")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--cache-dir", type=Path, default=Path(".demo"), help="where prepared inputs live")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    if not budgets or min(budgets) < 1:
        parser.error(f"--budgets must list positive token counts, got {args.budgets!r}")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    target = prepare_smollm2(args.cache_dir)
    data = prepare_chitchat(args.cache_dir / "bench" / f"chitchat-{args.num_conversations}-turns-2.jsonl",
                            args.num_conversations, 2)
    work = Path(tempfile.mkdtemp(prefix="precompute_batch-"))
    rows, reference = [], None
    try:
        for budget in budgets:
            out = work / f"cache-{budget}"
            config = PrecomputeConfig(target=target, data=[data], out=out, max_length=args.max_length,
                                      batch_tokens=max(args.batch_tokens, budget), forward_batch_tokens=budget,
                                      feature_codec="bf16", device="cpu", dtype=args.dtype, progress=False)
            began = time.perf_counter()
            summary = run_precompute(config)
            wall = time.perf_counter() - began
            found = rows_by_source(out)
            if reference is None:
                reference, (worst, ids_differ) = found, (0.0, 0.0)
            else:
                worst, ids_differ = difference(reference, found)
            rows.append({"forward_batch_tokens": budget, "forward_s": summary.forward_s, "wall_s": wall,
                         "num_tokens": summary.num_tokens,
                         "forward_tokens_per_s": summary.num_tokens / summary.forward_s,
                         "features_max_rel_diff": worst, "topk_ids_differ": ids_differ})
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"precompute_batch: SmolLM2-135M-Instruct on CPU ({torch.get_num_threads()} thread(s), {args.dtype}), "
          f"{rows[0]['num_tokens']:,} tokens of {args.num_conversations} chitchat conversations, batch_tokens "
          f"{args.batch_tokens}, bf16 features; differences against --forward-batch-tokens {budgets[0]}")
    print(f"{'--forward-batch-tokens':>22} {'forward s':>10} {'command s':>10} {'fwd tok/s':>10} "
          f"{'features rel diff':>18} {'top-k ids differ':>17}")
    for row in rows:
        print(f"{row['forward_batch_tokens']:>22,} {row['forward_s']:>10.1f} {row['wall_s']:>10.1f} "
              f"{row['forward_tokens_per_s']:>10,.0f} {row['features_max_rel_diff']:>18.2e} "
              f"{row['topk_ids_differ']:>17.2%}")
    if args.json:
        print(json.dumps({"target": "SmolLM2-135M-Instruct", "device": "cpu", "dtype": args.dtype,
                          "threads": torch.get_num_threads(), "num_conversations": args.num_conversations,
                          "batch_tokens": args.batch_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
