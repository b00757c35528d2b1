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
  generation budget is the one the replies were cut at (a reply whose last token is not one
  of CACHE/target's stop tokens was cut, and the replay commits nothing past its last token,
  as online decoding's shortened last verification does): then the committed prefix, the
  context features and the target's choices online are the cached ones, up to the feature
  codec's rounding and batching numerics. For replies not written by the target (no
  `--regenerate`, or sampled at T > 0), the context is text the target would not have
  produced, and every offline figure is only a proxy for the online one.

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
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from dflash.shards.commands import DflashCommand
from dflash.shards.files import write_json_atomic
from dflash.shards.fingerprint import target_fingerprint
from dflash.shards.records import iter_records, prompt_messages
from dflash.shards.target_info import TARGET_INFO_FILE, TargetInfo
from dflash.train.basis import match_features
from dflash.train.data import eligible_anchors
from dflash.train.export import eval_results_path, load_drafter
from dflash.train.identity import cache_fingerprint, check_same_target, read_run_info
from dflash.train.model import BlockLayout, DFlashDrafter, TargetHead
from dflash.train.speculative import (
    DecodeResult,
    DrafterProposer,
    Proposer,
    greedy_generate,
    speculative_generate,
)

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
    block_size: int,
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
    cut = stop_token_ids is not None and mask.any() and int(input_ids[np.flatnonzero(mask)[-1]]) not in stop_token_ids
    return SequenceAcceptance(anchors=anchors, drafts=drafts, matches=matches, scored=scored, accepted=accepted,
                              replay_taus=replay_last_reply(mask, anchors, accepted, cut=cut))


@dataclass
class OfflineTotals:
    """Sums over sequences, turned into the reported figures by `summary`."""

    block_size: int
    num_sequences: int = 0
    num_anchors: int = 0
    accepted_sum: int = 0
    reached: np.ndarray = field(init=False)  # [B-1] int64: anchors whose drafts 1..k all matched
    matched: np.ndarray = field(init=False)  # [B-1] int64: anchors whose draft k matched
    scored: np.ndarray = field(init=False)  # [B-1] int64: anchors where position k is scored
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
    stop_token_ids: set[int] | None = None,
) -> dict[str, Any]:
    """Offline acceptance over `sequences` (objects with input_ids, loss_mask, features,
    topk_ids, topk_logprobs, as `Cache.__getitem__` returns). Returns `OfflineTotals.summary()`.
    stop_token_ids: see `sequence_acceptance`.
    """
    drafter.eval()
    totals = OfflineTotals(block_size=block_size)
    for seq in sequences:
        totals.add(sequence_acceptance(
            drafter, head, seq.input_ids, seq.loss_mask, seq.features,
            target_top1(seq.topk_ids, seq.topk_logprobs),
            block_size=block_size, anchors_per_call=anchors_per_call, stop_token_ids=stop_token_ids))
        if progress is not None:
            progress(totals)
    return totals.summary()


