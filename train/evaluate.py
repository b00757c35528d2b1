"""`dflash-train eval`: the drafter's acceptance length, offline from a cache and online
against the real target.

Offline (from the cache, no target needed). For every eligible anchor a of a sequence
(`dflash.train.data.eligible_anchors`: a reply token followed by a reply token, the same
rule training draws its anchors from), the drafter drafts the block `[x[a], MASK x (B-1)]`
from the cached features at positions < a. Block position k (1..B-1) is compared with the
target's greedy choice for token a+k, which is the cached top-1 at position a+k-1 (the
cached distribution at t is the target's prediction for t+1). Position k is *scored* while
a+k is inside the sequence and a reply token (loss_mask[a+k]), exactly where training puts
a label. accepted(a) = the number of leading scored positions that match; tau(a) =
1 + accepted(a) (the target's bonus token), at most B.

- `acceptance_length`: the mean of tau(a) over all anchors: every reply position weighs the
  same.
- `per_position_acceptance[k-1]`: the fraction of anchors whose drafts 1..k all matched,
  among anchors where position k is scored. `per_position_match[k-1]`: the fraction where
  draft k matched, whatever came before (the teacher-forced accuracy training logs; it
  overstates what the target accepts).
- `replay_acceptance_length`: decoding replayed along the last reply of each sequence:
  start at its first token, jump a <- a + tau(a), average tau over the visited anchors.
  This is what `eval --online` measures on that conversation's prompt *when the reply is the
  target's own greedy output* (a cache made with `--regenerate` at temperature 0) and the
  generation budget covers the reply: then the committed prefix, the context features and
  the target's choices online are the cached ones, up to the feature codec's rounding and
  batching numerics. For replies not written by the target (no `--regenerate`, or sampled
  at T > 0), the context is text the target would not have produced, and every offline
  figure is only a proxy for the online one.

Online (`--online`): real greedy speculative decoding, batch 1, with the Hugging Face target
verifying (see `dflash.train.speculative`). Prompts are JSONL records in the styles stage one
reads; each record's conversation up to its last user turn, rendered with the target's chat
template and its generation prompt, is the prompt. Reported: tau (committed tokens per
target verify), tokens/s, the target's own `generate(do_sample=False)` tokens/s timed on the
same prompts in the same process, and `lossless` (every prompt's output equals the target's
greedy output token for token), with every mismatch (prompt, first differing position, both
tokens and the target's top-1/top-2 logit margin there).

What this file trades off: the offline pass runs the training forward (all anchors of a
sequence in a few packed calls) and takes the drafter's greedy tokens through the LM head in
row chunks, so logits over V exist for at most `argmax_rows` rows at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.train.data import eligible_anchors
from dflash.train.model import BlockLayout, DFlashDrafter, TargetHead
from dflash.train.speculative import DecodeResult, Proposer, greedy_generate, speculative_generate

# ---------------------------------------------------------------------------------------
# Offline
# ---------------------------------------------------------------------------------------


def greedy_tokens(hidden: torch.Tensor, lm_head: torch.Tensor, rows_per_chunk: int = 1024) -> torch.Tensor:
    """Argmax of `hidden @ lm_head.T` per row, `rows_per_chunk` rows at a time.

    hidden [N, H], lm_head [V, H]. Returns [N] int64. Logits are computed in float32.
    """
    out = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)  # [N]
    weight = lm_head.float()
    for start in range(0, hidden.shape[0], rows_per_chunk):
        rows = hidden[start:start + rows_per_chunk].float()  # [n, H]
        out[start:start + rows_per_chunk] = (rows @ weight.T).argmax(-1)
    return out


def target_top1(topk_ids: np.ndarray, topk_logprobs: np.ndarray) -> np.ndarray:
    """[T] int64: the target's greedy token after each position (the most likely cached id;
    a tie keeps the first, which is the writer's order)."""
    best = np.argmax(topk_logprobs, axis=1)  # [T]
    return topk_ids[np.arange(topk_ids.shape[0]), best].astype(np.int64)


@dataclass
class SequenceAcceptance:
    """The drafter against the target on every eligible anchor of one sequence."""

    anchors: np.ndarray
    """[A] int64, sorted."""
    drafts: np.ndarray
    """[A, B-1] int64: the drafter's greedy token at block positions 1..B-1."""
    matches: np.ndarray
    """[A, B-1] bool: draft k equals the target's greedy token (False where not scored)."""
    scored: np.ndarray
    """[A, B-1] bool: position k has a label (a+k < T and loss_mask[a+k])."""
    accepted: np.ndarray
    """[A] int64: leading matches; tau = accepted + 1."""
    replay_taus: list[int]
    """tau at each anchor visited when decoding of the last reply is replayed."""


def block_acceptance(matches: np.ndarray, scored: np.ndarray) -> np.ndarray:
    """[A, K] bool, [A, K] bool -> [A] int64: the number of leading positions that are scored
    and match (acceptance stops at the first mismatch and at the first unscored position)."""
    ok = matches & scored
    return np.cumprod(ok, axis=1).sum(axis=1).astype(np.int64)


