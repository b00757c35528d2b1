"""Builders for checks of dflash: the tests, the fault trials (tests/faults/) and the bench
scripts import them.

- Tokenizers and targets, no download: a byte-level BPE trained in code on a few sentences
  and wrapped in a PreTrainedTokenizerFast with a ChatML (Qwen-style) or Llama-3-style chat
  template, and a character-level one with ChatML specials; targets are a Qwen3 and a Llama
  with tied embeddings built from configs with random weights (saved with
  `save_pretrained`, or in memory).
- A target vLLM's CPU build runs (bench/engine_check.py, the engine tests): character
  tokens, vLLM-sized heads, spare embedding rows.
- Records and stage one: chat conversations, JSONL files written and read back (through the
  one record reader), a small PrecomputeConfig.
- Drafters: DrafterConfig with the tiny shared dimensions.
- Loss kernels: random problems for `sparse_kl_loss` and the float64 ground truth.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dflash.testing.families import FAMILIES, TargetFamily, family_config, family_model

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

# A small synthetic training cache and the tiny fit the training tests run on it.
FIT_LENGTHS = [40, 56, 33, 71, 48, 64, 29, 52, 45, 60, 38, 66, 50, 35, 58, 44]
TINY_FIT = dict(num_layers=1, num_drafts=3, tokens_per_step=96, eval_every=0, eval_fraction=0.1, wandb=False,
                spike_warmup_steps=2, log_every=1)


def fit_cache(tmp_path_factory, lengths: list[int] = FIT_LENGTHS) -> Path:
    """A finalized synthetic training cache (seed 1) in a fresh temporary folder."""
    from dflash.train.synthetic import write_synthetic_training_cache

    path = tmp_path_factory.mktemp("cache") / "cache"
    write_synthetic_training_cache(path, lengths=lengths, seed=1)
    return path


def tiny_fit_config(cache_dir: Path, out: Path, **overrides):
    """`TINY_FIT` on `cache_dir` into `out`; overrides (flat FitConfig keys) win."""
    from dflash.train.config import FitConfig

    return FitConfig.from_dict({"cache": [str(cache_dir)], "out": str(out), **TINY_FIT, **overrides})


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


def read_jsonl(path: Path) -> list:
    """The records of a JSONL file, read by `iter_records`, the one reader (lines split on
    b"\\n" only: a string holding U+2028, which `str.splitlines` splits on, stays one record);
    AssertionError naming the line when one is not JSON."""
    from dflash.common.records import iter_records

    records = list(iter_records([path]))
    for record in records:
        assert record.error is None, f"{path} line {record.index + 1}: {record.error}"
    return [record.data for record in records]


# Every record shape stage one reads: messages, prompt + response, conversations, text.
RECORDS = [{"messages": c} for c in CONVERSATIONS] + [
    {"prompt": "What is the capital of France?", "response": "Paris is the capital."},
    {"conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hello there!"}]},
    {"text": "The quick brown fox jumps over the lazy dog."},
]


def precompute_config(target, data, out, **overrides):
    """A PrecomputeConfig for the tiny targets: top-8, 3 feature layers, 3-row shards, CPU."""
    from dflash.precompute.config import PrecomputeConfig

    options = dict(target=target, data=[data], out=out, top_k=8, num_feature_layers=3,
                   batch_tokens=300, shard_max_rows=3, device="cpu", progress=False)
    return PrecomputeConfig(**{**options, **overrides})


# --------------------------------------------------------------------------- tiny models in memory


def tiny_causal_lm(kind: str, *, vocab_size: int = 64, hidden_size: int = 32, num_layers: int = 6):
    """A random Qwen3 ("qwen3") or Llama with tied embeddings ("llama"), in eval mode, with a
    large initialisation (logits far apart: verify-vs-one-token numerics cannot flip an
    argmax) and a repetition penalty in its generation config that greedy references must
    not pick up."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=512, initializer_range=0.2)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    model.generation_config.repetition_penalty = 1.5  # must not leak into the greedy reference
    return model.eval()


