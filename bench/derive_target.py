"""A target derived from the embedded default's, with its own cache: what `--init-from` is for.

Users adapt released drafters to a fine-tuned target. This makes that case on CPU:
1. fine-tune SmolLM2-135M-Instruct (the demo's target) briefly on chitchat conversations the
   demo never caches (their human replies, every token in the loss; AdamW, float32);
2. write prompts from another slice of chitchat (the first exchange of each);
3. build the derived target's cache with `dflash-precompute --regenerate` (its own greedy
   replies, bf16 features) and transcode it to `basis-fp8` (the demo's codec).

    python -m bench.derive_target --target .demo/smollm2-135m-instruct --work /tmp/derived [--json]

Then `python -m bench.warm_start --cache WORK/cache-bf16 --basis-cache WORK/cache-basis
--init-from .demo/run --target WORK/target --prompts WORK/prompts.jsonl ...` compares
scratch, warm start and warm start onto the basis cache. Every step is skipped when its
output exists, so a rerun continues.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

DEMO_CONVERSATIONS = 256  # the demo caches chitchat's first 256; the slices below come after them


def fine_tune(target: Path, out: Path, *, records: list[dict], steps: int, batch: int, lr: float,
              max_length: int, seed: int) -> dict:
    """`target` fine-tuned on `records` (chat-templated, every token in the loss), saved to `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    model.train()
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in records]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    losses, started = [], time.perf_counter()
    for step in range(steps):
        chunk = rng.sample(texts, batch)
        enc = tokenizer(chunk, return_tensors="pt", padding=True, truncation=True, max_length=max_length)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(**enc, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            print(f"[derive] fine-tune step {step + 1}/{steps} loss {losses[-1]:.3f}", file=sys.stderr, flush=True)
    model.eval()
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return {"steps": steps, "batch": batch, "lr": lr, "first_loss": losses[0], "last_loss": losses[-1],
            "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True, help="the demo's target (.demo/smollm2-135m-instruct)")
    parser.add_argument("--work", type=Path, required=True, help="where the derived target, prompts and caches go")
    parser.add_argument("--tune-conversations", type=int, default=512, help="conversations fine-tuned on")
    parser.add_argument("--prompts", type=int, default=256, help="conversations whose replies the cache regenerates")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    from dflash.shards.layout import MANIFEST
    from dflash.shards.transcode import transcode_cache
    from dflash.testing.prepare import chitchat_records

    args.work.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    derived = args.work / "target"
    if not (derived / "model.safetensors").is_file():
        tune = chitchat_records(limit=DEMO_CONVERSATIONS + args.tune_conversations, max_turns=4)[DEMO_CONVERSATIONS:]
        report["fine_tune"] = fine_tune(args.target, derived, records=tune, steps=args.steps, batch=args.batch,
                                        lr=args.lr, max_length=256, seed=args.seed)
    prompts = args.work / "prompts.jsonl"
    if not prompts.is_file():
        first = DEMO_CONVERSATIONS + args.tune_conversations
        records = chitchat_records(limit=first + args.prompts, max_turns=2)[first:]
        prompts.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    bf16 = args.work / "cache-bf16"
    if not (bf16 / MANIFEST).is_file():
        cmd = [str(Path(sys.executable).parent / "dflash-precompute"), "--target", str(derived), "--data", str(prompts),
               "--out", str(bf16), "--regenerate", "--max-new-tokens", "48", "--max-length", "256",
               "--feature-codec", "bf16", "--device", "cpu"]
        print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    basis = args.work / "cache-basis"
    if not (basis / MANIFEST).is_file():
        hidden = json.loads((derived / "config.json").read_text())["hidden_size"]
        transcode_cache(bf16, basis, feature_codec="basis-fp8", feature_rank=hidden)  # rank H, as the demo
    report.update(target=str(derived), prompts=str(prompts), cache_bf16=str(bf16), cache_basis=str(basis))
    print(f"derived target {derived}\nprompts {prompts}\ncaches {bf16} (bf16), {basis} (basis-fp8)")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
