"""`dflash-train export`: a trained drafter as a Hugging Face folder in z-lab's DFlash format.
Such a folder is read back by train/loading.py (`load_exported`; its `load_drafter`, which
reads a run's checkpoint for the export, also takes an exported folder as `--checkpoint`).

The folder holds what z-lab/dflash's `DFlashDraftModel.from_pretrained` and the serving
engines that adopted its format read:

- `config.json`: a Qwen3 config (`model_type: "qwen3"`, every attention/MLP/norm/RoPE field
  written out, RoPE both as `rope_parameters` and as the older top-level `rope_theta`) plus
  the DFlash fields: `architectures: ["DFlashDraftModel"]`,
  top-level `block_size` (the block's drafter rows, the kind's for its num_drafts: vLLM's
  default num_speculative_tokens is derived from it) and `num_target_layers`, and `dflash_config` with
  `target_layer_ids` (the target decoder layers whose outputs feed the drafter, in feature
  order; Hugging Face `hidden_states[id + 1]`) and `mask_token_id` (a row of the target's
  embedding).
- The attention layout, as z-lab's reference and vLLM's DFlash loader read it: `layer_types`
  (one per layer), `sliding_window` and `use_sliding_window` (true when a layer slides:
  transformers' Qwen3Config drops `sliding_window` without it); causality as the drafter's
  `is_causal`: unset, the layer rule (sliding layers causal, full ones bidirectional, and
  `dflash_config.causal: false` when no layer slides, as before); set, top-level `is_causal`
  and `dflash_config.causal` both (vLLM reads `is_causal` first, then `dflash_config.causal`;
  z-lab's reference `is_causal` only).
- `model.safetensors`: the drafter's parameters in bfloat16 by default (`--dtype`), under z-lab's names (`fc.weight`,
  `hidden_norm.weight`, `norm.weight`, `layers.N.self_attn.{q,k,v,o}_proj.weight`,
  `layers.N.self_attn.{q,k}_norm.weight`, `layers.N.mlp.{gate,up,down}_proj.weight`,
  `layers.N.{input,post_attention}_layernorm.weight`). No embedding and no LM head: the
  drafter borrows the target's, frozen.
- `README.md`: a model card with the training config, the cache it was trained from and
  the acceptance length measured by `dflash-train eval` for this checkpoint, when there is one.

Every file is readable as the user's umask allows (0644 by default), so a serving process
running as another user can load it.

No `auto_map`: the folder ships no modelling code, so `AutoModel` with trust_remote_code
cannot load it; load it with z-lab's class (or a serving engine), as their checkpoints are.

What this file trades off: the config is written field by field rather than through
`transformers.Qwen3Config.to_dict()`, so the file does not change with the installed
transformers version and carries no unrelated defaults (id2label, return_dict, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import click
import torch

from dflash.common.commands import DflashCommand
from dflash.common.files import atomic_dir
from dflash.common.options import PATH, check_choices, config_options, given
from dflash.shards import TargetInfo, open_cache
from dflash.shards.layout import TARGET_DIR, TARGET_INFO_FILE
from dflash.train import drafters
from dflash.train.loading import (
    HF_CONFIG_FILE,
    HF_WEIGHTS_FILE,
    LoadedDrafter,
    load_drafter,
)
from dflash.train.model import DRAFT_BUFFERS, FULL_ATTENTION, DFlashDrafter, DrafterConfig
from dflash.train.run_folder import eval_results_path, held_out_eval
from dflash.train.serving import VLLM_VERSION, vllm_refusal

ExportDtype = Literal["bfloat16", "float32", "float16"]
DTYPES = {name: getattr(torch, name) for name in get_args(ExportDtype)}
# What serving engines run drafters in; float16 is offered but has collapsed acceptance in
# some engines (the target features overflow it).
DEFAULT_EXPORT_DTYPE = "bfloat16"
# The exported folder's model card (its config.json and model.safetensors: loading.py).
CARD_FILE = "README.md"


# ---------------------------------------------------------------------------------------
# The format
# ---------------------------------------------------------------------------------------


def hf_config(config: DrafterConfig, *, dtype: str, token_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of an exported drafter. token_ids: bos/eos/pad ids of the target (optional)."""
    import transformers

    kind = drafters.of_config(config)
    n = config.num_hidden_layers
    sliding = config.layer_types is not None
    causal = {} if config.is_causal is None and sliding else {"causal": bool(config.is_causal)}
    data: dict[str, Any] = {
        "architectures": [kind.architecture],
        "model_type": "qwen3",
        "block_size": kind.hf_block_size(config),  # vLLM's and SGLang's field: the block's rows
        "num_target_layers": config.num_target_layers,
        # Read by z-lab's DFlashDraftModel (target_layer_ids, mask_token_id), vLLM's DFlash
        # loader (also causal and use_swa) and SGLang's (block_size here or top-level).
        "dflash_config": {
            "target_layer_ids": list(config.target_layer_ids),
            "mask_token_id": config.mask_token_id,
            "block_size": kind.hf_block_size(config),
            **causal,
            "use_swa": False,
            **kind.dflash_config_fields(config),  # the kind's own (vLLM's loader reads them here)
        },
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": config.layer_types or [FULL_ATTENTION] * n,
        "use_sliding_window": sliding,
        "sliding_window": config.sliding_window,
        "max_window_layers": n,
        "tie_word_embeddings": False,
        "initializer_range": config.initializer_range,
        "use_cache": True,
        "dtype": dtype,
        "transformers_version": transformers.__version__,
    }
    if config.is_causal is not None:
        data["is_causal"] = config.is_causal
    if config.draft_vocab_size is not None:  # vLLM's DFlash loader: its own head of these rows, and d2t
        data["draft_vocab_size"] = config.draft_vocab_size
    data.update(kind.hf_fields(config))  # the kind's heads
    for key, value in (token_ids or {}).items():
        if value is not None:
            data[key] = value
    return data


