"""`fit --init-from`: a run starts from an existing drafter's weights (train/init_from.py).

The source is written by the test (our export in float32, a run, or a z-lab-layout folder
written by hand); the warm-started run's step-0 checkpoint (`save_initial`) is the source's
weights, so its offline evaluation equals the source's exactly on a raw cache, and within the
basis's truncation (shards/FORMAT.md) on a basis cache.
"""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.common.files import file_sha256
from dflash.shards import open_cache
from dflash.shards.basis import SecondMoment, fit_basis
from dflash.testing.builders import FIT_LENGTHS, tiny_fit_config
from dflash.train.basis import fold_basis
from dflash.train.checkpoint import list_checkpoints
from dflash.train.evaluate import evaluate_offline
from dflash.train.export import export_run, write_export
from dflash.train.fit import fit
from dflash.train.identity import read_run_info
from dflash.train.init_from import unfold_basis
from dflash.train.loading import load_drafter, load_exported
from dflash.train.model import DFlashDrafter, DrafterConfig, TargetHead
from dflash.train.synthetic import write_synthetic_training_cache

RUN_BLOCK = 4  # the run's verify size; the sources are made for 8 (the verify size may differ)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("raw") / "cache"
    write_synthetic_training_cache(path, lengths=FIT_LENGTHS, seed=1)
    return path


def basis_cache(root: Path, rank: int) -> Path:
    """The raw cache's rows (same seed) stored as basis-bf16 coefficients of `rank`."""
    path = root / f"basis-{rank}"
    write_synthetic_training_cache(path, lengths=FIT_LENGTHS, seed=1, feature_codec="basis-bf16", feature_rank=rank)
    return path


def source_config(cache_dir: Path, **overrides) -> DrafterConfig:
    """A drafter for the cache's target, away from the run's defaults where the weights allow."""
    base = DrafterConfig.from_target(cache_dir / "target", num_hidden_layers=2, num_drafts=7)
    return dataclasses.replace(base, **{"rope_theta": 50_000.0, "rms_norm_eps": 1e-5, **overrides})


