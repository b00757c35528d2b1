"""The drafter registry: kind name -> kind (train/drafters/base.py's `DrafterKind`).

A family plugs in here and nowhere else: `register(kind)` makes it a `--drafter` choice of
`dflash-train fit`, a kind `eval`, `export` and `--init-from` load, and (with `options`) a
set of fit flags. Core code holds a kind, got from a name (`get`), a drafter config
(`of_config`), a drafter (`of`) or an exported config.json (`of_hf`), and asks it; it never
asks which kind it holds.

A drafter config dict (RUN/drafter_config.json) names its kind under `kind`; one written
before kinds had names has none, and is the kind that claims its fields
(`DrafterKind.claims_legacy`), else the default kind. One written before the block was
named once holds `block_size`, the kind's rows per block, read as its `num_drafts`.
"""

from __future__ import annotations

from typing import Any

from dflash.train.drafters.base import DrafterKind, Drafts, LossOperands
from dflash.train.drafters.dflash import DFlashKind
from dflash.train.drafters.dflash2 import DFlash2Kind
from dflash.train.drafters.dspark import DSparkKind
from dflash.train.drafters.lilicorr import LiLiCorrKind
from dflash.train.model import DFlashDrafter, DrafterConfig

_KINDS: dict[str, DrafterKind] = {}


def register(kind: DrafterKind) -> DrafterKind:
    """Add `kind` under `kind.name` (ValueError if the name is taken by another kind); returns it."""
    known = _KINDS.get(kind.name)
    if known is not None and type(known) is not type(kind):
        raise ValueError(f"drafter kind {kind.name!r} is registered already ({type(known).__name__})")
    _KINDS[kind.name] = kind
    return kind


def get(name: str) -> DrafterKind:
    """The kind registered as `name`; ValueError listing the known kinds."""
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"unknown drafter kind {name!r}; known kinds: {', '.join(names())}") from None


def names() -> tuple[str, ...]:
    """The registered kinds' names, in registration order (`--drafter`'s choices)."""
    return tuple(_KINDS)


def kinds() -> tuple[DrafterKind, ...]:
    return tuple(_KINDS.values())


DEFAULT = register(DFlashKind()).name
register(DSparkKind())
register(DFlash2Kind())
register(LiLiCorrKind())


def of_config(config: DrafterConfig) -> DrafterKind:
    """The kind of a drafter config (its class names it; DrafterConfig itself: the default kind)."""
    return get(getattr(type(config), "kind", None) or DEFAULT)  # (a stand-in config: the default kind)


def of(drafter: DFlashDrafter) -> DrafterKind:
    """The kind of a drafter module."""
    return of_config(drafter.config)


def make(config: DrafterConfig, **kwargs: Any) -> DFlashDrafter:
    """The freshly initialised drafter `config` describes (kwargs: DFlashDrafter's)."""
    return of_config(config).make(config, **kwargs)


def config_from_dict(data: dict[str, Any]) -> DrafterConfig:
    """A drafter config from its dict (`DrafterConfig.to_dict`, or one written before kinds had names)."""
    data = dict(data)
    kind = get(data.pop("kind", None) or next((k.name for k in kinds() if k.claims_legacy(data)), DEFAULT))
    if "block_size" in data:  # written before the block was named once: the kind's rows per block
        data["num_drafts"] = kind.num_drafts(int(data.pop("block_size")))
    return kind.config_class.from_dict(data)


def of_hf(data: dict[str, Any], where: str) -> DrafterKind:
    """The kind an exported config.json is (its `architectures`); ValueError naming `where`."""
    found = [kind for kind in kinds() if kind.loads(data)]
    if not found:
        wanted = " or ".join(f"[{kind.architecture!r}]" for kind in kinds())
        raise ValueError(f"{where}: architectures is {data.get('architectures')!r}, not {wanted}")
    return found[0]


def is_head(name: str) -> bool:
    """Whether state-dict entry `name` is some kind's own tensor beyond the DFlash backbone
    (`DrafterKind.owns`): what `--init-from` hands only to a drafter that has it."""
    return any(kind.owns(name) for kind in kinds())


__all__ = ["DEFAULT", "DrafterKind", "Drafts", "LossOperands", "config_from_dict", "get", "is_head", "kinds",
           "make", "names", "of", "of_config", "of_hf", "register"]
