"""Online acceptance: real speculative decoding against the Hugging Face target, batch 1, for
`dflash-train eval --online` (the decoding itself is `dflash.train.speculative`): greedy by
default, sampled at `temperature` > 0.

This module is the online loop's one face: what eval (and a bench) needs to decode is taken
from here, not from the modules behind it: the target loaded and checked against the
drafter with its stop tokens (`load_target`; the stop-token rules, `target_stop_token_ids`
and `cache_stop_token_ids`), the refusal of a target whose cache cannot be rolled back
(`rollback_refusal`), the drafter as a proposer (`DrafterProposer`, `drafter_proposer`), the
prompts rendered by one `ChatRenderer` (`load_prompts`, `suite_prompts`), and the decoding of
them all (`evaluate_online`).

Prompts are records in the styles stage one reads (`dflash.common.records`: the same reader,
so a record's index is the one a cache names as its sequence's source); each record's
conversation up to its last user turn, rendered with the target's chat template and its
generation prompt, is the prompt. Reported: tau (committed tokens per target verify),
tokens/s, the target's own `generate(do_sample=False)` tokens/s timed on the same prompts in
the same process, and `lossless`: every prompt's output equals the target's greedy output
token for token, or first differs from it at a near-tie. Every mismatch is listed (prompt,
first differing position, both tokens, the target's top-1/top-2 logit margin there) with its
kind: a near-tie when the reference's top logit exceeds its logit of the speculative token
by no more than the rounding bound of the target's dtype (`near_tie_bound`), else real; the
counts of both are reported. Only a real mismatch makes `lossless` false: a near-tie is the
target's own arithmetic (a B-token verify and a one-token step round differently), not a
draft accepted wrongly. Sampled (temperature > 0), each prompt's turn draws from its own
generator seeded from (seed, prompt, turn); `lossless` is then None: outputs are not compared
token for token (the rule is lossless in distribution, `speculative.MatchSampler`), and the
baseline is the target's plain sampling, timed. Prompts of a benchmark suite
(`dflash.train.suites`, `suite_prompts`) may have further user turns (MT-Bench): each is
asked after the speculative decoding's own reply to the turn before.

What this file trades off: the baseline runs in the same process, alternating with the
speculative run prompt by prompt, so the speedup is measured on one machine state (not
against a serving engine); batch 1 keeps the lossless check exact but says nothing of
throughput under load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.common.records import iter_records, prompt_messages
from dflash.shards.target_info import TARGET_INFO_FILE, TargetInfo
from dflash.train.mask_token import token_ids
from dflash.train.model import DFlashDrafter, TargetHead
from dflash.train.speculative import (
    DecodeResult,
    DrafterProposer,
    MatchSampler,
    Proposer,
    greedy_generate,
    speculative_generate,
)
from dflash.train.target_cache import rollback_refusal


def target_stop_token_ids(model: Any) -> set[int]:
    """The stop tokens online decoding ends a reply at, for a loaded Hugging Face target: its
    generation config's `eos_token_id` (what its own `generate` stops at), else its text
    config's."""
    eos = model.generation_config.eos_token_id
    return token_ids(model.config.get_text_config().eos_token_id if eos is None else eos)


def cache_stop_token_ids(target_dir: str | Path) -> set[int] | None:
    """The target's stop tokens as CACHE/target records them (the eos of target.json and of
    generation_config.json, as online decoding stops on), for offline scoring; None when
    neither names one."""
    target_dir = Path(target_dir)
    stops: set[int] = set()
    if (target_dir / TARGET_INFO_FILE).is_file():
        stops |= token_ids(TargetInfo.load(target_dir).eos_token_id)
    generation = target_dir / "generation_config.json"
    if generation.is_file():
        stops |= token_ids(json.loads(generation.read_text()).get("eos_token_id"))
    return stops or None


