"""Offline acceptance: how many drafted tokens the target would accept, scored from a cache
alone (no target model), for `dflash-train eval`.

For every eligible anchor a of a sequence (`dflash.train.data.eligible_anchors`: a reply
token followed by a reply token, the same rule training draws its anchors from), the drafter
drafts the block `[x[a], MASK x (B-1)]` from the cached features at positions < a, B the
verify size (`verify_size`: the anchor and its B - 1 drafts; the kind turns the drafts into
its rows). Block position k (1..B-1) is compared with the target's greedy choice for token
a+k, which is the cached top-1 at position a+k-1 (the cached distribution at t is the
target's prediction for t+1). Position k is *scored* while a+k is inside the sequence and a
reply token (loss_mask[a+k]), exactly where training puts a label. accepted(a) = the number
of leading scored positions that match; tau(a) = 1 + accepted(a) (the target's bonus token),
at most B.

- `acceptance_length`: the mean of tau(a) over all anchors: every reply position weighs the
  same.
- `per_position_acceptance[k-1]`: the fraction of anchors whose drafts 1..k all matched,
  among anchors where position k is scored. `per_position_match[k-1]`: the fraction where
  draft k matched, whatever came before (the teacher-forced accuracy training logs; it
  overstates what the target accepts).
- `replay_acceptance_length`: decoding replayed along the last reply of each sequence:
  start at its first token, jump a <- a + tau(a), average tau over the visited anchors.
  This is what `eval --online` (train/online.py) measures on that conversation's prompt
  *when the reply is the target's own greedy output* (a cache made with `--regenerate` at
  temperature 0) and the generation budget is the one the replies were cut at (a reply whose
  last token is not one of CACHE/target's stop tokens was cut, and the replay commits nothing
  past its last token, as online decoding's shortened last verification does): then the
  committed prefix, the context features and the target's choices online are the cached
  ones, up to the feature codec's rounding and batching numerics. For replies not written by
  the target (no `--regenerate`, or sampled at T > 0), the context is text the target would
  not have produced, and every offline figure is only a proxy for the online one.

What this file trades off: the pass runs the training forward (all anchors of a sequence in
a few packed calls, `BlockLayout`) rather than decoding step by step, and takes the
drafter's greedy tokens through the LM head in row chunks, so logits over V exist for at
most `argmax_rows` rows at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dflash.train import drafters
from dflash.train.data import eligible_anchors
from dflash.train.model import BlockLayout, DFlashDrafter, TargetHead


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


def replay_last_reply(loss_mask: np.ndarray, anchors: np.ndarray, accepted: np.ndarray, *,
                      cut: bool = False) -> list[int]:
    """tau per verification when greedy decoding of the last reply is replayed from the cache.

    Decoding starts at the last reply's first token (online: the token the prefill produced)
    and each verification at anchor a commits tau(a) = accepted(a) + 1 tokens, so the next
    anchor is a + tau(a). It ends at the first position that is not an eligible anchor (the
    reply's last token, or past it).

    cut: the reply was cut at the token limit rather than ended by a stop token. Online
    decoding then shortens its last verification to the tokens left, so no verification
    commits past the reply's last token e: tau(a) <= e - a. (A reply that ends with its stop
    token at e may commit e - a + 1: the bonus after the stop, as online decoding counts it.)
    """
    mask = np.asarray(loss_mask, dtype=bool)
    starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))  # first token of each reply
    if starts.size == 0:
        return []
    last = int(np.flatnonzero(mask)[-1])  # the last reply's last token
    by_anchor = dict(zip(anchors.tolist(), accepted.tolist()))
    taus, a = [], int(starts[-1])
    while a in by_anchor:
        taus.append(min(by_anchor[a] + 1, last - a) if cut else by_anchor[a] + 1)
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
    verify_size: int,
    anchors_per_call: int = 256,
    argmax_rows: int = 1024,
    stop_token_ids: set[int] | None = None,
) -> SequenceAcceptance:
    """Draft every eligible anchor of one sequence and score it against the target's top-1.

    input_ids [T] int, loss_mask [T] bool, features [T, L, H] float (the cached target
    features), top1 [T] int (the target's greedy token after each position). stop_token_ids:
    the target's stop tokens; a last reply that does not end with one was cut at the token
    limit, which the replayed decoding respects (`replay_last_reply`).
    """
    head = head.for_drafter(drafter)  # a draft vocabulary's rows, when it has one
    device = head.embed_tokens.device
    T = int(input_ids.shape[0])
    B = verify_size
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
    kind = drafters.of(drafter)
    Q = kind.block_rows(B - 1)  # drafter rows per block of B - 1 drafts
    for first in range(0, anchors.shape[0], anchors_per_call):
        chunk = anchors[first:first + anchors_per_call]  # [n]
        context_length = int(chunk.max())  # context rows 0..max(a)-1: all any block may see
        layout = BlockLayout.build([(context_length, chunk)], Q, device=device)
        block_ids = torch.full((chunk.shape[0], Q), drafter.config.mask_token_id, dtype=torch.long,
                               device=device)  # [n, Q]
        block_ids[:, 0] = ids[torch.as_tensor(chunk, device=device)]
        embeds = head.embed(block_ids.reshape(-1)).to(next(drafter.parameters()).dtype)  # [n*Q, H]
        hidden = drafter(embeds, flat[:context_length], layout)  # [n*Q, H]
        drafts[first:first + chunk.shape[0]] = kind.draft(  # the online loop's rule (train/drafters/)
            drafter, hidden.view(chunk.shape[0], Q, -1), block_ids[:, 0], head,
            rows_per_chunk=argmax_rows, context=flat[torch.as_tensor(chunk - 1, device=device)]).tokens.cpu().numpy()
    matches = (drafts == expected) & scored
    accepted = block_acceptance(matches, scored)
    cut = stop_token_ids is not None and mask.any() and int(input_ids[np.flatnonzero(mask)[-1]]) not in stop_token_ids
    return SequenceAcceptance(anchors=anchors, drafts=drafts, matches=matches, scored=scored, accepted=accepted,
                              replay_taus=replay_last_reply(mask, anchors, accepted, cut=cut))


@dataclass
class OfflineTotals:
    """Sums over sequences, turned into the reported figures by `summary`."""

    verify_size: int
    num_sequences: int = 0
    num_anchors: int = 0
    accepted_sum: int = 0
    reached: np.ndarray = field(init=False)  # [B-1] int64: anchors whose drafts 1..k all matched
    matched: np.ndarray = field(init=False)  # [B-1] int64: anchors whose draft k matched
    scored: np.ndarray = field(init=False)  # [B-1] int64: anchors where position k is scored
    replay_taus: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        width = self.verify_size - 1
        self.reached = np.zeros(width, np.int64)
        self.matched = np.zeros(width, np.int64)
        self.scored = np.zeros(width, np.int64)

    def add(self, seq: SequenceAcceptance) -> None:
        self.num_sequences += 1
        self.num_anchors += int(seq.anchors.shape[0])
        self.accepted_sum += int(seq.accepted.sum())
        k = np.arange(1, self.verify_size)
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
            "num_drafts": self.verify_size - 1,
            "verify_size": self.verify_size,
        }


def evaluate_offline(
    drafter: DFlashDrafter,
    head: TargetHead,
    sequences: Iterable[Any],
    *,
    verify_size: int,
    anchors_per_call: int = 256,
    progress: Any = None,
    stop_token_ids: set[int] | None = None,
) -> dict[str, Any]:
    """Offline acceptance over `sequences` (objects with input_ids, loss_mask, features,
    topk_ids, topk_logprobs, as `Cache.__getitem__` returns). Returns `OfflineTotals.summary()`.
    stop_token_ids: see `sequence_acceptance`.
    """
    drafter.eval()
    totals = OfflineTotals(verify_size=verify_size)
    for seq in sequences:
        totals.add(sequence_acceptance(
            drafter, head, seq.input_ids, seq.loss_mask, seq.features,
            target_top1(seq.topk_ids, seq.topk_logprobs),
            verify_size=verify_size, anchors_per_call=anchors_per_call, stop_token_ids=stop_token_ids))
        if progress is not None:
            progress(totals)
    return totals.summary()


__all__ = ["OfflineTotals", "SequenceAcceptance", "block_acceptance", "evaluate_offline",
           "replay_last_reply", "sequence_acceptance", "target_top1"]
