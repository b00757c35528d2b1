"""`TargetInfo`: the typed, versioned content of `CACHE/target/target.json`.

Stage one writes it next to the target's config, tokenizer and head.safetensors; stage two
reads the target's shape and special tokens from it (drafter sizing, the mask token, stop
tokens, the exported config) without loading the target. See FORMAT.md, "The target folder".
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.common.files import write_json_atomic
from dflash.shards.layout import TARGET_INFO_FILE

# Version 1: the fields below. A file without `version` predates the field and is version 1.
TARGET_INFO_VERSION = 1
READ_TARGET_INFO_VERSIONS = (1,)


@dataclass(kw_only=True)
class TargetInfo:
    """What stage two needs to know about the target a cache was built from."""

    version: int = TARGET_INFO_VERSION
    """Layout version of target.json; readers refuse versions they do not know."""
    layer_ids: list[int]
    """Decoder-layer ids whose outputs the cache holds, in feature order."""
    num_layers: int
    """Number of decoder layers of the target."""
    hidden_size: int
    """Target hidden size H."""
    vocab_size: int
    """Rows of the target's embedding and LM head, V."""
    tie_word_embeddings: bool
    """Whether the target ties its LM head to its embedding (head.safetensors holds both anyway)."""
    model_type: str
    """The Hugging Face `model_type` of the target."""
    mask_token_id: int | None = None
    """The tokenizer's mask token, if it has one."""
    pad_token_id: int | None = None
    """The tokenizer's pad token, if it has one."""
    eos_token_id: int | list[int] | None = None
    """The target config's end-of-sequence token(s)."""
    bos_token_id: int | None = None
    """The target config's beginning-of-sequence token."""
    rms_norm_eps: float | None = None
    """The target's RMSNorm epsilon, if its config names one."""
    rope_theta: float | None = None
    """The target's RoPE base, if its config names one."""
    dtype: str | None = None
    """The dtype the target ran in and head.safetensors is stored in (e.g. "bfloat16");
    None in files written before it was recorded."""
    fingerprint: str | None = None
    """The target's weights fingerprint (dflash.common.fingerprint); None in files written
    before it was recorded, or for a target without safetensors files."""

    def __post_init__(self) -> None:
        _check_version(self.version)
        if not isinstance(self.layer_ids, (list, tuple)) or not self.layer_ids or not all(
                _is_int(i) and i >= 0 for i in self.layer_ids):
            raise ValueError(f"TargetInfo.layer_ids must be a non-empty list of layer ids >= 0, "
                             f"got {self.layer_ids!r}")
        self.layer_ids = list(self.layer_ids)
        for name in ("num_layers", "hidden_size", "vocab_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"TargetInfo.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"TargetInfo.tie_word_embeddings must be true or false, "
                             f"got {self.tie_word_embeddings!r}")
        if not isinstance(self.model_type, str):
            raise ValueError(f"TargetInfo.model_type must be a string, got {self.model_type!r}")
        if self.fingerprint is not None and not isinstance(self.fingerprint, str):
            raise ValueError(f"TargetInfo.fingerprint must be a string or null, got {self.fingerprint!r}")
        if self.dtype is not None and not isinstance(self.dtype, str):
            raise ValueError(f"TargetInfo.dtype must be a dtype name or null, got {self.dtype!r}")
        for name in ("mask_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"TargetInfo.{name} must be a token id or null, got {value!r}")
        eos = self.eos_token_id
        if eos is not None and not _is_int(eos) and not (
                isinstance(eos, list) and all(_is_int(i) for i in eos)):
            raise ValueError(f"TargetInfo.eos_token_id must be a token id, a list of them or null, "
                             f"got {eos!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"TargetInfo.{name} must be a number or null, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetInfo:
        """Check the fields of a parsed target.json (a missing `version` reads as 1)."""
        if not isinstance(data, dict):
            raise ValueError(f"target info must be a JSON object, got {type(data).__name__}")
        _check_version(data.get("version", 1))  # first: another version may have other fields
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"target info has fields this dflash does not know: {unknown}; upgrade dflash")
        missing = [name for name, f in fields.items() if f.default is dataclasses.MISSING and name not in data]
        if missing:
            raise ValueError(f"target info field(s) {', '.join(map(repr, missing))} missing; re-run "
                             "dflash-precompute to rewrite the cache's target/ folder")
        return cls(**{"version": 1, **data})

    def save(self, target_dir: str | Path) -> Path:
        """Write `target_dir`/target.json atomically; returns its path."""
        path = Path(target_dir) / TARGET_INFO_FILE
        write_json_atomic(path, self.to_dict(), indent=2, sort_keys=False)
        return path

    @classmethod
    def load(cls, target_dir: str | Path) -> TargetInfo:
        """Read `target_dir`/target.json; a ValueError naming the file (and the field) when it
        is missing, not JSON, of an unknown version, or lacks or mistypes a field."""
        path = Path(target_dir) / TARGET_INFO_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"{path} is missing: is this a complete dflash cache's target/ folder?") from None
        except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path} is not valid JSON ({error}); re-run dflash-precompute to rewrite "
                             "the cache's target/ folder") from None
        try:
            return cls.from_dict(data)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None


def _check_version(version: Any) -> None:
    if not _is_int(version) or version not in READ_TARGET_INFO_VERSIONS:
        raise ValueError(
            f"TargetInfo.version is {version!r}; this dflash reads version(s) "
            f"{', '.join(map(str, READ_TARGET_INFO_VERSIONS))}: upgrade dflash to read it, or "
            "re-run dflash-precompute with this dflash to rewrite the cache")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = ["READ_TARGET_INFO_VERSIONS", "TARGET_INFO_FILE", "TARGET_INFO_VERSION", "TargetInfo"]
