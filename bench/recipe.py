"""Training recipe: which loss, start, learning rate, block size and budget make the best drafter.

Every variant trains on the same cache with the embedded default's budget (bench/tau.py's
`DEMO_FIT`: 1 layer, block 8, 400 steps of 512 block tokens, lr 1e-3, float32 on CPU) changed
in one place, for each seed; then offline tau over all held-out anchors, the replayed tau and
online tau (real speculative decoding with the target, lossless checked) on the first
held-out prompts, and the speculative / plain greedy speed ratio. The seed also draws the held-out
set, so each variant is compared with the baseline within a seed (the percentage) as well as
by mean and spread.

    python -m bench.recipe --cache .demo/cache --target .demo/smollm2-135m-instruct \\
        --prompts .demo/chitchat.jsonl --work /tmp/recipe [--variants kl,ce] [--workers 2] [--json]

The rows of 2026-12-02 (afternoon) change one thing against `demo (block 4)` (DEMO_V2: the
demo's settings that morning) on the demo's basis-fp8 cache: the start (`--norm-init flat`,
`--out-init zero`, the target's layer 28 copied in through `--init-from`, see
`copy_target_layer`), feature noise, gamma, `--train-on all`, layers, steps, block 3, and 3x
the data (`--more-data`); read them with `--baseline "demo (block 4)"`.

The sliding-window rows (`sliding 16`, `sliding 32`, their controls) change the attention of
the demo's settings against `demo (full attention)` on the demo's own cache:

    python -m bench.recipe --cache .demo/cache --target .demo/smollm2-135m-instruct \\
        --prompts .demo/chitchat.jsonl --work /tmp/recipe --baseline "demo (full attention)" \\
        --variants sliding,causal

Shares WORK/tau.jsonl with bench/feature_codecs.py: point both at one WORK (and the bf16
cache of that bench) and the kl baseline runs once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import torch

from bench.tau import Job, format_table, run_jobs, summarize

# label -> fit overrides (flat FitConfig keys) over DEMO_FIT (whose loss is kl). The loss and
# norm-init rows change one thing against kl; the rows after them change one thing against
# kl+ce, fit's default since the loss rows chose it (read them with --baseline kl+ce).
KL_CE = {"loss": "kl+ce"}
# `block_size` in these rows is fit's deprecated key, the drafter's rows per block as the rows'
# names count them (the kind converts it to --num-drafts: rows - 1 for dflash, rows for dspark).
VARIANTS: dict[str, dict] = {
    "kl (top-32 KL)": {},
    "ce (target top-1)": {"loss": "ce"},
    "kl+ce": KL_CE,
    "norm from target (kl)": {"norm_init": "target"},
    "lr 2e-3 (kl+ce)": {**KL_CE, "lr": 2e-3},
    "block 4 (kl+ce)": {**KL_CE, "block_size": 4},
    "block 16 (kl+ce)": {**KL_CE, "block_size": 16},
    "more data (kl+ce)": KL_CE,  # on --more-data's cache: more regenerated conversations, the same steps
}
MORE_DATA = "more data (kl+ce)"
# trained on --more-data's cache
MORE_DATA_ROWS = {MORE_DATA, "3x data (block 4)", "3x data + 1200 steps", "3x data + 1200 steps (block 3)",
                  "draft vocab 4096", "draft vocab 4096 (block 4)", "+ 3x human replies",
                  "draft vocab 4096 (2400 steps)", "+ 3x human replies (1200 steps)"}

# A second cache trained on beside the row's own, given as --human-cache: the chitchat
# conversations after the demo's with their own human replies (demo.run builds it as
# .demo/cache-human, `dflash-precompute --feature-basis` of the first cache).
HUMAN_CACHE = "human-cache"

# The 2026-12-02 (afternoon) rows: one change each against the embedded default's settings of
# that day (basis-fp8 cache, kl+ce, block 4: DEMO_V2). Read them with --baseline "demo (block 4)".
DEMO_V2 = {**KL_CE, "block_size": 4}
COPY_LAYER = 28  # the target layer a copy-init drafter starts as (see copy_target_layer)
VARIANTS.update({
    "demo (block 4)": DEMO_V2,
    "flat norm": {**DEMO_V2, "norm_init": "flat"},
    "zero out": {**DEMO_V2, "out_init": "zero"},
    "flat start": {**DEMO_V2, "norm_init": "flat", "out_init": "zero"},
    f"copy layer {COPY_LAYER}": {**DEMO_V2, "init_from": f"copy-layer-{COPY_LAYER}"},
    "noise 0.05": {**DEMO_V2, "feature_noise": 0.05},
    "noise 0.2": {**DEMO_V2, "feature_noise": 0.2},
    "gamma 8": {**DEMO_V2, "decay_gamma": 8.0},
    "ce weight 1": {**DEMO_V2, "ce_weight": 1.0},
    "2 layers": {**DEMO_V2, "num_layers": 2},
    "800 steps": {**DEMO_V2, "max_steps": 800},
    "1200 steps": {**DEMO_V2, "max_steps": 1200},
    "1600 steps": {**DEMO_V2, "max_steps": 1600},
    "1024 tokens/step": {**DEMO_V2, "tokens_per_step": 1024},
    "8 anchors/seq": {**DEMO_V2, "anchors_per_seq": 8},
    "all tokens": {**DEMO_V2, "train_on": "all"},
    # 170 blocks a step (512 is not a multiple of 3)
    "block 3": {**DEMO_V2, "block_size": 3, "tokens_per_step": 510},
    # The demo's settings since 2026-12-02 (afternoon), on its 512-conversation cache (--cache).
    "demo (block 3 / 800 steps)": {**DEMO_V2, "block_size": 3, "tokens_per_step": 510, "max_steps": 800},
    "3x data (block 4)": DEMO_V2,  # on --more-data's cache, as MORE_DATA
    "3x data + 1200 steps": {**DEMO_V2, "max_steps": 1200},
    # The best row's budget with the demo's block 3: a candidate for the demo's defaults.
    "3x data + 1200 steps (block 3)": {**DEMO_V2, "block_size": 3, "tokens_per_step": 510, "max_steps": 1200},
    # The 2026-12-02 (night) rows: a draft vocabulary of the 4,096 most frequent reply tokens
    # (--draft-vocab) on the demo's settings (block 3) and on the best-tau row (block 4).
    "draft vocab 4096": {**DEMO_V2, "block_size": 3, "tokens_per_step": 510, "max_steps": 1200,
                         "draft_vocab": 4096},
    "draft vocab 4096 (block 4)": {**DEMO_V2, "max_steps": 1200, "draft_vocab": 4096},
    # The demo's settings plus 2,304 further chitchat conversations with their human replies,
    # not regenerated (stage one's forward only; the 768 cache's basis), and 2x the steps (the
    # human replies are short: about 2x the reply tokens); and its control, the steps alone.
    "+ 3x human replies": {**DEMO_V2, "block_size": 3, "tokens_per_step": 510, "max_steps": 2400,
                           "draft_vocab": 4096, "extra_cache": HUMAN_CACHE},
    "draft vocab 4096 (2400 steps)": {**DEMO_V2, "block_size": 3, "tokens_per_step": 510, "max_steps": 2400,
                                     "draft_vocab": 4096},
    # The human replies at the demo's own budget: a candidate for its defaults (2x the steps
    # alone changed nothing).
    "+ 3x human replies (1200 steps)": {**DEMO_V2, "block_size": 3, "tokens_per_step": 510, "max_steps": 1200,
                                       "draft_vocab": 4096, "extra_cache": HUMAN_CACHE},
})

# The DSpark rows (issue 34): the demo's settings of 2026-12-03 (block 3, 1200 steps of 510 block
# tokens, kl+ce, a 4,096-token draft vocabulary) on its cache (--cache), and DSpark
# (`--drafter dspark`, train/drafters/dspark.py) at the same budget of block tokens per step. A DSpark
# block of N drafts N tokens (its anchor predicts too): block 2 drafts what DFlash's block 3
# does, with fewer queries; block 3 costs what DFlash's block 3 costs and drafts one more.
# Rank 64, not speculators' 256: markov_w1 is [49,152, r] for SmolLM2, and on the demo's ~60k
# reply tokens most of its rows never see a gradient; 64 keeps the head at ~3.4M parameters
# beside the 1-layer backbone. Read them with --baseline "demo (2026-12-03)".
DEMO_V3 = {**DEMO_V2, "block_size": 3, "tokens_per_step": 510, "max_steps": 1200, "draft_vocab": 4096}
DSPARK = {"drafter": "dspark", "markov_rank": 64}
VARIANTS.update({
    "demo (2026-12-03)": DEMO_V3,
    "dspark block 2": {**DEMO_V3, **DSPARK, "block_size": 2},
    "dspark block 3": {**DEMO_V3, **DSPARK},  # the demo's drafter since it won here on tau, 3 seeds
    "dspark block 3 (rank 256)": {**DEMO_V3, **DSPARK, "markov_rank": 256},
    "dspark block 3 + confidence": {**DEMO_V3, **DSPARK, "confidence_head": True},
    # the first run under 10 minutes (issue 44): on a cache of half the conversations
    # (`python -m demo.run --num-conversations 384`), three quarters of the steps
    "dspark block 3 (900 steps)": {**DEMO_V3, **DSPARK, "max_steps": 900},
    # the same at 1,200 steps with the drafter's compute in bfloat16 (autocast; float32 weights
    # and optimizer state), on a CPU with native bfloat16 products: is the demo's fit cheaper at its tau?
    "dspark block 3 (bf16 fit)": {**DEMO_V3, **DSPARK, "dtype": "bfloat16"},
    # block 4 or more, where the Markov head has more positions to help: 128 blocks of 4
    "demo at block 4": {**DEMO_V3, "block_size": 4, "tokens_per_step": 512},
    "dspark block 4": {**DEMO_V3, **DSPARK, "block_size": 4, "tokens_per_step": 512},
})
# DFlash2 (issue 43, `--drafter dflash2`, train/drafters/dflash2.py) beside DFlash ("demo (2026-12-03)")
# and DSpark ("dspark block 3") at the same budget of block tokens per step. Block 3 as theirs:
# DFlash2's block is DFlash's (the anchor predicts nothing), so 2 drafts per verify against DSpark's 3.
# It scores the whole vocabulary (vLLM's selector indexes its codebooks by token id), so it has no
# draft vocabulary; "demo (whole vocabulary)" is DFlash under that same condition. Selector rank 64,
# not z-lab's 256, for the reason DSpark's Markov head has 64: the codebooks are [49,152, r] each.
DFLASH2 = {"drafter": "dflash2", "selector_rank": 64, "selector_top_k": 16, "conv_group_size": 16,
           "draft_vocab": None}
VARIANTS.update({
    "dflash2 block 3": {**DEMO_V3, **DFLASH2},
    "demo (whole vocabulary)": {**DEMO_V3, "draft_vocab": None},
    "dflash2 block 4": {**DEMO_V3, **DFLASH2, "block_size": 4, "tokens_per_step": 512},  # DSpark's 3 drafts
})
# Sliding-window drafter layers against full attention at the same budget (`fit --layer-types`,
# `--sliding-window`), on the demo's settings and its cache (--cache .demo/cache): read them
# with --baseline "demo (full attention)". The demo's replies start at position 32 or later
# (the chat template's system prompt), so a window of 16 truncates the context of every
# anchor and 32 that of most. One layer: under the is_causal rule a sliding layer is also
# causal inside the block, so the bidirectional row changes the window alone, and the
# causal row the causality alone.
DEMO_NOW = DEMO_V3  # the same settings as "demo (2026-12-03)", under the name the sliding rows' readings use
SLIDING = {"layer_types": ["sliding_attention"]}
VARIANTS.update({
    "demo (full attention)": DEMO_NOW,
    "sliding 16": {**DEMO_NOW, **SLIDING, "sliding_window": 16},
    "sliding 16 (bidirectional)": {**DEMO_NOW, **SLIDING, "sliding_window": 16, "is_causal": False},
    "sliding 32": {**DEMO_NOW, **SLIDING, "sliding_window": 32},
    "causal (full attention)": {**DEMO_NOW, "is_causal": True},
})

# Issue 54: every kind at 3 drafts a verify on the demo's settings and budget (1,200 steps of ~512
# block tokens, 1 layer), each with fit's default kl+ce and with DSpark's paper loss 0.9 TV + 0.1 CE
# (`--loss 0.9tv+0.1ce`). DFlash, DFlash2 and LiLiCorr verify 4 rows a block (128 blocks a step),
# DSpark 3 (170 blocks). DFlash and DSpark keep the demo's 4,096-token draft vocabulary; DFlash2 and
# LiLiCorr score the whole vocabulary (their heads index by token id). LiLiCorr keeps its kind's
# defaults (8 candidates a slot, a 2-layer lattice at the drafter's width); its convolutions are
# DFlash2's row's. Online tau over every held-out prompt (--online-prompts 1000: the demo's cache holds
# 77). Read them with --baseline "dspark kl+ce" (the demo's drafter).
TV_CE = {"loss": "0.9tv+0.1ce"}
THREE_DRAFTS = {**{k: v for k, v in DEMO_V3.items() if k != "block_size"}, "num_drafts": 3, "tokens_per_step": 512}
KINDS_54 = {
    "dflash": THREE_DRAFTS,
    "dspark": {**THREE_DRAFTS, **DSPARK, "tokens_per_step": 510},
    "dflash2": {**THREE_DRAFTS, **DFLASH2},
    "lilicorr": {**THREE_DRAFTS, "drafter": "lilicorr", "draft_vocab": None},
    "lilicorr+conv": {**THREE_DRAFTS, "drafter": "lilicorr", "draft_vocab": None, "lilicorr_convolutions": True,
                      "conv_group_size": 16},
}
for _kind, _settings in KINDS_54.items():
    VARIANTS[f"{_kind} kl+ce"] = _settings
    VARIANTS[f"{_kind} tv+ce"] = {**_settings, **TV_CE}


def copy_target_layer(target: Path, cache: Path, layer: int, out: Path) -> Path:
    """A one-layer drafter folder (z-lab's layout, float32) that starts as the target's own
    decoder layer `layer`, for `fit --init-from` (the warm start's loading path).

    fc copies the feature slot of target layer `layer - 1`'s output (it must be one of the
    cache's feature layers) and zeroes the others; hidden_norm and the layer's input norm take
    the copied layer's input norm, the final norm the target's. So the copied layer's keys and
    values over the context are the target's own at that layer (up to the drafter's q/k
    norms, which Llama targets lack: they start at ones), and its attention and MLP write in
    the basis the target's head reads. On a basis cache the warm start unfolds fc (bounded by
    the basis's truncation). Reused when `out` exists.
    """
    from safetensors import safe_open

    from dflash.shards.layout import TARGET_DIR
    from dflash.train.export import write_export
    from dflash.train.model import DFlashDrafter, DrafterConfig

    if out.exists():
        return out
    config = DrafterConfig.from_target(cache / TARGET_DIR, num_hidden_layers=1,
                                       num_drafts=DEMO_V2["block_size"] - 1)
    if layer - 1 not in config.target_layer_ids:
        raise SystemExit(f"copy layer {layer}: its input, layer {layer - 1}'s output, is not among the cache's "
                         f"feature layers {config.target_layer_ids}")
    slot = config.target_layer_ids.index(layer - 1)
    drafter = DFlashDrafter(config)
    H = config.hidden_size
    with safe_open(str(target / "model.safetensors"), "pt") as weights, torch.no_grad():
        def tensor(name: str) -> torch.Tensor:
            return weights.get_tensor(name).float()

        prefix = f"model.layers.{layer}."
        state = {name: tensor(prefix + name) for name in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight")}
        drafter.layers[0].load_state_dict(state, strict=False)  # q_norm / k_norm stay ones
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, slot * H:(slot + 1) * H] = torch.eye(H)
        drafter.hidden_norm.weight.copy_(state["input_layernorm.weight"])
        drafter.norm.weight.copy_(tensor("model.norm.weight"))
    return write_export(drafter, out, dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="the embedded default's cache (.demo/cache)")
    parser.add_argument("--target", type=Path, required=True, help="the target folder (online tau)")
    parser.add_argument("--prompts", type=Path, required=True, help="the prompts file the cache was built from")
    parser.add_argument("--work", type=Path, required=True, help="where runs and tau.jsonl go (reused)")
    parser.add_argument("--variants", default="all",
                        help=f"comma-separated labels (a whole label picks that row alone, first words every row "
                        f"they start), or all: {', '.join(VARIANTS)}")
    parser.add_argument("--baseline", default="kl+ce",
                        help="the row every other is compared with, seed by seed (fit's default loss)")
    parser.add_argument("--more-data", type=Path,
                        help=f"for '{MORE_DATA}': a cache built like --cache from more conversations")
    parser.add_argument("--more-data-prompts", type=Path, help="the prompts file --more-data was built from")
    parser.add_argument("--human-cache", type=Path,
                        help="for the '+ 3x human replies' rows: the second cache (demo.run's .demo/cache-human)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workers", type=int, default=1, help="runs at once (the CPU's threads shared out)")
    parser.add_argument("--threads", type=int,
                        help="torch threads per run (default: the CPU's shared out among the workers)")
    parser.add_argument("--online-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.variants == "all":
        chosen = list(VARIANTS)
    else:
        wanted = args.variants.split(",")

        def matches(label: str, word: str) -> bool:  # a whole label picks itself alone
            return label == word or (word not in VARIANTS and label.startswith(word + " "))

        chosen = [label for label in VARIANTS if any(matches(label, w) for w in wanted)]
        unknown = [w for w in wanted if not any(matches(label, w) for label in VARIANTS)]
        if unknown:
            parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    baseline = args.baseline
    if baseline not in VARIANTS:
        parser.error(f"--baseline: unknown {baseline!r}; choose from {list(VARIANTS)}")
    if baseline not in chosen:
        chosen.insert(0, baseline)  # every variant is read against it
    if MORE_DATA_ROWS & set(chosen) and args.more_data is None:
        if args.variants != "all":
            parser.error(f"--variants {sorted(MORE_DATA_ROWS & set(chosen))} need --more-data CACHE")
        chosen = [label for label in chosen if label not in MORE_DATA_ROWS]
    if args.more_data is not None and args.more_data_prompts is None:
        parser.error("--more-data needs --more-data-prompts (the prompts file it was built from)")
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = {"date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}, "
                         f"load average {os.getloadavg()[0]:.1f} at start"}

    for label in chosen:  # the copy-init sources, built once into WORK
        source = VARIANTS[label].get("init_from")
        if source and source.startswith("copy-layer-"):
            path = copy_target_layer(args.target, args.cache, int(source.rsplit("-", 1)[1]), args.work / source)
            VARIANTS[label] = {**VARIANTS[label], "init_from": str(path)}

    human = [label for label in chosen if VARIANTS[label].get("extra_cache") == HUMAN_CACHE]
    if human and args.human_cache is None:
        parser.error(f"--variants {human} need --human-cache CACHE")

    def job(label: str, seed: int) -> Job:
        overrides = VARIANTS[label]
        if overrides.get("extra_cache") == HUMAN_CACHE:
            overrides = {**overrides, "extra_cache": str(args.human_cache)}
        if label in MORE_DATA_ROWS:
            return Job(label, str(args.more_data), seed, overrides, prompts=str(args.more_data_prompts))
        return Job(label, str(args.cache), seed, overrides)

    jobs = [job(label, int(seed))
            for seed in args.seeds.split(",") for label in chosen]
    records = run_jobs(jobs, args.work, target=args.target, prompts=args.prompts,
                       online_prompts=args.online_prompts, max_new_tokens=args.max_new_tokens, workers=args.workers,
                       threads=args.threads)
    report["runs"] = [records[job.key] for job in jobs]
    report["summary"] = summarize(jobs, records, baseline=baseline)
    report["seconds"] = time.perf_counter() - started
    print(f"recipe benchmark, {report['date']}, {report['machine']}\n")
    print("\n".join(format_table(report["summary"], f"tau on {args.cache.name}, one change per row",
                                        baseline=baseline)))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