# ---------------------------------------------------------------------------------------
# Online
# ---------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------
# Runs and the command
# ---------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class EvalConfig:
    """`dflash-train eval`: what to evaluate, on what."""

    run: str | None = None
    """Run folder written by `dflash-train fit` (its drafter config, caches and held-out set)."""
    checkpoint: str | None = None
    """A RUN/checkpoints/step-N folder or an exported drafter folder; None: RUN's newest."""
    cache: str | None = None
    """Cache for the offline figures: one of the run's caches (its held-out sequences are used)
    or another cache (all its sequences). None: the held-out sequences of all the run's caches
    (offline mode), or no offline figures (online mode)."""
    online: bool = False
    """Run real speculative decoding against the target."""
    target: str | None = None
    """Online: the target's Hugging Face folder."""
    prompts: str | None = None
    """Online: JSONL records; each one's conversation up to its last user turn is a prompt.
    With `cache`, only the records behind that cache's evaluated sequences are used, and the
    offline figures are computed on exactly those sequences (side by side)."""
    max_new_tokens: int = 256
    """Online: tokens generated per prompt at most."""
    block_size: int | None = None
    """Block size to draft with; None: the drafter's training block size."""
    limit: int | None = None
    """Evaluate at most this many sequences / prompts (the first ones, in order)."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    dtype: str = "auto"
    """Online target (and drafter) dtype: auto (float32 on cpu, bfloat16 on cuda), float32 or
    bfloat16. float32 makes the lossless check meaningful to the last bit; see speculative.py."""
    save: bool = True
    """Write the figures to RUN/eval/<checkpoint>.json (read by `dflash-train export`)."""
    chat_template_kwargs: str | None = None
    """Online: JSON object for the chat template; None: the cache's (a different one warns)."""
    chat_template: str | None = None
    """Online: Jinja chat template file; None: the cache's (or the tokenizer's)."""
    allow_target_mismatch: bool = False
    """Evaluate a cache or --target of another target than the run's (a warning in the report)."""

    def __post_init__(self) -> None:
        if not self.online and (self.target is not None or self.prompts is not None):
            raise ValueError("--target and --prompts are used only with --online: add --online, or drop them")
        if self.online and (self.target is None or self.prompts is None):
            raise ValueError("eval --online needs --target (the target's folder) and --prompts (a JSONL file)")
        if not self.online and self.cache is None and self.run is None:
            raise ValueError("eval needs --cache or --run (whose held-out sequences are evaluated)")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.block_size is not None and self.block_size < (1 if self.online and self.cache is None else 2):
            raise ValueError(f"--block-size must be >= 2 (1 online: plain decoding), got {self.block_size}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"--dtype must be auto, float32 or bfloat16, got {self.dtype!r}")


def held_out_selection(fit_config: dict[str, Any], cache_path: str | Path | None) -> list[tuple[Any, list[int]]]:
    """[(open cache, sequence indices)] to evaluate.

    The held-out set is the run's (`held_out_mask` over the concatenation of its caches, with
    its seed and eval_fraction). `cache_path` that is one of the run's caches gives its share
    of the held-out set; another cache gives all its sequences; None gives every run cache's
    share.
    """
    from dflash.shards import open_cache
    from dflash.train.data import held_out_mask

    run_caches = [str(Path(p).resolve()) for p in fit_config.get("cache", [])]
    if cache_path is not None and str(Path(cache_path).resolve()) not in run_caches:
        cache = open_cache(cache_path)
        return [(cache, list(range(len(cache))))]
    opened = []
    for path in fit_config.get("cache", []):
        if not Path(path).is_dir():
            raise ValueError(f"the run's cache {path} (RUN/config.json) does not exist here: pass --cache "
                             "with its current location to evaluate all of its sequences")
        opened.append(open_cache(path))
    held = held_out_mask(sum(len(c) for c in opened), float(fit_config["eval_fraction"]), int(fit_config["seed"]))
    selection, offset = [], 0
    for path, cache in zip(run_caches, opened):
        indices = np.flatnonzero(held[offset:offset + len(cache)]).tolist()
        offset += len(cache)
        if cache_path is None or path == str(Path(cache_path).resolve()):
            selection.append((cache, indices))
    if not any(indices for _, indices in selection):
        raise ValueError("the run holds out no sequence (eval_fraction 0?): pass --cache with a separate cache")
    return selection


def sources_in_file(cache: Any, indices: list[int], prompts: str | Path) -> dict[int, int]:
    """{record index in `prompts`: sequence index} for the sequences that came from that file.

    A cache names its input files as stage one was given them; they match `prompts` by
    resolved path, or else by file name (the cache may have been built elsewhere).
    """
    wanted = Path(prompts).resolve()
    by_path, by_name = {}, {}
    for i in indices:
        source = cache.source(i)
        if Path(source["file"]).resolve() == wanted:
            by_path[int(source["index"])] = i
        elif Path(source["file"]).name == wanted.name:
            by_name[int(source["index"])] = i
    return by_path or by_name


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    return torch.device(name)


def _check_cache(cache: Any, drafter: DFlashDrafter) -> None:
    spec, c = cache.spec, drafter.config
    if spec.feature_width != c.context_width or cache.feature_basis_sha256 != c.feature_basis_sha256:
        raise ValueError(f"{cache.path}: cache features ({spec.feature_codec}, {spec.feature_width} per token) "
                         f"are not what the drafter's fc reads ({c.context_width} per token)")
    if spec.layer_ids != c.target_layer_ids or spec.hidden_size != c.hidden_size or spec.vocab_size != c.vocab_size:
        raise ValueError(
            f"{cache.path}: cache has layers {spec.layer_ids}, hidden {spec.hidden_size}, vocabulary "
            f"{spec.vocab_size}; the drafter expects layers {c.target_layer_ids}, hidden {c.hidden_size}, "
            f"vocabulary {c.vocab_size}: evaluate on a cache of the drafter's target")


def _token_id_set(value: int | list[int] | tuple[int, ...] | None) -> set[int]:
    """An `eos_token_id` field (one id, several, or none) as a set."""
    return set(value) if isinstance(value, (list, tuple)) else set() if value is None else {value}


def cache_stop_token_ids(target_dir: str | Path) -> set[int] | None:
    """The target's stop tokens as CACHE/target records them (the eos of target.json and of
    generation_config.json, as online decoding stops on); None when neither names one."""
    target_dir = Path(target_dir)
    stops: set[int] = set()
    if (target_dir / TARGET_INFO_FILE).is_file():
        stops |= _token_id_set(TargetInfo.load(target_dir).eos_token_id)
    generation = target_dir / "generation_config.json"
    if generation.is_file():
        stops |= _token_id_set(json.loads(generation.read_text()).get("eos_token_id"))
    return stops or None


def load_target(path: str | Path, drafter: DFlashDrafter, *, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer, stop token ids) of the target; ValueError if it does not fit the drafter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"--target {path}: no config.json; give a Hugging Face model folder")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    text_config = model.config.get_text_config()
    c = drafter.config
    found = (text_config.num_hidden_layers, text_config.hidden_size, model.get_input_embeddings().weight.shape[0])
    if found != (c.num_target_layers, c.hidden_size, c.vocab_size):
        raise ValueError(
            f"--target {path} has {found[0]} layers, hidden {found[1]}, {found[2]} embedding rows; the "
            f"drafter was trained for {c.num_target_layers}, {c.hidden_size}, {c.vocab_size}")
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = text_config.eos_token_id
    stop = _token_id_set(eos)
    return model, tokenizer, stop


