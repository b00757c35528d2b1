"""Why a 2-token verify costs far more than a 1-token decode step on CPU: small-M matmuls.

Speculative decoding's verify forward runs the target on B query tokens (B = 2..16) and the
drafter's head scores B - 1 rows; plain greedy decoding runs one row. On CPU a product with
one row is a matrix-vector product that streams the weight once; with a few rows torch's
`F.linear(x, W)` (x [M, K], W [N, K]) can take a GEMM path that is much slower per call. This
bench times, for the embedded default's shapes (SmolLM2-135M: hidden 576, MLP 1536, the tied
49,152-row head), `F.linear(x, W)` against the same product written `(W @ x.T).T`, and the
whole target forward over a KV cache for 1 and 4 query tokens plain and inside the decoding
loops' `decoding_linear` (train/speculative.py), and reports
the largest difference between the two forms' outputs (they sum in another order).

    python -m bench.small_m_matmul                 # synthetic shapes only
    python -m bench.small_m_matmul --target .demo/smollm2-135m-instruct --json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"head 49152x576": (49152, 576), "mlp up 1536x576": (1536, 576), "attn 576x576": (576, 576)}


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear as (W @ x.T).T over the last dimension: [..., K] x [N, K] -> [..., N]."""
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    out = (weight @ flat.T).T  # [M, N]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def matmul_rows(repeats: int) -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k)
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k)
            plain = median_ms(lambda x=x, weight=weight: F.linear(x, weight), repeats)
            swapped = median_ms(lambda x=x, weight=weight: transposed_linear(x, weight), repeats)
            diff = (F.linear(x, weight) - transposed_linear(x, weight)).abs().max().item()
            rows.append({"shape": name, "rows": m, "linear_ms": plain, "transposed_ms": swapped, "max_diff": diff})
    return rows


def forward_rows(target_dir: str, repeats: int, context: int = 64) -> list[dict]:
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, context))
    rows = []
    from dflash.train.speculative import decoding_linear

    for form, decoding in (("linear", False), ("rows_linear", True)):
        for m in (1, 4):
            block = torch.randint(0, model.config.vocab_size, (1, m))

            def step(decoding=decoding, block=block, m=m):
                routed = decoding_linear(model) if decoding else contextlib.nullcontext()
                with torch.inference_mode(), routed:
                    kv = DynamicCache(config=model.config)
                    model(prompt, past_key_values=kv, use_cache=True)
                    t0 = time.perf_counter()
                    model(block, past_key_values=kv, use_cache=True,
                          position_ids=torch.arange(context, context + m)[None])
                    return time.perf_counter() - t0

            step()
            ms = 1e3 * statistics.median(step() for _ in range(repeats))
            rows.append({"form": form, "query_tokens": m, "forward_ms": ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="A Hugging Face causal-LM folder for the whole-forward rows.")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.machine(),
              "torch": torch.__version__, "threads": args.threads, "matmul": matmul_rows(args.repeats)}
    print(f"{'shape':<18}{'rows':>5}{'linear ms':>11}{'(W@x.T).T ms':>14}{'max diff':>10}")
    for row in result["matmul"]:
        print(f"{row['shape']:<18}{row['rows']:>5}{row['linear_ms']:>11.2f}{row['transposed_ms']:>14.2f}"
              f"{row['max_diff']:>10.1e}")
    if args.target:
        result["forward"] = forward_rows(args.target, max(5, args.repeats // 3))
        print(f"\n{'target forward':<18}{'query tokens':>13}{'ms':>8}")
        for row in result["forward"]:
            print(f"{row['form']:<18}{row['query_tokens']:>13}{row['forward_ms']:>8.1f}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
