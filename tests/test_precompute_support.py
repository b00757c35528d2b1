"""Builders shared by the data and precompute tests: tiny tokenizers and tiny random targets.

No download: a byte-level BPE is trained in code on a few sentences and wrapped in a
PreTrainedTokenizerFast with a ChatML (Qwen-style) or Llama-3-style chat template; the
targets are a Qwen3 and a Llama with tied embeddings built from configs with random weights
and saved with `save_pretrained`. This file holds no tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Llama 3 trims the content and starts with the BOS token.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]

CORPUS = [
    "Hello there! How are you doing today?",
    "I am fine, thank you. The weather is nice and sunny.",
    "What is the capital of France? Paris is the capital of France.",
    "Tell me a short story about a cat who likes to read books.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "The quick brown fox jumps over the lazy dog again and again.",
    "You are a helpful assistant. system user assistant",
]

VOCAB_SIZE = 320


def build_tokenizer(style: str):
    """A byte-level BPE tokenizer (round-trips any text) with a chat template of `style`
    ("chatml" or "llama3")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = CHATML_SPECIALS if style == "chatml" else LLAMA3_SPECIALS
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 8, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(CORPUS, trainer=trainer)
    if style == "chatml":
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
            chat_template=CHATML_TEMPLATE)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>", chat_template=LLAMA3_TEMPLATE)


def build_target(kind: str, path: Path) -> Path:
    """Save a tiny random target of `kind` ("qwen3" with a ChatML tokenizer, or "llama" with
    tied embeddings and a Llama-3 tokenizer) into `path`; returns `path`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    tokenizer = build_tokenizer("chatml" if kind == "qwen3" else "llama3")
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=6 if kind == "qwen3" else 4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.bos_token_id)
    if kind == "qwen3":
        config = Qwen3Config(head_dim=8, tie_word_embeddings=False, **common)
    else:
        config = LlamaConfig(tie_word_embeddings=True, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init: peaked, varied distributions
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
    if kind == "qwen3":  # like the real Qwen3: sampling defaults that greedy regeneration must override
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig(
            do_sample=True, temperature=0.6, top_k=20, top_p=0.95,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"},
     {"role": "assistant", "content": "I am fine, thank you."}],
    [{"role": "system", "content": "You are a cat."},
     {"role": "user", "content": "Tell me a short story."},
     {"role": "assistant", "content": "The cat likes to read books."},
     {"role": "user", "content": "And then?"},
     {"role": "assistant", "content": " The quick brown fox jumps. "}],
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "user", "content": "Numbers: 1 2 3 4 5 6 7 8 9 10 100 1000 and more numbers please"},
     {"role": "assistant", "content": "0 1 2 3 4 5 6 7 8 9 10 100 1000. Again: 0 1 2 3 4 5 6 7."}],
]


def write_jsonl(path: Path, records: list) -> Path:
    """Write records (dicts, or raw strings for deliberately broken lines) as JSONL."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return path
