"""Reading a drafter back: from a run folder's checkpoint (`load_drafter`) or from an exported
Hugging Face folder (`load_exported`), the one reader that `eval`, `export`, `fit --init-from`
and the bench scripts share.

It sits above the run folder's names (run_folder.py) and its checkpoints (checkpoint.py) and
below export.py, which writes the exported folder (its format is described there) and reads a
run's drafter through `load_drafter`; the exported folder's file names and the reading side
of its config.json (`drafter_config_from_hf`, the reverse of export's `hf_config`) are here,
so that nothing below export.py imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.train import drafters
from dflash.train.checkpoint import latest_checkpoint
from dflash.train.model import FULL_ATTENTION, SLIDING_ATTENTION, DFlashDrafter, DrafterConfig
from dflash.train.run_folder import CHECKPOINTS_DIR, DRAFTER_CONFIG_FILE, RUN_CONFIG_FILE, STATE_FILE, WEIGHTS_FILE

# The exported folder's files (export.py adds its model card, README.md).
HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"


@dataclass
class LoadedDrafter:
    """A drafter and where it came from."""

    drafter: DFlashDrafter
    checkpoint: Path
    """The checkpoint folder (RUN/checkpoints/step-N) or exported folder it was read from."""
    step: int | None
    """Training step of the checkpoint (None for an exported folder)."""
    fit_config: dict[str, Any] | None
    """RUN/config.json, when loaded from a run."""


def load_drafter(run: str | Path | None, checkpoint: str | Path | None = None, *,
                 device: torch.device | str = "cpu") -> LoadedDrafter:
    """The drafter of `checkpoint` (a RUN/checkpoints/step-N folder, or an exported folder),
    by default RUN's newest complete checkpoint. Weights stay float32."""
    from safetensors.torch import load_file

    if checkpoint is not None and is_exported(checkpoint):
        fit_config = _read_json(Path(run) / RUN_CONFIG_FILE) if run is not None else None
        return LoadedDrafter(load_exported(checkpoint, device=device), Path(checkpoint), None, fit_config)
    if run is None:
        raise ValueError("give --run (a folder written by dflash-train fit), or --checkpoint with an "
                         "exported drafter folder")
    run = Path(run)
    fit_config = _read_json(run / RUN_CONFIG_FILE)
    drafter_config = drafters.config_from_dict(_read_json(run / DRAFTER_CONFIG_FILE))
    if checkpoint is None:
        checkpoint = latest_checkpoint(run)
        if checkpoint is None:
            raise ValueError(f"{run}/{CHECKPOINTS_DIR} holds no complete checkpoint: train first, or pass "
                             "--checkpoint")
    checkpoint = Path(checkpoint)
    weights = checkpoint / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"{weights} does not exist: --checkpoint takes a RUN/{CHECKPOINTS_DIR}/step-N folder "
                         "or an exported drafter folder")
    drafter = drafters.make(drafter_config)
    load_weights(drafter, load_file(str(weights)), weights)
    state = _read_json(checkpoint / STATE_FILE) if (checkpoint / STATE_FILE).is_file() else {}
    return LoadedDrafter(drafter.to(device), checkpoint, state.get("step"), fit_config)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: is this a run folder written by dflash-train fit?") from None


