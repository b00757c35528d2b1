"""Sliding-window and causal drafter layers (DrafterConfig.layer_types / sliding_window / is_causal).

The rule is z-lab's reference's and vLLM's: a query at absolute position p sees a key at k
only when p - k < window (a bidirectional window also k - p < window), and a causal layer
only k <= p; a sliding_attention layer is causal unless is_causal says otherwise.
"""

import dataclasses

import numpy as np
import pytest
import torch

from dflash.testing.builders import drafter_config
from dflash.train.model import BlockLayout, DFlashDrafter, DrafterConfig, DrafterContextCache

B = 4
L = 3
H = 32
SEGMENTS = [(30, np.array([3, 9, 10, 22, 30])), (17, np.array([1, 8, 16]))]
MIXED = ["sliding_attention", "sliding_attention", "full_attention"]


def config(**overrides) -> DrafterConfig:
    fields = dict(num_hidden_layers=3, vocab_size=50, target_layer_ids=[0, 2, 4], num_target_layers=6,
                  num_drafts=B - 1, mask_token_id=49, rope_theta=10000.0)
    fields.update(overrides)
    return drafter_config(**fields)


def make(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg, attention="dense")
    for p in model.parameters():  # larger than the default init: every key carries a visible signal
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
    return model.eval()


@pytest.fixture
def batch(seed):
    layout = BlockLayout.build(SEGMENTS, B)
    return layout, torch.randn(layout.num_queries, H), torch.randn(layout.num_context, L * H)


# -- the mask, by hand ----------------------------------------------------------------------

# One segment of 6 context positions, blocks of 3 anchored at 2 (positions 2-4) and 5 (5-7),
# window 3: query p sees context k < anchor with k > p - 3.
HAND_CONTEXT = [  # [6 queries, 6 context keys]
    [1, 1, 0, 0, 0, 0],  # p=2: k in {0, 1}
    [0, 1, 0, 0, 0, 0],  # p=3: k in {1}
    [0, 0, 0, 0, 0, 0],  # p=4: none (k > 1 and k < 2)
    [0, 0, 0, 1, 1, 0],  # p=5: k in {3, 4}
    [0, 0, 0, 0, 1, 0],  # p=6: k in {4}
    [0, 0, 0, 0, 0, 0],  # p=7: none
]
BIDIRECTIONAL_BLOCKS = np.kron(np.eye(2, dtype=int), np.ones((3, 3), dtype=int))  # |p - k| <= 2 < 3
CAUSAL_BLOCKS = np.kron(np.eye(2, dtype=int), np.tril(np.ones((3, 3), dtype=int)))


@pytest.mark.parametrize("causal", [False, True])
def test_a_tiny_windowed_mask_by_hand(causal):
    layout = BlockLayout.build([(6, np.array([2, 5]))], 3)
    blocks = CAUSAL_BLOCKS if causal else BIDIRECTIONAL_BLOCKS
    expected = np.concatenate([np.array(HAND_CONTEXT), blocks], axis=1).astype(bool)
    np.testing.assert_array_equal(layout.dense_mask(window=3, causal=causal).numpy(), expected)


def test_a_window_wider_than_the_block_keeps_a_bidirectional_block_whole():
    layout = BlockLayout.build([(6, np.array([2, 5]))], 3)
    mask = layout.dense_mask(window=2, causal=False).numpy()
    # Window 2 inside a block of 3: positions two apart no longer see each other.
    np.testing.assert_array_equal(mask[0, 6:9], [True, True, False])
    np.testing.assert_array_equal(mask[2, 6:9], [False, True, True])


def test_the_layer_rule_reads_is_causal_as_z_lab_and_vllm_do():
    mixed = config(layer_types=MIXED, sliding_window=8)
    assert [mixed.layer_attention(i) for i in range(3)] == [(8, True), (8, True), (None, False)]
    both = dataclasses.replace(mixed, is_causal=False)
    assert [both.layer_attention(i) for i in range(3)] == [(8, False), (8, False), (None, False)]
    causal = config(is_causal=True)
    assert [causal.layer_attention(i) for i in range(3)] == [(None, True)] * 3
    assert [config().layer_attention(i) for i in range(3)] == [(None, False)] * 3


