"""Stage one's input side: read chat data, normalise records, render them with the target's
chat template and mark the assistant tokens.

Records come from `dflash.common.records.iter_records`, the one reader of both stages
(JSONL, `.jsonl.zst`, JSON, Parquet, `datasets` folders).

Records are normalised by `dflash.common.records.normalize_record` (the input contract
both stages share: `messages`, `conversations`, `prompt`+`response`, `text`); a `text`
record is tokenized with the tokenizer's special tokens and trained on every token (no chat
template, no assistant turn needed).

The loss mask. `ChatEncoder.encode` renders the conversation to text with the chat
template, finds each assistant message's content in that text, tokenizes with offsets and
marks every token whose characters overlap an assistant content span, plus the template's
end-of-turn token for that turn (the first special token after the content and before the
next turn starts: `<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3). Template scaffolding
(role headers, the newline after `<|im_end|>`, a default system prompt) is never marked:
the mask is exactly what the model writes when it answers. The content is located after
the rendered generation prompt for that turn (`messages[:i]` with
`add_generation_prompt=True`), so text that also occurs in an earlier user turn is not
mistaken for the reply. Rendering prefixes costs two extra template renders per assistant
turn; it is what makes the mask right for any template that renders the content verbatim.
A template that rewrites the content (e.g. strips reasoning from earlier turns) leaves it
unfound and the record is rejected with that reason rather than trained with a wrong mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash.common.records import RecordError

# ----------------------------------------------------------------------------- encoding

@dataclass
class Encoded:
    """A tokenized record."""

    input_ids: np.ndarray
    """[T] int32 token ids, T <= max_length."""
    loss_mask: np.ndarray
    """[T] bool, True on the assistant tokens (every token for `text` records)."""
    truncated: bool
    """Whether the rendering was longer than max_length and was cut."""


class ChatEncoder:
    """Renders records with a tokenizer's chat template and builds the assistant loss mask.

    Needs a fast tokenizer (character offsets); `max_length` cuts longer sequences.
    `chat_template` (Jinja text) replaces the tokenizer's template; `chat_template_kwargs`
    are passed to every rendering (e.g. {"enable_thinking": False}).
    """

    def __init__(self, tokenizer: Any, max_length: int, *, chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                f"{type(tokenizer).__name__} is not a fast tokenizer; the loss mask needs "
                "character offsets: give the target a tokenizer.json"
            )
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.chat_template = chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        special = set(tokenizer.all_special_ids)
        special.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
        self.special_ids = special

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The chat template's text for `messages`; RecordError when the template refuses."""
        if self.tokenizer.chat_template is None and self.chat_template is None:
            raise ValueError("the target's tokenizer has no chat template; give one or use 'text' records")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=self.chat_template, **self.chat_template_kwargs
            )
        except Exception as e:  # jinja's raise_exception and template errors
            raise RecordError(f"chat template failed: {e}") from e

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` followed by the template's generation prompt."""
        text = self.render(messages, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode(self, conversation: list[dict[str, str]] | str, *, cut_turns: frozenset[int] = frozenset()) -> Encoded:
        """Tokenize a normalised record; RecordError when no trained token survives.

        cut_turns: indices of assistant messages that were cut short (a regenerated reply that
        hit --max-new-tokens): the template still closes them with its end-of-turn token, but
        the model did not write it there, so it is left out of the loss mask.
        """
        if isinstance(conversation, str):
            ids = np.asarray(self.tokenizer(conversation)["input_ids"], dtype=np.int32)  # [T]
            mask = np.ones(len(ids), dtype=bool)  # [T]
        else:
            ids, mask = self._encode_chat(conversation, cut_turns)
        truncated = len(ids) > self.max_length
        ids, mask = ids[: self.max_length], mask[: self.max_length]
        if not mask.any():
            if truncated:
                raise RecordError(
                    f"no assistant token within the first {self.max_length} tokens (--max-length)"
                )
            raise RecordError("no token to train on after tokenization")
        return Encoded(input_ids=ids, loss_mask=mask, truncated=truncated)

    def _encode_chat(self, messages: list[dict[str, str]], cut_turns: frozenset[int]) -> tuple[np.ndarray, np.ndarray]:
        full = self.render(messages)
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)  # [T]
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # [T, 2]
        starts, ends = offsets[:, 0], offsets[:, 1]
        mask = np.zeros(len(ids), dtype=bool)  # [T]
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            begin, end = self._content_span(messages, i, full, cursor)
            mask |= (starts < end) & (ends > begin)
            turn_end = self._turn_end(messages, i, full)
            # The end-of-turn token: the first non-whitespace token after the content, if it
            # is a special token that starts before the next turn.
            j = int(np.searchsorted(starts, end, side="left"))
            while j < len(ids) and starts[j] < turn_end and ids[j] not in self.special_ids \
                    and not full[starts[j]:ends[j]].strip():
                j += 1
            if j < len(ids) and starts[j] < turn_end and ids[j] in self.special_ids and i not in cut_turns:
                mask[j] = True
            cursor = end
        return ids, mask

    def _content_span(self, messages: list[dict[str, str]], i: int, full: str, cursor: int) -> tuple[int, int]:
        if i == 0:
            start = 0
        else:
            prompt = self.render(messages[:i], add_generation_prompt=True)
            start = len(prompt) if full.startswith(prompt) else _common_prefix_len(prompt, full)
        start = max(start, cursor)
        content = messages[i]["content"]
        for candidate in (content, content.strip()):
            pos = full.find(candidate, start)
            if pos >= 0:
                return pos, pos + len(candidate)
        raise RecordError(
            f"message {i} (assistant) does not appear verbatim in the chat template's rendering"
        )

    def _turn_end(self, messages: list[dict[str, str]], i: int, full: str) -> int:
        if i + 1 == len(messages):
            return len(full)
        upto = self.render(messages[: i + 1])
        return len(upto) if full.startswith(upto) else len(full)


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(np.frombuffer(a[:n].encode("utf-32-le"), dtype=np.uint32)
                              != np.frombuffer(b[:n].encode("utf-32-le"), dtype=np.uint32))
    return int(mismatch[0]) if len(mismatch) else n