def write_source(cache_dir: Path, out: Path, *, seed: int = 3, **overrides) -> Path:
    """Our export (float32) of a random drafter with norms away from 1."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(source_config(cache_dir, **overrides))
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return write_export(drafter, out, dtype=torch.float32)


@pytest.fixture(scope="module")
def source(cache_dir, tmp_path_factory) -> Path:
    return write_source(cache_dir, tmp_path_factory.mktemp("source") / "draft")


def warm(cache: Path, out: Path, init_from: Path | None, **overrides):
    """A one-step tiny fit that also checkpoints step 0 (the warm-started weights)."""
    values = dict(max_steps=1, checkpoint_every=100, save_initial=True, num_drafts=RUN_BLOCK - 1, num_layers=None)
    if init_from is not None:
        values["init_from"] = str(init_from)
    return fit(tiny_fit_config(cache, out, **{**values, **overrides}))


def step0(run: Path) -> DFlashDrafter:
    first = list_checkpoints(run)[0]
    assert int(first.name.removeprefix("step-")) == 0
    return load_drafter(run, first).drafter


def offline(drafter: DFlashDrafter, cache: Path) -> dict:
    c = open_cache(cache)
    return evaluate_offline(drafter, TargetHead.load(c.target_dir), [c[i] for i in range(len(c))],
                            verify_size=RUN_BLOCK)


# -- the exact warm start -------------------------------------------------------------------


def test_step0_of_a_warm_start_is_the_source_and_scores_exactly_as_it(cache_dir, source, tmp_path):
    run = tmp_path / "run"
    warm(cache_dir, run, source)
    start, exported = step0(run), load_exported(source)
    state, expected = start.state_dict(), exported.state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    c = start.config
    assert (c.num_hidden_layers, c.rope_theta, c.rms_norm_eps, c.mask_token_id, c.num_drafts + 1) == (
        2, 50_000.0, 1e-5, exported.config.mask_token_id, RUN_BLOCK)
    ours, theirs = offline(start, cache_dir), offline(exported, cache_dir)
    assert ours == theirs and ours["num_anchors"] > 100 and sum(ours["per_position_match"]) > 0
    record = read_run_info(run)["init_from"]
    assert record["path"] == str(source) and record["kind"] == "export"
    assert record["weights_sha256"] == file_sha256(source / "model.safetensors")
    assert record["config"]["num_hidden_layers"] == 2 and record["config"]["num_drafts"] == 7
    saved = json.loads((run / "config.json").read_text())
    assert saved["init_from"] == str(source) and saved["num_layers"] == 2
    card = (export_run(run, tmp_path / "export") / "README.md").read_text()
    assert f"Warm-started from `{source}`" in card


def test_a_run_and_its_checkpoint_are_sources(cache_dir, source, tmp_path):
    first = tmp_path / "first"
    warm(cache_dir, first, source, max_steps=2)
    trained = load_file(list_checkpoints(first)[-1] / "model.safetensors")
    for name, where in [("from-run", first), ("from-checkpoint", list_checkpoints(first)[-1])]:
        state = step0_state(cache_dir, tmp_path / name, where)
        assert all(torch.equal(state[k], trained[k]) for k in trained)
        assert read_run_info(tmp_path / name)["init_from"]["kind"] == "checkpoint"


def step0_state(cache_dir: Path, run: Path, init_from: Path) -> dict:
    warm(cache_dir, run, init_from)
    return load_file(list_checkpoints(run)[0] / "model.safetensors")


def write_zlab_folder(folder: Path, num_layers: int = 2, **changes) -> dict[str, torch.Tensor]:
    """config.json as z-lab publishes it (torch_dtype, top-level block_size, dflash_config),
    updated by `changes`, and bfloat16 weights, both written here, not by our export; returns
    the weights."""
    folder.mkdir()
    L, H, F, V = num_layers, 32, 64, 64
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
        "dflash_config": {"mask_token_id": 62, "target_layer_ids": [0, 2, 4]}, "num_target_layers": 6,
        "hidden_size": H, "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000, "vocab_size": V, "max_position_embeddings": 40960, "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "transformers_version": "4.57.1", **changes,
    }
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(5)
    shapes = {"fc.weight": (H, 3 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(L):
        p = f"layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (32, H), p + "self_attn.k_proj.weight": (16, H),
                   p + "self_attn.v_proj.weight": (16, H), p + "self_attn.o_proj.weight": (H, 32),
                   p + "self_attn.q_norm.weight": (8,), p + "self_attn.k_norm.weight": (8,),
                   p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                   p + "mlp.down_proj.weight": (H, F), p + "input_layernorm.weight": (H,),
                   p + "post_attention_layernorm.weight": (H,)}
    tensors = {name: (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16) for name, shape in shapes.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def test_a_hand_written_zlab_folder_loads(cache_dir, tmp_path):
    tensors = write_zlab_folder(tmp_path / "z-lab")
    state = step0_state(cache_dir, tmp_path / "run", tmp_path / "z-lab")
    assert state.keys() == tensors.keys()
    assert all(torch.equal(state[k], tensors[k].float()) for k in tensors)
    assert json.loads((tmp_path / "run" / "drafter_config.json").read_text())["mask_token_id"] == 62


# z-lab's Qwen3.6-27B drafter's layout: 4 sliding_attention + 1 full_attention, window 2048, no is_causal.
QWEN36_LAYOUT = dict(layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048,
                     use_sliding_window=True)


def test_a_sliding_window_zlab_drafter_is_read_with_its_layout(cache_dir, tmp_path):
    """The run takes the source's layers, window and the is_causal rule (sliding layers causal)."""
    tensors = write_zlab_folder(tmp_path / "z-lab", num_layers=5, **QWEN36_LAYOUT)
    state = step0_state(cache_dir, tmp_path / "run", tmp_path / "z-lab")
    assert all(torch.equal(state[k], tensors[k].float()) for k in tensors)
    saved = json.loads((tmp_path / "run" / "drafter_config.json").read_text())
    assert (saved["layer_types"], saved["sliding_window"], saved.get("is_causal")) == (
        QWEN36_LAYOUT["layer_types"], 2048, None)
    start = step0(tmp_path / "run")
    assert [start.config.layer_attention(i) for i in range(5)] == [(2048, True)] * 4 + [(None, False)]
    run_config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (run_config["num_layers"], run_config["layer_types"], run_config["sliding_window"]) == (
        5, QWEN36_LAYOUT["layer_types"], 2048)
    exported = json.loads((export_run(tmp_path / "run", tmp_path / "export") / "config.json").read_text())
    assert (exported["layer_types"], exported["sliding_window"], exported["use_sliding_window"]) == (
        QWEN36_LAYOUT["layer_types"], 2048, True)


