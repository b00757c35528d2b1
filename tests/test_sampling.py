"""Speculative sampling at temperature > 0 is lossless in distribution: over many seeds, the
first K generated tokens of `speculative_generate` with `MatchSampler` follow the target's
own distribution (the product of its next-token distributions at temperature T, computed
exactly from one batched forward), as plain sampling (`generate(do_sample=True)`) does; two
deliberately broken samplers fail the same test.

The test: a chi-square goodness-of-fit of the N observed K-token sequences against the exact
probabilities, cells with fewer than 5 expected draws pooled into one, at level ALPHA. The
seeds are fixed, so the outcome is too; at the level, a correct sampler fails with
probability 1e-3 over the choice of seeds, and the broken ones here land at p < 1e-30.

The target is a 2-layer random Qwen3 over 8 tokens (so K = 3 tokens span 512 sequences);
the drafter is the target's own greedy continuation of the committed tokens, so drafts are
often right and often wrong, and every accepted length of a block of 3 occurs.
"""

import itertools

import numpy as np
import pytest
import torch

from dflash.testing.builders import tiny_causal_lm
from dflash.train.speculative import MatchSampler, greedy_generate, speculative_generate

V, K, BLOCK, T = 8, 3, 3, 1.0
LAYER_IDS = [0, 1]
PROMPT = [1, 5, 2, 7]
NUM_SEEDS = 800
ALPHA = 1e-3


@pytest.fixture(scope="module")
def target():
    return tiny_causal_lm("qwen3", vocab_size=V, num_layers=2)


@pytest.fixture(scope="module")
def exact(target) -> dict[tuple[int, ...], float]:
    """{the first K tokens: their probability under the target at temperature T}."""
    continuations = list(itertools.product(range(V), repeat=K - 1))  # every t1..t_{K-1}
    ids = torch.tensor([PROMPT + list(c) for c in continuations])  # [V^(K-1), P + K - 1]
    with torch.no_grad():
        logp = torch.log_softmax(target(ids).logits.double() / T, dim=-1)  # [V^(K-1), P + K - 1, V]
    start = len(PROMPT) - 1  # the logits that predict generated token 1
    probs = {}
    for row, c in enumerate(continuations):
        for last in range(V):
            tokens = (*c, last)
            probs[tokens] = float(sum(logp[row, start + j, tokens[j]] for j in range(K)).exp())
    return probs


class GreedyTargetProposer:
    """Drafts the target's greedy continuation of the committed tokens (memoised: the same
    prefixes recur across seeds)."""

    def __init__(self, target, prompt: list[int], memo: dict):
        self.target, self.prompt, self.memo = target, prompt, memo
        self.tokens: list[int] = []
        self.block: list[int] = []

    def reset(self) -> None:
        self.tokens, self.block = [], []

    def commit(self, features: torch.Tensor) -> None:
        n = features.shape[0]
        self.tokens = list(self.prompt) if not self.tokens else self.tokens + self.block[:n]

    def propose(self, anchor_token: int, verify_size: int) -> list[int]:
        sequence = self.tokens + [anchor_token]
        drafts = []
        for _ in range(verify_size - 1):
            key = tuple(sequence)
            if key not in self.memo:
                self.memo[key] = int(self.target(torch.tensor([sequence])).logits[0, -1].argmax())
            drafts.append(self.memo[key])
            sequence.append(drafts[-1])
        self.block = [anchor_token] + drafts
        return drafts


class AcceptsWithoutCheck(MatchSampler):
    """Broken: every draft is accepted, the target's draw after the block is the bonus."""

    def verify(self, drafts, logits):
        return list(drafts) + self.sample(logits[-1:])


class RedrawsTheBonus(MatchSampler):
    """Broken: after a rejected draft, the bonus is a fresh draw, not the draw that rejected it
    (that over-weights the rejected draft's token)."""

    def verify(self, drafts, logits):
        committed = super().verify(drafts, logits)
        if len(committed) <= len(drafts):  # a draft was rejected
            committed[-1] = self.sample(logits[len(committed) - 1:len(committed)])[0]
        return committed


def chi_square_p(observed: dict, expected_probs: dict, n: int) -> tuple[float, int]:
    """(p-value, degrees of freedom) of the goodness-of-fit of `observed` counts to
    `expected_probs`, cells under 5 expected draws pooled."""
    small = [c for c, p in expected_probs.items() if p * n < 5]
    cells = [([c], p * n) for c, p in expected_probs.items() if p * n >= 5]
    cells.append((small, sum(expected_probs[c] for c in small) * n))
    stat = sum((sum(observed.get(c, 0) for c in members) - e) ** 2 / e for members, e in cells if e > 0)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))), df


def first_tokens(target, sampler: str, seed: int, memo: dict) -> tuple[int, ...]:
    if sampler == "plain":
        out = greedy_generate(target, PROMPT, max_new_tokens=K, stop_token_ids=set(), temperature=T, seed=seed)
    else:
        kind = {"speculative": MatchSampler, "accepts-without-check": AcceptsWithoutCheck,
                "redraws-the-bonus": RedrawsTheBonus}[sampler]
        # One token more than K: the first verify after the prefill's token then drafts a
        # whole block (a budget of K would shorten it to K - 1 tokens).
        out = speculative_generate(target, GreedyTargetProposer(target, PROMPT, memo), PROMPT,
                                   max_new_tokens=K + 1, verify_size=BLOCK, layer_ids=LAYER_IDS,
                                   stop_token_ids=set(), sampler=kind(T, torch.Generator().manual_seed(seed)))
        assert sum(out.acceptance_lengths) == K and out.drafted[0] == BLOCK - 1
    return tuple(out.tokens[:K])


@pytest.mark.parametrize("sampler, lossless", [
    ("plain", True), ("speculative", True), ("accepts-without-check", False), ("redraws-the-bonus", False)])
def test_the_first_tokens_follow_the_targets_distribution(target, exact, sampler, lossless):
    memo: dict = {}
    draws = [first_tokens(target, sampler, seed, memo) for seed in range(NUM_SEEDS)]
    observed = {c: draws.count(c) for c in set(draws)}
    p, df = chi_square_p(observed, exact, NUM_SEEDS)
    print(f"{sampler}: chi-square p {p:.3g} over {df} degrees of freedom")
    assert (p > ALPHA) == lossless, f"{sampler}: p = {p:.3g} ({df} degrees of freedom)"


def test_speculative_sampling_accepts_drafts_and_is_seeded(target):
    """The check above exercises accepted drafts, not only rejections; a seed fixes a decoding."""
    memo: dict = {}

    def decode(seed):
        return speculative_generate(target, GreedyTargetProposer(target, PROMPT, memo), PROMPT, max_new_tokens=24,
                                    verify_size=BLOCK, layer_ids=LAYER_IDS, stop_token_ids=set(),
                                    sampler=MatchSampler(T, torch.Generator().manual_seed(seed)))

    runs = [decode(seed) for seed in range(20)]
    lengths = np.concatenate([r.acceptance_lengths for r in runs])
    assert set(lengths.tolist()) == {1, 2, 3}  # no draft, one, both accepted
    assert decode(3).tokens == runs[3].tokens and decode(4).tokens != runs[3].tokens


def test_match_sampler_refuses_temperature_zero():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        MatchSampler(0.0, torch.Generator())
