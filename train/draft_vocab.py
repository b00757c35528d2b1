"""A draft vocabulary (`fit --draft-vocab N`): the drafter scores N tokens, not the target's V.

Why: the drafter's LM head is most of its cost. In training every labelled row scores the
whole head (4NHV flops in the loss: SmolLM2-135M's 49,152 rows are most of a demo step);
in decoding a draft of B-1 rows against the head costs (B-1) * V * H multiply-adds, at
Qwen3 scale 152k rows, 0.62B of a 1.7B drafter's weights touched per drafted token. The
replies a drafter is trained on use few distinct tokens (the demo's 684 training replies:
2,106 distinct), so the N most frequent cover almost every token the target emits. EAGLE-3
drafters ship the same thing (`draft_vocab_size` and a `d2t` map); vLLM's DFlash model loads
it (the export writes `lm_head.weight` and `d2t`). z-lab's DFlash code loads no draft
vocabulary: a drafter trained with one serves through vLLM, or is evaluated by dflash.

The choice: the N token ids that occur most often at the training sequences' training
positions (the loss mask, or every token with --train-on all), counted on up to
`max_tokens` tokens of a seeded sample of training sequences (all of them when fewer), ties
by the lower id; ids the sample never uses follow by id. Draft id 0 is the most frequent.
The drafter's head is the target LM head's rows of those ids, frozen as the whole head is;
the buffers `draft_head` and `draft_ids` travel in its checkpoints. Stored in
RUN/draft_vocab.npz (ids and counts) at the first start; a resume reads it back.

The loss (`remap_teacher`): the cached teacher top-k is in target ids. Ids outside the
draft vocabulary cannot be drafted: their probability joins the teacher's tail bucket (the
bucket is 1 - sum of the in-vocabulary top-k), and their slots are given distinct filler
ids, the rarest draft ids the row does not hold, with teacher log-prob -inf, because the
loss kernel wants k distinct ids per row. A filler's student mass then counts in neither
the top-k nor the bucket: the loss treats it as a class of teacher probability 0, which is
near the truth for the rarest draft tokens and changes no gradient formula (the kernel's is
exact for any distinct ids). The CE target is the best in-vocabulary teacher token (the
target's greedy token whenever the vocabulary holds it); a row whose top-k lies wholly
outside the vocabulary gets weight 0.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dflash.common.files import write_npz_atomic
from dflash.train.model import DFlashDrafter, TargetHead
from dflash.train.run_folder import DRAFT_VOCAB_FILE

DEFAULT_MAX_TOKENS = 1 << 26  # 67M tokens: ~335 MB of ids and masks read, seconds to a minute


def count_tokens(corpus, sequences: np.ndarray, *, seed: int, max_tokens: int = DEFAULT_MAX_TOKENS,
                 rank: int = 0, world_size: int = 1,
                 combine: Callable[[np.ndarray], np.ndarray] | None = None, progress: bool = False) -> np.ndarray:
    """[V] int64: how often each token id occurs at the training positions of a seeded sample
    of `sequences` (global indices) holding at most about `max_tokens` tokens. Under several
    ranks each reads every world_size-th sequence of the sample and `combine` sums."""
    vocab_size = int(corpus.spec.vocab_size)
    order = np.random.default_rng([seed, 0xD2]).permutation(np.asarray(sequences, dtype=np.int64))
    lengths = corpus.lengths[order]
    take = int(np.searchsorted(np.cumsum(lengths), max_tokens, side="left")) + 1
    sample = order[:take]
    counts = np.zeros(vocab_size, dtype=np.int64)
    mine = sample[rank::world_size]
    if progress and len(mine) >= 10_000:
        from tqdm import tqdm

        mine = tqdm(mine, desc="counting the draft vocabulary", unit="seq", unit_scale=True, mininterval=2)
    for s in mine:
        cache, index = corpus.locate(int(s))
        ids = np.asarray(cache.input_ids(index), dtype=np.int64)
        mask = corpus.training_mask(cache.loss_mask(index))
        counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    if world_size > 1:
        if combine is None:
            raise ValueError("count_tokens over several ranks needs `combine` (an all-reduce sum)")
        counts = np.asarray(combine(counts), dtype=np.int64)
    return counts


def choose(counts: np.ndarray, size: int) -> np.ndarray:
    """[size] int64 token ids: the most frequent first, ties (and never-seen ids) by id."""
    if not 1 <= size <= counts.shape[0]:
        raise ValueError(f"--draft-vocab {size}: must lie in [1, {counts.shape[0]}] (the target's vocabulary)")
    order = np.lexsort((np.arange(counts.shape[0]), -counts))  # count descending, then id ascending
    return order[:size].astype(np.int64)


def load_or_choose(run_dir: Path, size: int, count: Callable[[], np.ndarray], *, write: bool) -> dict:
    """The run's draft vocabulary {ids [size] int64, counts [size], total: tokens counted}:
    RUN/draft_vocab.npz when it holds `size` ids (a resume), else chosen from `count()` and,
    when `write` (rank 0), stored there."""
    path = Path(run_dir) / DRAFT_VOCAB_FILE
    if path.exists():
        with np.load(path) as stored:
            if stored["ids"].shape == (size,):
                return {"ids": stored["ids"].astype(np.int64), "counts": stored["counts"],
                        "total": int(stored["total"])}
    counts = count()
    ids = choose(counts, size)
    vocab = {"ids": ids, "counts": counts[ids], "total": int(counts.sum())}
    if write:
        write_npz_atomic(path, ids=ids, counts=vocab["counts"], total=np.int64(vocab["total"]))
    return vocab


def install(drafter: DFlashDrafter, ids: np.ndarray, head: TargetHead) -> None:
    """Fill the drafter's draft buffers: the ids and the target LM head's rows of them."""
    with torch.no_grad():
        index = torch.as_tensor(ids, dtype=torch.long, device=head.lm_head.device)
        drafter.draft_ids.copy_(index.to(drafter.draft_ids.device))
        drafter.draft_head.copy_(head.lm_head[index].to(drafter.draft_head.device, drafter.draft_head.dtype))


def remap_teacher(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, head: TargetHead
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [N, k] draft rows, log-probs [N, k], CE targets [N] draft rows, live [N] bool) of
    the teacher's top-k for a draft-vocabulary head (module docstring): out-of-vocabulary
    slots get fillers with log-prob -inf; live is False where no slot is in the vocabulary."""
    rows = head.target_to_draft[topk_ids.long()]  # [N, k], -1 outside
    outside = rows < 0
    k = rows.shape[1]
    size = head.lm_head.shape[0]
    if size < 2 * k + 1:
        raise ValueError(f"--draft-vocab {size} is too small for the cache's top-{k}: use at least {2 * k + 1}")
    candidates = torch.arange(size - 2 * k - 1, size, device=rows.device)  # [2k+1] the rarest draft ids
    held = (rows[:, :, None] == candidates[None, None, :]).any(1)  # [N, 2k+1]
    free = candidates[torch.argsort(held.to(torch.int8), dim=1, stable=True)]  # [N, 2k+1] free ones first
    slot = (outside.long().cumsum(1) - 1).clamp(min=0)  # [N, k]: j-th outside slot takes the j-th free id
    ids = torch.where(outside, free.gather(1, slot), rows)
    logprobs = topk_logprobs.float().masked_fill(outside, -torch.inf)
    best = logprobs.argmax(1, keepdim=True)  # [N, 1]
    return ids, logprobs, ids.gather(1, best)[:, 0], ~outside.all(1)


__all__ = ["DEFAULT_MAX_TOKENS", "choose", "count_tokens", "install",
           "load_or_choose", "remap_teacher"]
