"""Offline acceptance length from cached top-1, and prompt records for online eval.

The offline tests use hand-made sequences and stub drafters whose answer is known: a
drafter that returns the target's top-1 for every block position accepts everything that
is scored; one that is always wrong accepts nothing. The stubs read the label position from
the block positions they are given, so a scorer that compared block position k with the
top-1 at a+k (the off-by-one peers shipped) instead of a+k-1 fails them.
"""

import json

import numpy as np
import pytest
import torch
from torch import nn

from dflash.common.records import iter_records, prompt_messages
from dflash.testing.builders import drafter_config
from dflash.train.acceptance import (
    block_acceptance,
    evaluate_offline,
    replay_last_reply,
    sequence_acceptance,
    target_top1,
)
from dflash.train.model import DFlashDrafter, DrafterContextCache, TargetHead
from dflash.train.online import ChatRenderer, load_prompts

V = 24  # vocabulary; the stubs' hidden size equals it so that the LM head can be the identity


class StubDrafter(nn.Module):
    """Returns one-hot hidden states: block position k of the block anchored at a "predicts"
    `answer[a + k - 1] + shift[k]` (mod V), so shift 0 everywhere copies the target's top-1."""

    def __init__(self, answer: np.ndarray, shift: list[int], verify_size: int):
        super().__init__()
        self.answer = torch.as_tensor(answer, dtype=torch.long)
        self.shift = torch.as_tensor(shift, dtype=torch.long)  # [B], entry 0 unused
        self.verify_size = verify_size
        self.config = type("Config", (), {"mask_token_id": V - 1})()
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, block_embeds, context_features, layout):
        positions = layout.block_positions  # [Q] = anchor + k
        k = torch.arange(positions.shape[0]) % self.verify_size
        label = self.answer[(positions - 1).clamp(min=0, max=len(self.answer) - 1)]
        token = (label + self.shift[k]) % V
        return nn.functional.one_hot(token, V).float()  # [Q, V]


def identity_head() -> TargetHead:
    eye = torch.eye(V)
    return TargetHead(embed_tokens=eye, lm_head=eye)


def make_sequence(T: int, reply_start: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, V - 1, size=T)  # [T]
    loss_mask = np.zeros(T, dtype=bool)
    loss_mask[reply_start:] = True
    features = rng.standard_normal((T, 2, 4)).astype(np.float32)  # [T, L, H]
    top1 = rng.integers(0, V - 1, size=T)  # [T]: target's greedy token after each position
    return input_ids, loss_mask, features, top1


@pytest.mark.parametrize("verify_size", [2, 4, 16])
def test_copying_drafter_accepts_every_scored_position(verify_size):
    T, start = 40, 5
    input_ids, loss_mask, features, top1 = make_sequence(T, start)
    drafter = StubDrafter(top1, [0] * verify_size, verify_size)
    result = sequence_acceptance(drafter, identity_head(), input_ids, loss_mask, features, top1,
                                 verify_size=verify_size, anchors_per_call=7)
    anchors = np.arange(start, T - 1)  # reply tokens followed by a reply token
    np.testing.assert_array_equal(result.anchors, anchors)
    # Block position k is scored while a+k < T: the full block in the middle, fewer at the end.
    expected_accepted = np.minimum(verify_size - 1, T - 1 - anchors)
    np.testing.assert_array_equal(result.accepted, expected_accepted)
    label = np.minimum(anchors[:, None] + np.arange(verify_size - 1), T - 1)  # a+k-1 for k = 1..B-1
    np.testing.assert_array_equal(result.drafts[result.scored], top1[label][result.scored])


