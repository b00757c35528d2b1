"""Speculative decoding on hybrid linear-attention targets (Qwen3-Next, Qwen3.5, Qwen3.5-MoE as
transformers builds them; Qwen3.6 is a Qwen3.5): after every verify the target's recurrent and
conv states must be those after exactly the committed tokens (train/target_cache.py).

Two references:
- the target's own greedy output (`generate`);
- the same loop run from scratch: every verify is one cache-free forward over the committed
  prefix and the block, so nothing can be left over from rejected drafts. Per-verify
  acceptance must equal it, greedy and sampled (`MatchSampler`, same seed: the loops draw the
  same number of times in the same order, so the same uniforms meet logits equal to the last
  bits, and a draw differs only if one lands that close to a boundary of the distribution).

The proposer drafts the greedy continuation of the committed prefix (from scratch) with one
draft wrong, its position cycling over the block, or none: every verify rolls back 0 to B-1
tokens, all of them over a run.

Tolerance: none on ids. The cached loop runs the gated delta rule token by token and the
projections over B rows at once, the scratch loop the chunked rule over the whole prefix:
their logits differ in the last bits (top-2 margins differ by 1e-4 at most here, against
margins of 3e-3 at least, 0.25 typically, on these large-initialisation targets), which flips an
argmax or a draw only at a near-tie; the assertions are on token ids, and the greedy test checks
that no margin is within 1e-3 of a tie.
"""

import json

import pytest
import torch
from click.testing import CliRunner

from dflash.testing.builders import HYBRID_KINDS, char_tokenizer, tiny_causal_lm, tiny_hybrid_lm
from dflash.train.speculative import MatchSampler, greedy_generate, speculative_generate
from dflash.train.target_cache import rollback_refusal

V = 64
PROMPT = [3, 9, 4, 1, 7, 2, 8, 5, 6, 3, 1, 4, 11, 40, 23]
LAYER_IDS = [0, 2]


@pytest.fixture(scope="module", params=[*HYBRID_KINDS, "qwen3"])
def target(request):
    """The hybrids, and a full-attention Qwen3 as the control."""
    return tiny_hybrid_lm(request.param) if request.param != "qwen3" else tiny_causal_lm("qwen3", num_layers=4)