def vllm_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors (name: shape) an exported folder with this config.json must hold for vLLM's
    loader, read from vLLM 0.32's module trees (`qwen3_dflash.py`; a kind's heads: its `head_tensors`; the names
    as they stand in the file; vLLM prefixes `model.` to all but `lm_head` and turns `d2t` into
    `draft_id_to_target_id`). vLLM's `load_weights` checks none of this: a tensor left out stays
    uninitialised memory and drafts garbage, so the tests compare exports to it."""
    h = config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hd, inner, vocab = config["head_dim"], config["intermediate_size"], config["vocab_size"]
    draft = config.get("draft_vocab_size") or vocab
    width = len(config["dflash_config"]["target_layer_ids"]) * h  # target_hidden_size = hidden_size here
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (h, width), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * hd, h),
                       p + "self_attn.k_proj.weight": (kv_heads * hd, h),
                       p + "self_attn.v_proj.weight": (kv_heads * hd, h),
                       p + "self_attn.o_proj.weight": (h, heads * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (inner, h), p + "mlp.up_proj.weight": (inner, h),
                       p + "mlp.down_proj.weight": (h, inner), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    if draft < vocab:  # a reduced head must ship with its id map, or vLLM refuses it
        shapes.update({"lm_head.weight": (draft, h), "d2t": (draft,)})
    shapes.update(drafters.of_hf(config, "config.json").head_tensors(config))
    return shapes


def draft_vocab_tensors(drafter: DFlashDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A draft vocabulary under EAGLE-3's names, as vLLM loads them: `lm_head.weight` [V_d, H]
    in `dtype` and `d2t` [V_d] int64 offsets (target id = draft id + d2t[draft id]); {} without."""
    if drafter.draft_ids is None:
        return {}
    ids = drafter.draft_ids.detach().to("cpu", torch.long)
    return {"lm_head.weight": drafter.draft_head.detach().to("cpu", dtype).contiguous(),
            "d2t": (ids - torch.arange(ids.shape[0])).contiguous()}


