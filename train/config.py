"""`dflash-train fit`'s configuration: one dataclass per component, composed into `FitConfig`.

Every leaf field's name is unique over all components and is its one user-facing key: the
flag (`spike_factor` is `--spike-factor`), the TOML key (at top level, or inside its
component's table, `[gating]`), and the key in `RUN/config.json`, which is flat (one key per
leaf field, `FitConfig.to_dict`). Each field's default and docstring exist once, here (or in
the component's own module); the flags' help is generated from them (`describe_fields`).

A rerun with the same RUN resumes, and refuses a config that differs in a field that would
change the numbers (a field whose metadata holds `RESUMABLE` may change between runs:
`RESUMABLE_CHANGES`). A field missing from a saved config.json (one written before the field
existed) counts as its default.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflash.common.options import (
    CHOICES,
    METAVAR,
    NONE_WORD,
    PATH,
    RESUMABLE,
    SEPARATOR,
    FieldInfo,
    check_choices,
    describe,
    field_docs,
    resumable,
)
from dflash.train import drafters
from dflash.train.gating import GatingConfig

DEFAULT_NUM_LAYERS = 5  # drafter layers of a run from scratch (the paper's Qwen3 drafters)
RENAMED = "block_size"  # num_drafts's key before the block was named once (`renamed`)
AUTO = {NONE_WORD: "auto"}
BOOKKEEPING = {RESUMABLE: True}  # a resumed run may change it: it does not change the numbers


def _positive(config: Any, *names: str) -> None:
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"fit config: {name} must be >= 1, got {getattr(config, name)}")


@dataclass(kw_only=True)
class ModelConfig:
    num_layers: int | None = field(default=None, metadata=AUTO)
    """Drafter decoder layers; auto: the --init-from source's, else 5."""
    num_drafts: int | None = field(default=None, metadata=AUTO)
    """Tokens drafted per verify (vLLM's num_speculative_tokens); the verify checks num_drafts + 1,
    the drafts and the target's bonus token. The drafter rows one block takes are the kind's;
    auto: the kind's default (a block of 16 rows)."""
    mask_token_id: int | None = field(default=None, metadata=AUTO)
    """Mask token id; auto: the tokenizer's mask token, else the first embedding row past the
    tokenizer's vocabulary, else a special token the chat template never writes (never a stop,
    pad or bos token)."""
    norm_init: Literal["ones", "target", "flat"] = "ones"
    """The final norm's initial weight: ones; target (the target's final norm, which the
    drafter's output shares the target's LM head with; needs `norm.weight` in the cache's
    target/head.safetensors, which stage one writes for every codec when the target's final
    norm is an RMSNorm); or flat (1/sqrt(hidden_size): the normed output has norm 1, not
    sqrt(hidden_size), so the untrained drafter's logits are near uniform; at norm
    sqrt(hidden_size) an output along the mask token's embedding meets head rows that share
    its direction and every logit is large, `python -m bench.start`)."""
    out_init: Literal["normal", "zero"] = "normal"
    """Initial o_proj and down_proj weights: normal (as every other linear), or zero (each
    decoder layer starts as the identity on the block's residual stream)."""

    draft_vocab: int | None = None
    """Draft from the N tokens the training replies use most, not the whole vocabulary: a head
    of N rows (the target's rows of them, frozen) makes the loss and each draft ~V/N times
    cheaper; the export adds `lm_head.weight` and `d2t`, which vLLM serves and z-lab's code
    does not load. None: the target's whole head (train/draft_vocab.py)."""
    layer_types: list[str] | None = field(default=None, metadata={NONE_WORD: "auto", SEPARATOR: ",",
                                                                  METAVAR: "auto|TYPES"})
    """Attention of each drafter layer, comma-separated, full_attention or sliding_attention (e.g.
    sliding_attention,sliding_attention,full_attention; its length sets num_layers); auto: the
    --init-from source's, else every layer full_attention."""
    sliding_window: int | None = field(default=None, metadata=AUTO)
    """Positions a sliding_attention layer's query reaches back: it sees keys at positions k >
    p - sliding_window of its own position p (z-lab's, vLLM's and Hugging Face's meaning); auto:
    the --init-from source's; needed when a layer slides."""
    is_causal: bool | None = field(default=None, metadata=AUTO)
    """Causal attention inside the block in every layer (on) or bidirectional in every layer (off);
    auto: the --init-from source's, else causal in sliding_attention layers only (how z-lab's
    reference and vLLM read a drafter config without is_causal)."""

    drafter: str = field(default=drafters.DEFAULT, metadata={CHOICES: drafters.names})
    """The drafter kind (train/drafters/): the family of drafter trained, exported and served;
    a kind's own options are flags of their own."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.layer_types is not None:
            unknown = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            if unknown or not self.layer_types:
                raise ValueError(f"fit config: layer_types takes full_attention or sliding_attention per layer, "
                                 f"got {self.layer_types}")
            if self.num_layers is not None and self.num_layers != len(self.layer_types):
                raise ValueError(f"fit config: num_layers {self.num_layers} and the {len(self.layer_types)} "
                                 "layer_types disagree: give one type per layer (or drop --num-layers)")
        if self.sliding_window is not None:
            _positive(self, "sliding_window")
        if self.draft_vocab is not None:
            _positive(self, "draft_vocab")
        if self.num_layers is not None:
            _positive(self, "num_layers")
        if self.num_drafts is not None:
            _positive(self, "num_drafts")


@dataclass(kw_only=True)
class DataConfig:
    anchors_per_seq: int = 512
    """Blocks per sequence per epoch (capped by the sequence's eligible positions)."""
    epochs: int = 6
    """Passes over the training sequences (each with freshly drawn anchors); max_steps, when
    set, overrides it."""
    max_steps: int | None = None
    """Train exactly this many steps, overriding epochs (more passes when the data is short, as
    the Hugging Face Trainer); the learning-rate schedule spans them."""
    tokens_per_step: int = 131072
    """Block tokens (anchors x block size) per optimizer step, over all ranks together."""
    seed: int = 0
    """Seed of the initial weights, the epoch permutations, anchors and the held-out set."""
    train_on: Literal["replies", "all"] = "replies"
    """Which positions anchor blocks and carry labels: replies (the cache's loss mask: the
    target's own tokens, as at inference), or all (every token, prompts and template included:
    the cached top-k exists at every position, so this is more distillation signal from the
    same cache at no stage-one cost; the labels at prompt positions are the target's
    predictions of text it did not write). fit's held-out loss follows it; `dflash-train
    eval` scores replies either way."""
    feature_noise: float = 0.0
    """Uniform noise in [-a, a] added to every context feature fc reads, in training only (in
    the cache's units: standardised coefficients on a basis cache). vllm-project/speculators
    adds 0.05 to the target's hidden states for every algorithm. Drawn from (seed, step), so a
    resumed run draws what the uninterrupted one did."""

    def __post_init__(self) -> None:
        check_choices(self)
        _positive(self, "anchors_per_seq", "epochs", "tokens_per_step")
        if not self.feature_noise >= 0:
            raise ValueError(f"fit config: feature_noise must be >= 0, got {self.feature_noise}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"fit config: max_steps must be >= 1 (or unset), got {self.max_steps}")


@dataclass(kw_only=True)
class OptimizerConfig:
    lr: float = 6e-4
    """Peak learning rate (AdamW)."""
    warmup_ratio: float = 0.04
    """Fraction of the steps spent in linear warm-up before the cosine decay to 0."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (the norm before clipping is logged)."""

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 <= self.warmup_ratio < 1 or not self.grad_clip > 0:
            raise ValueError("fit config: lr and grad_clip must be > 0 and warmup_ratio in [0, 1)")


@dataclass(kw_only=True)
class LossConfig:
    loss: Literal["kl", "ce", "kl+ce", "tv", "tv+ce", "0.9tv+0.1ce"] = "kl+ce"
    """kl: sparse KL to the cached top-k with a tail bucket; ce: cross-entropy to the target's
    top-1; kl+ce: kl + ce_weight * ce (the default: bench/RESULTS.md "recipe"); tv: total
    variation to the top-k with a tail bucket (a lower bound of the full TV, one minus the
    acceptance rate); tv+ce: tv + ce_weight * ce; 0.9tv+0.1ce: 0.9 * tv + 0.1 * ce, ce_weight
    ignored (the published recipe: train/README.md's loss section says whose)."""
    ce_weight: float = 0.5
    """Weight of the cross-entropy term in kl+ce and tv+ce."""
    decay_gamma: float | None = field(default=None, metadata=AUTO)
    """Position weights exp(-(k-1)/gamma); auto: by block size (7 for 16, 5 for 10, 4 for 8)."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.decay_gamma is not None and not self.decay_gamma > 0:
            raise ValueError(f"fit config: decay_gamma must be > 0 (or auto), got {self.decay_gamma}")


@dataclass(kw_only=True)
class CheckpointConfig:
    checkpoint_every: int = field(default=1000, metadata=BOOKKEEPING)
    """Steps between checkpoints (one is also written at the end)."""
    keep_checkpoints: int = field(default=3, metadata=BOOKKEEPING)
    """Complete checkpoints kept (the oldest are deleted)."""
    save_initial: bool = field(default=False, metadata=BOOKKEEPING)
    """Also checkpoint the untrained drafter as step 0, a baseline for `dflash-train eval`."""

    def __post_init__(self) -> None:
        _positive(self, "checkpoint_every", "keep_checkpoints")


@dataclass(kw_only=True)
class HeldOutConfig:
    """Held-out evaluation during fit (TOML section `[eval]`); not the `dflash-train eval`
    command's config, which is train/evaluate.py's EvalConfig."""

    eval_every: int = field(default=1000, metadata=BOOKKEEPING)
    """Steps between held-out evaluations (0: never)."""
    eval_fraction: float = 0.01
    """Fraction of the sequences held out (never trained on)."""
    eval_tokens: int = 131072
    """Block tokens scored per held-out evaluation (the start of a fixed held-out stream)."""

    def __post_init__(self) -> None:
        _positive(self, "eval_tokens")
        if self.eval_every < 0:
            raise ValueError(f"fit config: eval_every must be >= 0, got {self.eval_every}")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"fit config: eval_fraction must be in [0, 1), got {self.eval_fraction}")


@dataclass(kw_only=True)
class RuntimeConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto (cuda when available), cpu or cuda."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype: auto (bfloat16 on cuda, float32 on cpu), bfloat16 or float32; weights
    and optimizer state stay float32."""
    attention: Literal["auto", "flex", "dense"] = field(default="auto", metadata=BOOKKEEPING)
    """auto (flex on cuda, dense on cpu), flex or dense."""
    parallel: Literal["auto", "ddp", "fsdp"] = field(default="auto", metadata=BOOKKEEPING)
    """Several ranks: ddp, fsdp (FSDP2: parameters, gradients and optimizer state sharded), or
    auto (fsdp on cuda when 16 bytes per drafter parameter exceed a quarter of a GPU, else ddp)."""

    def __post_init__(self) -> None:
        check_choices(self)


@dataclass(kw_only=True)
class LoggingConfig:
    log_every: int = field(default=10, metadata=BOOKKEEPING)
    """Steps between console lines (metrics.jsonl gets every step)."""
    wandb: bool = field(default=True, metadata=BOOKKEEPING)
    """Log to Weights & Biases (offline unless WANDB_MODE says otherwise)."""
    wandb_project: str = field(default="dflash", metadata=BOOKKEEPING)
    """W&B project name."""

    def __post_init__(self) -> None:
        _positive(self, "log_every")


def _options_class() -> type:
    """One component holding every registered kind's fit options (train/drafters/): their
    fields are flat keys as any other (flags, TOML, RUN/config.json), in every run's config; a
    kind's options change the numbers of its own runs only (`check_resume`)."""
    bases = tuple(kind.options for kind in drafters.kinds() if kind.options is not None)
    namespace = {"__module__": __name__, "__doc__": _options_class.__doc__}
    return dataclass(kw_only=True)(type("DrafterOptions", bases, namespace))


DrafterOptions = _options_class()


@dataclass(kw_only=True)
class FitConfig:
    """The whole configuration of a run: its inputs and output, then one config per component.

    `FitConfig.from_dict` builds it from the flat keys (TOML, flags, RUN/config.json);
    `to_dict` gives them back.
    """

    cache: list[str] = field(metadata={PATH: "dir"})
    """Cache folders (written by dflash-precompute; repeat the flag for several); sequences are
    concatenated in this order."""
    out: str = field(metadata={PATH: "dir"})
    """Run folder: config, checkpoints, metrics; rerunning with it resumes."""
    # Compared by the sha256 of the source's weights instead (train/init_from.py).
    init_from: str | None = field(default=None, metadata={RESUMABLE: True})
    """Start from this drafter's weights (a z-lab-layout folder, a run folder or RUN/checkpoints/step-N)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    drafter_options: DrafterOptions = field(default_factory=DrafterOptions)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    gating: GatingConfig = field(default_factory=GatingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: HeldOutConfig = field(default_factory=HeldOutConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        if isinstance(self.cache, (str, Path)):
            self.cache = [self.cache]
        # Stored resolved: RUN/config.json is read from other directories (eval, export, resume).
        self.cache = [_absolute(c) for c in self.cache]
        self.out = _absolute(self.out)
        if self.init_from is not None:
            self.init_from = _absolute(self.init_from)
            if self.model.norm_init != "ones":
                raise ValueError(f"fit config: norm_init {self.model.norm_init} and init_from exclude each other "
                                 f"(the source's final norm is loaded): drop --norm-init {self.model.norm_init}")
            if self.model.out_init != "normal":
                raise ValueError("fit config: out_init zero and init_from exclude each other (the source's "
                                 "o_proj and down_proj are loaded): drop --out-init zero")
        if not self.cache:
            raise ValueError("fit config: `cache` is empty: give at least one cache folder")
        for kind in drafters.kinds():
            if kind.options is not None:
                kind.check_options(self.drafter_options, selected=kind.name == self.model.drafter)
        if self.model.num_drafts is None:
            self.model = dataclasses.replace(self.model,
                                             num_drafts=drafters.get(self.model.drafter).default_num_drafts)
        drafters.get(self.model.drafter).check_fit(self)
        rows = self.block_rows
        if self.data.tokens_per_step % rows:
            raise ValueError(
                f"fit config: tokens_per_step ({self.data.tokens_per_step}) must be a multiple of the block's "
                f"{rows} drafter rows (--num-drafts {self.model.num_drafts} of --drafter {self.model.drafter})"
            )

    @property
    def block_rows(self) -> int:
        """Drafter rows (block tokens) of one block: the kind's for num_drafts (train/drafters/)."""
        return drafters.get(self.model.drafter).block_rows(self.model.num_drafts)

    def components(self) -> dict[str, Any]:
        """The component configs by section name (`model`, `data`, ...)."""
        return {name: getattr(self, name) for name in COMPONENTS}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> FitConfig:
        """From flat keys (leaf field names; a field's none word, e.g. "auto", means None); a
        `block_size` (fit's key before the block was named once) is read as its kind's
        num_drafts, with a warning."""
        values = renamed(values, warn=True)
        unknown = sorted(set(values) - set(LEAVES))
        if unknown:
            raise ValueError(f"fit config: unknown field(s) {unknown}; known fields: {sorted(LEAVES)}")
        check_types(values, "fit config")
        sections: dict[str | None, dict[str, Any]] = {}
        for name, value in values.items():
            section, spec = LEAVES[name]
            if isinstance(value, str) and value == spec.metadata.get(NONE_WORD):
                value = None
            sections.setdefault(section, {})[name] = value
        parts = {section: COMPONENTS[section](**kwargs) for section, kwargs in sections.items() if section}
        return cls(**sections.get(None, {}), **parts)

    def to_dict(self) -> dict[str, Any]:
        """The flat keys: RUN/config.json, the checkpoint's state.json and W&B's config."""
        nested = dataclasses.asdict(self)
        flat = {name: value for name, value in nested.items() if name not in COMPONENTS}
        for section in COMPONENTS:
            flat.update(nested[section])
        return flat


def _absolute(path: str | Path) -> str:
    return str(Path(path).expanduser().resolve())


def check_types(values: Mapping[str, Any], where: str) -> None:
    """ValueError naming `where` and the field when a value is not of its field's type (a
    TOML `num_layers = "one"`); a field's none word is accepted for None."""
    for name, value in values.items():
        if name == RENAMED:  # an integer, read by `renamed`
            continue
        section, spec = LEAVES[name]
        if value is None or (isinstance(value, str) and value == spec.metadata.get(NONE_WORD)):
            continue
        hint = typing.get_type_hints(COMPONENTS[section] if section else FitConfig)[name]
        if not _is_a(value, hint):
            word = spec.metadata.get(NONE_WORD)
            raise ValueError(f"{where}: {name} must be {_type_name(hint)}" + (f" or {word!r}" if word else "")
                             + f", got {value!r}")


def _is_a(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, a) for a in args if a is not type(None))
    if origin is Literal:
        return isinstance(value, str)  # which choice: check_choices
    if origin is list:
        return isinstance(value, (str, Path)) or (
            isinstance(value, (list, tuple)) and all(_is_a(v, args[0]) for v in value))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, (str, Path))
    return True


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is list:
        return f"a list of {_type_name(args[0])}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


