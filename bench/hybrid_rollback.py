"""What the exact rollback of a hybrid target's cache costs per verify (train/target_cache.py).

A verify feeds B tokens (anchor and drafts) to a target with linear-attention layers. Three
ways to run it, timed per verify on a random target of the chosen family and size:

- `chunked`: the forward as plain decoding would run it (the chunked gated delta rule over
  the B tokens), with no way back: the floor, not exact after a rejection.
- `recorded` (what dflash does): recording on, so the B tokens go through the recurrent rule
  one at a time and the cache keeps the state after each; then the crop to the committed
  tokens. Also: the bytes of recorded states held from the forward to the crop.
- `re-run` (the alternative): the chunked forward, then the committed tokens (B/2 here) fed
  again from a snapshot of the states; timed as `chunked` plus that second forward (the
  snapshot's copies not counted).

    python -m bench.hybrid_rollback
    python -m bench.hybrid_rollback --kind qwen3_next --hidden 256 --verify-sizes 4,16 --json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch


def build(kind: str, hidden: int, num_layers: int, vocab: int, head_dim: int) -> torch.nn.Module:
    """A random hybrid target: 3 gated-delta-net layers to 1 full-attention layer, as Qwen3-Next and Qwen3.5."""
    import transformers

    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
                  num_attention_heads=max(hidden // head_dim, 1), num_key_value_heads=1, head_dim=head_dim,
                  layer_types=layer_types, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                  linear_num_key_heads=max(hidden // (2 * head_dim), 1),
                  linear_num_value_heads=max(hidden // head_dim, 1), max_position_embeddings=4096)
    torch.manual_seed(0)
    if kind == "qwen3_next":
        config = transformers.Qwen3NextConfig(**common, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=hidden // 2, shared_expert_intermediate_size=hidden)
        return transformers.Qwen3NextForCausalLM(config).eval()
    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**common)).eval()


def recorded_bytes(cache) -> int:
    """Bytes of the recurrent states and conv inputs the cache holds for a rollback."""
    total = 0
    for layer in cache.layers:
        for states in getattr(layer, "recurrent_states_history", {}).values():
            total += sum(s.numel() * s.element_size() for s in states)
        for conv in getattr(layer, "conv_states", {}).values():
            if conv is not None:
                total += conv.numel() * conv.element_size()
    return total


@torch.inference_mode()
def measure(target, prompt_tokens: int, verify_size: int, repeats: int) -> dict:
    from transformers import DynamicCache

    from dflash.train.target_cache import cache_kwarg, record_past, rollback

    arg = cache_kwarg(target)
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    block = torch.randint(0, vocab, (1, verify_size), generator=torch.Generator().manual_seed(1))
    committed = max(verify_size // 2, 1)

    def forward(cache, ids):
        start = int(cache.get_seq_length())
        return target(ids, position_ids=torch.arange(start, start + ids.shape[1])[None], **{arg: cache},
                      use_cache=True)

    def timed(step) -> float:
        cache = DynamicCache(config=target.config)
        target(prompt, **{arg: cache}, use_cache=True)
        return step(cache)

    def chunked(cache) -> float:
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            forward(cache, block)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    held = []

    def recorded(cache) -> float:
        record_past(cache, verify_size)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            forward(cache, block)
            held.append(recorded_bytes(cache))
            rollback(cache, int(cache.get_seq_length()) - verify_size + committed, fed=verify_size, family="bench")
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def rerun(cache) -> float:
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            forward(cache, block[:, :committed])
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    chunked_ms, recorded_ms, rerun_ms = (1e3 * timed(step) for step in (chunked, recorded, rerun))
    return {"num_drafts": verify_size - 1, "verify_size": verify_size, "chunked_ms": chunked_ms,
            "recorded_ms": recorded_ms,
            "rerun_ms": chunked_ms + rerun_ms, "recorded_over_chunked": recorded_ms / chunked_ms,
            "held_mib": max(held) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=["qwen3_5", "qwen3_next"], default="qwen3_5")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--verify-sizes", "--block-sizes", dest="verify_sizes", default="2,4,8,16",
                        help="comma-separated verify sizes B (the anchor and its drafts) to time; "
                             "--block-sizes is its former name")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = build(args.kind, args.hidden, args.layers, args.vocab, args.head_dim)
    rows = [measure(target, args.prompt_tokens, int(b), args.repeats) for b in args.verify_sizes.split(",")]
    print(f"{args.kind}: hidden {args.hidden}, {args.layers} layers, head dim {args.head_dim}, prompt "
          f"{args.prompt_tokens} tokens, CPU {args.threads} threads; ms per verify (median of {args.repeats})")
    print(f"{'verify':>6}{'chunked':>10}{'recorded':>10}{'ratio':>7}{'re-run':>9}{'held MiB':>10}")
    for r in rows:
        print(f"{r['verify_size']:>6}{r['chunked_ms']:>10.1f}{r['recorded_ms']:>10.1f}{r['recorded_over_chunked']:>7.2f}"
              f"{r['rerun_ms']:>9.1f}{r['held_mib']:>10.2f}")
    if args.json:
        print(json.dumps({"kind": args.kind, "hidden": args.hidden, "layers": args.layers, "head_dim": args.head_dim,
                          "prompt_tokens": args.prompt_tokens, "threads": args.threads,
                          "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                          "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"), "rows": rows}))


if __name__ == "__main__":
    main()
