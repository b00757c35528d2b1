"""GPU check of the training path: Flex Attention against the dense path, then a short fit.

1. Attention parity at a realistic shape (hidden 1024, 16 heads over 4 KV heads, block 16,
   two layers, 4 sequences of 1,024 positions with 64 random blocks each) and at a ragged
   layout (a block at anchor 0, duplicated anchors, row counts off Flex's 128-row tiles):
   the drafter's training forward with Flex Attention (the CUDA default) and with the dense
   SDPA path, both in float32, each against the dense path in float64 (the reference),
   outputs and every parameter's gradient of a fixed random projection of the output
   (relative Frobenius error <= 1e-4; the per-parameter errors are printed), then the Flex
   path under bf16 autocast against float32 (<= 2e-2). On CPU Flex runs forward only.
2. `fit` for a few steps on a synthetic cache with learnable structure (Zipf top-k): on
   CUDA in bf16 with Flex Attention and the Triton loss (the production settings), and the
   first step on CPU in float32 with the dense path and the torch loss. The first step's
   loss must agree (relative 2e-2: bf16 rounding), every loss must be finite, and the last
   steps' mean loss must be below the first steps'. Prints step time and tokens/s.

    python bench/gpu_train_check.py [--json]                    # CUDA, about a minute
    python bench/gpu_train_check.py --device cpu --quick        # the same logic on CPU (CI smoke)
    python bench/gpu_train_check.py --attention-only            # part 1 only (the gradient check)

Needs torch and numpy for part 1; part 2 also needs pyarrow and safetensors and is skipped
(with the reason) without them. Exit status 0 when every check that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


class Checks:
    def __init__(self):
        self.results: list[dict] = []

    def check(self, name: str, value: float, limit: float, *, below: bool = True) -> None:
        ok = bool(np.isfinite(value) and (value <= limit if below else value >= limit))
        self.results.append({"check": name, "value": float(value), "limit": limit, "ok": ok})
        print(f"gpu_train_check: {'ok  ' if ok else 'FAIL'} {name}: {value:.3g} "
              f"({'<=' if below else '>='} {limit:g})", flush=True)

    @property
    def failed(self) -> list[str]:
        return [r["check"] for r in self.results if not r["ok"]]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def drafter_case(quick: bool, ragged: bool = False):
    """(config, layout segments, block size) of an attention check.

    The main case is the realistic shape of the module docstring; anchors come from randint,
    so a segment may hold two blocks at one anchor (distinct blocks, as in training). The
    ragged case covers the mask's corners: an anchor at 0 (a block that sees no context), an
    anchor at the context length, duplicated anchors, context and query counts that are not
    multiples of Flex Attention's 128-row tiles.
    """
    H, heads, kv, hd, B = (1024, 16, 4, 64, 16) if not quick else (64, 4, 2, 16, 4)
    T, blocks, n_seq, L = (1024, 64, 4, 5) if not quick else (64, 6, 2, 3)
    config = dict(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=hd, vocab_size=1024, target_layer_ids=list(range(1, 2 * L, 2)),
                  num_target_layers=2 * L + 2, num_drafts=B - 1, mask_token_id=0, rms_norm_eps=1e-6, rope_theta=1e6,
                  max_position_embeddings=4 * T, initializer_range=0.02)
    gen = torch.Generator().manual_seed(0)
    if ragged:
        segments = [(T - 24, np.array([0, 0, 5, 5, 5, T // 3, T - 24])),
                    (77, np.sort(torch.randint(0, 78, (blocks // 8 + 3,), generator=gen).numpy())),
                    (T // 2 + 5, np.array([1, T // 2 + 5]))]
    else:
        segments = [(T, np.sort(torch.randint(1, T - B, (blocks,), generator=gen).numpy())) for _ in range(n_seq)]
    return config, segments, B, L, gen


def build_case(quick: bool, ragged: bool, device):
    """(drafter on the dense path, layout, embeds [Q, H], features [C, L*H], projection [Q, H]) of
    one attention case, every tensor drawn from the case's generator, the drafter from seed 0."""
    from dflash.train.model import BlockLayout, DFlashDrafter, DrafterConfig

    config, segments, B, L, gen = drafter_case(quick, ragged=ragged)
    layout = BlockLayout.build(segments, B, device=device)
    H = config["hidden_size"]
    embeds = torch.randn(layout.num_queries, H, generator=gen).to(device)
    features = torch.randn(layout.num_context, L * H, generator=gen).to(device)
    projection = torch.randn(layout.num_queries, H, generator=gen).to(device)
    torch.manual_seed(0)
    return DFlashDrafter(DrafterConfig(**config), attention="dense").to(device), layout, embeds, features, projection


