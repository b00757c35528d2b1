"""`fit --drafter lilicorr` end to end on the tiny synthetic cache, with and without DFlash2's
convolutions: it trains the lattice head, eval's offline drafts are what online decoding drafts,
online decoding is lossless, and `--init-from` a DFlash or a DFlash2 drafter loads the backbone
bit for bit and leaves the head fresh."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflash.shards import open_cache
from dflash.testing.builders import drafter_config, fit_cache, tiny_causal_lm
from dflash.train import drafters
from dflash.train.acceptance import sequence_acceptance, target_top1
from dflash.train.checkpoint import latest_checkpoint, list_checkpoints
from dflash.train.drafters.lilicorr import LiLiCorrDrafter
from dflash.train.export import write_export
from dflash.train.fit import fit
from dflash.train.loading import load_drafter
from dflash.train.model import DFlashDrafter, DrafterConfig, TargetHead
from dflash.train.speculative import DrafterProposer, greedy_generate, speculative_generate
from tests.test_train_fit import read_lines, run_subprocess, tiny_config

pytestmark = pytest.mark.e2e

LILICORR = dict(drafter="lilicorr", num_drafts=3, lilicorr_candidate_topk=4, lilicorr_hidden_size=16,
                lilicorr_num_heads=2, lilicorr_factor_dim=8)
CONVS = dict(lilicorr_convolutions=True, conv_kernel_size=2, conv_group_size=16)
VARIANTS = {"plain": {}, "convolutions": CONVS}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return fit_cache(tmp_path_factory)


@pytest.fixture(scope="module", params=list(VARIANTS))
def run(request, cache_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(request.param) / "run"
    result = run_subprocess(tiny_config(cache_dir, out, **LILICORR, **VARIANTS[request.param], save_initial=True))
    assert result.returncode == 0, result.stderr
    return out


def test_a_lilicorr_run_trains_its_head(run):
    first, last = (load_file(str(c / "model.safetensors")) for c in (list_checkpoints(run)[0],
                                                                       latest_checkpoint(run)))
    head = [name for name in last if name.startswith("lilicorr.")]
    moved = [name for name in head if not torch.equal(first[name], last[name])]
    # (out_head scores transitions, which train once two slots in a row hold the target's token
    # among their top 4 of 64: rare in these few steps from a random start)
    assert {"lilicorr.in_head.weight", "lilicorr.anchor_out_head.weight", "lilicorr.context_proj.weight",
            "lilicorr.layers.0.attn.in_proj_weight", "lilicorr.feature_mlp.up_proj.weight"} <= set(moved)
    drafter = load_drafter(run).drafter
    assert type(drafter) is LiLiCorrDrafter
    convs = [name for name in last if ".attention_conv." in name or ".mlp_conv." in name]
    assert bool(convs) == bool(drafter.config.conv_kernel_size)
    assert all(not torch.equal(first[name], last[name]) for name in convs if "kernel_projection" in name)
    assert len(read_lines(run / "metrics.jsonl")[0]["accuracy"]) == 3  # positions 1..3 draft


def test_offline_drafts_are_what_online_decoding_drafts(run, cache_dir):
    drafter = load_drafter(run).drafter.eval()
    cache = open_cache(cache_dir)
    head = TargetHead.load(cache.target_dir)
    seq = cache[0]
    D = drafter.config.num_drafts
    scored = sequence_acceptance(drafter, head, seq.input_ids, seq.loss_mask, seq.features,
                                 target_top1(seq.topk_ids, seq.topk_logprobs), verify_size=D + 1)
    proposer = DrafterProposer(drafter, head)
    features = torch.as_tensor(np.asarray(seq.features, dtype=np.float32).reshape(len(seq.input_ids), -1))
    for i in (0, len(scored.anchors) // 2, len(scored.anchors) - 1):
        a = int(scored.anchors[i])
        proposer.reset()
        proposer.commit(features[:a // 2])  # in two commits: the anchor's context row is the last one's
        proposer.commit(features[a // 2:a])
        assert proposer.propose(int(seq.input_ids[a]), D + 1) == scored.drafts[i].tolist()


def test_fit_refuses_what_lilicorr_cannot_train(cache_dir, tmp_path):
    with pytest.raises(ValueError, match="--drafter lilicorr scores the whole vocabulary .*drop --draft-vocab"):
        tiny_config(cache_dir, tmp_path / "a", **LILICORR, draft_vocab=16)
    with pytest.raises(ValueError, match="lilicorr_candidate_topk must be a power of two <= 16, got 6"):
        tiny_config(cache_dir, tmp_path / "b", **{**LILICORR, "lilicorr_candidate_topk": 6})
    with pytest.raises(ValueError, match="conv_kernel_size 5 exceeds the block's 4 rows: pass --conv-kernel-size 4"):
        tiny_config(cache_dir, tmp_path / "c", **LILICORR, **{**CONVS, "conv_kernel_size": 5})


# -- online ---------------------------------------------------------------------------------

V, LAYER_IDS = 64, [1, 3]


@pytest.mark.parametrize("convs", [{}, dict(conv_kernel_size=2, conv_group_size=8)], ids=["plain", "convolutions"])
@pytest.mark.parametrize("num_drafts", [2, 4])
def test_lilicorr_online_decoding_is_lossless(num_drafts, convs):
    target = tiny_causal_lm("qwen3")
    torch.manual_seed(1)
    config = drafter_config("lilicorr", num_hidden_layers=2, vocab_size=V, target_layer_ids=LAYER_IDS,
                            num_target_layers=6, num_drafts=num_drafts, mask_token_id=V - 1, initializer_range=0.2,
                            lilicorr_candidate_topk=4, lilicorr_num_heads=2, lilicorr_factor_dim=8, **convs)
    drafter = drafters.make(config, attention="dense")
    with torch.no_grad():  # transitions that move drafts
        for param in drafter.lilicorr.parameters():
            param.normal_(std=0.3)
    head = TargetHead(embed_tokens=target.get_input_embeddings().weight.detach(),
                      lm_head=target.get_output_embeddings().weight.detach())
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    reference = greedy_generate(target, prompt, max_new_tokens=23, stop_token_ids=set())
    out = speculative_generate(target, DrafterProposer(drafter, head), prompt, max_new_tokens=23,
                               verify_size=num_drafts + 1, layer_ids=LAYER_IDS, stop_token_ids=set())
    assert out.tokens == reference.tokens
    assert max(out.drafted) == num_drafts


# -- warm starts ----------------------------------------------------------------------------


def warm(cache_dir: Path, out: Path, init_from: Path, **overrides) -> dict[str, torch.Tensor]:
    """A one-step lilicorr fit from `init_from`; its step-0 weights."""
    values = dict(max_steps=1, checkpoint_every=100, save_initial=True, num_layers=None, init_from=str(init_from),
                  **LILICORR)
    fit(tiny_config(cache_dir, out, **{**values, **overrides}))
    return load_file(str(list_checkpoints(out)[0] / "model.safetensors"))


def fresh_head(cache_dir: Path, out: Path, **overrides) -> dict[str, torch.Tensor]:
    """The step-0 head of the same run without --init-from (the run's seed)."""
    values = dict(max_steps=1, checkpoint_every=100, save_initial=True, num_layers=1, **LILICORR)
    fit(tiny_config(cache_dir, out, **{**values, **overrides}))
    state = load_file(str(list_checkpoints(out)[0] / "model.safetensors"))
    return {name: t for name, t in state.items() if name.startswith("lilicorr.")}


@pytest.mark.parametrize("source_kind", ["dflash", "dflash2"])
def test_init_from_loads_the_backbone_bit_for_bit_and_leaves_the_head_fresh(cache_dir, tmp_path, source_kind):
    torch.manual_seed(3)
    base = DrafterConfig.from_target(cache_dir / "target", num_hidden_layers=1, num_drafts=3)
    if source_kind == "dflash":
        source = DFlashDrafter(base)
        convs = {}
    else:
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        source = drafters.make(drafter_config("dflash2", **{**fields, "conv_group_size": 16, "selector_rank": 8,
                                                            "selector_top_k": 4}))
        convs = CONVS
    with torch.no_grad():
        for param in source.parameters():
            param.normal_(std=0.1)
    state = warm(cache_dir, tmp_path / "run", write_export(source, tmp_path / "source", dtype=torch.float32), **convs)
    for name, tensor in source.state_dict().items():
        if not name.startswith("candidate_selector."):
            assert torch.equal(state[name], tensor), name
    assert not any(name.startswith("candidate_selector.") for name in state)
    head = {name: t for name, t in state.items() if name.startswith("lilicorr.")}
    fresh = fresh_head(cache_dir, tmp_path / "fresh", **convs)
    assert head.keys() == fresh.keys() and all(torch.equal(head[k], fresh[k]) for k in head)