def _select(config: EvalConfig, loaded) -> tuple[list[tuple[Any, list[int]]], set | None]:
    """Which sequences to score offline ([(cache, indices)]) and, online with a cache, which
    prompt records to keep (their record keys; None: the first `limit` of the file)."""
    selection: list[tuple[Any, list[int]]] = []
    if config.cache is not None or not config.online:
        if loaded.fit_config is not None:
            selection = held_out_selection(loaded.fit_config, config.cache)
        else:
            from dflash.shards import open_cache

            cache = open_cache(config.cache)
            selection = [(cache, list(range(len(cache))))]
    keep = None
    if config.online and selection:
        cache, indices = selection[0]
        if len(selection) > 1:
            raise ValueError("eval --online with a run of several caches: pass --cache with the one the "
                             "prompts file went into")
        matched = sources_in_file(cache, indices, config.prompts)
        if not matched:
            raise ValueError(f"none of the {len(indices)} evaluated sequences of {cache.path} came from "
                             f"{config.prompts}; pass the prompts file the cache was built from, or drop --cache")
        keep = set(sorted(matched)[: config.limit] if config.limit else matched)
        selection = [(cache, sorted(matched[r] for r in keep))]
    elif config.limit is not None:
        remaining, limited = config.limit, []
        for cache, indices in selection:
            limited.append((cache, indices[:remaining]))
            remaining -= len(limited[-1][1])
        selection = limited
    return selection, keep