def replay_last_reply(loss_mask: np.ndarray, anchors: np.ndarray, accepted: np.ndarray) -> list[int]:
    """tau per verification when greedy decoding of the last reply is replayed from the cache.

    Decoding starts at the last reply's first token (online: the token the prefill produced)
    and each verification at anchor a commits tau(a) = accepted(a) + 1 tokens, so the next
    anchor is a + tau(a). It ends at the first position that is not an eligible anchor (the
    reply's last token, or past it).
    """
    mask = np.asarray(loss_mask, dtype=bool)
    starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))  # first token of each reply
    if starts.size == 0:
        return []
    by_anchor = dict(zip(anchors.tolist(), accepted.tolist()))
    taus, a = [], int(starts[-1])
    while a in by_anchor:
        taus.append(by_anchor[a] + 1)
        a += taus[-1]
    return taus


@torch.no_grad()
def sequence_acceptance(
    drafter: DFlashDrafter,
    head: TargetHead,
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    features: np.ndarray,
    top1: np.ndarray,
    *,
    block_size: int,
    anchors_per_call: int = 256,
    argmax_rows: int = 1024,
) -> SequenceAcceptance:
    """Draft every eligible anchor of one sequence and score it against the target's top-1.

    input_ids [T] int, loss_mask [T] bool, features [T, L, H] float (the cached target
    features), top1 [T] int (the target's greedy token after each position).
    """
    device = head.embed_tokens.device
    T = int(input_ids.shape[0])
    B = block_size
    anchors = eligible_anchors(loss_mask)  # [A] int64
    k = np.arange(1, B)  # [B-1]
    label_pos = anchors[:, None] + k[None, :]  # [A, B-1]: the token block position k predicts
    in_range = label_pos < T
    mask = np.asarray(loss_mask, dtype=bool)
    scored = in_range & mask[np.minimum(label_pos, T - 1)]
    expected = top1[np.minimum(label_pos - 1, T - 1)]  # [A, B-1] cached top-1 at a+k-1
    drafts = np.empty((anchors.shape[0], B - 1), dtype=np.int64)
    ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64), device=device)  # [T]
    flat = torch.as_tensor(np.asarray(features, dtype=np.float32).reshape(T, -1), device=device)  # [T, L*H]
    for first in range(0, anchors.shape[0], anchors_per_call):
        chunk = anchors[first:first + anchors_per_call]  # [n]
        context_length = int(chunk.max())  # context rows 0..max(a)-1: all any block may see
        layout = BlockLayout.build([(context_length, chunk)], B, device=device)
        block_ids = torch.full((chunk.shape[0], B), drafter.config.mask_token_id, dtype=torch.long,
                               device=device)  # [n, B]
        block_ids[:, 0] = ids[torch.as_tensor(chunk, device=device)]
        embeds = head.embed(block_ids.reshape(-1)).to(next(drafter.parameters()).dtype)  # [n*B, H]
        hidden = drafter(embeds, flat[:context_length], layout)  # [n*B, H]
        hidden = hidden.view(chunk.shape[0], B, -1)[:, 1:].reshape(-1, hidden.shape[-1])  # [n*(B-1), H]
        drafts[first:first + chunk.shape[0]] = (
            greedy_tokens(hidden, head.lm_head, argmax_rows).view(chunk.shape[0], B - 1).cpu().numpy())
    matches = (drafts == expected) & scored
    accepted = block_acceptance(matches, scored)
    return SequenceAcceptance(anchors=anchors, drafts=drafts, matches=matches, scored=scored, accepted=accepted,
                              replay_taus=replay_last_reply(mask, anchors, accepted))


@dataclass
class OfflineTotals:
    """Sums over sequences, turned into the reported figures by `summary`."""

    block_size: int
    num_sequences: int = 0
    num_anchors: int = 0
    accepted_sum: int = 0
    reached: np.ndarray = None  # [B-1] anchors whose drafts 1..k all matched
    matched: np.ndarray = None  # [B-1] anchors whose draft k matched
    scored: np.ndarray = None  # [B-1] anchors where position k is scored
    replay_taus: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        width = self.block_size - 1
        self.reached = np.zeros(width, np.int64)
        self.matched = np.zeros(width, np.int64)
        self.scored = np.zeros(width, np.int64)

    def add(self, seq: SequenceAcceptance) -> None:
        self.num_sequences += 1
        self.num_anchors += int(seq.anchors.shape[0])
        self.accepted_sum += int(seq.accepted.sum())
        k = np.arange(1, self.block_size)
        self.reached += (seq.accepted[:, None] >= k[None, :]).sum(axis=0)
        self.matched += seq.matches.sum(axis=0)
        self.scored += seq.scored.sum(axis=0)
        self.replay_taus.extend(seq.replay_taus)

    def summary(self) -> dict[str, Any]:
        def ratio(num: np.ndarray) -> list[float | None]:
            return [round(float(n) / s, 6) if s else None for n, s in zip(num, self.scored)]

        return {
            "acceptance_length": (1.0 + self.accepted_sum / self.num_anchors) if self.num_anchors else None,
            "per_position_acceptance": ratio(self.reached),
            "per_position_match": ratio(self.matched),
            "num_anchors": self.num_anchors,
            "num_sequences": self.num_sequences,
            "replay_acceptance_length": (float(np.mean(self.replay_taus)) if self.replay_taus else None),
            "num_replay_verifications": len(self.replay_taus),
            "block_size": self.block_size,
        }