# -- the paths agree ------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("is_causal", [None, True, False])
@pytest.mark.parametrize("window", [2, 5])
def test_flex_and_dense_agree_with_windows(batch, is_causal, window):
    pytest.importorskip("torch.nn.attention.flex_attention")
    layout, embeds, features = batch
    drafter = make(config(layer_types=MIXED, sliding_window=window, is_causal=is_causal))
    dense = drafter(embeds, features, layout)
    drafter.attention = "flex"
    with torch.no_grad():  # Flex Attention has no backward on CPU; eager forward is exact math
        flex = drafter(embeds, features, layout)
    # Same softmax over the same visible keys, different reduction order: fp32 rounding.
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_dense_queries", [B, 2 * B, 4096])
def test_dense_chunking_with_windows_does_not_change_outputs(batch, max_dense_queries):
    layout, embeds, features = batch
    drafter = make(config(layer_types=MIXED, sliding_window=5))
    reference = drafter(embeds, features, layout)
    drafter.max_dense_queries = max_dense_queries
    torch.testing.assert_close(drafter(embeds, features, layout), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("is_causal", [None, False])
def test_a_window_past_the_sequence_is_full_attention(batch, is_causal):
    """A window longer than every sequence sees what full attention sees: the same numbers,
    in training and at inference."""
    layout, embeds, features = batch
    sliding = ["sliding_attention"] * 3
    windowed = make(config(layer_types=sliding, sliding_window=1000, is_causal=is_causal))
    # The rule makes sliding layers causal: the full drafter to match is then causal everywhere.
    full = make(config(is_causal=True if is_causal is None else is_causal))
    full.load_state_dict(windowed.state_dict())
    torch.testing.assert_close(windowed(embeds, features, layout), full(embeds, features, layout), rtol=0, atol=0)
    cache = DrafterContextCache()
    windowed.append_context(cache, features[None, :9])
    block = embeds[None, :B]
    torch.testing.assert_close(windowed.forward_block(block, cache), full.forward_block(block, cache),
                               rtol=0, atol=0)


@pytest.mark.parametrize("is_causal", [None, True, False])
@pytest.mark.parametrize("block", range(len(SEGMENTS[0][1])))
def test_inference_block_matches_training_with_windows(batch, block, is_causal):
    layout, embeds, features = batch
    drafter = make(config(layer_types=MIXED, sliding_window=5, is_causal=is_causal))
    a = int(layout.anchors[block])
    rows = slice(block * B, (block + 1) * B)
    training = drafter(embeds, features, layout)[rows]
    cache = DrafterContextCache()
    drafter.append_context(cache, features[None, : a // 2])
    drafter.append_context(cache, features[None, a // 2: a])
    inference = drafter.forward_block(embeds[None, rows], cache)[0]
    torch.testing.assert_close(inference, training, rtol=1e-5, atol=1e-5)


# -- what a windowed query sees (by perturbation) -------------------------------------------

WINDOW = 5
BLOCK = 3  # anchor 22 of segment 0: positions 22..25


def sliding_only(is_causal=None) -> DFlashDrafter:
    return make(config(layer_types=["sliding_attention"] * 3, sliding_window=WINDOW, is_causal=is_causal))


def test_context_beyond_every_window_is_invisible(batch):
    layout, embeds, features = batch
    drafter = sliding_only()
    a = int(layout.anchors[BLOCK])
    rows = slice(BLOCK * B, (BLOCK + 1) * B)
    reference = drafter(embeds, features, layout)[rows]
    perturbed = features.clone()
    # Three layers deep, a block query at p still reads only keys > p - WINDOW (keys are the
    # fused context, not transformed by earlier layers): positions <= a - WINDOW never reach it.
    perturbed[: a - WINDOW + 1] += 5.0 * torch.randn(a - WINDOW + 1, L * H)
    torch.testing.assert_close(drafter(embeds, perturbed, layout)[rows], reference, rtol=0, atol=0)


@pytest.mark.parametrize("offset", range(1, WINDOW))
def test_context_inside_the_window_reaches_the_queries_it_should(batch, offset):
    """Context position a - offset reaches block position k only when k < WINDOW - offset
    (p - (a - offset) < WINDOW) in a causal one-layer drafter, where nothing else carries it."""
    layout, embeds, features = batch
    drafter = make(config(num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=WINDOW))
    a = int(layout.anchors[BLOCK])
    rows = slice(BLOCK * B, (BLOCK + 1) * B)
    reference = drafter(embeds, features, layout)[rows]
    perturbed = features.clone()
    perturbed[a - offset] += 5.0 * torch.randn(L * H)
    changed = (drafter(embeds, perturbed, layout)[rows] - reference).abs().amax(dim=1) > 1e-4  # [B]
    assert changed.tolist() == [k < WINDOW - offset for k in range(B)]


def test_a_causal_layer_hides_later_block_positions(batch):
    layout, embeds, features = batch
    drafter = make(config(num_hidden_layers=1, is_causal=True))
    reference = drafter(embeds, features, layout)[:B]
    perturbed = embeds.clone()
    perturbed[2] += 5.0 * torch.randn(H)
    changed = (drafter(perturbed, features, layout)[:B] - reference).abs().amax(dim=1) > 1e-4
    assert changed.tolist() == [False, False, True, True]


# -- the config -----------------------------------------------------------------------------


@pytest.mark.parametrize("fields,message", [
    (dict(layer_types=["sliding_attention"] * 2, sliding_window=4), r"one of .* per layer \(3 layers\)"),
    (dict(layer_types=["sliding_attention", "linear_attention", "full_attention"], sliding_window=4),
     "one of 'full_attention' or 'sliding_attention' per layer"),
    (dict(layer_types=MIXED), "sliding_window .* is set exactly when a layer is sliding_attention"),
    (dict(sliding_window=4), "sliding_window .* is set exactly when a layer is sliding_attention"),
    (dict(layer_types=MIXED, sliding_window=0), r"sliding_window \(>= 1\)"),
])
def test_config_refuses_a_bad_layout(fields, message):
    with pytest.raises(ValueError, match=message):
        config(**fields)


def test_a_full_config_is_stored_as_before_and_a_sliding_one_round_trips():
    full = config(layer_types=["full_attention"] * 3)
    assert full.layer_types is None
    assert not {"layer_types", "sliding_window", "is_causal"} & full.to_dict().keys()
    mixed = config(layer_types=MIXED, sliding_window=7, is_causal=False)
    data = mixed.to_dict()
    assert (data["layer_types"], data["sliding_window"], data["is_causal"]) == (MIXED, 7, False)
    assert DrafterConfig.from_dict(data) == mixed


# -- online ---------------------------------------------------------------------------------


@pytest.mark.parametrize("verify_size", [2, 4])
def test_speculative_decoding_with_a_sliding_drafter_is_lossless_past_its_window(verify_size):
    from dflash.testing.builders import tiny_causal_lm
    from dflash.train.model import TargetHead
    from dflash.train.speculative import DrafterProposer, greedy_generate, speculative_generate

    target = tiny_causal_lm("qwen3")
    V = target.get_input_embeddings().weight.shape[0]
    torch.manual_seed(1)
    cfg = drafter_config(num_hidden_layers=2, vocab_size=V, target_layer_ids=[1, 3], num_target_layers=6,
                         num_drafts=verify_size - 1, mask_token_id=V - 1, initializer_range=0.2,
                         layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    head = TargetHead(embed_tokens=target.get_input_embeddings().weight.detach(),
                      lm_head=target.get_output_embeddings().weight.detach())
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    reference = greedy_generate(target, prompt, max_new_tokens=20, stop_token_ids=set())
    out = speculative_generate(target, DrafterProposer(DFlashDrafter(cfg, attention="dense"), head), prompt,
                               max_new_tokens=20, verify_size=verify_size, layer_ids=[1, 3], stop_token_ids=set())
    assert out.tokens == reference.tokens
    assert sum(out.acceptance_lengths) == 20 - 1


def test_model_flops_count_a_sliding_layer_over_its_window_only():
    from dflash.train.model import model_flops_per_token

    full = config()
    mixed = config(layer_types=MIXED, sliding_window=8)
    c = full
    attention_per_key = 2 * 2 * c.num_attention_heads * c.head_dim * 3.0  # forward and backward
    context = 100.0
    # two of the three layers see 8 keys instead of context + block
    assert model_flops_per_token(full, context) - model_flops_per_token(mixed, context) == pytest.approx(
        2 * attention_per_key * (context + B - 8))
    wide = config(layer_types=MIXED, sliding_window=10_000)  # a window past every key: full attention's count
    assert model_flops_per_token(wide, context) == model_flops_per_token(full, context)