def parameter_gradients(model, layout, embeds, features, projection, attention: str,
                        dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The drafter's training forward with `attention` in `dtype` and every parameter's
    gradient of the loss sum(hidden * projection) / numel (a fixed random projection).

    Not hidden.square().mean(): the drafter ends in an RMSNorm with unit weight, so that loss
    is H * ms / (ms + eps) per row, constant up to eps, and every gradient but the final norm's
    is ~1e-9, made of the eps term and cancellation: fp32 rounding is a 10% relative error
    there on either path (dense fp32 against dense float64: 0.12 at this shape on CPU).
    """
    model = model.to(dtype)
    model.attention = attention
    model.zero_grad(set_to_none=True)
    hidden = model(embeds.to(dtype), features.to(dtype), layout)
    (hidden * projection.to(dtype)).sum().div(hidden.numel()).backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return hidden.detach().double(), grads


def attention_parity(checks: Checks, device: torch.device, quick: bool) -> dict:
    """Flex and dense attention in fp32, each against the dense path in float64 (the
    reference: the same attention, exact up to 1e-15), outputs and every parameter's gradient;
    on CUDA also a ragged layout (the mask's corners) and bf16 autocast and timing."""
    from dflash.train.model import BlockLayout, DFlashDrafter, DrafterConfig

    report: dict = {}
    cases = ["main", "ragged"] if device.type == "cuda" or quick else ["main"]
    for case in cases:
        model, layout, embeds, features, projection = build_case(quick, case == "ragged", device)
        ref_out, ref_grads = parameter_gradients(model, layout, embeds, features, projection, "dense", torch.float64)
        errors: dict[str, dict] = {}
        for attention in ("dense", "flex"):
            if device.type == "cpu" and attention == "flex":
                model.float()
                model.attention = "flex"
                with torch.no_grad():  # Flex Attention has no backward on CPU (torch 2.13, eager or compiled)
                    out = model(embeds, features, layout).double()
                errors[attention] = {"forward": rel(out, ref_out)}
                continue
            out, grads = parameter_gradients(model, layout, embeds, features, projection, attention, torch.float32)
            errors[attention] = {"forward": rel(out, ref_out),
                                 "gradients": {n: rel(grads[n], ref_grads[n]) for n in ref_grads},
                                 "gradient_norms": {n: float(ref_grads[n].norm()) for n in ref_grads}}
        tag = "" if case == "main" else " [ragged layout]"
        for attention, err in errors.items():
            checks.check(f"{attention} fp32 vs float64 dense: forward (relative){tag}", err["forward"], 1e-4)
            if "gradients" in err:
                worst = max(err["gradients"], key=err["gradients"].get)
                checks.check(f"{attention} fp32 vs float64 dense: gradients (worst relative, {worst}){tag}",
                             err["gradients"][worst], 1e-4)
        if "gradients" in errors.get("flex", {}):
            print(f"gpu_train_check: per-parameter relative gradient error against float64{tag} (flex, dense):",
                  flush=True)
            for n in ref_grads:
                print(f"    {n:44s} {errors['flex']['gradients'][n]:9.2e} {errors['dense']['gradients'][n]:9.2e}"
                      f"   |grad| {errors['dense']['gradient_norms'][n]:.2e}", flush=True)
        report[case] = {"queries": layout.num_queries, "context": layout.num_context, "errors": errors}
    model.float()
    if device.type == "cuda":
        config, segments, B, L, gen = drafter_case(quick)
        layout = BlockLayout.build(segments, B, device=device)
        embeds = torch.randn(layout.num_queries, config["hidden_size"], generator=gen).to(device)
        features = torch.randn(layout.num_context, L * config["hidden_size"], generator=gen).to(device)
        torch.manual_seed(0)
        model = DFlashDrafter(DrafterConfig(**config), attention="flex").to(device)
        with torch.no_grad():
            full = model(embeds, features, layout)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                low = model(embeds, features, layout)
        checks.check("flex bf16 autocast vs fp32 forward (relative)", rel(low.float(), full), 2e-2)
        torch.cuda.synchronize()
        for _ in range(2):  # warm-up (compilation), then time
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(embeds, features, layout).float().square().mean().backward()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        print(f"gpu_train_check: drafter forward+backward, {layout.num_queries} block rows over "
              f"{layout.num_context} context rows, bf16 flex: {1e3 * seconds:.1f} ms", flush=True)
        report.update(forward_backward_ms=1e3 * seconds, queries=layout.num_queries, context=layout.num_context)
    return report


def short_fit(checks: Checks, device: torch.device, quick: bool, workdir: Path) -> dict:
    try:
        import pyarrow  # noqa: F401
        import safetensors  # noqa: F401
    except ImportError as error:
        print(f"gpu_train_check: SKIP fit: {error} (carry its wheel in .whl/ to run it)", flush=True)
        return {"skipped": str(error)}
    from dflash.train.config import FitConfig
    from dflash.train.fit import fit
    from dflash.train.synthetic import write_synthetic_training_cache

    steps = 6 if quick else 30
    size = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, top_k=8) if quick else \
        dict(vocab_size=16384, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             intermediate_size=1024, top_k=32)
    # Small: the synthetic writer draws a full-vocabulary distribution per token on the CPU.
    lengths = [int(n) for n in np.random.default_rng(0).integers(64 if quick else 512, 128 if quick else 1024,
                                                               size=24 if quick else 32)]
    cache = workdir / "cache"
    write_synthetic_training_cache(cache, lengths=lengths, zipf=True, seed=0, **size)
    block = 4 if quick else 16
    common = dict(cache=[str(cache)], num_layers=1 if quick else 2, num_drafts=block - 1,
                  anchors_per_seq=8 if quick else 64, tokens_per_step=(64 if quick else 8192), max_steps=steps,
                  lr=1e-3, warmup_ratio=0.0, eval_every=0, eval_fraction=0.05, checkpoint_every=steps,
                  wandb=False, spike_warmup_steps=steps, log_every=max(1, steps // 3))
    runs = {}
    settings = {"reference": dict(device="cpu", dtype="float32", attention="dense")}
    if device.type == "cuda":
        settings["cuda"] = dict(device="cuda", dtype="bfloat16", attention="flex")
    for name, setting in settings.items():
        out = workdir / name
        # Beside a CUDA run the CPU reference only needs its first loss (computed before any
        # update, so the schedule's length does not matter): one step.
        only = dict(max_steps=1, checkpoint_every=1) if name == "reference" and len(settings) > 1 else {}
        t0 = time.perf_counter()
        fit(FitConfig.from_dict({"out": str(out), **common, **only, **setting}))
        seconds = time.perf_counter() - t0
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        runs[name] = {"loss": [m["loss"] for m in metrics], "seconds": seconds,
                      "median_step_s": float(np.median([m["step_time_s"] for m in metrics[1:] or metrics])),
                      "tokens_per_s": float(np.median([m["tokens_per_s"] for m in metrics[1:] or metrics]))}
    for name, run in runs.items():
        loss = np.asarray(run["loss"])
        if len(loss) < 2:
            continue
        checks.check(f"{name} fit: every loss finite (count of non-finite)", float((~np.isfinite(loss)).sum()), 0)
        k = max(1, len(loss) // 5)
        checks.check(f"{name} fit: mean of last {k} losses / first {k}", float(loss[-k:].mean() / loss[:k].mean()),
                     1.0 - 1e-6)
        print(f"gpu_train_check: {name} fit: {len(loss)} steps, median step {1e3 * run['median_step_s']:.1f} ms, "
              f"{run['tokens_per_s']:,.0f} block tokens/s, loss {loss[0]:.4f} -> {loss[-1]:.4f}", flush=True)
    if "cuda" in runs:
        first = abs(runs["cuda"]["loss"][0] - runs["reference"]["loss"][0]) / abs(runs["reference"]["loss"][0])
        checks.check("cuda bf16 flex+triton vs cpu fp32 dense+torch: step-1 loss (relative)", first, 2e-2)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
    parser.add_argument("--attention-only", action="store_true",
                        help="only part 1, the attention checks (the gradient reproduction; no fit)")
    parser.add_argument("--workdir", help="keep the caches and runs here (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity uses IEEE fp32
    checks = Checks()
    report = {"bench": "gpu_train_check", "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    report["attention"] = attention_parity(checks, device, args.quick)
    if not args.attention_only:
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(args.workdir) if args.workdir else Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            report["fit"] = short_fit(checks, device, args.quick, workdir)
    finish(checks, report, args.json)


def finish(checks: Checks, report: dict, as_json: bool) -> None:
    report["checks"] = checks.results
    report["failed"] = checks.failed
    print(f"gpu_train_check: {'FAIL: ' + ', '.join(checks.failed) if checks.failed else 'all checks passed'}",
          flush=True)
    if as_json:
        print(json.dumps(report))
    sys.exit(1 if checks.failed else 0)


if __name__ == "__main__":
    main()