# Section name -> component class, in FitConfig's order.
COMPONENTS: dict[str, type] = {
    name: hint for name, hint in typing.get_type_hints(FitConfig).items() if dataclasses.is_dataclass(hint)
}


def _leaves() -> dict[str, tuple[str | None, dataclasses.Field]]:
    leaves: dict[str, tuple[str | None, dataclasses.Field]] = {}
    owners = [(None, FitConfig), *COMPONENTS.items()]
    for section, cls in owners:
        for spec in dataclasses.fields(cls):
            if section is None and spec.name in COMPONENTS:
                continue
            assert spec.name not in leaves, f"{spec.name} is a field of two fit config components"
            leaves[spec.name] = (section, spec)
    return leaves


# Leaf field name -> (its section, None for FitConfig's own fields; its dataclass field).
LEAVES = _leaves()
FIELDS = frozenset(LEAVES)

# Fields a resumed run may change (their metadata holds RESUMABLE): bookkeeping, not the numbers.
RESUMABLE_CHANGES = resumable(FitConfig)


def describe_fields() -> list[FieldInfo]:
    """Every leaf field in FitConfig's order, with its type, default and docstring."""
    return describe(FitConfig)


def load_toml(path: str | Path) -> dict:
    """Read a fit config file: flat keys, at top level or in their component's `[section]`
    table (dashes allowed in names); returns the flat keys."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: not valid TOML: {error}") from None
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    values: dict[str, Any] = {}
    for key, value in data.items():
        key = key.replace("-", "_")
        if key in COMPONENTS and isinstance(value, dict):
            for inner, inner_value in value.items():
                inner = inner.replace("-", "_")
                if LEAVES.get(inner, (None,))[0] != key and (key, inner) != ("model", RENAMED):
                    raise ValueError(f"{path}: [{key}] has no field {inner!r}; its fields: "
                                     f"{sorted(f.name for f in dataclasses.fields(COMPONENTS[key]))}")
                values[inner] = inner_value
        else:
            values[key] = value
    unknown = sorted(set(values) - FIELDS - {RENAMED})
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {unknown}; known fields: {sorted(FIELDS)}")
    check_types(values, str(path))
    # Paths in the file are relative to the file, not to the directory fit runs in.
    if "cache" in values:
        caches = [values["cache"]] if isinstance(values["cache"], str) else values["cache"]
        values["cache"] = [str((path.parent / Path(c).expanduser()).resolve()) for c in caches]
    for key in ("out", "init_from"):
        if key in values:
            values[key] = str((path.parent / Path(values[key]).expanduser()).resolve())
    return values


def resolve(config_file: str | Path | None, overrides: dict) -> FitConfig:
    """The config file's values, then the overrides (None values are 'not given')."""
    values = load_toml(config_file) if config_file else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    missing = [name for name in ("cache", "out") if not values.get(name)]
    if missing:
        raise ValueError(f"fit config: {', '.join(missing)} not given (flag or config file)")
    return FitConfig.from_dict(values)