@torch.no_grad()
def scratch_logits(target, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32 logits of one cache-free forward."""
    return target(torch.tensor([ids])).logits[0].float()


class CyclingProposer:
    """Drafts the target's greedy continuation of the committed prefix (computed from scratch),
    with draft w = 1 + j % B wrong in the j-th block (w = B: all right)."""

    def __init__(self, target, prompt: list[int]):
        self.target, self.prompt = target, prompt
        self.reset()

    def reset(self) -> None:
        self.committed, self.block, self.blocks = [], [], 0

    def commit(self, features: torch.Tensor) -> None:
        n = features.shape[0]
        self.committed = list(self.prompt) if not self.committed else self.committed + self.block[:n]

    def propose(self, anchor_token: int, verify_size: int) -> list[int]:
        ids = self.committed + [anchor_token]
        drafts = []
        for _ in range(verify_size - 1):
            drafts.append(int(scratch_logits(self.target, ids + drafts)[-1].argmax()))
        wrong = 1 + self.blocks % verify_size
        if wrong < verify_size:
            drafts[wrong - 1] = (drafts[wrong - 1] + 1) % V
        self.blocks += 1
        self.block = [anchor_token] + drafts
        return drafts


def scratch_speculative(target, proposer, prompt, *, max_new_tokens, verify_size, sampler=None):
    """`speculative_generate`'s loop with no cache: (tokens, committed per verify, margins)."""
    last = scratch_logits(target, prompt)[-1:]
    tokens = last.argmax(-1).tolist() if sampler is None else sampler.sample(last)
    proposer.reset()
    proposer.commit(torch.zeros(len(prompt), 1))
    acceptance, margins = [], []
    while len(tokens) < max_new_tokens:
        size = min(verify_size, max_new_tokens - len(tokens))
        block = [tokens[-1]] + (proposer.propose(tokens[-1], size) if size > 1 else [])
        logits = scratch_logits(target, prompt + tokens[:-1] + block)[-size:]  # [size, V]
        if sampler is None:
            choice = logits.argmax(-1).tolist()
            accepted = 0
            while accepted < size - 1 and block[accepted + 1] == choice[accepted]:
                accepted += 1
            new = choice[: accepted + 1]
        else:
            new = sampler.verify(block[1:], logits)
            accepted = len(new) - 1
        top = logits[: accepted + 1].topk(2, dim=-1).values
        margins += (top[:, 0] - top[:, 1]).tolist()
        tokens += new
        acceptance.append(accepted + 1)
        proposer.commit(torch.zeros(accepted + 1, 1))
    return tokens, acceptance, margins


@pytest.mark.parametrize("verify_size", [2, 4])
def test_greedy_equals_the_target_and_the_scratch_loop(target, verify_size):
    n = 26
    greedy = greedy_generate(target, PROMPT, max_new_tokens=n, stop_token_ids=set())
    spec = speculative_generate(target, CyclingProposer(target, PROMPT), PROMPT, max_new_tokens=n,
                                verify_size=verify_size, layer_ids=LAYER_IDS, stop_token_ids=set())
    tokens, acceptance, margins = scratch_speculative(target, CyclingProposer(target, PROMPT), PROMPT,
                                                      max_new_tokens=n, verify_size=verify_size)
    assert min(margins) > 1e-3  # no near-tie: equal ids are a fair test
    assert spec.tokens == greedy.tokens == tokens
    assert spec.acceptance_lengths == acceptance
    # Every rollback size happened: 0 (all accepted) to B-1 (all rejected).
    assert set(spec.acceptance_lengths[:-1]) == set(range(1, verify_size + 1))


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_equals_the_scratch_loop_with_the_same_seed(target, temperature):
    n, verify_size = 24, 4
    spec = speculative_generate(
        target, CyclingProposer(target, PROMPT), PROMPT, max_new_tokens=n, verify_size=verify_size,
        layer_ids=LAYER_IDS, stop_token_ids=set(),
        sampler=MatchSampler(temperature, torch.Generator().manual_seed(7)))
    tokens, acceptance, _ = scratch_speculative(
        target, CyclingProposer(target, PROMPT), PROMPT, max_new_tokens=n, verify_size=verify_size,
        sampler=MatchSampler(temperature, torch.Generator().manual_seed(7)))
    assert spec.tokens == tokens
    assert spec.acceptance_lengths == acceptance
    assert max(acceptance) > 1  # some drafts were accepted, so rollbacks of several sizes


def test_hybrids_are_not_refused(target):
    assert rollback_refusal(target) is None


def test_a_family_that_cannot_roll_back_is_refused_by_name():
    """Zaya's linear layers ignore `recurrent_states_to_keep` (transformers 5.25): refused
    before decoding by the probe, and by the loop itself at the first verify."""
    zaya = tiny_hybrid_lm("zaya")
    reason = rollback_refusal(zaya)
    assert reason is not None and "zaya" in reason and "recurrent state" in reason and "\n" not in reason
    with pytest.raises(ValueError, match="cannot be made exact on zaya targets"):
        speculative_generate(zaya, CyclingProposer(zaya, PROMPT), PROMPT, max_new_tokens=8, verify_size=4,
                             layer_ids=[0, 1], stop_token_ids=set())


# --------------------------------------------------------------------------- eval --online end to end


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    """A tiny Qwen3-Next over character tokens (and a Zaya), stage one with --regenerate on
    the Qwen3-Next, a 3-step fit on that cache."""
    from dflash.precompute.run import run_precompute
    from dflash.testing.builders import precompute_config, tiny_fit_config, write_jsonl
    from dflash.train.fit import fit

    root = tmp_path_factory.mktemp("hybrid")
    tokenizer = char_tokenizer()
    for kind in ("qwen3_next", "zaya"):
        model = tiny_hybrid_lm(kind, tokenizer=tokenizer)
        model.save_pretrained(root / kind)
        tokenizer.save_pretrained(root / kind)
    words = ["hello", "how are you", "tell me a story", "what is this", "ok", "fine thanks"]
    prompts = write_jsonl(root / "chat.jsonl", [
        {"messages": [{"role": "user", "content": words[i % 6]}, {"role": "assistant", "content": words[(i + 2) % 6]}]}
        for i in range(8)])
    run_precompute(precompute_config(root / "qwen3_next", prompts, root / "cache", feature_layers=[0, 2],
                                     regenerate=True, max_new_tokens=12, dtype="float32"))
    fit(tiny_fit_config(root / "cache", root / "run", anchors_per_seq=8, epochs=1, max_steps=3,
                        checkpoint_every=3, eval_fraction=0.25))
    return root, prompts


def eval_online(root, prompts, target: str, *, offline: bool = True):
    from dflash.train.cli import main

    return CliRunner().invoke(main, [
        "eval", "--online", "--run", str(root / "run"), "--target", str(root / target), "--prompts", str(prompts),
        *(["--cache", str(root / "cache")] if offline else []), "--max-new-tokens", "12",
        "--allow-target-mismatch", "--json"])


@pytest.mark.e2e
def test_eval_online_is_lossless_on_a_hybrid(hybrid_run):
    root, prompts = hybrid_run
    result = eval_online(root, prompts, "qwen3_next")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.strip().splitlines()[-1])
    online = figures["online"]
    assert online["lossless"] is True and online["mismatches"] == []
    assert figures["num_sequences"] == online["num_prompts"] >= 1 and online["num_verifications"] > 0
    assert "lossless yes" in result.output


@pytest.mark.e2e
def test_eval_online_refuses_a_family_it_cannot_roll_back_and_keeps_the_offline_figures(hybrid_run):
    root, prompts = hybrid_run
    result = eval_online(root, prompts, "zaya")
    assert result.exit_code != 0
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "cannot be made exact on zaya targets" in errors[0], result.output
    assert "online   not decoded: refused" in result.output and "online   tau" not in result.output
    saved = json.loads(next((root / "run" / "eval").glob("*.json")).read_text())
    assert saved["num_sequences"] >= 1 and saved["acceptance_length"] >= 1.0  # the offline figures
    assert "zaya" in saved["online_refused"]


@pytest.mark.e2e
def test_eval_online_alone_refuses_in_one_line(hybrid_run):
    root, prompts = hybrid_run
    result = eval_online(root, prompts, "zaya", offline=False)
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]  # besides loading bars
    assert len(errors) == 1 and errors[0].startswith("Error: eval --online --target") and "zaya" in errors[0]
    assert "online   " not in result.output
