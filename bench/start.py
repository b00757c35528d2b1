"""Why the untrained drafter's loss is what it is: step 0 under each start `fit` offers.

Builds the drafter `fit` builds at step 0 for a cache (the same config, seed and initial
weights, then `--norm-init` / `--out-init` as asked), drafts the blocks of the first
sequences at every eligible anchor, and reports over their predicted positions (block
positions 1..B-1):
- the loss `fit` logs at its first step (kl+ce: top-k KL with a tail bucket + 0.5 x CE to
  the target's top-1, weighted mean per label) and ln V, the loss of a uniform guess;
- the logits: the mean of the largest, of the mask token's own and of all; how often the
  mask token (or the block's anchor token) is the drafter's argmax;
- the hidden state the head reads: its norm, and its cosine with the mask token's embedding.

    python -m bench.start --cache .demo/cache [--sequences 32] [--seed 0] [--json]

No training: a few seconds. The figures say where an untrained drafter's first loss comes
from; bench/recipe.py measures what each start does to training (loss@1, the plateau, tau).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch

STARTS = {
    "normal (today)": {},
    "norm flat": {"norm_init": "flat"},
    "out zero": {"out_init": "zero"},
    "flat start (both)": {"norm_init": "flat", "out_init": "zero"},
    "norm from target": {"norm_init": "target"},
}


def measure(cache_dir: Path, *, sequences: int, seed: int, num_drafts: int, ce_weight: float = 0.5) -> list[dict]:
    from dflash.kernels.loss import sparse_kl_loss
    from dflash.shards import open_cache
    from dflash.train import drafters
    from dflash.train.config import ModelConfig
    from dflash.train.data import Corpus, Segment, decay_gamma, read_batch
    from dflash.train.fit import initial_weights
    from dflash.train.model import BlockLayout, DFlashDrafter, DrafterConfig, TargetHead

    cache = open_cache(cache_dir)
    target_dir = cache.target_dir
    config = DrafterConfig.from_target(target_dir, num_hidden_layers=1, num_drafts=num_drafts)
    block_rows = drafters.get(drafters.DEFAULT).block_rows(num_drafts)  # fit's default kind: the anchor and its drafts
    if cache.spec.is_basis:
        import dataclasses

        config = dataclasses.replace(config, feature_width=cache.spec.feature_width,
                                     feature_basis_sha256=cache.feature_basis_sha256)
    head = TargetHead.load(target_dir)
    with tempfile.TemporaryDirectory() as index_dir:
        corpus = Corpus([cache], index_dir=Path(index_dir))
        counts = corpus.num_eligible[:sequences]
        segments = [Segment(i, 0, int(n)) for i, n in enumerate(counts) if n > 0]
        batch = read_batch(corpus, segments, stream=0, plan_anchors=int(counts.max()), seed=seed,
                           block_size=block_rows, gamma=decay_gamma(num_drafts + 1), mask_token_id=config.mask_token_id)
    layout = BlockLayout.build(batch.segments, block_rows)
    top1 = batch.topk_ids.gather(1, batch.topk_logprobs.argmax(1, keepdim=True))[:, 0]
    anchor_ids = batch.block_ids[batch.label_rows - batch.label_positions]
    mask_row = head.embed_tokens[config.mask_token_id].float()
    rows = []
    for label, start in STARTS.items():
        if start.get("norm_init") == "target" and head.final_norm is None:
            continue
        torch.manual_seed(seed)  # fit seeds the initial weights with the data seed
        model = DFlashDrafter(config)
        initial_weights(model, ModelConfig(**start), head, target_dir)  # what fit applies
        with torch.no_grad():
            hidden = model(head.embed(batch.block_ids).float(), batch.context_features.float(), layout)
            out = hidden[batch.label_rows].float()  # [N, H]
            loss = sparse_kl_loss(out, head.lm_head.float(), batch.topk_ids, batch.topk_logprobs, batch.weights,
                                  tail="bucket", reduction="sum", ce_targets=top1, ce_weight=ce_weight)
            logits = out @ head.lm_head.float().T  # [N, V]
            ce = torch.nn.functional.cross_entropy(logits, top1)
            argmax = logits.argmax(1)
        rows.append({
            "start": label, "loss": float(loss / batch.weights.sum()), "ce_top1": float(ce),
            "uniform": math.log(config.vocab_size),
            "max_logit": float(logits.max(1).values.mean()),
            "mask_logit": float(logits[:, config.mask_token_id].mean()),
            "mean_logit": float(logits.mean()),
            "argmax_is_mask": float((argmax == config.mask_token_id).double().mean()),
            "argmax_is_anchor": float((argmax == anchor_ids).double().mean()),
            "hidden_norm": float(out.norm(dim=1).mean()),
            "cos_mask_embedding": float(torch.nn.functional.cosine_similarity(out, mask_row[None], dim=1).mean()),
        })
    return [{"labels": int(batch.label_rows.shape[0]), "mask_token_id": config.mask_token_id,
             "mask_embedding_norm": float(mask_row.norm()), "hidden_size": config.hidden_size,
             "vocab_size": config.vocab_size}, *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="a cache folder (the demo's: .demo/cache)")
    parser.add_argument("--sequences", type=int, default=32, help="the first N sequences' blocks are drafted")
    parser.add_argument("--seed", type=int, default=0, help="fit's --seed (the initial weights)")
    parser.add_argument("--num-drafts", type=int, default=3, help="fit's --num-drafts: drafts per verify (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    info, *rows = measure(args.cache, sequences=args.sequences, seed=args.seed,
                          num_drafts=args.num_drafts)
    print(f"step 0 of a 1-layer drafter, {args.num_drafts} drafts per verify, seed {args.seed}, "
          f"{datetime.date.today()}, "
          f"{platform.machine()}: {info['labels']} predicted positions of {args.sequences} sequences; mask token "
          f"{info['mask_token_id']} (embedding norm {info['mask_embedding_norm']:.2f}), H {info['hidden_size']}, "
          f"ln V {math.log(info['vocab_size']):.2f}")
    print(f"{'start':<20} {'loss':>7} {'CE top1':>8} {'max logit':>9} {'mask logit':>10} {'mean logit':>10} "
          f"{'argmax=mask':>11} {'argmax=anchor':>13} {'|h|':>6} {'cos(h,mask)':>11}")
    for r in rows:
        print(f"{r['start']:<20} {r['loss']:>7.2f} {r['ce_top1']:>8.2f} {r['max_logit']:>9.2f} "
              f"{r['mask_logit']:>10.2f} {r['mean_logit']:>10.2f} {r['argmax_is_mask']:>11.1%} "
              f"{r['argmax_is_anchor']:>13.1%} "
              f"{r['hidden_norm']:>6.2f} {r['cos_mask_embedding']:>11.3f}")
    if args.json:
        print(json.dumps({"info": info, "rows": rows, "date": datetime.date.today().isoformat(),
                          "seed": args.seed, "num_drafts": args.num_drafts,
                          "verify_size": args.num_drafts + 1}, default=lambda x: np.asarray(x).tolist()))


if __name__ == "__main__":
    main()