def evaluate_offline(
    drafter: DFlashDrafter,
    head: TargetHead,
    sequences: Iterable[Any],
    *,
    block_size: int,
    anchors_per_call: int = 256,
    progress: Any = None,
) -> dict[str, Any]:
    """Offline acceptance over `sequences` (objects with input_ids, loss_mask, features,
    topk_ids, topk_logprobs, as `Cache.__getitem__` returns). Returns `OfflineTotals.summary()`.
    """
    drafter.eval()
    totals = OfflineTotals(block_size=block_size)
    for seq in sequences:
        totals.add(sequence_acceptance(
            drafter, head, seq.input_ids, seq.loss_mask, seq.features,
            target_top1(seq.topk_ids, seq.topk_logprobs),
            block_size=block_size, anchors_per_call=anchors_per_call))
        if progress is not None:
            progress(totals)
    return totals.summary()


# ---------------------------------------------------------------------------------------
# Online
# ---------------------------------------------------------------------------------------

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "chatgpt": "assistant", "model": "assistant", "system": "system"}


def prompt_messages(record: Any) -> list[dict[str, str]]:
    """The chat messages up to and including the last user turn of a record.

    Record styles as stage one reads them: `messages` (role/content), `conversations`
    (from/value, ShareGPT roles), `prompt` (+ `response`, optional `system`). ValueError with
    the reason otherwise (a `text` record has no user turn to prompt with).
    """
    if not isinstance(record, dict):
        raise ValueError(f"record is a {type(record).__name__}, not an object")
    if record.get("messages") is not None:
        messages = [_message(m, i, "messages", "role", "content") for i, m in enumerate(record["messages"])]
    elif record.get("conversations") is not None:
        messages = [_message(m, i, "conversations", "from", "value")
                    for i, m in enumerate(record["conversations"])]
    elif record.get("prompt") is not None:
        messages = [{"role": "system", "content": _content(record["system"], "system")}] \
            if record.get("system") is not None else []
        messages.append({"role": "user", "content": _content(record["prompt"], "prompt")})
    elif record.get("text") is not None:
        raise ValueError("a 'text' record has no user turn to use as a prompt")
    else:
        raise ValueError("record has none of the fields 'messages', 'conversations', 'prompt'")
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError("conversation has no user turn")
    return messages[: users[-1] + 1]


def _message(item: Any, i: int, key: str, role_key: str, content_key: str) -> dict[str, str]:
    if not isinstance(item, dict) or not isinstance(item.get(role_key), str):
        raise ValueError(f"{key}[{i}] is not an object with a '{role_key}'")
    role = item[role_key]
    if key == "conversations":
        if role.lower() not in ROLE_ALIASES:
            raise ValueError(f"{key}[{i}].{role_key} is {role!r}, expected one of {sorted(ROLE_ALIASES)}")
        role = ROLE_ALIASES[role.lower()]
    return {"role": role, "content": _content(item.get(content_key), f"{key}[{i}].{content_key}")}


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    raise ValueError(f"field '{where}' must be a string")


@dataclass
class Prompt:
    """One prompt for online decoding."""

    source: dict[str, Any]
    """{"file", "index"}: the prompts file and the record's 0-based line (as stage one names it)."""
    token_ids: list[int]


def iter_prompt_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(0-based line, parsed record) of every non-blank line of a JSONL file (or the elements
    of a JSON list); a line that is not JSON gives (line, None)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, list):
            yield from enumerate(data)
            return
    for index, line in enumerate(text.splitlines()):
        if line.strip():
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError:
                yield index, None


def load_prompts(path: str | Path, tokenizer: Any, *, keep: set[int] | None = None,
                 limit: int | None = None) -> tuple[list[Prompt], list[dict[str, Any]]]:
    """Prompts of a records file, rendered with the tokenizer's chat template.

    keep: only these record indices (None: all). Returns (prompts, rejected), each rejected
    record as {"file", "index", "reason"}.
    """
    if tokenizer.chat_template is None:
        raise ValueError("the target's tokenizer has no chat template: online eval renders prompts with it")
    prompts, rejected = [], []
    for index, record in iter_prompt_records(path):
        if keep is not None and index not in keep:
            continue
        if limit is not None and len(prompts) >= limit:
            break
        source = {"file": str(path), "index": index}
        try:
            if record is None:
                raise ValueError(f"invalid JSON on line {index + 1}")
            text = tokenizer.apply_chat_template(prompt_messages(record), tokenize=False,
                                                 add_generation_prompt=True)
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
        raise ValueError("no usable prompt: check the prompts file (rejected records are listed)")
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
