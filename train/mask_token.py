"""The mask token: which embedding row fills block positions 1..B-1 of every draft.

The rule (`choose_mask_token_id`) reads `CACHE/target/target.json` and the Hugging Face
tokenizer files stage one copies beside it (tokenizer.json, tokenizer_config.json, the chat
template as a .jinja file, chat_template.json or in the config, generation_config.json) as
plain JSON, without loading a tokenizer (training needs one token id, not the tokenizer).
The id chosen is recorded in RUN/config.json and drafter_config.json, so a run keeps it.
What this trades off: a tokenizer format these files do not describe (a sentencepiece model
without tokenizer.json) counts as a synthetic target (rule 4 of `choose_mask_token_id`): pass `mask_token_id`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash.shards import TargetInfo


def choose_mask_token_id(target: TargetInfo, target_dir: str | Path | None = None) -> int:
    """The mask token for a target: `target.json` plus the tokenizer files beside it.

    The mask token fills block positions 1..B-1 and is embedded with the frozen target
    embedding, so it must be a real embedding row. Reference inference code (z-lab's
    `dflash_generate`, serving engines) pre-fills its output buffer with it, stops when a stop
    token appears anywhere in that buffer and drops mask tokens from the result, so it must
    never be a stop, pad, bos or unk token, nor a token the chat template emits. In order:

    1. the tokenizer's own mask token, when it is none of those;
    2. the first embedding row past the tokenizer's vocabulary, when the embedding has spare
       rows (Qwen3: 151669, as z-lab's Qwen3 drafters use);
    3. the lowest-id special token of the tokenizer that is none of those and that the chat
       template never writes (SmolLM2: 3, `<repo_name>`);
    4. without tokenizer files (synthetic targets), the highest embedding row that is none of
       the target's named special tokens.

    ValueError when nothing qualifies: pass an explicit id (fit config field `mask_token_id`).
    An explicit id is used as given; the choice is recorded in the run's resolved config.
    """
    vocab = _TokenizerVocabulary.read(target_dir) if target_dir is not None else None
    reserved = token_ids(target.eos_token_id, target.pad_token_id, target.bos_token_id)
    if vocab is not None:
        reserved |= vocab.reserved_ids

    def usable(token_id: int) -> bool:
        in_template = vocab is not None and vocab.special.get(token_id, "\0") in vocab.template
        return 0 <= token_id < target.vocab_size and token_id not in reserved and not in_template

    mask = target.mask_token_id if target.mask_token_id is not None else (vocab.mask_id if vocab else None)
    if mask is not None and usable(mask):
        return int(mask)
    if vocab is not None:
        if vocab.num_ids < target.vocab_size:
            return vocab.num_ids
        for token_id in sorted(vocab.special):
            if usable(token_id):
                return token_id
    else:
        for token_id in range(target.vocab_size - 1, -1, -1):
            if token_id not in reserved:
                return token_id
    raise ValueError(
        f"no mask token for this target: the tokenizer has no mask token, the embedding "
        f"({target.vocab_size} rows) has no row past the tokenizer's vocabulary, and every special "
        "token is a stop, pad or bos token or written by the chat template; pass a token id that "
        "the target never generates explicitly (fit config field `mask_token_id`)")



def mask_token_refusal(token_id: int, target: TargetInfo, target_dir: str | Path | None = None) -> str | None:
    """Why `token_id` cannot be this target's mask token under `choose_mask_token_id`'s rule
    (a phrase: "a stop, pad, bos or unk token", ...), or None when it can."""
    if not 0 <= token_id < target.vocab_size:
        return f"not a row of the embedding ({target.vocab_size} rows)"
    vocab = _TokenizerVocabulary.read(target_dir) if target_dir is not None else None
    reserved = token_ids(target.eos_token_id, target.pad_token_id, target.bos_token_id)
    if vocab is not None:
        reserved |= vocab.reserved_ids
    if token_id in reserved:
        return "a stop, pad, bos or unk token"
    if vocab is not None and vocab.special.get(token_id, "\0") in vocab.template:
        return "a token the chat template writes"
    return None

def token_ids(*values: int | list[int] | tuple[int, ...] | None) -> set[int]:
    """Token-id fields as Hugging Face configs write them (`eos_token_id` and the like: an id, a
    list of ids, or None) as one set: the one reader of such fields, for the mask-token rule
    here and the stop tokens of online decoding (`dflash.train.online`)."""
    ids: set[int] = set()
    for value in values:
        if isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
        elif value is not None:
            ids.add(int(value))
    return ids


@dataclass
class _TokenizerVocabulary:
    """What the mask-token rule needs from the tokenizer files in CACHE/target/, read as JSON
    (tokenizer.json, tokenizer_config.json, the chat template, generation_config.json)."""

    num_ids: int
    """One past the highest id the tokenizer defines (base vocabulary and added tokens)."""
    special: dict[int, str]
    """Added tokens marked special: id -> content."""
    reserved_ids: set[int]
    """Stop (eos of the tokenizer and generation config), pad, bos and unk tokens."""
    mask_id: int | None
    """The tokenizer's mask token, if tokenizer_config.json names one."""
    template: str
    """The chat template's source text ('' when there is none)."""

    @classmethod
    def read(cls, target_dir: str | Path) -> _TokenizerVocabulary | None:
        """None when `target_dir` has no tokenizer.json (a synthetic target)."""
        target_dir = Path(target_dir)
        if not (target_dir / "tokenizer.json").is_file():
            return None
        tokenizer = read_target_json(target_dir / "tokenizer.json")
        base = (tokenizer.get("model") or {}).get("vocab") or {}
        by_content: dict[str, int] = dict(base) if isinstance(base, dict) else {
            entry[0]: i for i, entry in enumerate(base)}  # Unigram: a list of [piece, score]
        added = tokenizer.get("added_tokens") or []
        by_content.update({t["content"]: int(t["id"]) for t in added})
        special = {int(t["id"]): t["content"] for t in added if t.get("special")}
        num_ids = max(by_content.values(), default=-1) + 1
        config_path = target_dir / "tokenizer_config.json"
        config = read_target_json(config_path) if config_path.is_file() else {}

        def named(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):  # older files: {"content": ..., "lstrip": ...}
                value = value.get("content")
            return by_content.get(value) if isinstance(value, str) else None

        reserved = {i for i in map(named, ("eos_token", "pad_token", "bos_token", "unk_token")) if i is not None}
        generation_path = target_dir / "generation_config.json"
        if generation_path.is_file():
            generation = read_target_json(generation_path)
            reserved |= token_ids(*(generation.get(key) for key in ("eos_token_id", "pad_token_id", "bos_token_id")))
        return cls(num_ids=num_ids, special=special, reserved_ids=reserved, mask_id=named("mask_token"),
                   template=_chat_template_text(target_dir, config))


def _chat_template_text(target_dir: Path, tokenizer_config: dict) -> str:
    """Every chat template of the tokenizer, concatenated (the special tokens a template
    writes appear in its source as literal strings)."""
    parts = [p.read_text(encoding="utf-8") for p in sorted(target_dir.glob("*.jinja"))]
    for source in (tokenizer_config.get("chat_template"),
                   read_target_json(target_dir / "chat_template.json").get("chat_template")
                   if (target_dir / "chat_template.json").is_file() else None):
        if isinstance(source, str):
            parts.append(source)
        elif isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            parts += [entry.get("template", "") for entry in source if isinstance(entry, dict)]
    return "\n".join(parts)


def read_target_json(path: Path) -> dict:
    """A JSON file of CACHE/target/; ValueError naming it when it is missing."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is missing: is this a complete dflash cache's target/ folder?") from None


__all__ = ["choose_mask_token_id", "mask_token_refusal", "read_target_json", "token_ids"]
