"""What a draft vocabulary (`fit --draft-vocab N`) leaves out, per N, on a cache's held-out split.

    python -m bench.draft_vocab --cache CACHE [--sizes 1024,2048,4096,8192,16384] [--eval-fraction 0.1]
                                [--seed 0] [--json]

The vocabulary is chosen as `fit` chooses it (train/draft_vocab.py: the N most frequent
tokens at the training sequences' loss-masked positions), on the split `fit` makes with the
same --eval-fraction and --seed; the figures are on the held-out sequences, which the choice
never saw:

- top-1 covered: the share of held-out reply positions p whose target greedy token (the
  cached top-1 at p - 1, what a drafted token must equal to be accepted) is in the vocabulary. A
  drafter with this vocabulary can never draft the rest: the ceiling on its acceptance.
- top-k mass: the mean teacher probability of the cached top-k that lies in the vocabulary
  (the rest joins the loss's tail bucket).
- head: N / V, the drafter head's share of the whole head's flops in training and drafting.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def measure(cache_path: str, sizes: list[int], *, eval_fraction: float, seed: int) -> dict:
    from dflash.shards import open_cache
    from dflash.train import draft_vocab
    from dflash.train.acceptance import target_top1
    from dflash.train.data import Corpus, held_out_mask

    cache = open_cache(cache_path)
    corpus = Corpus([cache])
    held_out = held_out_mask(len(corpus), eval_fraction, seed)
    counts = draft_vocab.count_tokens(corpus, np.flatnonzero(~held_out), seed=seed)
    top1, topk_ids, topk_p = [], [], []
    for i in np.flatnonzero(held_out):
        seq = cache[int(i)]
        positions = np.flatnonzero(np.asarray(seq.loss_mask, dtype=bool))
        rows = positions[positions > 0] - 1  # the cached distribution at p - 1 is the target's for token p
        top1.append(target_top1(seq.topk_ids, seq.topk_logprobs)[rows])
        topk_ids.append(seq.topk_ids[rows])
        topk_p.append(np.exp(seq.topk_logprobs[rows]))
    top1, topk_ids, topk_p = np.concatenate(top1), np.concatenate(topk_ids), np.concatenate(topk_p)
    vocab_size = int(cache.spec.vocab_size)
    rows = []
    for size in sizes:
        inside = np.zeros(vocab_size, dtype=bool)
        inside[draft_vocab.choose(counts, size)] = True
        rows.append({"size": size, "top1_covered": float(inside[top1].mean()),
                     "topk_mass_covered": float((topk_p * inside[topk_ids]).sum(1).mean()),
                     "topk_mass": float(topk_p.sum(1).mean()), "head_share": size / vocab_size})
    return {"cache": str(cache_path), "vocab_size": vocab_size, "train_tokens_counted": int(counts.sum()),
            "distinct_train_tokens": int((counts > 0).sum()), "held_out_positions": int(top1.shape[0]),
            "eval_fraction": eval_fraction, "seed": seed, "rows": rows}


def format_table(result: dict) -> list[str]:
    lines = [f"draft vocabulary on {result['cache']}: V {result['vocab_size']:,}, "
             f"{result['train_tokens_counted']:,} training tokens counted ({result['distinct_train_tokens']:,} "
             f"distinct), {result['held_out_positions']:,} held-out labelled positions",
             f"{'N':>8} {'top-1 covered':>14} {'top-k mass in vocab':>20} {'head N/V':>9}"]
    for row in result["rows"]:
        lines.append(f"{row['size']:>8,} {row['top1_covered']:>14.4f} "
                     f"{row['topk_mass_covered']:>10.4f} of {row['topk_mass']:.4f} {row['head_share']:>9.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", required=True)
    parser.add_argument("--sizes", default="1024,2048,4096,8192,16384")
    parser.add_argument("--eval-fraction", type=float, default=0.1, help="as fit's (the demo's 0.1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.cache, [int(s) for s in args.sizes.split(",")], eval_fraction=args.eval_fraction,
                     seed=args.seed)
    print("\n".join(format_table(result)))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