def load_target(path: str | Path, drafter: DFlashDrafter, *, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.nn.Module, Any, set[int]]:
    """(model, tokenizer, stop token ids) of the target's Hugging Face folder, in `dtype` on
    `device`, in eval mode; ValueError if its sizes (layers, hidden size, embedding rows) are
    not the ones the drafter was trained for."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # here: `dflash-train --help` stays fast

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
    return model, tokenizer, target_stop_token_ids(model)


def drafter_proposer(drafter: DFlashDrafter, target: torch.nn.Module) -> DrafterProposer:
    """The drafter as the decoding loop's proposer, drafting through the loaded target's own
    embedding and LM head."""
    head = TargetHead(embed_tokens=target.get_input_embeddings().weight.detach(),
                      lm_head=target.get_output_embeddings().weight.detach())
    return DrafterProposer(drafter, head)


@dataclass
class Prompt:
    """One prompt for online decoding."""

    source: dict[str, Any]
    """{"file", "index"}: the prompts file and the record's 0-based line (as stage one names it)."""
    token_ids: list[int]
    messages: list[dict[str, str]] = field(default_factory=list)
    """The conversation `token_ids` renders (needed only with `next_turns`)."""
    next_turns: list[str] = field(default_factory=list)
    """Further user turns, each asked after the decoded reply to the one before (MT-Bench)."""