HYBRID_KINDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
"""The hybrid linear-attention families `tiny_hybrid_lm` builds (Qwen3.6 is built as Qwen3.5)."""
HYBRID_LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def tiny_hybrid_lm(kind: str, *, vocab_size: int = 64, hidden_size: int = 32, tokenizer=None):
    """A random 4-layer hybrid target ("qwen3_next", "qwen3_5", "qwen3_5_moe"; "zaya" too, a
    family whose linear layers cannot be rolled back) in eval mode, float32, with gated delta
    net layers at 0, 1, 3 and full attention at 2, and the large initialisation of
    `tiny_causal_lm`; over `tokenizer`'s vocabulary (stopping at its eos) when one is given,
    with NUM_SPARE_ROWS spare rows (the mask-token rule's pick) whose LM-head rows are zero,
    so that the target never emits them."""
    import transformers

    if tokenizer is not None:
        vocab_size = len(tokenizer) + NUM_SPARE_ROWS
    stops = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id) if tokenizer else {}
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, **stops)
    linear = dict(num_hidden_layers=4, head_dim=8, layer_types=HYBRID_LAYER_TYPES, linear_conv_kernel_dim=4,
                  linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    builders = {
        "qwen3_next": lambda: transformers.Qwen3NextForCausalLM(
            transformers.Qwen3NextConfig(**common, **linear, **moe)),
        "qwen3_5": lambda: transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**common, **linear)),
        "qwen3_5_moe": lambda: transformers.Qwen3_5MoeForCausalLM(
            transformers.Qwen3_5MoeTextConfig(**common, **linear, **moe)),
        "zaya": lambda: transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model("zaya", **common, num_hidden_layers=4)),
    }
    if kind not in builders:
        raise ValueError(f"unknown hybrid kind {kind!r}: one of {', '.join(builders)}")
    torch.manual_seed(0)
    model = builders[kind]().float().eval()
    if tokenizer is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        with torch.no_grad():
            model.get_output_embeddings().weight[len(tokenizer):] = 0
    return model



class HalfRightProposer:
    """A proposer (train/speculative.py's protocol) for a random target: it drafts the target's
    greedy next token first and a wrong one after it, so that every verify accepts some drafts
    and rejects one, and the target's cache is cropped each time. `prompt` is the decoded
    prompt; `vocab_size` the target's (the wrong draft is the right one plus one, wrapped)."""

    def __init__(self, target, prompt: list[int], vocab_size: int):
        self.target, self.prompt, self.vocab_size = target, list(prompt), vocab_size
        self.tokens, self.block = [], []

    def reset(self) -> None:
        self.tokens, self.block = [], []

    def commit(self, features: torch.Tensor) -> None:
        self.tokens = list(self.prompt) if not self.tokens else self.tokens + self.block[:features.shape[0]]

    def propose(self, anchor_token: int, verify_size: int) -> list[int]:
        with torch.no_grad():
            right = int(self.target(torch.tensor([self.tokens + [anchor_token]])).logits[0, -1].argmax())
        drafts = [right] + [(right + 1) % self.vocab_size] * (verify_size - 2)
        self.block = [anchor_token] + drafts
        return drafts


CHAR_CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer():
    """A fast character-level tokenizer with ChatML special tokens (ids 0-2: <|endoftext|>,
    <|im_start|>, <|im_end|>), built in code."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({c: i + 3 for i, c in enumerate(chars)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<|endoftext|>",
                                        eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHAR_CHATML_TEMPLATE
    return tokenizer


def char_chat_target(tokenizer):
    """A random 6-layer Qwen3 over `char_tokenizer()`'s vocabulary that stops at <|im_end|> (2)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
        initializer_range=0.2, eos_token_id=2, pad_token_id=0)).eval()
    target.generation_config.eos_token_id = 2
    return target


# --------------------------------------------------------------------------- a target vLLM runs

# vLLM's CPU attention takes head sizes 32, 64, 80, 96, 112, 128, ... (not the tests' 8):
# the smallest is used, with 2 heads and hidden 64.
VLLM_TARGET_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32, max_position_embeddings=512)
# The target's (so the drafter's) RoPE base: not 1e4, the value a config without rope_theta gets
# in vLLM 0.32 (transformers' Qwen3Config default fills rope_parameters before vLLM's own 1e6
# fallback can), so that a missing rope_theta changes what vLLM runs.
VLLM_TARGET_ROPE_THETA = 100.0
NUM_SPARE_ROWS = 5

