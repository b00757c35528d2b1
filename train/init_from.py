"""`dflash-train fit --init-from SOURCE`: start a run from an existing DFlash drafter's weights.

SOURCE is a drafter folder in z-lab's layout (`config.json` whose `architectures` names a
kind, train/drafters/, and `model.safetensors`, in any dtype: ours from `dflash-train export`,
or one z-lab published), a run folder of `dflash-train fit` (its newest complete checkpoint),
or one of its `RUN/checkpoints/step-N` folders. Weights only: the optimizer, the learning-rate
schedule and the data order start fresh.

The run takes from the source what its weights were trained with: the layer count (unless
`--num-layers` says otherwise, which is refused when it differs), the mask token (unless
`--mask-token-id` overrides it; a source mask token that is a stop, pad, bos or chat-template
token of this target is refused), RMSNorm epsilon and RoPE theta, and its attention layout
(`layer_types`, `sliding_window`, `is_causal`, each unless its flag overrides it; read as
z-lab's reference and vLLM read them, loading.py's `attention_layout`: a `sliding_attention`
layer without `is_causal` is causal). What a source uses that no drafter here implements
(attention sinks, scaled embeddings, values or logits, other layer types) is refused by name
(loading.py's `drafter_config_from_hf`). A kind's own tensors beyond the DFlash backbone
(`DrafterKind.owns`) go to a drafter of a kind that has them, whose shapes the kind checks
(`check_init`, naming the flag); a drafter without them starts its own fresh (a DFlash source
under a kind with heads or convolutions: the backbone is the source's). The block size may differ
(the weights do not depend on it). Every shape the weights imply must equal this run's, and
`target_layer_ids` must be the cache's feature layers: each mismatch is a one-line refusal
naming the field. A cache of another target than the source's is the point (adapting a
released drafter to a fine-tuned target) and is recorded, not refused.

Onto a basis cache (codec basis-bf16/basis-fp8: coefficients c = P^T D x), the source's raw
fc W [H, L*H] becomes fc' = W D^-1 P [H, r], the reverse of export's fold (train/basis.py):
fc' c = W D^-1 P P^T D x, which is W x up to the part of D x outside the basis's span
(shards/FORMAT.md, "The feature basis", states the bound).

The run records the source (path, kind, sha256 of its weights file, its config, its target's
fingerprint when known) in RUN/run.json under `init_from`. A rerun resumes from the run's own
checkpoints; `--init-from` given again must name the same weights (by sha256), another source
is refused.

`warm_start(drafter, state, source_config)` is the one loading path: it takes any state dict in
z-lab's parameter names with the config it was made for, so an init experiment (e.g. the
target's own decoder layers copied into the drafter) is a state dict and a config away.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.common.files import file_sha256, write_json_atomic
from dflash.shards.target_info import TargetInfo
from dflash.train import drafters
from dflash.train.checkpoint import latest_checkpoint
from dflash.train.identity import RUN_INFO_FILE, read_run_info
from dflash.train.mask_token import mask_token_refusal
from dflash.train.model import DRAFT_BUFFERS, SLIDING_ATTENTION, DFlashDrafter, DrafterConfig

RECORD_KEY = "init_from"
# The shape fields the weights imply, with what to do when the source's differs from the run's.
SHAPE_FIELDS = {
    "hidden_size": "the source was trained for a target of another width: start from a drafter of this "
                   "target's family, or train from scratch (drop --init-from)",
    "num_attention_heads": "the drafter's attention follows the target's config: start from a drafter made "
                           "for this target's shape, or drop --init-from",
    "num_key_value_heads": "the drafter's attention follows the target's config: start from a drafter made "
                           "for this target's shape, or drop --init-from",
    "head_dim": "the drafter's attention follows the target's config: start from a drafter made for this "
                "target's shape, or drop --init-from",
    "intermediate_size": "the drafter's MLP follows the target's config: start from a drafter made for this "
                         "target's shape, or drop --init-from",
    "vocab_size": "the drafter shares the target's embedding and LM head: start from a drafter of a target "
                  "with this vocabulary, or drop --init-from",
}


@dataclass
class InitSource:
    """A drafter to start from, as read (or as an earlier start of the run recorded it)."""

    path: str
    """The folder given to --init-from, resolved."""
    kind: str
    """"export" (a z-lab-layout folder) or "checkpoint" (a run's RUN/checkpoints/step-N)."""
    weights: str
    """Its weights file (model.safetensors)."""
    weights_sha256: str
    """sha256 of that file: what a rerun's --init-from must match."""
    config: DrafterConfig
    """The source's drafter config, raw-feature (a basis-trained checkpoint is folded)."""
    target_fingerprint: str | None = None
    """The source's target (a run records it; an export does not)."""

    def record(self) -> dict[str, Any]:
        """What RUN/run.json keeps under `init_from`."""
        return {"path": self.path, "kind": self.kind, "weights": self.weights,
                "weights_sha256": self.weights_sha256, "config": self.config.to_dict(),
                "target_fingerprint": self.target_fingerprint}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> InitSource:
        return cls(path=record["path"], kind=record["kind"], weights=record["weights"],
                   weights_sha256=record["weights_sha256"], config=drafters.config_from_dict(record["config"]),
                   target_fingerprint=record.get("target_fingerprint"))


def read_source(path: str | Path) -> InitSource:
    """The source at `path` (config and weights' sha256; the weights are read by `load_state`)."""
    from dflash.train.loading import drafter_config_from_hf, is_exported

    path = Path(path).expanduser().resolve()
    if is_exported(path):
        config_file = path / "config.json"
        config = drafter_config_from_hf(json.loads(config_file.read_text()), f"--init-from {config_file}")
        return InitSource(path=str(path), kind="export", weights=str(path / "model.safetensors"),
                          weights_sha256=file_sha256(path / "model.safetensors"), config=config)
    if (path / "drafter_config.json").is_file():  # a run folder: its newest complete checkpoint
        checkpoint = latest_checkpoint(path)
        if checkpoint is None:
            raise ValueError(f"--init-from {path}: the run holds no complete checkpoint; train it first, or "
                             "give a RUN/checkpoints/step-N or exported folder")
        run = path
    elif (path / "model.safetensors").is_file() and (path.parent.parent / "drafter_config.json").is_file():
        checkpoint, run = path, path.parent.parent
    else:
        raise ValueError(f"--init-from {path}: not a drafter folder (config.json + model.safetensors), a run "
                         "folder of dflash-train fit, nor a RUN/checkpoints/step-N folder")
    config = drafters.config_from_dict(json.loads((run / "drafter_config.json").read_text()))
    config = dataclasses.replace(config, feature_width=None, feature_basis_sha256=None)  # folded in load_state
    return InitSource(path=str(path), kind="checkpoint", weights=str(checkpoint / "model.safetensors"),
                      weights_sha256=file_sha256(checkpoint / "model.safetensors"), config=config,
                      target_fingerprint=read_run_info(run).get("target_fingerprint"))


def load_state(source: InitSource) -> dict[str, torch.Tensor]:
    """The source's raw-feature weights, float32, under z-lab's names; ValueError when the
    file is no longer the one recorded (its sha256 differs)."""
    from safetensors.torch import load

    data = Path(source.weights).read_bytes()
    found = hashlib.sha256(data).hexdigest()
    if found != source.weights_sha256:
        raise ValueError(f"--init-from {source.path}: {source.weights} has sha256 {found[:12]}, the run "
                         f"recorded {source.weights_sha256[:12]}: restore the source, or train into a new --out")
    if source.kind == "export":
        return {name: t.float() for name, t in load(data).items()}
    from dflash.train.basis import match_features
    from dflash.train.loading import load_drafter

    checkpoint = Path(source.weights).parent
    loaded = load_drafter(checkpoint.parent.parent, checkpoint)
    drafter = match_features(loaded.drafter, None, (loaded.fit_config or {}).get("cache"))  # raw features
    return {name: t.detach().float() for name, t in drafter.state_dict().items()}


# -- the run's side ----------------------------------------------------------------------


def resolve_source(run_dir: str | Path, init_from: str | None) -> InitSource | None:
    """The source of the run in `run_dir`: `init_from` read, or (not given) the one the run
    recorded; None for a run from scratch. ValueError when the run was started from another
    source (or from scratch) than `init_from` names."""
    run_dir = Path(run_dir)
    saved = read_run_info(run_dir).get(RECORD_KEY)
    if init_from is None:
        return InitSource.from_record(saved) if saved else None
    source = read_source(init_from)
    # A checkpoint, not config.json: other ranks may see rank 0's config.json of this very start.
    if saved is None and latest_checkpoint(run_dir) is not None:
        raise ValueError(f"--init-from {source.path}: {run_dir} was started without --init-from (from "
                         "random weights): resume it without --init-from, or train into a new --out")
    if saved is not None and saved["weights_sha256"] != source.weights_sha256:
        raise ValueError(f"--init-from {source.path}: weights sha256 {source.weights_sha256[:12]}, but "
                         f"{run_dir / RUN_INFO_FILE} records that the run started from {saved['path']} (sha256 "
                         f"{saved['weights_sha256'][:12]}): give that source, or train into a new --out")
    return source


def model_fields(source: InitSource | None, *, num_layers: int | None, mask_token_id: int | None,
                 default_num_layers: int) -> tuple[int, int | None]:
    """(num_layers, mask_token_id) for the run: the given ones, else the source's (num_layers:
    `default_num_layers` without a source; mask_token_id: None, the target's pick)."""
    if source is None:
        return (default_num_layers if num_layers is None else num_layers), mask_token_id
    if num_layers is not None and num_layers != source.config.num_hidden_layers:
        raise ValueError(f"--init-from {source.path}: num_hidden_layers is {source.config.num_hidden_layers} in the "
                         f"source, --num-layers gives {num_layers}: drop --num-layers (the source's is used) or "
                         f"pass --num-layers {source.config.num_hidden_layers}")
    return source.config.num_hidden_layers, (source.config.mask_token_id if mask_token_id is None else mask_token_id)


def attention_fields(source: InitSource | None, *, layer_types: list[str] | None, sliding_window: int | None,
                     is_causal: bool | None) -> tuple[list[str] | None, int | None, bool | None]:
    """(layer_types, sliding_window, is_causal) for the run: each given one, else the source's
    (a window only where a layer slides); without a source, the given ones (None: full,
    bidirectional). The weights do not depend on them, so a given one may differ from the
    source's."""
    if source is None:
        return layer_types, sliding_window, is_causal
    c = source.config
    if layer_types is not None and len(layer_types) != c.num_hidden_layers:
        raise ValueError(f"--init-from {source.path}: the source has {c.num_hidden_layers} layers, --layer-types "
                         f"gives {len(layer_types)}: give one type per layer of the source")
    layer_types = c.layer_types if layer_types is None else layer_types
    slides = layer_types is not None and SLIDING_ATTENTION in layer_types
    if sliding_window is None and slides:
        sliding_window = c.sliding_window
    return layer_types, sliding_window, c.is_causal if is_causal is None else is_causal


def adopt(config: DrafterConfig, source: InitSource, *, target_dir: str | Path, mask_given: bool) -> DrafterConfig:
    """The run's drafter config checked against the source's and given its trained-with
    numerics (rms_norm_eps, rope_theta); ValueError naming the first field that differs."""
    check_compatible(source.config, config, where=f"--init-from {source.path}")
    if not mask_given:
        why = mask_token_refusal(config.mask_token_id, TargetInfo.load(target_dir), target_dir)
        if why is not None:
            raise ValueError(f"--init-from {source.path}: the source's mask_token_id {config.mask_token_id} is {why} "
                             f"of this target: pass --mask-token-id with a token the target never generates "
                             "(the drafter then relearns it), or start from another drafter")
    return dataclasses.replace(config, rms_norm_eps=source.config.rms_norm_eps, rope_theta=source.config.rope_theta)


def check_compatible(source: DrafterConfig, config: DrafterConfig, *, where: str) -> None:
    """ValueError (one line: the field, both values, what to do) when weights made for `source`
    cannot be loaded into a drafter of `config`; block size and mask token may differ."""
    for name, advice in SHAPE_FIELDS.items():
        ours, theirs = getattr(config, name), getattr(source, name)
        if ours != theirs:
            raise ValueError(f"{where}: {name} is {theirs} in the source, {ours} for this run's target: {advice}")
    if source.num_hidden_layers != config.num_hidden_layers:
        raise ValueError(f"{where}: num_hidden_layers is {source.num_hidden_layers} in the source, "
                         f"{config.num_hidden_layers} for this run: pass --num-layers {source.num_hidden_layers}")
    drafters.of_config(config).check_init(source, config, where)
    if source.target_layer_ids != config.target_layer_ids:
        raise ValueError(f"{where}: target_layer_ids is {source.target_layer_ids} in the source, the cache's feature "
                         f"layers are {config.target_layer_ids}: rebuild the cache with dflash-precompute "
                         f"--feature-layers {','.join(map(str, source.target_layer_ids))}")


def unfold_basis(fc_weight: torch.Tensor, basis) -> torch.Tensor:
    """fc' = W D^-1 P [H, r] (float32) from a raw-feature fc W [H, L*H]: the reverse of
    export's fold fc = fc' P^T D, exact when r = L*H (P P^T = I)."""
    if fc_weight.shape[1] != basis.input_width:
        raise ValueError(f"the source's fc reads {fc_weight.shape[1]} features, the basis maps {basis.input_width}")
    scale = torch.from_numpy(basis.scale)  # [L*H]
    if not bool((scale != 0).all()):
        raise ValueError("the basis's scale D has zero entries: it cannot be inverted to warm-start onto it")
    projection = torch.from_numpy(basis.projection)  # [L*H, r] float32
    return (fc_weight.to("cpu", torch.float32) / scale) @ projection


def warm_start(drafter: DFlashDrafter, state: dict[str, torch.Tensor], source_config: DrafterConfig, *,
               basis=None, where: str = "--init-from") -> None:
    """Load `state` (z-lab parameter names, any dtype; made for `source_config`, raw features)
    into `drafter` in place. With `basis` (the drafter reads its coefficients), fc goes through
    `unfold_basis`. ValueError when the shapes or names do not fit."""
    from dflash.train.loading import load_weights

    check_compatible(source_config, drafter.config, where=where)
    c = drafter.config
    if (basis is None) != (c.feature_width is None):
        raise ValueError(f"{where}: the drafter reads {'coefficients' if c.feature_width else 'raw features'}; "
                         "pass the basis exactly when it reads a basis cache's coefficients")
    # The draft vocabulary is the run's own (chosen from its data before this call): a
    # source's, if it had one, is not carried over.
    state = {name: t for name, t in state.items() if name not in DRAFT_BUFFERS}
    state.update({name: t for name, t in drafter.state_dict().items() if name in DRAFT_BUFFERS})
    # A kind's heads (train/drafters/): a source without them warm-starts the drafter's
    # backbone, whose heads keep their fresh initial weights; a source's heads go to a drafter
    # that has them only, and one without drops them.
    own = drafter.state_dict()
    state = {name: t for name, t in state.items() if not drafters.is_head(name) or name in own}
    state.update({name: t for name, t in own.items() if drafters.is_head(name) and name not in state})
    if basis is not None:
        if basis.sha256() != c.feature_basis_sha256 or basis.rank != c.feature_width:
            raise ValueError(f"{where}: the basis is not the one the drafter reads (sha256 {c.feature_basis_sha256})")
        if "fc.weight" in state:
            state["fc.weight"] = unfold_basis(state["fc.weight"], basis)
    load_weights(drafter, state, Path(where))


def record_source(run_dir: str | Path, source: InitSource) -> None:
    """Add the source's record to RUN/run.json (after `record_run_target` wrote the rest)."""
    path = Path(run_dir) / RUN_INFO_FILE
    write_json_atomic(path, {**read_run_info(run_dir), RECORD_KEY: source.record()}, indent=1)


__all__ = ["InitSource", "adopt", "attention_fields", "check_compatible", "file_sha256", "load_state", "model_fields",
           "read_source", "record_source", "resolve_source", "unfold_basis", "warm_start"]
