"""Online acceptance: real greedy speculative decoding against the Hugging Face target, batch
1, for `dflash-train eval --online` (the decoding itself is `dflash.train.speculative`).

Prompts are records in the styles stage one reads (`dflash.shards.records`: the same reader,
so a record's index is the one a cache names as its sequence's source); each record's
conversation up to its last user turn, rendered with the target's chat template and its generation prompt, is
the prompt. Reported: tau (committed tokens per target verify), tokens/s, the target's own
`generate(do_sample=False)` tokens/s timed on the same prompts in the same process, and
`lossless` (every prompt's output equals the target's greedy output token for token), with
every mismatch (prompt, first differing position, both tokens and the target's top-1/top-2
logit margin there).

What this file trades off: the baseline runs in the same process, alternating with the
speculative run prompt by prompt, so the speedup is measured on one machine state (not
against a serving engine); batch 1 keeps the lossless check exact but says nothing of
throughput under load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.shards.records import iter_records, prompt_messages
from dflash.train.speculative import DecodeResult, Proposer, greedy_generate, speculative_generate


@dataclass
class Prompt:
    """One prompt for online decoding."""

    source: dict[str, Any]
    """{"file", "index"}: the prompts file and the record's 0-based line (as stage one names it)."""
    token_ids: list[int]


def load_prompts(path: str | Path, tokenizer: Any, *, keep: set[int] | None = None,
                 limit: int | None = None, chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> tuple[list[Prompt], list[dict[str, Any]]]:
    """Prompts of a records file, rendered with the tokenizer's chat template.

    keep: only these record indices (None: all). Returns (prompts, rejected), each rejected
    record as {"file", "index", "reason"}.
    """
    if tokenizer.chat_template is None and chat_template is None:
        raise ValueError("the target's tokenizer has no chat template: online eval renders prompts with it")
    prompts, rejected = [], []
    for record in iter_records([path], flag="--prompts"):
        if keep is not None and record.index not in keep:
            continue
        if limit is not None and len(prompts) >= limit:
            break
        source = {"file": str(path), "index": record.index}
        try:
            if record.error is not None:
                raise ValueError(f"{record.error} on line {record.index + 1}")
            template = {} if chat_template is None else {"chat_template": chat_template}
            text = tokenizer.apply_chat_template(prompt_messages(record.data), tokenize=False,
                                                 add_generation_prompt=True, **template,
                                                 **(chat_template_kwargs or {}))
        except ValueError as e:
            rejected.append({**source, "reason": str(e)})
            continue
        prompts.append(Prompt(source=source, token_ids=tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts, rejected


def first_mismatch(reference: DecodeResult, output: DecodeResult) -> dict[str, Any] | None:
    """None when the token lists are equal; else where and how they first differ."""
    if reference.tokens == output.tokens:
        return None
    n = min(len(reference.tokens), len(output.tokens))
    i = next((j for j in range(n) if reference.tokens[j] != output.tokens[j]), n)
    return {
        "position": i,
        "reference_token": reference.tokens[i] if i < len(reference.tokens) else None,
        "speculative_token": output.tokens[i] if i < len(output.tokens) else None,
        "reference_length": len(reference.tokens),
        "speculative_length": len(output.tokens),
        # The target's top-1 minus top-2 logit where the two runs chose: near 0 is a tie that
        # last-bit differences between a block verify and one-token decoding can flip.
        "reference_margin": reference.margins[i] if i < len(reference.margins) else None,
        "speculative_margin": output.margins[i] if i < len(output.margins) else None,
    }


def evaluate_online(
    target: torch.nn.Module,
    proposer: Proposer,
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    block_size: int,
    layer_ids: list[int],
    stop_token_ids: set[int],
    warmup: bool = True,
    progress: Any = None,
) -> dict[str, Any]:
    """Speculative decoding against plain greedy decoding on every prompt.

    Per prompt the target's `generate` runs first (the reference and the baseline timing),
    then speculative decoding; alternating keeps slow drifts of the machine from favouring
    one side. With `warmup`, both run once untimed on the first prompt (allocator and kernel
    warm-up).
    """
    if not prompts:
        raise ValueError("no prompt to decode: give JSONL chat records with a user turn")
    kwargs = dict(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    if warmup:
        greedy_generate(target, prompts[0].token_ids, max_new_tokens=min(8, max_new_tokens),
                        stop_token_ids=stop_token_ids)
        speculative_generate(target, proposer, prompts[0].token_ids, block_size=block_size,
                             layer_ids=layer_ids, max_new_tokens=min(8, max_new_tokens),
                             stop_token_ids=stop_token_ids)
    taus: list[int] = []
    spec_tokens = spec_s = base_tokens = base_s = 0.0
    mismatches, per_prompt = [], []
    for i, prompt in enumerate(prompts):
        reference = greedy_generate(target, prompt.token_ids, **kwargs)
        output = speculative_generate(target, proposer, prompt.token_ids, block_size=block_size,
                                      layer_ids=layer_ids, **kwargs)
        base_tokens += len(reference.tokens)
        base_s += reference.elapsed_s
        spec_tokens += len(output.tokens)
        spec_s += output.elapsed_s
        taus.extend(output.acceptance_lengths)
        mismatch = first_mismatch(reference, output)
        if mismatch is not None:
            mismatches.append({**prompt.source, **mismatch})
        per_prompt.append({
            **prompt.source, "prompt_tokens": len(prompt.token_ids), "new_tokens": len(output.tokens),
            "acceptance_length": float(np.mean(output.acceptance_lengths)) if output.acceptance_lengths else None,
            "acceptance_lengths": output.acceptance_lengths,  # per verify: an engine's per-step count meets these
            "lossless": mismatch is None,
        })
        if progress is not None:
            progress(i + 1, len(prompts), taus, mismatches)
    return {
        "acceptance_length": float(np.mean(taus)) if taus else None,
        "lossless": not mismatches,
        "mismatches": mismatches,
        "tokens_per_s": spec_tokens / spec_s if spec_s else None,
        "baseline_tokens_per_s": base_tokens / base_s if base_s else None,
        "speedup": (spec_tokens / spec_s) / (base_tokens / base_s) if spec_s and base_s else None,
        "num_prompts": len(prompts),
        "num_verifications": len(taus),
        "new_tokens": int(spec_tokens),
        "max_new_tokens": max_new_tokens,
        "block_size": block_size,
        "per_prompt": per_prompt,
    }


__all__ = ["Prompt", "evaluate_online", "first_mismatch", "load_prompts"]