def test_copying_drafter_gives_tau_verify_size_and_replay():
    B, T, start = 4, 40, 5
    input_ids, loss_mask, features, top1 = make_sequence(T, start)
    drafter = StubDrafter(top1, [0] * B, B)
    seq = type("Seq", (), {})()
    seq.input_ids, seq.loss_mask, seq.features = input_ids, loss_mask, features
    # The cache stores top-k unsorted here: top-1 must come from the log-probs, not column 0.
    seq.topk_ids = np.stack([(top1 + 3) % V, top1], axis=1).astype(np.int32)
    seq.topk_logprobs = np.tile(np.array([[-2.0, -0.5]], np.float32), (T, 1))
    summary = evaluate_offline(drafter, identity_head(), [seq], verify_size=B)
    anchors = np.arange(start, T - 1)
    taus = 1 + np.minimum(B - 1, T - 1 - anchors)
    assert summary["num_anchors"] == len(anchors)
    assert summary["acceptance_length"] == pytest.approx(taus.mean())
    assert summary["per_position_acceptance"] == [1.0, 1.0, 1.0]
    # Replay from the reply's first token: anchors 5, 9, ..., 33 commit 4 tokens each, 37 commits
    # 3 (only positions 38 and 39 exist), and 40 is past the sequence.
    assert summary["replay_acceptance_length"] == pytest.approx((8 * 4 + 3) / 9)
    assert summary["num_replay_verifications"] == 9


def test_full_blocks_give_exactly_verify_size():
    B, T, start = 4, 30, 3
    input_ids, loss_mask, features, top1 = make_sequence(T, start)
    drafter = StubDrafter(top1, [0] * B, B)
    result = sequence_acceptance(drafter, identity_head(), input_ids, loss_mask, features, top1, verify_size=B)
    full = result.scored.all(axis=1)
    assert full.sum() > 10
    assert np.all(result.accepted[full] + 1 == B)


@pytest.mark.parametrize("verify_size", [2, 4, 16])
def test_always_wrong_drafter_gives_tau_one(verify_size):
    input_ids, loss_mask, features, top1 = make_sequence(50, 10, seed=1)
    seq = type("Seq", (), {})()
    seq.input_ids, seq.loss_mask, seq.features = input_ids, loss_mask, features
    seq.topk_ids = top1[:, None].astype(np.int32)
    seq.topk_logprobs = np.zeros((50, 1), np.float32)
    drafter = StubDrafter(top1, [0] + [1] * (verify_size - 1), verify_size)
    summary = evaluate_offline(drafter, identity_head(), [seq], verify_size=verify_size)
    assert summary["acceptance_length"] == 1.0
    assert summary["per_position_acceptance"] == [0.0] * (verify_size - 1)
    assert summary["replay_acceptance_length"] == 1.0


def test_shifted_drafter_is_rejected():
    """A drafter aligned to the top-1 at a+k (one position late) matches only by chance."""
    B = 4
    input_ids, loss_mask, features, top1 = make_sequence(60, 5, seed=2)
    late = np.concatenate([top1[1:], top1[:1]])  # answer[a+k-1] = top1[a+k]
    drafter = StubDrafter(late, [0] * B, B)
    result = sequence_acceptance(drafter, identity_head(), input_ids, loss_mask, features, top1, verify_size=B)
    assert result.accepted.mean() < 0.2


def test_partial_drafter_per_position_figures():
    """Right at positions 1 and 2, wrong at 3: accepted 2, acceptance [1, 1, 0] and the
    marginal match rate [1, 1, 0]; right at 1 and 3 only: acceptance [1, 0, 0], match [1, 0, 1]."""
    B = 4
    input_ids, loss_mask, features, top1 = make_sequence(40, 0, seed=3)
    seq = type("Seq", (), {})()
    seq.input_ids, seq.loss_mask, seq.features = input_ids, loss_mask, features
    seq.topk_ids, seq.topk_logprobs = top1[:, None].astype(np.int32), np.zeros((40, 1), np.float32)
    first = evaluate_offline(StubDrafter(top1, [0, 0, 0, 5], B), identity_head(), [seq], verify_size=B)
    assert first["per_position_acceptance"] == [1.0, 1.0, 0.0]
    assert first["per_position_match"] == [1.0, 1.0, 0.0]
    second = evaluate_offline(StubDrafter(top1, [0, 0, 5, 0], B), identity_head(), [seq], verify_size=B)
    assert second["per_position_acceptance"] == [1.0, 0.0, 0.0]
    assert second["per_position_match"] == [1.0, 0.0, 1.0]
    assert second["acceptance_length"] == 2.0