def drafter_config_from_hf(data: dict[str, Any], where: str) -> DrafterConfig:
    """A DrafterConfig from an exported (or z-lab) config.json; ValueError naming `where` and
    the field when the checkpoint uses a feature this drafter does not implement."""
    dflash = data.get("dflash_config") or {}

    def pick(name: str, default: Any = None) -> Any:
        return dflash.get(name, data.get(name, default))

    kind = drafters.of_hf(data, where)
    for other in drafters.kinds():  # another kind's own fields: that kind's architecture is missing
        foreign = [f"dflash_config.{name}" for name in other.dflash_config_keys
                   if name not in kind.dflash_config_keys and pick(name) is not None]
        if foreign:
            raise ValueError(f"{where}: the checkpoint sets {foreign}, {other.title}'s fields, under architectures "
                             f"{data.get('architectures')!r}: a {other.title} drafter's architectures is "
                             f"[{other.architecture!r}] (this one loads as {kind.title}, without them)")
    kind.check_hf(data, where)  # the kind's block layout and heads
    unsupported = {
        "attention_bias": bool(data.get("attention_bias")),
        "rope_parameters.rope_type": (data.get("rope_parameters") or {}).get("rope_type", "default") != "default",
        "hidden_act": data.get("hidden_act", "silu") != "silu",
        # vLLM's DFlash loader (also z-lab's reference: output_multiplier, final_logit_softcapping)
        "dflash_config.attention_sink_bias": bool(dflash.get("attention_sink_bias",
                                                             data.get("add_swa_attention_sink_bias"))),
        "dflash_config.attention_value_scale": dflash.get("attention_value_scale") is not None,
        "dflash_config.input_embedding_scale": float(pick("input_embedding_scale", 1.0)) != 1.0,
        "dflash_config.output_multiplier": float(pick("output_multiplier", 1.0)) != 1.0,
        "dflash_config.final_logit_softcapping": bool(pick("final_logit_softcapping")),
        "is_neox_style": not data.get("is_neox_style", True),
        "logit_scale": float(data.get("logit_scale", 1.0)) != 1.0,
        "target_hidden_size": data.get("target_hidden_size") not in (None, data.get("hidden_size")),
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ValueError(f"{where}: this drafter implements Qwen3-style attention without bias or sinks, "
                         f"default half-split RoPE, SiLU and unscaled embeddings, values and logits; the "
                         f"checkpoint sets {bad}")
    layer_types, sliding_window, is_causal = attention_layout(data, where)
    for name in ("target_layer_ids", "mask_token_id"):
        if pick(name) is None:
            raise ValueError(f"{where}: dflash_config.{name} is missing")
    rope_theta = (data.get("rope_parameters") or {}).get("rope_theta", data.get("rope_theta", 10000.0))
    heads = int(data["num_attention_heads"])
    return kind.config_from_hf(dict(
        hidden_size=int(data["hidden_size"]),
        intermediate_size=int(data["intermediate_size"]),
        num_hidden_layers=int(data["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or int(data["hidden_size"]) // heads),
        vocab_size=int(data["vocab_size"]),
        target_layer_ids=[int(i) for i in pick("target_layer_ids")],
        num_target_layers=int(pick("num_target_layers", max(pick("target_layer_ids")) + 1)),
        num_drafts=kind.num_drafts(int(pick("block_size", 16))),  # vLLM's block_size: the kind's rows
        mask_token_id=int(pick("mask_token_id")),
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(data.get("max_position_embeddings", 32768)),
        initializer_range=float(data.get("initializer_range", 0.02)),
        draft_vocab_size=None if data.get("draft_vocab_size") in (None, data["vocab_size"])
        else int(data["draft_vocab_size"]),
        layer_types=layer_types,
        sliding_window=sliding_window,
        is_causal=is_causal,
    ), data)


def attention_layout(data: dict[str, Any], where: str) -> tuple[list[str] | None, int | None, bool | None]:
    """(layer_types, sliding_window, is_causal) of a DFlash config.json, read as vLLM's DFlash
    loader reads them (`_resolve_layer_attention`): `layer_types`, or every layer sliding
    under `dflash_config.use_swa`; the window from `dflash_config.swa_window_size`, else the
    top-level `sliding_window`, which transformers' Qwen3Config keeps only with
    `use_sliding_window`; causality from `is_causal`, else `dflash_config.causal`, else None
    (the rule: sliding layers causal). ValueError naming the field for what cannot be honoured."""
    dflash = data.get("dflash_config") or {}
    n = int(data["num_hidden_layers"])
    layer_types = data.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown or len(layer_types) != n:
            raise ValueError(f"{where}: layer_types {layer_types} is not one of {FULL_ATTENTION!r} or "
                             f"{SLIDING_ATTENTION!r} per layer ({n} layers): this drafter implements those two")
    if layer_types is None or (dflash.get("use_swa") and SLIDING_ATTENTION not in layer_types):
        layer_types = [SLIDING_ATTENTION if dflash.get("use_swa") else FULL_ATTENTION] * n
    window = None
    if SLIDING_ATTENTION in layer_types:
        window = dflash.get("swa_window_size")
        if window is None and data.get("use_sliding_window"):
            window = data.get("sliding_window")
        if window is None:
            raise ValueError(f"{where}: layer_types has {SLIDING_ATTENTION} layers but no window: set sliding_window "
                             "with use_sliding_window true (transformers' Qwen3Config drops sliding_window without "
                             "it, and vLLM then refuses the folder), or dflash_config.swa_window_size")
        window = int(window)
    causal = data.get("is_causal")
    if causal is None:
        causal = dflash.get("causal")
    return layer_types, window, None if causal is None else bool(causal)


def read_draft_vocab(state: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """The reverse of export.py's `draft_vocab_tensors`: `state` with `lm_head.weight` and `d2t`
    as the drafter's `draft_head` and `draft_ids` (an export with a draft vocabulary)."""
    if "d2t" not in state and "lm_head.weight" not in state:
        return state
    if "d2t" not in state or "lm_head.weight" not in state:
        raise ValueError(f"{where}: a draft vocabulary needs both lm_head.weight and d2t, the file has one")
    state = dict(state)
    offsets = state.pop("d2t").long()
    state["draft_ids"] = offsets + torch.arange(offsets.shape[0])
    state["draft_head"] = state.pop("lm_head.weight")
    return state


def is_exported(path: str | Path) -> bool:
    """Whether `path` is a folder with a DFlash draft config.json and weights."""
    path = Path(path)
    return (path / HF_CONFIG_FILE).is_file() and (path / HF_WEIGHTS_FILE).is_file()


def load_exported(path: str | Path, *, device: torch.device | str = "cpu",
                  dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load an exported folder (ours or z-lab's format) into a DFlashDrafter."""
    from safetensors.torch import load_file

    path = Path(path)
    config = drafter_config_from_hf(json.loads((path / HF_CONFIG_FILE).read_text()), str(path / HF_CONFIG_FILE))
    drafter = drafters.make(config)
    load_weights(drafter, read_draft_vocab(load_file(str(path / HF_WEIGHTS_FILE)), path / HF_WEIGHTS_FILE),
                 path / HF_WEIGHTS_FILE)
    return drafter.to(device=device, dtype=dtype)


def load_weights(drafter: DFlashDrafter, state: dict[str, torch.Tensor], where: Path) -> None:
    """Load `state` into `drafter`, refusing (ValueError naming `where`) names or shapes that
    differ from the drafter's config."""
    expected = drafter.state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{where}: parameters do not match the drafter's config: missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{where}: {name} has shape {tuple(tensor.shape)}, the config implies "
                             f"{tuple(expected[name].shape)}")
    drafter.load_state_dict({name: t.to(expected[name].dtype) for name, t in state.items()})


__all__ = ["HF_CONFIG_FILE",
           "attention_layout", "HF_WEIGHTS_FILE", "LoadedDrafter", "drafter_config_from_hf",
           "is_exported", "load_drafter", "load_exported", "load_weights", "read_draft_vocab"]