# ChatML with Qwen3's switch: `enable_thinking=False` writes an empty think block after each
# assistant header (the generation prompt's and a reply's alike, so that a prompt is a prefix of
# its rendered conversation, as in Qwen3's template): a prompt rendered without the cache's
# kwargs differs from one with them.
_NO_THINK = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}" + _NO_THINK
    + "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n" + _NO_THINK + "{% endif %}")


def vllm_target(path: Path, arch: str = "llama") -> Path:
    """A random 6-layer target over `char_tokenizer()`'s vocabulary, with
    vLLM-sized heads and 5 spare embedding rows (the mask-token rule's pick): a Llama with
    tied embeddings, a Qwen3 with its own head and THINKING_TEMPLATE, or any other family of
    `dflash.testing.families.FAMILIES` by its name (its fields at these dimensions).

    Character tokens (decoded without spaces between them) make regeneration exact: a reply
    decoded to text and encoded again is the same ids (a byte-level BPE target emits partial
    UTF-8 that comes back as U+FFFD), so the cache holds the very trajectories the check
    decodes. The spare rows are zero, so the target never emits them (its top logit is
    positive).
    """
    from tokenizers import decoders
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    tokenizer = char_tokenizer()
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()  # decode "ab", not "a b"
    common = dict(vocab_size=len(tokenizer) + NUM_SPARE_ROWS, pad_token_id=0, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": VLLM_TARGET_ROPE_THETA},
                  **VLLM_TARGET_DIMS)
    if arch == "llama":
        config = LlamaConfig(tie_word_embeddings=True, **common)
    elif arch == "qwen3":
        config = Qwen3Config(tie_word_embeddings=False, **common)
        tokenizer.chat_template = THINKING_TEMPLATE
    else:

        if arch not in FAMILIES:
            raise ValueError(f"unknown target architecture {arch!r}: one of {', '.join(FAMILIES)}")
        own_rope = family_config(FAMILIES[arch]).rope_parameters
        if own_rope.get("rope_type", "default") != "default":  # gpt-oss's YaRN: vLLM's model reads its fields
            common["rope_parameters"] = {**own_rope, "rope_theta": VLLM_TARGET_ROPE_THETA}
        config = family_config(FAMILIES[arch], **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # peaked distributions: greedy near-ties are rare
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
        model.get_input_embeddings().weight[len(tokenizer):] = 0.0
        model.get_output_embeddings().weight[len(tokenizer):] = 0.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# --------------------------------------------------------------------------- drafters


def drafter_config(kind: str | None = None, **fields):
    """A drafter config of `kind` (train/drafters/; None: the default kind) with the tests' tiny
    dimensions (hidden 32, intermediate 48, 4 heads of 8, 2 KV heads); `fields` gives the rest
    (vocabulary, layers, target layers, block, the kind's own fields...)."""
    from dflash.train import drafters

    dims = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return drafters.get(kind or drafters.DEFAULT).config_class(**{**dims, **fields})


# --------------------------------------------------------------------------- loss kernels

# (N, H, V, k): odd sizes everywhere (masks, partial tiles and chunks) and a round one.
SHAPES = {"odd": (37, 48, 1031, 7), "round": (64, 64, 512, 8)}

# fp32 paths against fp64: fp32 logits over H <= 64 terms are good to ~1e-6 relative, and
# the loss's exp/log and the k-term sums lose at most a decade more; 1e-4 is a margin that
# still catches any wrong term (those are O(1) relative).
FP32_TOL = 1e-4


def row_weights_and_grads(n, g):
    """Row weights in [0, 2), an upstream gradient with every fourth row zero, and the
    generator (for further draws), for the reduction="none" tests."""
    weights = torch.rand(n, generator=g) * 2
    grad_output = torch.randn(n, generator=g) * 3
    grad_output[::4] = 0.0
    return weights, grad_output, g


def make_problem(n, h, v, k, *, seed=0, dtype=torch.float32, logit_std=3.0):
    """Student hidden/head with logits of std ~logit_std, teacher top-k over random ids with a
    random tail (the k+1-th class of a softmax)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)  # [N, H]
    weight = (torch.randn(v, h, generator=g) * (logit_std / h**0.5)).to(dtype)  # [V, H]
    ids = torch.rand(n, v, generator=g).argsort(1)[:, :k]  # [N, k] int64, distinct per row
    logprobs = torch.log_softmax(torch.randn(n, k + 1, generator=g) * 2.0, 1)[:, :k]  # [N, k]
    return hidden, weight, ids, logprobs


def truth(hidden, weight, ids, logprobs, weights=None, *, tail="bucket", reduction="mean",
          ce_targets=None, ce_weight=0.0, divergence="kl"):
    """float64 loss straight from the formula in kernels/sparse_kl.py's docstring (inputs are
    upcast exactly)."""
    logp = (hidden.double() @ weight.double().T).log_softmax(1)  # [N, V] f64
    lp = logp.gather(1, ids)  # [N, k]
    lq = logprobs.double()
    q = lq.exp()
    if divergence == "tv":
        p = lp.exp()  # [N, k]
        row = 0.5 * ((p - q).abs().sum(1) + ((1 - p.sum(1)) - (1 - q.sum(1)).clamp(min=0)).abs())
    elif tail == "bucket":
        q_tail = (1 - q.sum(1)).clamp(min=0)
        p_tail = 1 - lp.exp().sum(1)
        row = (q * (lq - lp)).sum(1) + torch.special.xlogy(q_tail, q_tail) - q_tail * p_tail.log()
    else:
        q_hat = q / q.sum(1, keepdim=True)
        p_hat = lp.exp() / lp.exp().sum(1, keepdim=True)
        row = (q_hat * (q_hat.log() - p_hat.log())).sum(1)
    if ce_weight:
        row = row - ce_weight * logp.gather(1, ce_targets[:, None]).squeeze(1)
    w = torch.ones(len(row), dtype=torch.float64) if weights is None else weights.double()
    row = w * row
    if reduction == "none":
        return row
    return row.sum() if reduction == "sum" else row.sum() / w.sum()


def loss_and_grads(fn, hidden, weight, grad_weight=False, grad_output=None):
    """Run fn(hidden, weight) with fresh leaves; return (loss, d_hidden, d_weight or None)."""
    x = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(grad_weight)
    loss = fn(x, w)
    loss.backward(grad_output)
    return loss.detach(), x.grad, (w.grad if grad_weight else None)


def rel_err(a, b):
    """max |a - b| / max |b|: one scalar per tensor, insensitive to tiny entries."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# Subprocesses run on one thread each: results are then bitwise reproducible across