def test_block_acceptance_stops_at_unscored_positions():
    matches = np.array([[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=bool)
    scored = np.array([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 1]], dtype=bool)
    np.testing.assert_array_equal(block_acceptance(matches, scored), [3, 1, 0, 1])


def test_replay_follows_the_last_reply():
    loss_mask = np.array([0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1], dtype=bool)
    anchors = np.array([2, 3, 7, 8, 9, 10, 11])
    accepted = np.array([5, 5, 1, 0, 2, 0, 0])
    # last reply starts at 7: tau 2 -> 9: tau 3 -> 12 is the reply's last token, not an anchor
    assert replay_last_reply(loss_mask, anchors, accepted) == [2, 3]


def test_replay_of_a_cut_reply_never_commits_past_its_last_token():
    loss_mask = np.array([0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0], dtype=bool)
    anchors = np.array([2, 3, 7, 8, 9, 10, 11])
    accepted = np.array([5, 5, 1, 0, 3, 0, 0])
    # at 9 the drafts for 10, 11, 12 all match: a reply ended by its stop token at 12 counts
    # the bonus after it (tau 4); one cut at the token limit stops at 12 (tau 3), as online
    # decoding's shortened last verification does.
    assert replay_last_reply(loss_mask, anchors, accepted) == [2, 4]
    assert replay_last_reply(loss_mask, anchors, accepted, cut=True) == [2, 3]


def test_target_top1_takes_the_most_likely_cached_id():
    ids = np.array([[4, 7, 9], [1, 2, 3]], np.int32)
    logprobs = np.array([[-3.0, -0.1, -2.0], [-0.5, -0.5, -4.0]], np.float32)
    np.testing.assert_array_equal(target_top1(ids, logprobs), [7, 1])


@pytest.mark.parametrize("layout", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}])
@pytest.mark.parametrize("verify_size", [2, 5])
def test_offline_drafts_equal_the_inference_path(seed, verify_size, layout):
    """The packed training forward used offline drafts the same tokens as the inference path
    (context cache of the features before the anchor, then one block), sliding layers too."""
    H, L, T = 16, 2, 23
    config = drafter_config(hidden_size=H, intermediate_size=32, head_dim=4, num_hidden_layers=2, vocab_size=V,
                            target_layer_ids=[0, 1], num_target_layers=3, num_drafts=verify_size - 1,
                            mask_token_id=V - 1, initializer_range=0.5, **layout)
    drafter = DFlashDrafter(config, attention="dense").eval()
    head = TargetHead(embed_tokens=torch.randn(V, H), lm_head=torch.randn(V, H) * 3)
    input_ids, loss_mask, _, top1 = make_sequence(T, 4, seed=seed)
    features = np.random.default_rng(seed).standard_normal((T, L, H)).astype(np.float32)
    result = sequence_acceptance(drafter, head, input_ids, loss_mask, features, top1,
                                 verify_size=verify_size, anchors_per_call=5)
    flat = torch.as_tensor(features).reshape(T, L * H)
    for row, a in enumerate(result.anchors.tolist()):
        cache = DrafterContextCache()
        drafter.append_context(cache, flat[None, :a])
        block = torch.full((1, verify_size), V - 1)
        block[0, 0] = int(input_ids[a])
        hidden = drafter.forward_block(head.embed(block), cache)  # [1, B, H]
        expected = head.logits(hidden[0, 1:]).argmax(-1).numpy()
        np.testing.assert_array_equal(result.drafts[row], expected, err_msg=f"anchor {a}")


