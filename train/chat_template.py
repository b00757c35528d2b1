"""The chat-template settings online evaluation renders prompts with: the cache's by default.

Stage one records `chat_template_kwargs` and `chat_template_text` (a template given with
--chat-template) in the manifest's options; prompts rendered otherwise would not match the
replies the drafter was trained on (a thinking-mode mismatch alone can halve acceptance).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any


def resolve_template_settings(cache: Any | None, kwargs_json: str | None,
                              template_file: str | None) -> tuple[dict[str, Any], str | None]:
    """(chat_template_kwargs, chat_template text) for online evaluation.

    Given options win; each one that differs from what `cache` recorded is warned about.
    ValueError when `kwargs_json` is not a JSON object or `template_file` is unreadable.
    """
    options = cache.spec.options if cache is not None else {}
    cached_kwargs = options.get("chat_template_kwargs") or {}
    cached_text = options.get("chat_template_text")
    kwargs, text = cached_kwargs, cached_text
    if kwargs_json is not None:
        try:
            kwargs = json.loads(kwargs_json)
        except json.JSONDecodeError as error:
            raise ValueError(f"--chat-template-kwargs is not JSON ({error.msg}): {kwargs_json!r}") from None
        if not isinstance(kwargs, dict):
            raise ValueError(f"--chat-template-kwargs must be a JSON object, got {kwargs_json!r}")
        if cache is not None and kwargs != cached_kwargs:
            warnings.warn(f"--chat-template-kwargs {kwargs} differ from the cache's {cached_kwargs}: "
                          "prompts are rendered unlike the training data", stacklevel=2)
    if template_file is not None:
        path = Path(template_file)
        if not path.is_file():
            raise ValueError(f"--chat-template {template_file}: no such file")
        text = path.read_text(encoding="utf-8")
        if cache is not None and text != cached_text:
            warnings.warn(f"--chat-template {template_file} is not the template the cache was built with",
                          stacklevel=2)
    return kwargs, text
