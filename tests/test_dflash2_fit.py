"""`fit --drafter dflash2` end to end on the tiny synthetic cache: it trains the convolutions and
the selector, resumes exactly after SIGKILL, drafts offline as online decoding does, decodes
losslessly, and warm-starts from a DFlash drafter (convolutions the identity) and from a
DFlash2 folder in z-lab's layout (their Qwen3.8-27B-DFlash2 release's, at tiny widths)."""

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.shards import open_cache
from dflash.testing.builders import drafter_config, fit_cache, tiny_causal_lm
from dflash.train import drafters
from dflash.train.acceptance import sequence_acceptance, target_top1
from dflash.train.checkpoint import latest_checkpoint, list_checkpoints
from dflash.train.drafters.dflash2 import DFlash2Drafter
from dflash.train.export import write_export
from dflash.train.fit import fit
from dflash.train.loading import load_drafter
from dflash.train.model import BlockLayout, DFlashDrafter, DrafterConfig, TargetHead
from dflash.train.speculative import DrafterProposer, greedy_generate, speculative_generate
from tests import test_train_fit as train_fit
from tests.test_init_from import write_zlab_folder
from tests.test_train_fit import DRIVER, assert_same_checkpoint, read_lines, run_subprocess, tiny_config

pytestmark = pytest.mark.e2e