def run_eval(config: EvalConfig, *, show_progress: bool = True) -> dict[str, Any]:
    """Evaluate as `config` says; returns the figures (offline keys at top level, online ones
    under "online") and saves them to RUN/eval/<checkpoint>.json when asked."""
    from tqdm import tqdm

    device = _device(config.device)
    loaded = load_drafter(config.run, config.checkpoint, device=device)
    drafter = loaded.drafter.eval()
    block_size = config.block_size or drafter.config.block_size
    result: dict[str, Any] = {"checkpoint": str(loaded.checkpoint), "step": loaded.step}

    selection, keep = _select(config, loaded)

    run_fingerprint = read_run_info(config.run).get("target_fingerprint") if config.run else None
    warnings = result["warnings"] = []
    fit_caches = (loaded.fit_config or {}).get("cache") or []
    if selection:
        drafter = match_features(drafter, selection[0][0], fit_caches)  # folds a basis for raw features
        for cache, _ in selection:
            _check_cache(cache, drafter)
            warnings.append(check_same_target(f"--cache {cache.path}", cache_fingerprint(cache), run_fingerprint,
                                              allow=config.allow_target_mismatch))
        head = TargetHead.load(selection[0][0].target_dir, device=device, dtype=torch.float32)
        total = sum(len(indices) for _, indices in selection)
        bar = tqdm(total=total, desc="offline", unit="seq", disable=not show_progress)

        def progress(totals: OfflineTotals) -> None:
            bar.update(1)
            bar.set_postfix(tau=f"{1 + totals.accepted_sum / max(totals.num_anchors, 1):.3f}")

        sequences = (cache[i] for cache, indices in selection for i in indices)
        result.update(evaluate_offline(drafter, head, sequences, block_size=block_size, progress=progress,
                                       stop_token_ids=cache_stop_token_ids(selection[0][0].target_dir)))
        bar.close()
        result["caches"] = [{"path": str(cache.path), "num_sequences": len(indices)} for cache, indices in selection]
        result["regenerated"] = all(cache.spec.replies[0] for cache, _ in selection)
        result["generation_temperature"] = selection[0][0].spec.replies[1]

    if config.online:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            config.dtype, torch.float32 if device.type == "cpu" else torch.bfloat16)
        warnings.append(check_same_target(f"--target {config.target}", target_fingerprint(config.target),
                                          run_fingerprint, allow=config.allow_target_mismatch))
        target, tokenizer, stop = load_target(config.target, drafter, device=device, dtype=dtype)
        from dflash.train.chat_template import resolve_template_settings

        template_kwargs, template_text = resolve_template_settings(
            selection[0][0] if selection else None, config.chat_template_kwargs, config.chat_template)
        prompts, rejected = load_prompts(config.prompts, tokenizer, keep=keep,
                                         limit=None if keep is not None else config.limit,
                                         chat_template=template_text, chat_template_kwargs=template_kwargs)
        if not prompts:
            shown = "; ".join(f"line {r['index'] + 1}: {r['reason']}" for r in rejected[:3])
            raise ValueError(f"--prompts {config.prompts}: no usable prompt ({len(rejected)} record(s) rejected"
                             + (f"; {shown}" if shown else "") + "): give JSONL chat records with a user turn")
        head = TargetHead(embed_tokens=target.get_input_embeddings().weight.detach(),
                          lm_head=target.get_output_embeddings().weight.detach())
        proposer = DrafterProposer(match_features(drafter, None, fit_caches).to(dtype), head)
        bar = tqdm(total=len(prompts), desc="online", unit="prompt", disable=not show_progress)

        def online_progress(done: int, total: int, taus: list[int], mismatches: list) -> None:
            bar.update(1)
            bar.set_postfix(tau=f"{np.mean(taus) if taus else 0:.3f}", mismatches=len(mismatches))

        online = evaluate_online(target, proposer, prompts, max_new_tokens=config.max_new_tokens,
                                 block_size=block_size, layer_ids=drafter.config.target_layer_ids,
                                 stop_token_ids=stop, progress=online_progress)
        bar.close()
        online.update(rejected=rejected, stop_token_ids=sorted(stop), device=str(device),
                      dtype=str(dtype).removeprefix("torch."), target=str(config.target),
                      prompts=str(config.prompts), chat_template_kwargs=template_kwargs)
        result["online"] = online

    result["warnings"] = [w for w in dict.fromkeys(warnings) if w is not None]
    if config.save and config.run is not None:
        result["saved_to"] = str(_save_result(eval_results_path(Path(config.run), loaded.checkpoint), result))
    return result


def _save_result(path: Path, result: dict[str, Any]) -> Path:
    """Merge `result` into RUN/eval/<checkpoint>.json: an offline-only call keeps the
    checkpoint's earlier online figures."""
    saved = json.loads(path.read_text()) if path.is_file() else {}
    saved.update(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, saved, indent=1, sort_keys=False)
    return path