# --------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("record, expected", [
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                   {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                   {"role": "assistant", "content": "d"}]},
     [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
      {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
     [{"role": "user", "content": "hi"}]),
    ({"prompt": "p", "response": "r", "system": "s"},
     [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}]),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]},
     [{"role": "user", "content": "xy"}]),
    ({"prompt": "p"}, [{"role": "user", "content": "p"}]),
])
def test_prompt_messages_cut_at_last_user_turn(record, expected):
    assert prompt_messages(record) == expected


@pytest.mark.parametrize("record, reason", [
    ({"text": "plain"}, "no user turn"),
    ({"messages": [{"role": "assistant", "content": "b"}]}, "no user turn"),
    ({"conversations": [{"from": "robot", "value": "b"}]}, "expected one of"),
    ({"other": 1}, "none of the fields"),
    ([1, 2], "not an object"),
    ({"prompt": "p", "system": 3}, "'system' must be a string"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "lone surrogate"),
])
def test_prompt_messages_rejects_with_reason(record, reason):
    with pytest.raises(ValueError, match=reason):
        prompt_messages(record)


class TemplateTokenizer:
    """A stand-in for a chat tokenizer: renders `role: content` lines, one id per character."""

    chat_template = "stub"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize
        text = "".join(f"{m['role']}:{m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens):
        assert not add_special_tokens
        return {"input_ids": [ord(c) for c in text]}


def test_load_prompts_keeps_sources_and_rejects(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                    "\n"
                    "not json\n"
                    '{"text": "doc"}\n'
                    '{"prompt": "q"}\n')
    prompts, rejected = load_prompts(path, ChatRenderer(TemplateTokenizer()))
    assert [p.source["index"] for p in prompts] == [0, 4]
    assert "".join(map(chr, prompts[0].token_ids)) == "user:hi\nassistant:"
    assert [(r["index"], r["reason"]) for r in rejected] == [
        (2, "invalid JSON: Expecting value on line 3"), (3, "a 'text' record has no user turn to use as a prompt")]
    kept, _ = load_prompts(path, ChatRenderer(TemplateTokenizer()), keep={4})
    assert [p.source["index"] for p in kept] == [4]


def test_prompt_indices_are_stage_ones_despite_unicode_line_separators(tmp_path):
    # U+2028 / U+2029 / U+0085 inside a JSON string are not line ends in JSONL; a reader that
    # splits on them (str.splitlines) shifts every later index, and eval then pairs prompts
    # with other records' cached sequences.
    records = [{"messages": [{"role": "user", "content": "a\u2028b\u2029c\u0085d"},
                             {"role": "assistant", "content": "x"}]},
               {"prompt": "first held out"}, {"prompt": "second held out"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert [r.index for r in iter_records([path])] == [0, 1, 2]
    prompts, rejected = load_prompts(path, ChatRenderer(TemplateTokenizer()), keep={1, 2})
    assert rejected == []
    assert [(p.source["index"], "".join(map(chr, p.token_ids))) for p in prompts] == [
        (1, "user:first held out\nassistant:"), (2, "user:second held out\nassistant:")]


def test_train_split_is_the_complement_of_the_held_out_set(tmp_path):
    from dflash.train.data import held_out_mask
    from dflash.train.evaluate import held_out_selection
    from dflash.train.synthetic import write_synthetic_training_cache

    path = tmp_path / "cache"
    write_synthetic_training_cache(path, lengths=[30 + i for i in range(20)], seed=1)
    fit_config = {"cache": [str(path)], "eval_fraction": 0.25, "seed": 3}
    (_, held), = held_out_selection(fit_config, None)
    (_, trained), = held_out_selection(fit_config, None, "train")
    assert held == np.flatnonzero(held_out_mask(20, 0.25, 3)).tolist() and held
    assert sorted(held + trained) == list(range(20)) and not set(held) & set(trained)
    (_, trained_of_cache), = held_out_selection(fit_config, path, "train")  # the run's cache named: its share
    assert trained_of_cache == trained
