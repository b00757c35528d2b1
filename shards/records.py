"""Chat records as both stages read them: the input contract of `dflash-precompute` and of
`dflash-train eval --online`'s prompts (pure Python: no tokenizer, no torch).

`normalize_record` accepts four shapes and turns each into either a list of
`{"role", "content"}` messages or a plain text:
- `messages`: [{"role", "content"}] (content a string or a list of text parts);
- `conversations`: ShareGPT [{"from", "value"}], `human`/`user` -> user, `gpt`/`assistant`/
  `chatgpt`/`model` -> assistant, `system` -> system;
- `prompt` + `response` (optional `system`): one user turn and one assistant turn;
- `text`: a plain document.

`prompt_messages` cuts a record to the messages up to and including its last user turn,
the prompt that online evaluation decodes from.
"""

from __future__ import annotations

from typing import Any

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
}


class RecordError(ValueError):
    """A record that cannot be used; `str(error)` is the reason written to rejected.jsonl."""


def normalize_record(data: Any, *, require_assistant: bool = True) -> list[dict[str, str]] | str:
    """A record as chat messages [{"role", "content"}] or, for `text` records, a string.

    require_assistant: a conversation without an assistant turn is refused (stage one has
    nothing to train on); False accepts prompt-only records (`prompt` without `response`).
    Raises RecordError with the reason when a field is missing or malformed.
    """
    if not isinstance(data, dict):
        raise RecordError(f"record is a {type(data).__name__}, not an object")
    if data.get("messages") is not None:
        messages = [_message(m, i, "messages", "role", "content") for i, m in enumerate(_list(data, "messages"))]
    elif data.get("conversations") is not None:
        messages = [_message(m, i, "conversations", "from", "value")
                    for i, m in enumerate(_list(data, "conversations"))]
    elif data.get("prompt") is not None or data.get("response") is not None:
        messages = []
        if data.get("system") is not None:
            messages.append({"role": "system", "content": _text(data["system"], "system")})
        messages.append({"role": "user", "content": _text(data.get("prompt"), "prompt")})
        if require_assistant or data.get("response") is not None:
            messages.append({"role": "assistant", "content": _text(data.get("response"), "response")})
    elif data.get("text") is not None:
        text = _text(data["text"], "text")
        if not text:
            raise RecordError("field 'text' is empty")
        return text
    else:
        raise RecordError(
            "record has none of the fields 'messages', 'conversations', 'prompt'+'response', 'text'"
        )
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise RecordError("conversation has no assistant turn")
    return messages


def prompt_messages(data: Any) -> list[dict[str, str]]:
    """The chat messages of a record up to and including its last user turn.

    RecordError with the reason when the record is malformed, is a `text` record (no user
    turn to prompt with) or has no user turn.
    """
    messages = normalize_record(data, require_assistant=False)
    if isinstance(messages, str):
        raise RecordError("a 'text' record has no user turn to use as a prompt")
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise RecordError("conversation has no user turn")
    return messages[: users[-1] + 1]


def _list(data: dict, key: str) -> list:
    value = data[key]
    if not isinstance(value, list) or not value:
        raise RecordError(f"field '{key}' must be a non-empty list")
    return value


def _message(item: Any, i: int, field: str, role_key: str, content_key: str) -> dict[str, str]:
    if not isinstance(item, dict):
        raise RecordError(f"{field}[{i}] is not an object")
    role = item.get(role_key)
    if not isinstance(role, str):
        raise RecordError(f"{field}[{i}] has no '{role_key}'")
    _check_unicode(role, f"{field}[{i}].{role_key}")
    if field == "conversations":
        if role.lower() not in ROLE_ALIASES:
            raise RecordError(f"{field}[{i}].from is {role!r}, expected one of {sorted(ROLE_ALIASES)}")
        role = ROLE_ALIASES[role.lower()]
    return {"role": role, "content": _text(item.get(content_key), f"{field}[{i}].{content_key}")}


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return _check_unicode(value, where)
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return _check_unicode("".join(str(p.get("text", "")) for p in value), where)  # OpenAI-style parts
    if value is None:
        raise RecordError(f"field '{where}' is missing")
    raise RecordError(f"field '{where}' must be a string, got {type(value).__name__}")


def _check_unicode(text: str, where: str) -> str:
    """JSON escapes can encode lone surrogates (`"\\ud800"`), which no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RecordError(f"field '{where}' holds invalid Unicode (a lone surrogate at character {e.start})") from None
    return text


def cut_assistant_turns(data: Any, messages: list[dict[str, str]]) -> frozenset[int]:
    """Indices (into `messages`) of the assistant turns a regenerated record marks as cut.

    `dflash-regenerate` writes `finish_reasons`, one per assistant turn in order; "length"
    means the reply stopped at the token limit, so the template's end-of-turn token after it
    was not written by the model. Records without the field have no cut turns.
    """
    reasons = data.get("finish_reasons") if isinstance(data, dict) else None
    if not isinstance(reasons, list):
        return frozenset()
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(reasons) != len(turns):
        raise RecordError(f"field 'finish_reasons' has {len(reasons)} entries for {len(turns)} assistant turns")
    return frozenset(i for i, reason in zip(turns, reasons) if reason == "length")
