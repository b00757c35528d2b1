"""A synthetic cache with a `target/` folder: stage two's tests and benchmarks without a target.

`dflash.shards.synthetic` writes the rows; this adds what `dflash-precompute` would put in
`CACHE/target/` (a Qwen3-style config.json, target.json, head.safetensors with a random
embedding and LM head), so `dflash-train fit` runs on it end to end. The numbers mean
nothing; shapes, formats and code paths are the real ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from dflash.common.files import atomic_dir
from dflash.shards import TargetInfo
from dflash.shards.layout import HEAD_FILE, TARGET_DIR


def write_synthetic_target(target_dir: str | Path, *, vocab_size: int, hidden_size: int,
                           num_layers: int, layer_ids: list[int], num_attention_heads: int,
                           num_key_value_heads: int, head_dim: int, intermediate_size: int,
                           mask_token_id: int | None = None, seed: int = 0,
                           dtype: torch.dtype = torch.bfloat16, distinct_rows: int | None = None) -> None:
    """Write config.json, target.json and head.safetensors for an imaginary Qwen3 target, as
    one folder published atomically (an existing one is replaced), as stage one does.

    distinct_rows: draw only this many embedding and head rows and repeat them down the
    vocabulary (a benchmark's multi-GB head in seconds instead of a minute of sampling)."""
    from safetensors.torch import save_file

    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim, "intermediate_size": intermediate_size, "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }
    info = TargetInfo(
        layer_ids=list(layer_ids), num_layers=num_layers, hidden_size=hidden_size,
        vocab_size=vocab_size, tie_word_embeddings=False, model_type="qwen3",
        mask_token_id=mask_token_id, pad_token_id=None, eos_token_id=vocab_size - 1,
        bos_token_id=None, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        dtype=str(dtype).removeprefix("torch."))
    generator = torch.Generator().manual_seed(seed)
    rows = vocab_size if distinct_rows is None else min(distinct_rows, vocab_size)
    repeat = -(-vocab_size // rows)
    embed = (torch.randn(rows, hidden_size, generator=generator) * 0.5).to(dtype)  # [rows, H]
    head = (torch.randn(rows, hidden_size, generator=generator) / hidden_size ** 0.5).to(dtype)  # [rows, H]
    embed, head = (t.repeat(repeat, 1)[:vocab_size] for t in (embed, head))  # [V, H]
    norm = 1.0 + 0.25 * torch.randn(hidden_size, generator=generator)  # [H] the final norm's scale
    with atomic_dir(target_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        info.save(tmp)
        save_file({"embed_tokens.weight": embed.to(dtype).contiguous(),
                   "lm_head.weight": head.to(dtype).contiguous(), "norm.weight": norm.contiguous()},
                  str(tmp / HEAD_FILE))


def write_synthetic_training_cache(cache_dir: str | Path, *, lengths: list[int], vocab_size: int = 64,
                                   hidden_size: int = 32, layer_ids: tuple[int, ...] = (0, 2, 4),
                                   num_layers: int = 6, top_k: int = 4, num_attention_heads: int = 4,
                                   num_key_value_heads: int = 2, head_dim: int = 8,
                                   intermediate_size: int = 64, feature_codec: str = "bf16",
                                   feature_rank: int | None = None,
                                   seed: int = 0, zipf: bool = False):
    """A finalized cache of random rows plus its target/ folder; returns the open Cache."""
    from dflash.shards import CacheSpec
    from dflash.shards.synthetic import write_synthetic_cache

    spec = CacheSpec(vocab_size=vocab_size, hidden_size=hidden_size, layer_ids=list(layer_ids),
                     top_k=top_k, feature_codec=feature_codec, feature_rank=feature_rank,
                     max_length=int(np.max(lengths)),
                     target={"name": "synthetic", "model_type": "qwen3", "num_layers": num_layers,
                             "config_sha256": "synthetic", "dtype": "bfloat16"})
    cache = write_synthetic_cache(cache_dir, spec, lengths, seed=seed, zipf=zipf)
    write_synthetic_target(Path(cache_dir) / TARGET_DIR, vocab_size=vocab_size, hidden_size=hidden_size,
                           num_layers=num_layers, layer_ids=list(layer_ids),
                           num_attention_heads=num_attention_heads,
                           num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                           intermediate_size=intermediate_size, seed=seed)
    return cache
