"""GPU check of `dflash-train eval --online` in bf16 against float32, on a random target.

Issue 42 saw online eval on an H200 report "lossless NO" on 4 of 5 prompts in bf16 and run
3-4x slower per prompt than in float32. This script runs the eval's own loop
(`dflash.train.online.evaluate_online`: the target's greedy `generate`, then speculative
decoding, prompt by prompt) on a random Llama built in code, with a random drafter, in both
dtypes, and prints per generated token the time of speculative decoding and of plain greedy
decoding, tau, the mismatches split into near-ties (within the dtype's rounding bound,
`online.near_tie_bound`) and real ones, and the torch operators dispatched per token (one
untimed prompt under the profiler: a proxy for kernel launches), and the rounding drift that
the near-tie bound rests on: the largest change of a top-8 margin between one-token steps and
16-token verifies over the same 64 positions, in units of u|z| (`margin_drift`). Checks:

- no real mismatch, in any row (a correctness check: exit status 1 when it fails);
- the bf16 drift within the bound's TIE_ROUNDINGS (16) (a correctness check of the bound: a
  larger drift would make real mismatches of near-ties);
- bf16 no slower per token than float32 (speculative decoding, the eval's timed path): the
  ratio bf16 / float32 at most 1.05, the 5% being run-to-run noise; a goal, exit status 0
  when missed (bench/gpu_report.py reports it as a missed goal). CUDA only: on a CPU bf16 GEMMs
  are slower than float32 ones unless the CPU has bf16 units, which says nothing of a GPU.

On CUDA a third row decodes bf16 with torch's default attention backends, cuDNN's included
(what eval did before `speculative.decoding_attention`): cuDNN builds one graph per key
length, so that row shows what the per-length builds cost; `sdpa_backends` names the backend
torch picks for a bf16 one-token step and a bf16 verify, with and without cuDNN.

Size: 8 layers of Llama-2-7B's shape (hidden 4096, 32 heads over 8 KV heads of 128, MLP
11,008), vocabulary 32,000: about 1.7 B parameters, 6.7 GB in float32, so that a decode step
reads enough bytes (about 2 ms of an H200's bandwidth in float32) for bf16's halving to show
beside transformers' kernel launches (a few hundred a step, which bf16 adds a few casts to); a
smaller target is launch-bound and compares launch counts, not dtypes. 4 prompts of 64-256
tokens, 128 new tokens each, verifies of 16 (15 drafts); the cuDNN row decodes one prompt, 64 new tokens. About
a minute on an H200, imports included; `--budget-s` skips the rows that would start past it.

    python bench/gpu_online_eval.py [--json]                    # CUDA
    python bench/gpu_online_eval.py --device cpu --quick --json # the same logic on CPU (CI smoke)

Prints a table, a PASS/FAIL line per check, and with --json one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]

TARGET_SIZES = {
    "full": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=8,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "quick": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
SPEED_SLACK = 1.05
"""bf16 passes "no slower than float32" at a per-token ratio up to this (run-to-run noise)."""


def random_target(size: dict, device: torch.device, seed: int):
    """A random Llama (transformers' default initialisation, std 0.02) on `device`, float32
    holding bf16-exact weights, so that both dtypes decode the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**size, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).to(torch.float32).eval()


def random_drafter(size: dict, device: torch.device, verify_size: int, seed: int):
    """A random one-layer DFlash drafter on the target's three default feature layers."""
    from dflash.shards.layers import default_layer_ids
    from dflash.train.model import DFlashDrafter, DrafterConfig

    layers = size["num_hidden_layers"]
    config = DrafterConfig(
        hidden_size=size["hidden_size"], intermediate_size=size["intermediate_size"], num_hidden_layers=1,
        num_attention_heads=size["num_attention_heads"], num_key_value_heads=size["num_key_value_heads"],
        head_dim=size["head_dim"], vocab_size=size["vocab_size"], target_layer_ids=default_layer_ids(layers, 3),
        num_target_layers=layers, num_drafts=verify_size - 1, mask_token_id=size["vocab_size"] - 1)
    torch.manual_seed(seed)
    return DFlashDrafter(config, attention="dense").to(device).eval()