def renamed(values: Mapping[str, Any], *, warn: bool) -> dict[str, Any]:
    """Flat keys with a `block_size` (the name before the block was named once: the drafter's
    rows per block, e.g. 16 for 15 drafts of the default kind) as `num_drafts`, converted by
    the `drafter` kind; `warn`: say so on stderr (a flag or config file gave it)."""
    values = dict(values)
    if values.get(RENAMED) is None:
        values.pop(RENAMED, None)
        return values
    rows = int(values.pop(RENAMED))
    kind = drafters.get(values.get("drafter") or drafters.DEFAULT)
    if values.get("num_drafts") is not None and values["num_drafts"] != kind.num_drafts(rows):
        raise ValueError(f"fit config: block_size {rows} (--drafter {kind.name}: {kind.num_drafts(rows)} drafts) "
                         f"and num_drafts {values['num_drafts']} disagree: give num_drafts alone")
    values["num_drafts"] = kind.num_drafts(rows)
    if warn:
        print(f"warning: block_size (--block-size) {rows} is deprecated: for --drafter {kind.name} it means "
              f"--num-drafts {values['num_drafts']} (a verify of {values['num_drafts'] + 1}); pass that instead",
              file=sys.stderr, flush=True)
    return values


def check_resume(saved_path: Path, config: FitConfig) -> None:
    """Refuse to resume a run whose saved config differs in a field that changes the numbers."""
    saved = renamed(json.loads(saved_path.read_text()), warn=False)  # a run started before the rename too
    current = config.to_dict()
    defaults = {info.name: None if info.default is dataclasses.MISSING else info.default
                for info in describe_fields()}
    # Another kind's options change nothing in this run, whatever either call said (a change
    # of kind is refused by the `drafter` field itself).
    kind = drafters.get(current["drafter"])
    idle = {name for other in drafters.kinds() if other is not kind for name in other.option_names()}
    for name in sorted(FIELDS - RESUMABLE_CHANGES - {"out"} - (idle - kind.option_names())):
        a, b = saved.get(name, defaults[name]), current[name]
        if name == "cache":
            a = [str(Path(p).resolve()) for p in a or []]
            b = [str(Path(p).resolve()) for p in b]
        if a != b:
            raise ValueError(
                f"{saved_path}: the run was started with {name} = {a!r}, this call gives {b!r}. "
                f"Resume with the same value, or train into a new --out folder"
            )


__all__ = ["COMPONENTS", "CheckpointConfig", "DEFAULT_NUM_LAYERS", "DataConfig", "FieldInfo", "FitConfig",
           "HeldOutConfig",
           "GatingConfig", "LoggingConfig", "LossConfig", "ModelConfig", "OptimizerConfig",
           "RESUMABLE_CHANGES", "RuntimeConfig", "check_resume", "describe_fields", "field_docs",
           "load_toml", "resolve"]
