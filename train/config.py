"""`dflash-train fit`'s configuration: one dataclass, loadable from TOML, overridable by flags.

The TOML file uses the field names below at top level (`cache` is a list of paths, the
rest scalars); flags override it; the resolved config is written to `RUN/config.json`.
A rerun with the same RUN resumes, and refuses a config that differs in a field that would
change the numbers (`RESUMABLE_CHANGES` lists the fields that may change between runs).
"""

from __future__ import annotations

import dataclasses
import json
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib
from dataclasses import dataclass
from pathlib import Path

LOSSES = ("kl", "ce", "kl+ce")

# Fields a resumed run may change: they affect bookkeeping, not the numbers.
RESUMABLE_CHANGES = frozenset({
    "checkpoint_every", "keep_checkpoints", "eval_every", "log_every", "wandb", "wandb_project",
    "max_consecutive_skips", "attention", "save_initial", "parallel",
})


@dataclass(kw_only=True)
class FitConfig:
    cache: list[str]
    """Cache folders (written by dflash-precompute); sequences are concatenated in this order."""
    out: str
    """Run folder: config, checkpoints, metrics; rerunning with it resumes."""
    num_layers: int = 5
    """Drafter decoder layers."""
    block_size: int = 16
    """Tokens per block: the anchor and block_size - 1 predictions."""
    anchors_per_seq: int = 512
    """Blocks per sequence per epoch (capped by the sequence's eligible positions)."""
    epochs: int = 6
    """Passes over the training sequences (each with freshly drawn anchors)."""
    max_steps: int | None = None
    """Train at most this many steps; the learning-rate schedule then spans them."""
    tokens_per_step: int = 131072
    """Block tokens (anchors x block size) per optimizer step, over all ranks together."""
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
    loss: str = "kl"
    """kl: sparse KL to the cached top-k with a tail bucket; ce: cross-entropy to the target's
    top-1; kl+ce: kl + ce_weight * ce."""
    ce_weight: float = 0.5
    """Weight of the cross-entropy term in kl+ce."""
    decay_gamma: float | None = None
    """Position weights exp(-(k-1)/gamma); None: by block size (7 for 16, 5 for 10, 4 for 8)."""
    seed: int = 0
    """Seed of the initial weights, the epoch permutations, anchors and the held-out set."""
    spike_factor: float = 3.0
    """Skip a step whose loss or grad norm exceeds this x its running mean."""
    spike_warmup_steps: int = 50
    """Accepted steps before the spike test applies."""
    max_consecutive_skips: int = 20
    """Stop after this many skipped steps in a row."""
    checkpoint_every: int = 1000
    """Steps between checkpoints (one is also written at the end)."""
    keep_checkpoints: int = 3
    """Complete checkpoints kept (the oldest are deleted)."""
    eval_every: int = 1000
    """Steps between held-out evaluations (0: never)."""
    eval_fraction: float = 0.01
    """Fraction of the sequences held out (never trained on)."""
    eval_tokens: int = 131072
    """Block tokens scored per held-out evaluation (the start of a fixed held-out stream)."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    dtype: str = "auto"
    """Compute dtype: auto (bfloat16 on cuda, float32 on cpu), bfloat16 or float32; weights
    and optimizer state stay float32."""
    attention: str = "auto"
    """auto (flex on cuda, dense on cpu), flex or dense."""
    parallel: str = "auto"
    """Several ranks: ddp, fsdp (FSDP2: parameters, gradients and optimizer state sharded), or
    auto (fsdp on cuda when 16 bytes per drafter parameter exceed a quarter of a GPU, else ddp)."""
    mask_token_id: int | None = None
    """Mask token id; None: the target's mask token, else its pad token, else its eos token."""
    wandb: bool = True
    """Log to Weights & Biases (offline unless WANDB_MODE says otherwise)."""
    wandb_project: str = "dflash"
    """W&B project name."""
    log_every: int = 10
    """Steps between console lines (metrics.jsonl gets every step)."""
    save_initial: bool = False
    """Also checkpoint the untrained drafter as step 0, a baseline for `dflash-train eval`."""

    def __post_init__(self) -> None:
        if isinstance(self.cache, (str, Path)):
            self.cache = [self.cache]
        self.cache = [str(c) for c in self.cache]
        self.out = str(self.out)
        if not self.cache:
            raise ValueError("fit config: `cache` is empty: give at least one cache folder")
        positive = ("num_layers", "anchors_per_seq", "epochs", "tokens_per_step", "checkpoint_every",
                    "keep_checkpoints", "log_every", "eval_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"fit config: {name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"fit config: block_size must be >= 2, got {self.block_size}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"fit config: max_steps must be >= 1 (or unset), got {self.max_steps}")
        if self.tokens_per_step % self.block_size:
            raise ValueError(
                f"fit config: tokens_per_step ({self.tokens_per_step}) must be a multiple of "
                f"block_size ({self.block_size})"
            )
        if not self.lr > 0 or not 0 <= self.warmup_ratio < 1 or not self.grad_clip > 0:
            raise ValueError("fit config: lr and grad_clip must be > 0 and warmup_ratio in [0, 1)")
        if self.loss not in LOSSES:
            raise ValueError(f"fit config: loss must be one of {LOSSES}, got {self.loss!r}")
        if self.decay_gamma is not None and not self.decay_gamma > 0:
            raise ValueError(f"fit config: decay_gamma must be > 0 (or auto), got {self.decay_gamma}")
        if self.eval_every < 0:
            raise ValueError(f"fit config: eval_every must be >= 0, got {self.eval_every}")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"fit config: eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.parallel not in ("auto", "ddp", "fsdp"):
            raise ValueError(f"fit config: parallel must be auto, ddp or fsdp, got {self.parallel!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"fit config: device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"fit config: dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        if self.attention not in ("auto", "flex", "dense"):
            raise ValueError(f"fit config: attention must be auto, flex or dense, got {self.attention!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = {f.name for f in dataclasses.fields(FitConfig)}


def load_toml(path: str | Path) -> dict:
    """Read a fit config file: top-level keys are FitConfig fields (dashes allowed)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: not valid TOML: {error}") from None
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    values = {key.replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(set(values) - FIELDS)
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {unknown}; known fields: {sorted(FIELDS)}")
    return values


def resolve(config_file: str | Path | None, overrides: dict) -> FitConfig:
    """The config file's values, then the overrides (None values are 'not given')."""
    values = load_toml(config_file) if config_file else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    if values.get("decay_gamma") == "auto":
        values["decay_gamma"] = None
    missing = [name for name in ("cache", "out") if not values.get(name)]
    if missing:
        raise ValueError(f"fit config: {', '.join(missing)} not given (flag or config file)")
    return FitConfig(**values)


def check_resume(saved_path: Path, config: FitConfig) -> None:
    """Refuse to resume a run whose saved config differs in a field that changes the numbers."""
    saved = json.loads(saved_path.read_text())
    current = config.to_dict()
    for name in sorted(FIELDS - RESUMABLE_CHANGES):
        a, b = saved.get(name), current[name]
        if name == "cache":
            a = [str(Path(p).resolve()) for p in a or []]
            b = [str(Path(p).resolve()) for p in b]
        elif name == "out":
            continue
        if a != b:
            raise ValueError(
                f"{saved_path}: the run was started with {name} = {a!r}, this call gives {b!r}. "
                f"Resume with the same value, or train into a new --out folder"
            )


__all__ = ["FitConfig", "LOSSES", "RESUMABLE_CHANGES", "check_resume", "load_toml", "resolve"]