# processes, and two ranks share the CI's two cores.
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

KILLED_RUN = """
import json, os, signal, sys
from dflash.shards import CacheWriter
from dflash.precompute.config import PrecomputeConfig
from dflash.precompute.run import run_precompute

options, kill_after = json.loads(sys.argv[1]), int(sys.argv[2])
add, count = CacheWriter.add, [0]

def add_then_die(self, **row):
    count[0] += 1
    if count[0] > kill_after:  # mid-shard, rows of the open shard not yet sealed
        os.kill(os.getpid(), signal.SIGKILL)
    add(self, **row)

CacheWriter.add = add_then_die
run_precompute(PrecomputeConfig(**options))
"""


def killed_precompute(config, rows: int):
    """Run stage one with `config` (a PrecomputeConfig) in a subprocess that SIGKILLs itself
    after writing `rows` rows (KILLED_RUN); returns the CompletedProcess."""
    import dataclasses
    import subprocess
    import sys

    options = dataclasses.asdict(config)
    options = {k: (str(v) if k in ("target", "out") else v) for k, v in options.items()}
    options["data"] = [str(p) for p in options["data"]]
    return subprocess.run([sys.executable, "-c", KILLED_RUN, json.dumps(options), str(rows)], env=SUBPROCESS_ENV,
                          capture_output=True, text=True, timeout=300)


def build_family_target(family: TargetFamily, path: Path) -> Path:
    """Save a tiny random target of `family` with `build_tokenizer("chatml")` into `path`; returns `path`."""
    tokenizer = build_tokenizer("chatml")
    model = family_model(family, vocab_size=VOCAB_SIZE, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