def sdpa_backends(size: dict, device: torch.device, kv_length: int, verify_size: int) -> dict[str, str]:
    """The backend torch picks for a bf16 one-token step (no mask) and a bf16 verify (a causal
    mask over the cache), with torch's defaults and inside `decoding_attention`."""
    from torch.nn.attention import SDPBackend

    from dflash.train.speculative import decoding_attention

    names = {backend.value: name for name, backend in SDPBackend.__members__.items()}
    heads, head_dim = size["num_attention_heads"], size["head_dim"]

    def choice(queries: int, masked: bool) -> str:
        # as transformers calls it: grouped KV heads without a mask, repeated to every head with one
        kv_heads = heads if masked else size["num_key_value_heads"]
        q = torch.randn(1, heads, queries, head_dim, device=device, dtype=torch.bfloat16)
        k = v = torch.randn(1, kv_heads, kv_length, head_dim, device=device, dtype=torch.bfloat16)
        mask = (torch.ones(queries, kv_length, dtype=torch.bool, device=device).tril(kv_length - queries)[None, None]
                if masked else None)  # [1, 1, q, kv]
        return names.get(torch._fused_sdp_choice(q, k, v, mask, enable_gqa=not masked), "?")

    found = {"step_default": choice(1, False), "verify_default": choice(verify_size, True)}
    with decoding_attention(device):
        found.update(step_decoding=choice(1, False), verify_decoding=choice(verify_size, True))
    return found