def write_export(drafter: DFlashDrafter, out: str | Path, *, dtype: torch.dtype = DTYPES[DEFAULT_EXPORT_DTYPE],
                 token_ids: dict[str, Any] | None = None, card: str | None = None) -> Path:
    """Write the folder: config.json, model.safetensors in `dtype`, README.md (when `card`
    is given), each file readable as the umask allows.

    Written under a temporary name and renamed, so `out` exists complete or not at all; an
    existing `out` is refused (ValueError) rather than overwritten.
    """
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists():
        raise ValueError(f"{out} already exists: remove it or export to another --out")
    ids = list(drafter.config.target_layer_ids)
    if ids != sorted(set(ids)):
        raise ValueError(
            f"target_layer_ids {ids} are not strictly ascending: serving engines (vLLM, SGLang) sort and "
            "de-duplicate them, so fc's column blocks would meet the wrong layers; retrain on a cache "
            "built with ascending, distinct --feature-layers")
    state = drafter.state_dict()
    dtype_name = next(name for name, value in DTYPES.items() if value == dtype)
    assert not any(name.split(".")[0] in ("embed_tokens", "lm_head") for name in state), sorted(state)
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in state.items() if name not in DRAFT_BUFFERS}
    tensors.update(draft_vocab_tensors(drafter, dtype))
    config = hf_config(drafter.config, dtype=dtype_name, token_ids=token_ids)
    with atomic_dir(out) as tmp:
        try:
            save_file(tensors, str(tmp / HF_WEIGHTS_FILE), metadata={"format": "pt"})
        except Exception as error:  # safetensors raises SafetensorError, not OSError, on a full disk
            raise OSError(f"{tmp / HF_WEIGHTS_FILE}: cannot write the drafter's weights: {error}; "
                          f"free space under {out.parent} and export again") from error
        (tmp / HF_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if card is not None:
            (tmp / CARD_FILE).write_text(card)
    return out


def _plural(count: Any, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def model_card(loaded: LoadedDrafter, *, evaluation: dict[str, Any] | None,
               held_out: dict[str, Any] | None = None, serving_note: str | None = None) -> str:
    """README.md of an export: what the drafter is for, how it was trained, what it measured;
    `serving_note` (an engine's gap for this target) follows the serving commands."""
    c = loaded.drafter.config
    kind = drafters.of_config(c)
    fit = loaded.fit_config or {}
    caches = []
    for path in fit.get("cache", []):
        try:
            cache = open_cache(path, check_rows=False)
        except (ValueError, OSError) as error:
            caches.append({"path": path, "note": f"not readable at export time: {error}"})
            continue
        spec = cache.spec
        caches.append({
            "path": path, "target": spec.target.get("name"),
            "num_sequences": len(cache), "num_tokens": int(cache.num_tokens),
            "layer_ids": spec.layer_ids, "top_k": spec.top_k, "feature_codec": spec.feature_codec,
            "topk_codec": spec.topk_codec, "max_length": spec.max_length,
            "regenerated": spec.regenerated, "generation_temperature": spec.generation_temperature,
            "inputs": spec.inputs,
        })
    target = next((entry.get("target") for entry in caches if entry.get("target")), None)
    lines = [
        "---",
        "library_name: transformers",
        "tags: [dflash, speculative-decoding, draft-model]",
        *([f"base_model: {target}"] if target else []),
        "---",
        "",
        f"# {kind.title} drafter{f' for {target}' if target else ''}",
        "",
        "A block-diffusion draft model for speculative decoding (DFlash, arXiv 2602.06036), trained "
        f"with dflash from an offline target cache. It drafts {c.num_drafts} tokens per verify of "
        f"{c.num_drafts + 1} (the drafts and the target's bonus token) in one forward from the target's "
        f"layer outputs {c.target_layer_ids} (of {c.num_target_layers} "
        f"layers; Hugging Face `hidden_states[id + 1]`). "
        + ("It has no embedding and no LM head: it uses the target's, frozen. " if c.draft_vocab_size is None else
           f"It has no embedding (it uses the target's) and an LM head of {c.draft_vocab_size:,} rows, the "
           "target's own rows of its draft vocabulary, frozen. ")
        + f"Mask token id: {c.mask_token_id}.",
        "",
        f"Shape: {_plural(c.num_hidden_layers, 'Qwen3-style layer')}, hidden {c.hidden_size}, MLP "
        f"{c.intermediate_size}, {c.num_attention_heads} query / {c.num_key_value_heads} key-value "
        f"heads of {c.head_dim}, RoPE theta {c.rope_theta:g}." + _attention_sentence(c),
        "",
        *(kind.card_lines(c) + [""] if kind.card_lines(c) else []),  # the kind's paragraph, if any
        *kind.serving_lines(c, target),
        *(["", serving_note] if serving_note else []),
        "",
        "## Measured acceptance length",
        "",
    ]
    if evaluation:
        lines += _evaluation_lines(evaluation)
    elif held_out and held_out.get("tau") is not None:
        lines += [f"Held-out tau during training (teacher-forced, {_plural(held_out.get('blocks'), 'block')}): "
                  f"{held_out['tau']:.3f} at step {held_out.get('step')}. Run `dflash-train eval` on the run "
                  "before exporting for the full offline and online figures."]
    else:
        lines += ["Not measured for this checkpoint: run `dflash-train eval` on the run before exporting."]
    lines += [
        "",
        "## Training",
        "",
        f"Checkpoint: `{loaded.checkpoint}`" + (f" (step {loaded.step})" if loaded.step is not None else ""),
        *([f"Warm-started from `{fit['init_from']}` (`fit --init-from`; RUN/run.json holds its sha256)."]
          if fit.get("init_from") else []),
        "",
        "```json",
        json.dumps(fit, indent=2) if fit else "{}",
        "```",
        "",
        "## Training data (dflash caches)",
        "",
        "```json",
        json.dumps(caches, indent=2),
        "```",
        "",
    ]
    return "\n".join(lines)


def _attention_sentence(c: DrafterConfig) -> str:
    """The layout of the layers' attention, when it is not every layer full and bidirectional."""
    if c.layer_types is None and c.is_causal is None:
        return ""
    kinds = [("sliding window " + str(window) if window else "full") + (", causal" if causal else ", bidirectional")
             for window, causal in map(c.layer_attention, range(c.num_hidden_layers))]
    return f" Attention by layer: {'; '.join(kinds)} inside the block."


def _evaluation_lines(evaluation: dict[str, Any]) -> list[str]:
    lines = ["| measure | acceptance length (tau) | on |", "|---|---|---|"]
    if evaluation.get("acceptance_length") is not None:
        lines.append(f"| offline, all held-out anchors | {evaluation['acceptance_length']:.3f} | "
                     f"{_plural(evaluation.get('num_anchors'), 'anchor')} of "
                     f"{_plural(evaluation.get('num_sequences'), 'sequence')} |")
    if evaluation.get("replay_acceptance_length") is not None:
        lines.append(f"| offline, greedy decoding replayed | {evaluation['replay_acceptance_length']:.3f} | "
                     f"{evaluation.get('num_replay_verifications')} verifications |")
    online = evaluation.get("online")
    if online and online.get("acceptance_length") is not None:
        how = f"sampled at temperature {online['temperature']:g}" if online.get("temperature") else "greedy"
        lines.append(f"| online, {how} speculative decoding | {online['acceptance_length']:.3f} | "
                     f"{online.get('num_prompts')} prompts, lossless: {online.get('lossless')}, "
                     f"{online.get('tokens_per_s') or 0:.1f} tok/s against "
                     f"{online.get('baseline_tokens_per_s') or 0:.1f} tok/s plain {how.split(' at ')[0]} "
                     f"({online.get('device', '?')}) |")
    for suite in evaluation.get("suites", []):
        how = f"temperature {suite['temperature']:g}" if suite["temperature"] else "greedy"
        lines.append(f"| online, {suite['suite']} ({how}) | {suite['acceptance_length'] or 0:.3f} | "
                     f"{suite['num_prompts']} prompts, {suite['num_turns']} turns |")
    verify = evaluation.get("verify_size", evaluation.get("block_size"))  # (block_size: an eval before the rename)
    lines += ["", f"Verify size {verify} ({verify - 1 if verify else '?'} drafts and the target's bonus token); "
              "tau counts the bonus token."]
    return lines


@dataclass(kw_only=True)
class ExportConfig:
    """`dflash-train export`: which checkpoint, where, in which dtype."""

    run: Path = field(metadata={PATH: "dir"})
    """Run folder written by dflash-train fit."""
    checkpoint: Path | None = None
    """A RUN/checkpoints/step-N folder (default: the newest complete one)."""
    out: Path
    """Folder to create."""
    dtype: ExportDtype = DEFAULT_EXPORT_DTYPE
    """Weight dtype in model.safetensors: bfloat16 is what engines serve (training keeps float32
    master weights; float32 on request)."""

    def __post_init__(self) -> None:
        check_choices(self)
        self.run, self.out = Path(self.run), Path(self.out)
        if self.checkpoint is not None:
            self.checkpoint = Path(self.checkpoint)


def vllm_warning(run: str | Path) -> str | None:
    """One line when the pinned vLLM serves no DFlash drafter for the target of RUN's first cache
    (dflash.train.serving), naming the family and the reason; else None."""
    caches = json.loads((Path(run) / "config.json").read_text()).get("cache") or []
    if not caches or not (Path(caches[0]) / TARGET_DIR / TARGET_INFO_FILE).is_file():
        return None
    model_type = TargetInfo.load(Path(caches[0]) / TARGET_DIR).model_type
    reason = vllm_refusal(model_type)
    return None if reason is None else (f"Warning: the target is a {model_type} model, for which vLLM {VLLM_VERSION} "
                                        f"serves no DFlash drafter: {reason}")


def export_run(run: str | Path, out: str | Path, *, checkpoint: str | Path | None = None,
               dtype: str = DEFAULT_EXPORT_DTYPE) -> Path:
    """Export RUN's checkpoint (newest by default) to `out` with weights in `dtype`; returns `out`
    (the arguments are ExportConfig's, checked there)."""
    config = ExportConfig(run=run, out=out, checkpoint=checkpoint, dtype=dtype)
    run, out, dtype = config.run, config.out, config.dtype
    loaded = load_drafter(run, config.checkpoint)
    results = eval_results_path(run, loaded.checkpoint)
    evaluation = json.loads(results.read_text()) if results.is_file() else None
    token_ids = None
    caches = (loaded.fit_config or {}).get("cache") or []
    if caches and (Path(caches[0]) / TARGET_DIR / TARGET_INFO_FILE).is_file():
        target = TargetInfo.load(Path(caches[0]) / TARGET_DIR)
        token_ids = {key: getattr(target, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    refusal = vllm_warning(run)
    card = model_card(loaded, evaluation=evaluation, held_out=held_out_eval(run, loaded.step),
                      serving_note=None if refusal is None else refusal.removeprefix("Warning: "))
    if loaded.drafter.config.feature_width is not None:  # trained on basis coefficients: fold the basis in
        from dflash.train.basis import basis_of_caches, fold_basis

        loaded.drafter = fold_basis(loaded.drafter, basis_of_caches(caches, loaded.drafter.config.feature_basis_sha256))
    try:
        return write_export(loaded.drafter, out, dtype=DTYPES[dtype],
                            token_ids=token_ids, card=card)
    except OSError as error:
        raise OSError(f"--out {out}: cannot write the export there ({error.strerror or error}); choose a "
                      f"folder in a writable place") from error


@click.command("export", cls=DflashCommand)
@config_options(ExportConfig)
def export_command(**options: Any) -> None:
    """Write a Hugging Face folder in z-lab's DFlash draft format."""
    path = export_run(**given(options))  # ValueError/OSError: one line
    click.echo(f"exported {path} (config.json, model.safetensors, README.md)")
    refusal = vllm_warning(options["run"])
    if refusal is not None:
        click.echo(refusal, err=True)
    warning = drafters.of_hf(json.loads((path / HF_CONFIG_FILE).read_text()), str(path)).export_warning(path.name)
    if warning is not None:
        click.echo(warning, err=True)


__all__ = [
    "CARD_FILE",
    "ExportConfig",
    "export_command",
    "export_run",
    "hf_config",
    "model_card",
    "vllm_warning",
    "write_export",
]