def test_the_flags_override_the_sources_layout(cache_dir, tmp_path):
    write_zlab_folder(tmp_path / "z-lab", num_layers=5, **QWEN36_LAYOUT)
    warm(cache_dir, tmp_path / "run", tmp_path / "z-lab", sliding_window=8, is_causal=False)
    c = step0(tmp_path / "run").config
    assert [c.layer_attention(i) for i in range(5)] == [(8, False)] * 4 + [(None, False)]
    warm(cache_dir, tmp_path / "full", tmp_path / "z-lab", layer_types=["full_attention"] * 5)
    c = step0(tmp_path / "full").config
    assert (c.layer_types, c.sliding_window, c.is_causal) == (None, None, None)


@pytest.mark.parametrize(("changes", "message"), [
    (dict(dflash_config={"mask_token_id": 62, "target_layer_ids": [0, 2, 4], "conv_kernel_size": 2,
                         "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}),
     r"config.json: the checkpoint sets \['dflash_config.conv_kernel_size', .*'dflash_config.selector_top_k'\], "
     r"DFlash2's fields, under architectures \['DFlashDraftModel'\]"),
    (dict(dflash_config={"mask_token_id": 62, "target_layer_ids": [0, 2, 4], "attention_sink_bias": True}),
     r"config.json: .* the checkpoint sets \['dflash_config.attention_sink_bias'\]"),
    (dict(use_sliding_window=False), r"config.json: layer_types has sliding_attention layers but no window"),
])
def test_a_layout_that_cannot_be_honoured_is_refused_by_name(cache_dir, tmp_path, changes, message):
    write_zlab_folder(tmp_path / "z-lab", num_layers=5, **{**QWEN36_LAYOUT, **changes})
    with pytest.raises(ValueError, match=r"--init-from .*z-lab/" + message):
        warm(cache_dir, tmp_path / "run", tmp_path / "z-lab")
    assert not (tmp_path / "run").exists()


def test_layer_types_of_another_depth_than_the_sources_are_refused(cache_dir, tmp_path):
    write_zlab_folder(tmp_path / "z-lab", num_layers=5, **QWEN36_LAYOUT)
    with pytest.raises(ValueError, match=r"the source has 5 layers, --layer-types gives 2: give one type per layer"):
        warm(cache_dir, tmp_path / "run", tmp_path / "z-lab", layer_types=["sliding_attention", "full_attention"],
             sliding_window=8)


def test_a_run_from_scratch_takes_its_layer_types(cache_dir, tmp_path):
    warm(cache_dir, tmp_path / "run", None, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    c = step0(tmp_path / "run").config
    assert (c.num_hidden_layers, c.layer_types, c.sliding_window, c.is_causal) == (
        2, ["sliding_attention", "full_attention"], 6, None)


# -- onto a basis cache ---------------------------------------------------------------------


@pytest.mark.parametrize("rank", [96, 40])  # L*H = 96: full rank; 40: truncated
def test_the_unfolded_fc_is_within_the_stated_bound(cache_dir, rank):
    """||W x - fc' P^T D x|| <= ||W D^-1||_2 ||(I - P P^T) D x|| per token (shards/FORMAT.md)."""
    c = open_cache(cache_dir)
    x = np.concatenate([c[i].features.reshape(len(c[i].input_ids), -1) for i in range(4)]).astype(np.float32)
    moment = SecondMoment(x.shape[1], scale=np.linspace(0.5, 2.0, x.shape[1]))
    moment.add(x)
    basis = fit_basis(moment.matrix, moment.num_tokens, rank, scale=moment.scale)
    w = torch.randn(32, x.shape[1], generator=torch.Generator().manual_seed(0))  # [H, L*H]
    fc = unfold_basis(w, basis)  # [H, r]
    xt = torch.from_numpy(x)
    error = (xt @ w.T - torch.from_numpy(basis.encode(x)) @ fc.T).norm(dim=1)  # [T]
    scaled = xt * torch.from_numpy(basis.scale)
    p = torch.from_numpy(basis.projection)
    outside = (scaled - scaled @ p @ p.T).norm(dim=1)  # [T]
    bound = torch.linalg.matrix_norm(w / torch.from_numpy(basis.scale), ord=2) * outside
    reference = (xt @ w.T).norm(dim=1)
    assert bool((error <= bound + 1e-5 * reference).all())
    if rank == 96:
        assert float((error / reference).max()) < 1e-5
    else:
        assert float((error / reference).mean()) > 1e-3  # truncation shows, and stays within the bound


@pytest.mark.parametrize("rank", [96, 40])
def test_warm_start_onto_a_basis_cache(cache_dir, source, tmp_path, rank):
    """The step-0 drafter reads coefficients; folded back, its fc is the source's projected on
    the basis's span (the source's own at full rank), and at full rank it scores as the source
    on the raw cache up to bf16 rounding of the stored coefficients."""
    cache = basis_cache(tmp_path, rank)
    run = tmp_path / "run"
    warm(cache, run, source)
    start, exported = step0(run), load_exported(source)
    basis = open_cache(cache).load_feature_basis()
    assert start.config.feature_width == rank
    folded = fold_basis(start, basis).fc.weight.detach()
    p, d = torch.from_numpy(basis.projection), torch.from_numpy(basis.scale)
    w = exported.fc.weight.detach()
    torch.testing.assert_close(folded, ((w / d) @ p @ p.T) * d, rtol=1e-4, atol=1e-5)
    if rank == 96:
        torch.testing.assert_close(folded, w, rtol=1e-4, atol=1e-5)
        ours, theirs = offline(start, cache), offline(exported, cache_dir)
        assert ours["num_anchors"] == theirs["num_anchors"]
        # A near-tie may flip under bf16 coefficients instead of bf16 features: a few anchors.
        assert abs(ours["acceptance_length"] - theirs["acceptance_length"]) < 0.02


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value", "message"), [
    ("hidden_size", 48, r"hidden_size is 48 in the source, 32 for this run's target: the source was trained"),
    ("num_attention_heads", 8, r"num_attention_heads is 8 in the source, 4 for this run's target"),
    ("num_key_value_heads", 4, r"num_key_value_heads is 4 in the source, 2 for this run's target"),
    ("head_dim", 16, r"head_dim is 16 in the source, 8 for this run's target"),
    ("intermediate_size", 40, r"intermediate_size is 40 in the source, 64 for this run's target"),
    ("vocab_size", 80, r"vocab_size is 80 in the source, 64 for this run's target"),
    ("target_layer_ids", [0, 2, 3], r"target_layer_ids is \[0, 2, 3\] in the source, the cache's feature layers "
                                    r"are \[0, 2, 4\]: rebuild the cache with "
                                    r"dflash-precompute --feature-layers 0,2,3"),
    ("mask_token_id", 63, r"the source's mask_token_id 63 is a stop, pad, bos or unk token of this target: pass "
                          r"--mask-token-id"),
])
def test_an_incompatible_source_is_refused(cache_dir, tmp_path, field, value, message):
    source = write_source(cache_dir, tmp_path / "source", **{field: value})
    with pytest.raises(ValueError, match=message):
        warm(cache_dir, tmp_path / "run", source)
    assert not (tmp_path / "run").exists()


def test_num_layers_other_than_the_sources_is_refused(cache_dir, source, tmp_path):
    with pytest.raises(ValueError, match=r"num_hidden_layers is 2 in the source, --num-layers gives 1: drop "
                                         r"--num-layers \(the source's is used\) or pass --num-layers 2"):
        warm(cache_dir, tmp_path / "run", source, num_layers=1)


def test_mask_token_id_overrides_the_sources(cache_dir, tmp_path):
    source = write_source(cache_dir, tmp_path / "source", mask_token_id=63)  # the target's eos: refused alone
    warm(cache_dir, tmp_path / "run", source, mask_token_id=5)
    assert step0(tmp_path / "run").config.mask_token_id == 5


def test_a_folder_that_is_no_drafter_is_refused(cache_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"not a drafter folder \(config.json \+ model.safetensors\), a run folder"):
        warm(cache_dir, tmp_path / "run", tmp_path / "empty")


def test_norm_init_target_with_init_from_is_refused(cache_dir, source, tmp_path):
    with pytest.raises(ValueError, match="norm_init target and init_from exclude each other"):
        tiny_fit_config(cache_dir, tmp_path / "run", init_from=str(source), norm_init="target")


# -- resume ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_source(cache_dir, tmp_path_factory) -> Path:
    return write_source(cache_dir, tmp_path_factory.mktemp("other") / "draft", seed=4)


def interrupted(cache_dir: Path, run: Path, source: Path) -> dict:
    """A 3-step warm-started run, then its last checkpoint removed (as if it died after step 2);
    returns the final weights of the uninterrupted run."""
    warm(cache_dir, run, source, max_steps=3, checkpoint_every=1, save_initial=False)
    last = list_checkpoints(run)[-1]
    final = load_file(last / "model.safetensors")
    import shutil

    shutil.rmtree(last)
    return final


@pytest.mark.parametrize("again", ["same", "none"])
def test_a_warm_started_run_resumes_from_its_own_checkpoint(cache_dir, source, tmp_path, again):
    run = tmp_path / "run"
    final = interrupted(cache_dir, run, source)
    result = warm(cache_dir, run, source if again == "same" else None, max_steps=3, checkpoint_every=1,
                  save_initial=False)
    assert result.step == 3
    resumed = load_file(list_checkpoints(run)[-1] / "model.safetensors")
    assert all(torch.equal(resumed[k], final[k]) for k in final)  # step 3 from step 2, not from the source
    assert json.loads((run / "config.json").read_text())["init_from"] == str(source)
    assert read_run_info(run)["init_from"]["weights_sha256"] == file_sha256(source / "model.safetensors")


def test_resuming_with_another_source_is_refused(cache_dir, source, other_source, tmp_path):
    run = tmp_path / "run"
    interrupted(cache_dir, run, source)
    with pytest.raises(ValueError, match=rf"--init-from {other_source}: weights sha256 [0-9a-f]{{12}}, but "
                                         rf".*run.json records that the run started from {source} "
                                         r"\(sha256 [0-9a-f]{12}\): give that source, or train into a new --out"):
        warm(cache_dir, run, other_source, max_steps=3, checkpoint_every=1, save_initial=False)


def test_init_from_on_a_run_from_scratch_is_refused(cache_dir, source, tmp_path):
    run = tmp_path / "run"
    warm(cache_dir, run, None, num_layers=2, max_steps=2, checkpoint_every=1)
    with pytest.raises(ValueError, match=r"was started without --init-from \(from random weights\): resume it "
                                         r"without --init-from, or train into a new --out"):
        warm(cache_dir, run, source, max_steps=2, checkpoint_every=1)
