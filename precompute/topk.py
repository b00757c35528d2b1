"""The target's next-token top-k, chunked, and the final norm and LM head read from a
checkpoint: what both stage-one engines share.

`chunked_topk` is the one top-k of stage one: logits in the model's dtype one chunk of
positions at a time, then log-softmax in fp32 and `torch.topk`, so neither a [T, V] fp32
tensor nor more than one chunk of logits ever exists. The transformers engine feeds it the LM
head over the base model's output; the vLLM engine (whose worker holds only the pre-norm last
layer) feeds it `apply_head`: the target's final RMS norm as Llama and Qwen compute it (fp32
normalisation, then the weight in the model dtype) and its LM head, read from the checkpoint
by `read_head_tensors`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

# fp32 log-softmax work per chunk of positions: chunk rows = this / (4 * V).
TOPK_CHUNK_BYTES = 2**28

NORM_NAME = "model.norm.weight"
HEAD_NAME = "lm_head.weight"
EMBED_NAME = "model.embed_tokens.weight"


def chunked_topk(logits_of: Callable[[slice], torch.Tensor], total: int, top_k: int, vocab_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([total, k] int32 ids, [total, k] float32 full-vocabulary log-probs), most likely first;
    `logits_of(rows)` gives the [n, V] logits of a slice of the `total` positions."""
    topk_ids = torch.empty((total, top_k), dtype=torch.int32, device=device)  # [N, k]
    topk_logprobs = torch.empty((total, top_k), dtype=torch.float32, device=device)  # [N, k]
    rows_per_chunk = max(1, TOPK_CHUNK_BYTES // (4 * vocab_size))
    for lo in range(0, total, rows_per_chunk):
        rows = slice(lo, min(lo + rows_per_chunk, total))
        # One fused log_softmax then topk: on CPU this beats topk(logits) - logsumexp
        # (whose exp pass is slower than log_softmax's), and the chunk bounds the memory.
        logprobs = torch.log_softmax(logits_of(rows).float(), dim=-1)  # [n, V] fp32
        values, indices = torch.topk(logprobs, top_k, dim=-1)  # [n, k]
        topk_logprobs[rows], topk_ids[rows] = values, indices.int()
    return topk_ids, topk_logprobs


def apply_head(hidden: torch.Tensor, norm: torch.Tensor, head: torch.Tensor, eps: float) -> torch.Tensor:
    """Logits [n, V] (model dtype) of pre-norm last-layer states [n, H]: Llama's RMSNorm
    (normalised in fp32, cast back, times `norm` [H]) then the LM head `head` [V, H]."""
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return torch.nn.functional.linear(norm * x.to(hidden.dtype), head)


def read_head_tensors(path: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors `names` of the checkpoint in folder `path` (model.safetensors or its index),
    on the CPU, in their stored dtype; a name absent from the checkpoint is absent from the
    result."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: path / weight_map[name] for name in names if name in weight_map}
    else:
        files = {name: path / "model.safetensors" for name in names}
    tensors = {}
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if files.get(name) == file:
                    tensors[name] = f.get_tensor(name)
    return tensors


def load_head(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(final norm weight [H], LM head [V, H], rms_norm_eps) of the target in `path`, on
    `device` in `dtype`; a tied head is the embedding."""
    tensors = read_head_tensors(path, (NORM_NAME, HEAD_NAME, EMBED_NAME))
    head = tensors.get(HEAD_NAME, tensors.get(EMBED_NAME))
    assert NORM_NAME in tensors and head is not None, f"{path}: no {NORM_NAME} or LM head (checked at load)"
    config = json.loads((path / "config.json").read_text())
    eps = float(config.get("text_config", config).get("rms_norm_eps", 1e-6))
    return tensors[NORM_NAME].to(device, dtype), head.to(device, dtype), eps


__all__ = ["EMBED_NAME", "HEAD_NAME", "NORM_NAME", "TOPK_CHUNK_BYTES", "apply_head", "chunked_topk",
           "load_head", "read_head_tensors"]
