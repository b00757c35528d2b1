"""Where speculative decoding's time goes, against plain greedy decoding, per verify size.

Loads a target and a trained drafter (by default the demo's: `.demo/`, after `make demo`),
decodes the first held-out prompts greedily with `generate` and speculatively at each
verify size (the anchor and its drafts: num_drafts + 1), and splits the speculative time
into drafting (the drafter's forward and its LM-head rows) and verification (the target's
forward over the block, which also yields the next context features). Every speculative
output is checked token for token against the greedy one. A verify size other than the one
the drafter was trained with is allowed (a shorter verify drafts fewer positions); tau drops
accordingly.

    python bench/spec_profile.py                           # the demo's target, run and prompts
    python bench/spec_profile.py --verify-sizes 2,4,8 --limit 10 --json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


class TimedProposer:
    """A proposer that adds its propose() wall time to `seconds`."""

    def __init__(self, inner):
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def reset(self):
        self.inner.reset()

    def commit(self, features):
        self.inner.commit(features)

    def propose(self, anchor_token, verify_size):
        t0 = time.perf_counter()
        out = self.inner.propose(anchor_token, verify_size)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def timed_forward(model: torch.nn.Module, record: list[tuple[int, float]]) -> None:
    """Record (query tokens, seconds) of every forward of `model`; the signature stays visible
    (functools.wraps), so the decoding loop still finds the model's cache argument."""
    forward = model.forward

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        record.append((int(ids.shape[1]) if ids is not None else -1, time.perf_counter() - t0))
        return out

    model.forward = wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    demo = Path(os.environ.get("DFLASH_DEMO_DIR", REPO / ".demo"))
    parser.add_argument("--target", type=Path, default=demo / "smollm2-135m-instruct")
    parser.add_argument("--run", type=Path, default=demo / "run", help="a dflash-train fit run folder")
    parser.add_argument("--prompts", type=Path, default=demo / "chitchat.jsonl")
    parser.add_argument("--verify-sizes", "--block-sizes", dest="verify_sizes", default="2,4,8",
                        help="comma-separated verify sizes (the anchor and its drafts) to decode with; "
                             "--block-sizes is its former name")
    parser.add_argument("--limit", type=int, default=8, help="held-out prompts decoded")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from dflash.common.records import iter_records
    from dflash.train.data import held_out_mask
    from dflash.train.loading import load_drafter
    from dflash.train.online import ChatRenderer, drafter_proposer, load_prompts, load_target
    from dflash.train.speculative import greedy_generate, speculative_generate

    for path, what in ((args.target, "--target"), (args.run, "--run"), (args.prompts, "--prompts")):
        if not path.exists():
            raise SystemExit(f"{what} {path} does not exist: run `make demo` first, or pass {what}")
    loaded = load_drafter(args.run)
    fit = loaded.fit_config or {}
    if loaded.drafter.config.feature_width is not None:  # trained on basis coefficients: decode raw features
        from dflash.train.basis import basis_of_caches, fold_basis

        loaded.drafter = fold_basis(loaded.drafter, basis_of_caches(fit.get("cache") or [],
                                                                    loaded.drafter.config.feature_basis_sha256))
    drafter = loaded.drafter.float().eval()
    target, tokenizer, stop = load_target(args.target, drafter, device=torch.device("cpu"), dtype=torch.float32)
    num_records = sum(1 for _ in iter_records([args.prompts], flag="--prompts"))  # stage one's indices
    held = held_out_mask(num_records, fit.get("eval_fraction", 0.1), fit.get("seed", 0))
    prompts, _ = load_prompts(args.prompts, ChatRenderer(tokenizer), keep=set(np.flatnonzero(held).tolist()),
                              limit=args.limit)
    prompts = prompts[: args.limit]
    layer_ids = drafter.config.target_layer_ids
    forwards: list[tuple[int, float]] = []
    timed_forward(target, forwards)

    def greedy_all():
        return [greedy_generate(target, p.token_ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stop)
                for p in prompts]

    greedy_all()  # warm-up (first-call allocations, lazy imports)
    forwards.clear()
    t0 = time.perf_counter()
    reference = greedy_all()
    greedy_s = time.perf_counter() - t0
    greedy_tokens = sum(len(r.tokens) for r in reference)
    one_token = [s for n, s in forwards if n == 1]
    rows = []
    for verify_size in [int(b) for b in args.verify_sizes.split(",")]:
        proposer = TimedProposer(drafter_proposer(drafter, target))
        outputs, verify_s, spec_s = [], 0.0, 0.0
        for p in prompts:
            forwards.clear()
            t0 = time.perf_counter()
            outputs.append(speculative_generate(target, proposer, p.token_ids, max_new_tokens=args.max_new_tokens,
                                                verify_size=verify_size, layer_ids=layer_ids, stop_token_ids=stop))
            spec_s += time.perf_counter() - t0
            verify_s += sum(s for _, s in forwards[1:])  # forwards[0] is the prompt's prefill
        num_verifies = sum(len(o.acceptance_lengths) for o in outputs)
        tokens = sum(len(o.tokens) for o in outputs)
        rows.append({
            "num_drafts": verify_size - 1,
            "verify_size": verify_size,
            "tau": float(np.mean([a for o in outputs for a in o.acceptance_lengths])),
            "verifications": num_verifies,
            "ms_per_verify": 1e3 * verify_s / max(1, num_verifies),
            "ms_per_draft": 1e3 * proposer.seconds / max(1, proposer.calls),
            "spec_tokens_per_s": tokens / spec_s,
            "speedup": (tokens / spec_s) / (greedy_tokens / greedy_s),
            "lossless": all(o.tokens == r.tokens for o, r in zip(outputs, reference)),
        })
    report = {
        "bench": "spec_profile",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "target": str(args.target), "run": str(args.run), "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "greedy_tokens_per_s": greedy_tokens / greedy_s,
        "ms_per_target_token": 1e3 * float(np.median(one_token)) if one_token else None,
        "rows": rows,
    }
    print(f"spec_profile, {report['date']}, {report['machine']}; {len(prompts)} held-out prompts, "
          f"up to {args.max_new_tokens} new tokens")
    print(f"plain greedy: {report['greedy_tokens_per_s']:.1f} tok/s, {report['ms_per_target_token']:.1f} ms "
          "per target token (median decode step)")
    print(f"{'verify':>6} {'tau':>6} {'verifies':>8} {'ms/verify':>9} {'ms/draft':>8} {'ms/token':>8} "
          f"{'tok/s':>6} {'speed-up':>8} {'lossless':>8}")
    for r in rows:
        per_token = (r["ms_per_verify"] + r["ms_per_draft"]) / r["tau"]
        print(f"{r['verify_size']:>6} {r['tau']:>6.3f} {r['verifications']:>8} {r['ms_per_verify']:>9.1f} "
              f"{r['ms_per_draft']:>8.1f} {per_token:>8.1f} {r['spec_tokens_per_s']:>6.1f} {r['speedup']:>7.2f}x "
              f"{'yes' if r['lossless'] else 'NO':>8}")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