DFLASH2 = dict(drafter="dflash2", num_drafts=3, selector_rank=8, selector_top_k=4)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return fit_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def straight_run(cache_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "run"
    result = run_subprocess(tiny_config(cache_dir, out, **DFLASH2, save_initial=True))
    assert result.returncode == 0, result.stderr
    return out


def test_a_dflash2_run_trains_its_convolutions_and_selector(straight_run):
    first, last = (load_file(str(c / "model.safetensors")) for c in (list_checkpoints(straight_run)[0],
                                                                       latest_checkpoint(straight_run)))
    own = [name for name in last if drafters.get("dflash2").owns(name)]
    assert len(own) == 3 + 4  # the selector's three, two convolutions' two each in the one layer
    for name in own:
        assert not torch.equal(first[name], last[name]), name
    assert torch.equal(first["layers.0.attention_conv.base_kernel"][:, 0], torch.ones(2, 32))  # the identity
    assert type(load_drafter(straight_run).drafter) is DFlash2Drafter
    assert len(read_lines(straight_run / "metrics.jsonl")[0]["accuracy"]) == 3  # positions 1..3 draft


def test_resume_after_sigkill_is_exact(cache_dir, straight_run, tmp_path, monkeypatch):
    out = tmp_path / "run"
    config = tiny_config(cache_dir, out, **DFLASH2, save_initial=True)
    monkeypatch.setattr(train_fit, "DRIVER", DRIVER)
    killed = run_subprocess(config, 5, "between-checkpoints")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = run_subprocess(config)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_checkpoint(latest_checkpoint(out), latest_checkpoint(straight_run))
    assert [line["loss"] for line in read_lines(out / "metrics.jsonl")] == [
        line["loss"] for line in read_lines(straight_run / "metrics.jsonl")]


def test_offline_drafts_are_what_online_decoding_drafts(straight_run, cache_dir):
    drafter = load_drafter(straight_run).drafter.eval()
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
        proposer.commit(features[:a])
        assert proposer.propose(int(seq.input_ids[a]), D + 1) == scored.drafts[i].tolist()


def test_fit_refuses_what_dflash2_cannot_train(cache_dir, tmp_path):
    with pytest.raises(ValueError, match="--drafter dflash2 scores the whole vocabulary .*drop --draft-vocab"):
        tiny_config(cache_dir, tmp_path / "a", **DFLASH2, draft_vocab=16)
    with pytest.raises(ValueError, match="conv_kernel_size 5 exceeds the block's 4 rows: pass --conv-kernel-size 4"):
        tiny_config(cache_dir, tmp_path / "b", **DFLASH2, conv_kernel_size=5)


# -- online ---------------------------------------------------------------------------------

V, LAYER_IDS = 64, [1, 3]


@pytest.mark.parametrize("num_drafts", [2, 4])
def test_dflash2_online_decoding_is_lossless(num_drafts):
    target = tiny_causal_lm("qwen3")
    torch.manual_seed(1)
    config = drafter_config("dflash2", num_hidden_layers=2, vocab_size=V, target_layer_ids=LAYER_IDS,
                            num_target_layers=6, num_drafts=num_drafts, mask_token_id=V - 1, initializer_range=0.2,
                            conv_group_size=8, selector_rank=8, selector_top_k=6)
    drafter = drafters.make(config, attention="dense")
    with torch.no_grad():  # convolutions off the identity, transitions that move drafts
        for layer in drafter.layers:
            layer.attention_conv.kernel_projection.weight.normal_(std=0.3)
            layer.mlp_conv.base_kernel.normal_()
        drafter.candidate_selector.successor_codebook.normal_(std=3.0)
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
    """A one-step dflash2 fit from `init_from`; its step-0 weights."""
    values = dict(max_steps=1, checkpoint_every=100, save_initial=True, num_layers=None, init_from=str(init_from),
                  **DFLASH2)
    fit(tiny_config(cache_dir, out, **{**values, **overrides}))
    return load_file(str(list_checkpoints(out)[0] / "model.safetensors"))


def test_init_from_a_dflash_drafter_starts_as_that_drafter(cache_dir, tmp_path):
    """Its backbone loaded, its convolutions the identity: step 0 computes the source's rows."""
    torch.manual_seed(3)
    source = DFlashDrafter(DrafterConfig.from_target(cache_dir / "target", num_hidden_layers=1, num_drafts=7))
    with torch.no_grad():
        for name, param in source.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    state = warm(cache_dir, tmp_path / "run", write_export(source, tmp_path / "source", dtype=torch.float32))
    for name, tensor in source.state_dict().items():
        assert torch.equal(state[name], tensor), name
    drafter = load_drafter(tmp_path / "run", list_checkpoints(tmp_path / "run")[0]).drafter.eval()
    g = torch.Generator().manual_seed(2)
    context, embeds = torch.randn(10, drafter.config.context_width, generator=g), torch.randn(8, 32, generator=g)
    layout = BlockLayout.build([(10, np.array([3, 9]))], 4)
    assert torch.equal(drafter(embeds, context, layout), source.eval()(embeds, context, layout))


# z-lab's Qwen3.8-27B-DFlash2: 5 sliding layers of window 2048 (bidirectional in the block), block 8,
# a top-16 selector of rank 256, two-tap convolutions in groups of 16 channels.
ZLAB_DFLASH2 = dict(
    architectures=["DFlash2DraftModel"], block_size=None, is_causal=False,
    layer_types=["sliding_attention"] * 5, sliding_window=2048, use_sliding_window=True,
    dflash_config={"block_size": 8, "mask_token_id": 62, "target_layer_ids": [0, 2, 4], "conv_kernel_size": 2,
                   "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16})


def write_zlab_dflash2_folder(folder: Path) -> dict[str, torch.Tensor]:
    """write_zlab_folder's DFlash layout at 5 layers, with DFlash2's config and tensors added."""
    tensors = write_zlab_folder(folder, num_layers=5, **ZLAB_DFLASH2)
    config = json.loads((folder / "config.json").read_text())
    config.pop("block_size")
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(6)
    H, V = 32, 64
    extra = {"candidate_selector.predecessor_codebook": (V, 256), "candidate_selector.successor_codebook": (V, 256),
             "candidate_selector.hidden_projection.weight": (256, H)}
    for i in range(5):
        for conv in ("attention_conv", "mlp_conv"):
            extra |= {f"layers.{i}.{conv}.base_kernel": (2, 2, H),
                      f"layers.{i}.{conv}.kernel_projection.weight": (2 * 2 * (H // 16), H)}
    tensors |= {name: (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16) for name, shape in extra.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def test_init_from_z_labs_dflash2_release_layout(cache_dir, tmp_path):
    tensors = write_zlab_dflash2_folder(tmp_path / "z-lab")
    state = warm(cache_dir, tmp_path / "run", tmp_path / "z-lab", selector_rank=256, selector_top_k=16)
    assert state.keys() == tensors.keys()
    assert all(torch.equal(state[k], tensors[k].float()) for k in tensors)
    config = load_drafter(tmp_path / "run", list_checkpoints(tmp_path / "run")[0]).drafter.config
    assert [config.layer_attention(i) for i in range(5)] == [(2048, False)] * 5
    assert (config.conv_kernel_size, config.conv_group_size, config.selector_rank, config.selector_top_k) == (
        2, 16, 256, 16)
    record = json.loads((tmp_path / "run" / "run.json").read_text())["init_from"]
    assert record["config"]["num_drafts"] == 7 and record["config"]["kind"] == "dflash2"  # z-lab's block 8


def test_a_dflash2_source_of_other_shapes_is_refused_by_flag(cache_dir, tmp_path):
    write_zlab_dflash2_folder(tmp_path / "z-lab")
    with pytest.raises(ValueError, match=r"selector_rank is 256 in the source, 8 for this run: pass "
                                         r"--selector-rank 256"):
        warm(cache_dir, tmp_path / "run", tmp_path / "z-lab")
