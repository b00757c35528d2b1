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

`iter_records` is the one reader of input files, used by `dflash-precompute`,
`dflash-regenerate` and `dflash-train eval --online` alike, so that a record's index means
the same thing everywhere (eval pairs prompts with cached sequences by it). It streams
`InputRecord`s from JSONL (plain, or zstandard-compressed `.jsonl.zst`, read as a stream),
JSON (a list, or an `{id: record}` object), Parquet or a `datasets` directory, each with a
source `{"file", "index"}`: for JSONL the index is the 0-based line number, split on b"\n"
only (a JSON string may hold U+2028, U+2029 or U+0085, which `str.splitlines` would also
split on); elsewhere the 0-based record position. A JSONL line that is not UTF-8 or not JSON
(or nests too deeply to parse) is an `InputRecord` with an `error`, never an exception, so
one bad line costs one record. Parquet needs pyarrow, `datasets` folders the `datasets`
package (imported only when such a folder is read).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

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


# ----------------------------------------------------------------------------- reading

@dataclass
class InputRecord:
    """One record as read from an input file."""

    file: str
    """The input path as given on the command line (or `dir/split` for a DatasetDict)."""
    index: int
    """0-based line number (JSONL) or record position (JSON, Parquet, datasets)."""
    data: Any
    """The parsed record; None when `error` is set."""
    error: str | None = None
    """Why the record could not be read (e.g. invalid JSON)."""

    @property
    def source(self) -> dict[str, Any]:
        return {"file": self.file, "index": self.index}


# ----------------------------------------------------------------------------- readers

# How an input file's name ends (lowercased) -> its format: the reader's one list, which the
# unknown-format error prints. No ending is the tail of another, so their order does not matter.
INPUT_SUFFIXES = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".jsonl.zst": "jsonl.zst",
    ".ndjson.zst": "jsonl.zst",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
}


def input_format(path: Path, flag: str = "--data") -> str:
    """"jsonl", "jsonl.zst", "json", "parquet" or "datasets" for `path`; ValueError naming
    `flag` (the option that gave the path) when unknown."""
    if path.is_dir():
        return "datasets"
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file or directory")
    name = path.name.lower()
    for suffix, fmt in INPUT_SUFFIXES.items():
        if name.endswith(suffix):
            return fmt
    raise ValueError(
        f"{flag} {path}: unknown format {path.suffix.lower()!r}; give a file ending in "
        f"{', '.join(INPUT_SUFFIXES)}, or a directory written by datasets' save_to_disk"
    )


def iter_records(paths: Sequence[str | Path], limit: int | None = None, *,
                 flag: str = "--data") -> Iterator[InputRecord]:
    """Stream the records of every input in order, at most `limit` in total. Errors about a
    whole file (unknown format, not JSON) name `flag`, the option that gave the paths."""
    count = 0
    for path in paths:
        for record in _iter_one(Path(path), str(path), flag):
            if limit is not None and count >= limit:
                return
            count += 1
            yield record


def _iter_one(path: Path, name: str, flag: str) -> Iterator[InputRecord]:
    fmt = input_format(path, flag)
    if fmt in ("jsonl", "jsonl.zst"):
        yield from _iter_jsonl(path, name)
    elif fmt == "json":
        yield from _iter_json(path, name, flag)
    elif fmt == "parquet":
        yield from _iter_parquet(path, name)
    else:
        yield from _iter_datasets(path, name, flag)


def _iter_jsonl(path: Path, name: str) -> Iterator[InputRecord]:
    with open_lines(path) as f:
        for index, raw in enumerate(f):
            if not raw.strip():
                continue  # blank lines are not records
            yield _parse_line(raw, name, index)


def open_lines(path: Path) -> BinaryIO:
    """`path` opened for reading lines of bytes; a `.zst` file is decompressed as a stream
    (constant memory, however large the corpus)."""
    if not path.name.lower().endswith(".zst"):
        return open(path, "rb")
    import zstandard

    raw = open(path, "rb")
    try:
        stream = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
    except BaseException:
        raw.close()
        raise
    return io.BufferedReader(stream, buffer_size=1 << 20)


def _parse_line(raw: bytes, name: str, index: int) -> InputRecord:
    """One JSONL line as a record, or as an error that rejects just this line."""
    try:
        return InputRecord(name, index, json.loads(raw.decode("utf-8")))
    except UnicodeDecodeError as e:
        return InputRecord(name, index, None, f"invalid UTF-8 at byte {e.start}")
    except json.JSONDecodeError as e:
        return InputRecord(name, index, None, f"invalid JSON: {e.msg}")
    except RecursionError:
        return InputRecord(name, index, None, "invalid JSON: nested too deeply to parse")


def _iter_json(path: Path, name: str, flag: str) -> Iterator[InputRecord]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one JSON value per line under a .json name
            yield from _iter_jsonl(path, name)
            return
        raise ValueError(f"{flag} {path}: not valid JSON ({e}); fix the file or use JSONL") from e
    except RecursionError:
        raise ValueError(f"{flag} {path}: JSON nested too deeply to parse; use JSONL") from None
    if isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()):
        data = list(data.values())  # {id: record} mappings, in file order
    if not isinstance(data, list):
        raise ValueError(
            f"{flag} {path}: a JSON input must be a list of records or an {{id: record}} "
            f"object, got {type(data).__name__}"
        )
    for index, record in enumerate(data):
        yield InputRecord(name, index, record)


def _iter_parquet(path: Path, name: str) -> Iterator[InputRecord]:
    import pyarrow.parquet as pq

    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield InputRecord(name, index, record)
            index += 1


def _iter_datasets(path: Path, name: str, flag: str) -> Iterator[InputRecord]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise ValueError(
            f"{flag} {path}: a directory must be a dataset saved with datasets' save_to_disk ({e})"
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        splits = [(str(Path(name) / split), loaded[split]) for split in sorted(loaded)]
    else:
        splits = [(name, loaded)]
    for split_name, dataset in splits:
        for index, record in enumerate(dataset):
            yield InputRecord(split_name, index, record)


def input_sha256(path: str | Path) -> str:
    """sha256 of an input file, or of a directory's files (sorted relative paths and bytes)."""
    path = Path(path)
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()
