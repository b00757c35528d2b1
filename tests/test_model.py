"""The drafter: parameter names, the attention rule (by perturbation), path parity, inference."""

import numpy as np
import pytest
import torch

from dflash.testing.builders import drafter_config
from dflash.train.model import BlockLayout, DFlashDrafter, DrafterConfig, DrafterContextCache, TargetHead

B = 4  # block size
L = 3  # target features
H = 32  # the hidden size of dflash.testing.builders.drafter_config


def tiny_config(**overrides) -> DrafterConfig:
    fields = dict(num_hidden_layers=2, vocab_size=50, target_layer_ids=[0, 2, 4], num_target_layers=6,
                  num_drafts=B - 1, mask_token_id=49, rope_theta=10000.0)
    fields.update(overrides)
    return drafter_config(**fields)


# Two sequences; blocks at 3 and 5 overlap (positions 5, 6), as random anchors do.
SEGMENTS = [(20, np.array([3, 5, 10, 16])), (15, np.array([1, 9]))]


@pytest.fixture
def drafter(seed) -> DFlashDrafter:
    model = DFlashDrafter(tiny_config(), attention="dense")
    # Larger weights than the default init so that every path carries a visible signal.
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
    return model.eval()


@pytest.fixture
def batch(seed):
    layout = BlockLayout.build(SEGMENTS, B)
    embeds = torch.randn(layout.num_queries, H)  # [Q, H]
    features = torch.randn(layout.num_context, L * H)  # [C, L*H]
    return layout, embeds, features


def block_rows(layout: BlockLayout, block: int) -> slice:
    return slice(block * B, (block + 1) * B)


def context_row(layout: BlockLayout, segment: int, position: int) -> int:
    return layout.context_offsets[segment] + position


def segment_of(block: int) -> int:
    return 0 if block < len(SEGMENTS[0][1]) else 1