def format_report(result: dict[str, Any]) -> str:
    """The human table printed by `dflash-train eval`."""
    lines = [f"checkpoint {result['checkpoint']}" + (f" (step {result['step']})" if result.get("step") is not None else "")]
    if result.get("acceptance_length") is not None:
        lines.append(
            f"offline  tau {result['acceptance_length']:.3f} over {result['num_anchors']} anchors of "
            f"{result['num_sequences']} sequences (block {result['block_size']})")
        if result.get("replay_acceptance_length") is not None:
            kind = ("= online greedy tau (replies regenerated greedily)"
                    if result.get("regenerated") and result.get("generation_temperature") == 0
                    else "proxy: replies not the target's greedy output")
            lines.append(f"         replayed decoding tau {result['replay_acceptance_length']:.3f} over "
                         f"{result['num_replay_verifications']} verifications ({kind})")
        width = len(result["per_position_acceptance"])
        lines.append("position " + " ".join(f"{k:>5d}" for k in range(1, width + 1)))
        for name in ("acceptance", "match"):
            values = result[f"per_position_{name}"]
            lines.append(f"{name:<8} " + " ".join("    -" if v is None else f"{v:5.3f}" for v in values))
    lines += [f"warning: {warning}" for warning in result.get("warnings", [])]
    online = result.get("online")
    if online:
        status = "yes" if online["lossless"] else f"NO ({len(online['mismatches'])} prompts differ)"
        lines.append(
            f"online   tau {online['acceptance_length'] or 0:.3f} over {online['num_verifications']} verifications, "
            f"{online['num_prompts']} prompts, lossless {status}")
        lines.append(
            f"         {online['tokens_per_s']:.1f} tok/s speculative vs {online['baseline_tokens_per_s']:.1f} "
            f"tok/s greedy ({online['speedup']:.2f}x, {online['device']} {online['dtype']})")
        for mismatch in online["mismatches"]:
            lines.append(f"         mismatch {mismatch['file']}:{mismatch['index']} at token {mismatch['position']}: "
                         f"target {mismatch['reference_token']} (margin {mismatch['reference_margin']}), "
                         f"speculative {mismatch['speculative_token']}")
        if online["rejected"]:
            lines.append(f"         {len(online['rejected'])} prompt records skipped "
                         f"(first: line {online['rejected'][0]['index'] + 1}: {online['rejected'][0]['reason']})")
    return "\n".join(lines)


@click.command("eval", cls=DflashCommand)
@click.option("--run", type=click.Path(file_okay=False), help="Run folder written by dflash-train fit.")
@click.option("--checkpoint", type=click.Path(), help="RUN/checkpoints/step-N or an exported folder [newest].")
@click.option("--cache", type=click.Path(file_okay=False),
              help="Cache to score offline (a run cache: its held-out sequences; another: all).")
@click.option("--online", is_flag=True, help="Real speculative decoding against --target.")
@click.option("--target", type=click.Path(file_okay=False), help="The target's Hugging Face folder (online).")
@click.option("--prompts", type=click.Path(dir_okay=False, exists=True), help="JSONL records (online).")
@click.option("--max-new-tokens", type=int, default=256, show_default=True, help="Online: tokens per prompt.")
@click.option("--block-size", type=int, help="Draft block size [the drafter's].")
@click.option("--limit", type=int, help="At most this many sequences / prompts.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="Online target dtype (auto: float32 on cpu, bfloat16 on cuda).")
@click.option("--chat-template-kwargs", default=None,
              help="Online: JSON object for the chat template [the cache's].")
@click.option("--chat-template", type=click.Path(dir_okay=False), default=None,
              help="Online: Jinja chat template file [the cache's, else the tokenizer's].")
@click.option("--save/--no-save", default=True, show_default=True, help="Write RUN/eval/<checkpoint>.json.")
@click.option("--allow-target-mismatch", is_flag=True,
              help="Evaluate a cache or --target of another target than the run's (warned in the report).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object on the last line.")
def eval_command(as_json: bool, **options: Any) -> None:
    """Acceptance length of a drafter: offline from a cache, and with --online against the target.

    \b
    tau = 1 + the number of leading drafts the target accepts (its bonus token counts 1).
    Offline: every eligible anchor of the held-out sequences (or of --cache), block position
    k scored against the cached top-1 at a+k-1; "replayed" follows greedy decoding along
    each sequence's last reply and equals the online tau when the cache was made with
    --regenerate at temperature 0. Online: real greedy speculative decoding, checked token
    for token against the target's own greedy output (lossless).
    """
    result = run_eval(EvalConfig(**options))  # a ValueError is a one-line error (DflashCommand)
    click.echo(format_report(result))
    if as_json:
        click.echo(json.dumps(result))