def decode_row(target, drafter, prompts, *, dtype: torch.dtype, attention: str, max_new_tokens: int,
               verify_size: int) -> dict:
    """evaluate_online with target and drafter in `dtype`; attention "decoding" (the eval's) or
    "torch default" (cuDNN's allowed: `speculative.decoding_attention` replaced for the row)."""
    from dflash.train import speculative
    from dflash.train.online import drafter_proposer, evaluate_online

    target.to(dtype)
    proposer = drafter_proposer(drafter.to(dtype), target)
    kept = speculative.decoding_attention
    if attention == "torch default":
        speculative.decoding_attention = lambda device: contextlib.nullcontext()
    t0 = time.perf_counter()
    try:
        online = evaluate_online(target, proposer, prompts, max_new_tokens=max_new_tokens, verify_size=verify_size,
                                 layer_ids=drafter.config.target_layer_ids, stop_token_ids=set())
        ops = ops_per_token(target, proposer, prompts[0].token_ids, drafter.config.target_layer_ids, verify_size,
                            min(32, max_new_tokens // 2))
        drift = margin_drift(target, prompts[0].token_ids, 4 * verify_size, verify_size)
    finally:
        speculative.decoding_attention = kept
    return {
        "dtype": str(dtype).removeprefix("torch."), "attention": attention,
        "num_prompts": len(prompts), "new_tokens": online["new_tokens"],
        "speculative_ms_per_token": 1e3 / online["tokens_per_s"],
        "greedy_ms_per_token": 1e3 / online["baseline_tokens_per_s"],
        "acceptance_length": online["acceptance_length"],
        "num_near_ties": online["num_near_ties"], "num_real_mismatches": online["num_real_mismatches"],
        "mismatches": online["mismatches"], "wall_s": time.perf_counter() - t0,
        "margin_drift_u": drift,
        **ops,
    }


def margin_drift(target, prompt_ids: list[int], new_tokens: int, verify_size: int) -> float:
    """The premise of `online.near_tie_bound`, measured: the same `new_tokens` positions after
    the prompt (random tokens, teacher-forced) decoded one token at a time and in verifies of
    `verify_size`, with the eval's attention; returns the largest change of a margin between
    the one-token top logit and another of its TOP_K best, over the positions, in units of
    u * |top logit| (u the unit roundoff of the target's dtype)."""
    from transformers import DynamicCache

    from dflash.train.speculative import TOP_K, decoding_attention
    from dflash.train.target_cache import cache_kwarg

    device, argument, start = target.device, cache_kwarg(target), len(prompt_ids)
    continuation = torch.randint(0, target.config.vocab_size, (new_tokens,), generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([prompt_ids + continuation.tolist()], device=device)  # [1, T]

    def logits(step: int) -> torch.Tensor:  # [new_tokens, V] float32
        cache = DynamicCache(config=target.config)
        target(ids[:, :start], **{argument: cache}, use_cache=True, logits_to_keep=1)
        return torch.cat([target(ids[:, t:t + step], **{argument: cache}, use_cache=True).logits[0].float()
                          for t in range(start, start + new_tokens, step)])

    with torch.inference_mode(), decoding_attention(device):
        one, block = logits(1), logits(verify_size)
    top = one.topk(TOP_K, dim=-1)
    z_one, z_block = top.values, block.gather(1, top.indices)  # [n, K]
    change = ((z_one[:, :1] - z_one) - (z_block[:, :1] - z_block)).abs().amax(dim=1)  # [n]
    unit = torch.finfo(target.dtype).eps / 2
    return float((change / (unit * z_one[:, 0].abs())).max())


def ops_per_token(target, proposer, prompt_ids: list[int], layer_ids: list[int], verify_size: int,
                  new_tokens: int) -> dict:
    """torch operators dispatched per generated token (a proxy for kernel launches, which set
    a small target's time on a GPU), greedy and speculative, over one untimed prompt of
    `new_tokens` under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from dflash.train.speculative import greedy_generate, speculative_generate

    def count(fn) -> float:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = fn()
        return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / len(out.tokens)

    return {
        "greedy_ops_per_token": count(lambda: greedy_generate(target, prompt_ids, max_new_tokens=new_tokens,
                                                              stop_token_ids=set())),
        "speculative_ops_per_token": count(lambda: speculative_generate(
            target, proposer, prompt_ids, max_new_tokens=new_tokens, verify_size=verify_size, layer_ids=layer_ids,
            stop_token_ids=set())),
    }


def check(name: str, value: float, limit: float) -> dict:
    ok = bool(value <= limit)
    print(f"gpu_online_eval: {'PASS' if ok else 'FAIL'} {name}: {value:.4g} (<= {limit:g})", flush=True)
    return {"check": name, "value": float(value), "limit": limit, "ok": ok}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny target, 2 prompts of 24 new tokens (CI smoke)")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per row (default 4; quick 2)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="per prompt (default 128; quick 24)")
    parser.add_argument("--verify-size", "--block-size", dest="verify_size", type=int, default=16,
                        help="tokens per verify, the anchor and its drafts (default 16: 15 drafts; "
                             "--block-size is its former name)")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="wall seconds: a row that would start later is skipped (default 150)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_online_eval: FAIL: --device cuda, but torch sees no CUDA device (use --device cpu --quick)")
        return 2
    import transformers

    from dflash.train.online import TIE_ROUNDINGS, Prompt

    size = TARGET_SIZES["quick" if args.quick else "full"]
    num_prompts = args.num_prompts or (2 if args.quick else 4)
    max_new_tokens = args.max_new_tokens or (24 if args.quick else 128)
    target = random_target(size, device, args.seed)
    drafter = random_drafter(size, device, args.verify_size, args.seed + 1)
    generator = torch.Generator().manual_seed(args.seed + 2)
    prompts = [Prompt(source={"file": "random", "index": i},
                      token_ids=torch.randint(0, size["vocab_size"] - 1, (64 + 64 * i,), generator=generator).tolist())
               for i in range(num_prompts)]
    plan = [(torch.bfloat16, "decoding", prompts, max_new_tokens), (torch.float32, "decoding", prompts, max_new_tokens)]
    if device.type == "cuda":  # the eval before the fix, shorter: each new key length builds a cuDNN graph
        plan.append((torch.bfloat16, "torch default", prompts[:1], min(64, max_new_tokens)))
    rows, skipped = [], []
    for dtype, attention, row_prompts, row_tokens in plan:
        if time.perf_counter() - start > args.budget_s:
            skipped.append(f"{dtype} {attention}")
            continue
        rows.append(decode_row(target, drafter, row_prompts, dtype=dtype, attention=attention,
                               max_new_tokens=row_tokens, verify_size=args.verify_size))
    backends = sdpa_backends(size, device, 256, args.verify_size)
    num_parameters = sum(p.numel() for p in target.parameters())

    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads")
    print(f"gpu_online_eval, {datetime.date.today().isoformat()}, {machine}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(f"target: random Llama, {size['num_hidden_layers']} layers, hidden {size['hidden_size']}, vocabulary "
          f"{size['vocab_size']} ({num_parameters / 1e6:,.1f} M parameters); drafter: random, 1 layer, "
          f"{args.verify_size - 1} drafts per verify of {args.verify_size}; up to {max_new_tokens} new tokens per "
          "prompt")
    print(f"{'dtype':<9} {'attention':<14} {'prompts':>7} {'spec ms/tok':>11} {'greedy ms/tok':>13} {'tau':>6} "
          f"{'near-ties':>9} {'real':>5} {'drift u|z|':>10} {'spec ops/tok':>12} {'greedy ops/tok':>14}")
    for r in rows:
        print(f"{r['dtype']:<9} {r['attention']:<14} {r['num_prompts']:>7} {r['speculative_ms_per_token']:>11.2f} "
              f"{r['greedy_ms_per_token']:>13.2f} {r['acceptance_length']:>6.3f} {r['num_near_ties']:>9} "
              f"{r['num_real_mismatches']:>5} {r['margin_drift_u']:>10.1f} {r['speculative_ops_per_token']:>12.0f} "
              f"{r['greedy_ops_per_token']:>14.0f}")
    for name in skipped:
        print(f"{name}: skipped (past --budget-s {args.budget_s:g})")
    print("SDPA backend, bf16: one-token step {step_default} by default, {step_decoding} decoding; "
          "verify {verify_default} by default, {verify_decoding} decoding".format(**backends))

    checks = [check("no real mismatch: real mismatches, every row (count)",
                    sum(r["num_real_mismatches"] for r in rows), 0)]
    bf16_drifts = [r["margin_drift_u"] for r in rows if r["dtype"] == "bfloat16"]
    if bf16_drifts:  # the near-tie bound's premise; float32's drift is only shown (near_tie_bound says why)
        checks.append(check("bf16 margin drift, verify vs one-token steps (u|z|)", max(bf16_drifts), TIE_ROUNDINGS))
    by_kind = {(r["dtype"], r["attention"]): r for r in rows}
    bf16, fp32 = by_kind.get(("bfloat16", "decoding")), by_kind.get(("float32", "decoding"))
    ratio = bf16["speculative_ms_per_token"] / fp32["speculative_ms_per_token"] if bf16 and fp32 else None
    if ratio is not None and device.type == "cuda":
        checks.append(check("bf16 no slower per token than float32: bf16 / float32 speculative ms per token", ratio,
                            SPEED_SLACK))
    elif ratio is not None:
        print(f"gpu_online_eval: bf16 / float32 speculative ms per token {ratio:.3g} (not checked on a CPU)")
    greedy_ratio = bf16["greedy_ms_per_token"] / fp32["greedy_ms_per_token"] if bf16 and fp32 else None
    default = by_kind.get(("bfloat16", "torch default"))
    cudnn_cost = default["speculative_ms_per_token"] / bf16["speculative_ms_per_token"] if default and bf16 else None
    if greedy_ratio is not None:
        print(f"gpu_online_eval: bf16 / float32 greedy ms per token {greedy_ratio:.3g}"
              + ("" if cudnn_cost is None else f"; bf16 speculative ms per token with cuDNN's attention allowed / "
                 f"without {cudnn_cost:.3g}"))
    failed = [c["check"] for c in checks if not c["ok"]]
    print(f"gpu_online_eval: {'FAIL: ' + '; '.join(failed) if failed else 'every check passed'} "
          f"in {time.perf_counter() - start:.0f} s")
    if args.json:
        print(json.dumps({
            "bench": "gpu_online_eval", "date": datetime.date.today().isoformat(), "machine": machine,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "target": {**size, "num_parameters": num_parameters},
            "num_drafts": args.verify_size - 1, "verify_size": args.verify_size,
            "max_new_tokens": max_new_tokens, "rows": rows, "skipped": skipped, "sdpa_backends": backends,
            "bf16_over_float32": ratio, "bf16_over_float32_greedy": greedy_ratio, "cudnn_over_decoding": cudnn_cost,
            "checks": checks, "failed": failed,
            "elapsed_s": time.perf_counter() - start,
        }))
    correctness_failed = any(not c["ok"] for c in checks if not c["check"].startswith("bf16 no slower"))
    return 1 if correctness_failed else 0


if __name__ == "__main__":
    sys.exit(main())