def test_parameter_names_match_z_lab():
    model = DFlashDrafter(tiny_config(num_hidden_layers=1))
    names = set(model.state_dict())
    layer = {f"layers.0.{n}.weight" for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        "input_layernorm", "post_attention_layernorm")}
    assert names == layer | {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert model.fc.weight.shape == (H, L * H)


def test_dense_mask_matches_rule():
    layout = BlockLayout.build(SEGMENTS, B)
    mask = layout.dense_mask().numpy()  # [Q, C+Q]
    C = layout.num_context
    expected = np.zeros_like(mask)
    block = 0
    for seg, (_length, anchors) in enumerate(SEGMENTS):
        for a in anchors:
            for q in range(block * B, (block + 1) * B):
                c0 = layout.context_offsets[seg]
                expected[q, c0:c0 + a] = True  # context strictly before the anchor
                expected[q, C + block * B: C + (block + 1) * B] = True  # own block
            block += 1
    np.testing.assert_array_equal(mask, expected)


NUM_BLOCKS = sum(len(a) for _, a in SEGMENTS)


@pytest.mark.parametrize("block", range(NUM_BLOCKS))
def test_context_at_or_after_anchor_is_invisible(drafter, batch, block):
    layout, embeds, features = batch
    seg = segment_of(block)
    a = int(layout.anchors[block])
    reference = drafter(embeds, features, layout)[block_rows(layout, block)]
    perturbed = features.clone()
    start, stop = context_row(layout, seg, a), context_row(layout, seg, layout.context_lengths[seg])
    perturbed[start:stop] += 5.0 * torch.randn(stop - start, L * H)
    out = drafter(embeds, perturbed, layout)[block_rows(layout, block)]
    torch.testing.assert_close(out, reference, rtol=0, atol=0)


@pytest.mark.parametrize("block", range(NUM_BLOCKS))
def test_context_just_before_anchor_is_visible(drafter, batch, block):
    layout, embeds, features = batch
    seg = segment_of(block)
    a = int(layout.anchors[block])
    reference = drafter(embeds, features, layout)[block_rows(layout, block)]
    perturbed = features.clone()
    perturbed[context_row(layout, seg, a - 1)] += 5.0 * torch.randn(L * H)
    out = drafter(embeds, perturbed, layout)[block_rows(layout, block)]
    assert (out - reference).abs().max() > 1e-3


@pytest.mark.parametrize("block", range(NUM_BLOCKS))
def test_other_blocks_and_sequences_are_invisible(drafter, batch, block):
    layout, embeds, features = batch
    seg = segment_of(block)
    reference = drafter(embeds, features, layout)[block_rows(layout, block)]
    perturbed_embeds = embeds + 5.0 * torch.randn_like(embeds)
    perturbed_embeds[block_rows(layout, block)] = embeds[block_rows(layout, block)]
    perturbed_features = features.clone()
    other = 1 - seg
    start = layout.context_offsets[other]
    stop = start + layout.context_lengths[other]
    perturbed_features[start:stop] += 5.0 * torch.randn(stop - start, L * H)
    out = drafter(perturbed_embeds, perturbed_features, layout)[block_rows(layout, block)]
    torch.testing.assert_close(out, reference, rtol=0, atol=0)


@pytest.mark.parametrize("position", range(B))
def test_block_is_bidirectional(drafter, batch, position):
    layout, embeds, features = batch
    reference = drafter(embeds, features, layout)[block_rows(layout, 0)]
    perturbed = embeds.clone()
    perturbed[position] += 5.0 * torch.randn(H)
    out = drafter(perturbed, features, layout)[block_rows(layout, 0)]
    others = [k for k in range(B) if k != position]
    assert ((out - reference)[others].abs().amax(dim=1) > 1e-4).all()


@pytest.mark.parametrize("max_dense_queries", [B, 2 * B, 4096])
def test_dense_chunking_does_not_change_outputs(drafter, batch, max_dense_queries):
    layout, embeds, features = batch
    reference = drafter(embeds, features, layout)
    drafter.max_dense_queries = max_dense_queries
    # Chunking changes which masked keys are in a call (and so the reduction order): fp32
    # rounding only.
    torch.testing.assert_close(drafter(embeds, features, layout), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_and_dense_agree(drafter, batch):
    pytest.importorskip("torch.nn.attention.flex_attention")
    layout, embeds, features = batch
    dense = drafter(embeds, features, layout)
    drafter.attention = "flex"
    with torch.no_grad():  # Flex Attention has no backward on CPU; eager forward is exact math
        flex = drafter(embeds, features, layout)
    # Same softmax over the same visible keys, different reduction order: fp32 rounding.
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_bf16_autocast_keeps_one_dtype(drafter, batch, attention):
    """fp32 master weights under bf16 autocast (the GPU setting): every attention input is bf16."""
    layout, embeds, features = batch
    drafter.attention = attention
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = drafter(embeds.bfloat16(), features.bfloat16(), layout)
    assert out.dtype == torch.bfloat16
    # bf16 rounding through two layers: a loose match to the fp32 result.
    drafter.attention = "dense"
    reference = drafter(embeds, features, layout)
    assert (out.float() - reference).abs().max() < 0.1 * reference.abs().max()


@pytest.mark.parametrize("block", range(len(SEGMENTS[0][1])))
def test_inference_block_matches_training(drafter, batch, block):
    layout, embeds, features = batch
    a = int(layout.anchors[block])
    training = drafter(embeds, features, layout)[block_rows(layout, block)]
    cache = DrafterContextCache()
    # Commit the context in two pieces, as speculative decoding does, then draft at a.
    drafter.append_context(cache, features[None, : a // 2])
    drafter.append_context(cache, features[None, a // 2: a])
    assert cache.length == a
    inference = drafter.forward_block(embeds[None, block_rows(layout, block)], cache)[0]
    torch.testing.assert_close(inference, training, rtol=1e-5, atol=1e-5)


def test_context_cache_crop_drops_positions(drafter, batch):
    layout, embeds, features = batch
    cache = DrafterContextCache()
    drafter.append_context(cache, features[None, :10])
    cache.crop(3)
    reference = DrafterContextCache()
    drafter.append_context(reference, features[None, :3])
    assert cache.length == 3
    block = embeds[None, :B]
    torch.testing.assert_close(drafter.forward_block(block, cache), drafter.forward_block(block, reference))


def test_backward_reaches_every_parameter(drafter, batch):
    layout, embeds, features = batch
    drafter.train()
    drafter(embeds, features, layout).square().sum().backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("field,value,message", [
    ("num_key_value_heads", 3, "multiple"),
    ("mask_token_id", 50, "not a row"),
    ("num_drafts", 0, "num_drafts"),
    ("target_layer_ids", [], "empty"),
])
def test_config_rejects_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**{field: value})


def test_layout_rejects_anchor_past_context():
    with pytest.raises(ValueError, match="anchors must lie"):
        BlockLayout.build([(5, np.array([2, 6]))], B)


@pytest.mark.parametrize("content", [b"\x00" * 16, b"not a safetensors file at all"])
def test_a_damaged_target_head_names_the_file(tmp_path, content):
    (tmp_path / "head.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match=r"head\.safetensors: cannot read the target's embedding and LM head: "
                                         r".*rebuild the cache's target/ folder"):
        TargetHead.load(tmp_path)