class ChatRenderer:
    """Conversations to prompt ids with the target's chat template (or `chat_template`) and its
    generation prompt, and generated ids back to reply text (special tokens skipped)."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None):
        if tokenizer.chat_template is None and chat_template is None:
            raise ValueError("the target's tokenizer has no chat template: online eval renders prompts with it")
        self.tokenizer = tokenizer
        self.options = {**({} if chat_template is None else {"chat_template": chat_template}),
                        **(chat_template_kwargs or {})}

    def ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **self.options)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def reply(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def suite_prompts(items: list[Any], renderer: ChatRenderer) -> list[Prompt]:
    """Prompts of a suite's rows (`dflash.train.suites.SuiteItem`): the first user turn rendered,
    the others kept for after its reply."""
    prompts = []
    for item in items:
        messages = [{"role": "user", "content": item.turns[0]}]
        prompts.append(Prompt(source=dict(item.source), token_ids=renderer.ids(messages), messages=messages,
                              next_turns=list(item.turns[1:])))
    return prompts


def load_prompts(path: str | Path, renderer: ChatRenderer, *, keep: set[int] | None = None,
                 limit: int | None = None) -> tuple[list[Prompt], list[dict[str, Any]]]:
    """Prompts of a records file, rendered by `renderer` (the one that also renders the later
    turns of a decoding).

    keep: only these record indices (None: all). Returns (prompts, rejected), each rejected
    record as {"file", "index", "reason"}.
    """
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
            token_ids = renderer.ids(prompt_messages(record.data))
        except ValueError as e:
            rejected.append({**source, "reason": str(e)})
            continue
        prompts.append(Prompt(source=source, token_ids=token_ids))
    return prompts, rejected


TIE_ROUNDINGS = 16
"""A near-tie's margin, in units of the target dtype's rounding of its top logit (`near_tie_bound`)."""


def near_tie_bound(top_logit: float, dtype: torch.dtype) -> float:
    """The largest gap between the reference's top logit and another token's that rounding
    alone can overturn between a block verify and one-token decoding (the top-2 margin, when
    the other token is the runner-up): TIE_ROUNDINGS * u * |top_logit|, u the unit roundoff of
    `dtype` (2^-8 for bf16, 2^-24 for float32).

    Why: the two runs compute the same logits with different GEMM shapes (a B-row verify, a
    one-row step), so in a different summation order and, in bf16, from hidden states each
    layer rounded to 2^-8 relative. (1) The logits themselves are rounded to the dtype on
    output, each by at most u|z|: the margin between the top two moves by at most 2u(|z1| +
    |z2|), about 4u|z|, from one run to the other (in bf16 the logits of a random target sit
    on that grid, and exact ties, margin 0, are common). (2) The hidden state reaching the LM
    head differs by the layers' own roundings, which moves the logits further in an
    ill-conditioned network. Measured on CPU in bf16 (`bench.gpu_online_eval.margin_drift`:
    random Llamas of 4-16 layers, hidden 256-512, 64 positions, 16-token verifies against
    one-token steps, 3 seeds; bench/RESULTS.md "eval"): the largest change of a top-8 margin
    was 3.5-4.1 u|z| at the default initialisation (0.02: term (1) alone) and up to 15.4 u|z|
    at initialisation 0.2 (gain 3 per layer, logits about 12: term (2)); 16 covers both, the
    second barely, and a trained model is far better conditioned than that one. In bf16 the
    bound is |z| / 16: 0.5 at a top logit of 8. Float32 gets ~1e-6 |z|; its summation-order
    drift measured 13-17 u|z| there (255 at initialisation 0.2), so a float32 tie closer than
    that is reported as real: such ties are rare at float32's resolution, and the report
    prints the gap and the bound beside each mismatch.
    """
    return TIE_ROUNDINGS * (torch.finfo(dtype).eps / 2) * abs(top_logit)


def first_mismatch(reference: DecodeResult, output: DecodeResult, dtype: torch.dtype) -> dict[str, Any] | None:
    """None when the token lists are equal; else where and how they first differ, and whether
    that is a near-tie (`near_tie`): the speculative token is among the reference's best
    tokens there (`DecodeResult.top_ids`) and the reference's top logit exceeds its logit by at
    most `near_tie_bound` for the target's `dtype` (`reference_gap`; with the runner-up, the
    gap is the top-2 margin). Anything else (a token further down, a wider gap, one output
    ending early) is a real mismatch."""
    if reference.tokens == output.tokens:
        return None
    n = min(len(reference.tokens), len(output.tokens))
    i = next((j for j in range(n) if reference.tokens[j] != output.tokens[j]), n)
    speculative_token = output.tokens[i] if i < len(output.tokens) else None
    gap = bound = None
    if i < len(reference.top_ids) and speculative_token in reference.top_ids[i]:
        logits = reference.top_logits[i]
        gap = logits[0] - logits[reference.top_ids[i].index(speculative_token)]
        bound = near_tie_bound(logits[0], dtype)
    return {
        "position": i,
        "reference_token": reference.tokens[i] if i < len(reference.tokens) else None,
        "speculative_token": speculative_token,
        "reference_length": len(reference.tokens),
        "speculative_length": len(output.tokens),
        # The target's top-1 minus top-2 logit where the two runs chose: near 0 is a tie that
        # last-bit differences between a block verify and one-token decoding can flip.
        "reference_margin": reference.margins[i] if i < len(reference.margins) else None,
        "speculative_margin": output.margins[i] if i < len(output.margins) else None,
        "reference_gap": gap,
        "tie_bound": bound,
        "near_tie": gap is not None and gap <= bound,
    }


def turn_seed(seed: int, prompt: int, turn: int) -> int:
    """The sampling seed of one prompt's turn: a hash of (seed, prompt, turn), so that seeds
    of different runs, prompts and turns never coincide."""
    return int(np.random.SeedSequence([seed, prompt, turn]).generate_state(1, np.uint64)[0] >> 1)


def per_position_acceptance(acceptance_lengths: list[int], drafted: list[int],
                            verify_size: int) -> list[float | None]:
    """[verify_size - 1]: per block position k, the share of the verifies that drafted k whose
    drafts 1..k were all accepted (None where no verify drafted k)."""
    accepted, drafted_ = np.asarray(acceptance_lengths) - 1, np.asarray(drafted)
    shares = []
    for k in range(1, verify_size):
        checked = drafted_ >= k
        shares.append(round(float((accepted[checked] >= k).mean()), 6) if checked.any() else None)
    return shares


def evaluate_online(
    target: torch.nn.Module,
    proposer: Proposer,
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    verify_size: int,
    layer_ids: list[int],
    stop_token_ids: set[int],
    warmup: bool = True,
    progress: Any = None,
    temperature: float = 0.0,
    seed: int = 0,
    renderer: ChatRenderer | None = None,
) -> dict[str, Any]:
    """Speculative decoding against plain decoding of the target on every prompt (and every
    further turn of a multi-turn prompt, which needs `renderer`).

    Per turn the target's `generate` runs first (the reference and the baseline timing), then
    speculative decoding; alternating keeps slow drifts of the machine from favouring one
    side. With `warmup`, both run once untimed on the first prompt (allocator and kernel
    warm-up). temperature 0: greedy, checked token for token; > 0: sampled (module docstring).
    verify_size: the tokens one verify checks, the anchor and its drafts (num_drafts + 1; 1 is
    plain decoding).
    """
    if not prompts:
        raise ValueError("no prompt to decode: give JSONL chat records with a user turn")
    kwargs = dict(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    sampled = temperature > 0

    def sampler(prompt: int, turn: int) -> MatchSampler | None:
        if not sampled:
            return None
        generator = torch.Generator(device=target.device).manual_seed(turn_seed(seed, prompt, turn))
        return MatchSampler(temperature, generator)

    if warmup:
        greedy_generate(target, prompts[0].token_ids, max_new_tokens=min(8, max_new_tokens),
                        stop_token_ids=stop_token_ids, temperature=temperature, seed=seed)
        speculative_generate(target, proposer, prompts[0].token_ids, verify_size=verify_size,
                             layer_ids=layer_ids, max_new_tokens=min(8, max_new_tokens),
                             stop_token_ids=stop_token_ids, sampler=sampler(0, 0))  # turn 0: no real turn
    taus: list[int] = []
    drafted: list[int] = []
    spec_tokens = spec_s = base_tokens = base_s = 0.0
    mismatches, per_prompt = [], []
    for i, prompt in enumerate(prompts):
        token_ids, messages, later = prompt.token_ids, prompt.messages, list(prompt.next_turns)
        for turn in range(1, 2 + len(later)):
            reference = greedy_generate(target, token_ids, temperature=temperature,
                                        seed=turn_seed(seed, i, turn) if sampled else 0, **kwargs)
            output = speculative_generate(target, proposer, token_ids, verify_size=verify_size,
                                          layer_ids=layer_ids, sampler=sampler(i, turn), **kwargs)
            base_tokens += len(reference.tokens)
            base_s += reference.elapsed_s
            spec_tokens += len(output.tokens)
            spec_s += output.elapsed_s
            taus.extend(output.acceptance_lengths)
            drafted.extend(output.drafted)
            source = {**prompt.source, **({"turn": turn} if prompt.next_turns else {})}
            mismatch = None if sampled else first_mismatch(reference, output, target.dtype)
            if mismatch is not None:
                mismatches.append({**source, **mismatch})
            per_prompt.append({
                **source, "prompt_tokens": len(token_ids), "new_tokens": len(output.tokens),
                "acceptance_length": float(np.mean(output.acceptance_lengths)) if output.acceptance_lengths else None,
                "acceptance_lengths": output.acceptance_lengths,  # per verify: an engine's per-step count meets these
                "lossless": None if sampled else mismatch is None or mismatch["near_tie"],
                "near_tie": None if sampled else mismatch is not None and mismatch["near_tie"],
            })
            if turn > len(later):
                break
            messages = [*messages, {"role": "assistant", "content": renderer.reply(output.tokens)},
                        {"role": "user", "content": later[turn - 1]}]
            token_ids = renderer.ids(messages)
        if progress is not None:
            progress(i + 1, len(prompts), taus, mismatches)
    turn_taus = [p["acceptance_length"] for p in per_prompt if p["acceptance_length"] is not None]
    real = [m for m in mismatches if not m["near_tie"]]
    return {
        "acceptance_length": float(np.mean(taus)) if taus else None,
        # z-lab's "Average Acceptance length": the mean over turns of each turn's mean
        "mean_turn_acceptance_length": float(np.mean(turn_taus)) if turn_taus else None,
        "per_position_acceptance": per_position_acceptance(taus, drafted, verify_size),
        "lossless": None if sampled else not real,
        "mismatches": mismatches,  # near-ties and real ones, each with "near_tie"
        "num_near_ties": None if sampled else len(mismatches) - len(real),
        "num_real_mismatches": None if sampled else len(real),
        "tokens_per_s": spec_tokens / spec_s if spec_s else None,
        "baseline_tokens_per_s": base_tokens / base_s if base_s else None,
        "speedup": (spec_tokens / spec_s) / (base_tokens / base_s) if spec_s and base_s else None,
        "num_prompts": len(prompts),
        "num_turns": len(per_prompt),
        "num_verifications": len(taus),
        "new_tokens": int(spec_tokens),
        "max_new_tokens": max_new_tokens,
        "num_drafts": verify_size - 1,  # drafts per verify; 0: plain decoding
        "verify_size": verify_size,  # the anchor and its drafts, what tau counts against
        "temperature": temperature,
        "seed": seed if sampled else None,
        "per_prompt": per_prompt,
    }


__all__ = ["TIE_ROUNDINGS", "ChatRenderer", "DrafterProposer", "Prompt", "cache_stop_token_ids", "drafter_proposer",
           "evaluate_online", "first_mismatch", "load_prompts", "load_target", "near_tie_bound",
           "per_position_acceptance", "rollback_refusal", "suite_prompts", "target_stop_token_ids", "turn_seed"]
