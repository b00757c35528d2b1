"""The drafter's start: `fit --norm-init target` (the final norm starts as the target's, which
stage one stores in CACHE/target/head.safetensors as the per-channel scale the target's norm
applies), `--norm-init flat`, `--out-init zero`; and `--feature-noise`'s draws."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.precompute.target import final_norm_scale
from dflash.testing.builders import tiny_fit_config
from dflash.train.checkpoint import list_checkpoints
from dflash.train.fit import fit
from dflash.train.model import TargetHead
from dflash.train.synthetic import write_synthetic_training_cache


def tiny(kind: str):
    from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = (GemmaForCausalLM(GemmaConfig(**common)) if kind == "gemma"
             else LlamaForCausalLM(LlamaConfig(**common)))
    with torch.no_grad():
        model.base_model.norm.weight.normal_(0.5, 0.3)
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_the_stored_scale_is_what_the_targets_norm_multiplies_by(kind):
    model = tiny(kind)
    weight = model.base_model.norm.weight.detach()
    expected = weight + 1 if kind == "gemma" else weight  # Gemma's norm scales by 1 + weight
    scale = final_norm_scale(model, 32)
    torch.testing.assert_close(scale, expected.float(), rtol=1e-6, atol=1e-6)
    # and the norm of any input is the RMS-normalised input times that scale
    x = torch.randn(3, 32)
    eps = model.config.rms_norm_eps
    normalised = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(model.base_model.norm(x), normalised * scale, rtol=1e-5, atol=1e-5)


def test_a_model_without_an_rms_norm_stores_none():
    model = tiny("llama")
    model.base_model.norm = torch.nn.LayerNorm(32)
    assert final_norm_scale(model, 32) is None


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache") / "cache"
    write_synthetic_training_cache(path, lengths=[40, 56, 33, 71, 48, 64, 29, 52], seed=1)
    return path


def initial_norm(cache_dir: Path, out: Path, **overrides) -> torch.Tensor:
    fit(tiny_fit_config(cache_dir, out, anchors_per_seq=6, max_steps=1, checkpoint_every=100, save_initial=True,
                        **overrides))
    return load_file(list_checkpoints(out)[0] / "model.safetensors")["norm.weight"]


@pytest.mark.e2e  # a fit
def test_norm_init_target_starts_from_the_targets_norm(cache_dir, tmp_path):
    target_norm = load_file(cache_dir / "target" / "head.safetensors")["norm.weight"]
    assert not torch.allclose(target_norm, torch.ones_like(target_norm))
    assert torch.equal(initial_norm(cache_dir, tmp_path / "target", norm_init="target"), target_norm)
    assert torch.equal(initial_norm(cache_dir, tmp_path / "ones"), torch.ones_like(target_norm))  # the default
    assert torch.equal(TargetHead.load(cache_dir / "target").final_norm, target_norm)


def test_norm_init_target_on_a_cache_without_the_norm_is_a_clear_error(tmp_path):
    path = tmp_path / "cache"
    write_synthetic_training_cache(path, lengths=[40, 56, 33, 71], seed=1)
    head = path / "target" / "head.safetensors"
    tensors = load_file(head)
    del tensors["norm.weight"]  # as a cache written before stage one stored the norm
    save_file(tensors, head)
    assert TargetHead.load(path / "target").final_norm is None
    with pytest.raises(ValueError, match=r"head\.safetensors holds no norm\.weight .*--norm-init ones"):
        initial_norm(path, tmp_path / "run", norm_init="target")


def initial_state(cache_dir: Path, out: Path, **overrides) -> dict[str, torch.Tensor]:
    fit(tiny_fit_config(cache_dir, out, anchors_per_seq=6, max_steps=1, checkpoint_every=100, save_initial=True,
                        **overrides))
    return load_file(list_checkpoints(out)[0] / "model.safetensors")


@pytest.mark.e2e  # fits
def test_flat_norm_and_zero_out_start_as_documented(cache_dir, tmp_path):
    normal = initial_state(cache_dir, tmp_path / "normal")
    flat = initial_state(cache_dir, tmp_path / "flat", norm_init="flat", out_init="zero")
    hidden = normal["norm.weight"].shape[0]
    assert torch.equal(flat["norm.weight"], torch.full((hidden,), hidden ** -0.5))
    zeroed = [name for name in flat if name.endswith(("o_proj.weight", "down_proj.weight"))]
    assert len(zeroed) == 2 * sum(1 for name in flat if name.endswith("q_proj.weight")) > 0
    for name, tensor in flat.items():
        if name in zeroed:
            assert not tensor.any() and normal[name].std() > 0.01, name
        elif name != "norm.weight":  # every other weight is drawn as without the options (same seed)
            assert torch.equal(tensor, normal[name]), name


def test_feature_noise_is_bounded_and_drawn_from_seed_and_step():
    from dflash.train.fit import feature_noise

    x = torch.randn(50, 16, dtype=torch.bfloat16)
    a = feature_noise(x, 0.05, seed=3, rank=0, step=7)
    assert a.dtype == x.dtype and a.shape == x.shape
    delta = a.float() - x.float()
    assert delta.abs().max() <= 0.05 + 0.02 * x.float().abs().max()  # bf16 rounding of x + noise
    assert torch.equal(a, feature_noise(x, 0.05, seed=3, rank=0, step=7))  # a resume redraws the same
    assert not torch.equal(a, feature_noise(x, 0.05, seed=3, rank=0, step=8))
    assert not torch.equal(a, feature_noise(x, 0.05, seed=3, rank=1, step=7))  # each rank its own draw
    noise = feature_noise(torch.zeros(4000), 0.2, seed=0, rank=0, step=0)
    assert noise.abs().max() <= 0.2 and 0.18 < noise.abs().max() and abs(float(noise.mean())) < 0.01


@pytest.mark.parametrize("option", [{"norm_init": "flat"}, {"out_init": "zero"}])
def test_init_options_and_init_from_exclude_each_other(cache_dir, tmp_path, option):
    with pytest.raises(ValueError, match="and init_from exclude each other"):
        tiny_fit_config(cache_dir, tmp_path / "run", init_from=str(tmp_path), **option)


@pytest.mark.e2e  # fits
def test_feature_noise_changes_training_and_a_rerun_repeats_it(cache_dir, tmp_path):
    def losses(out: Path, **overrides) -> list[float]:
        fit(tiny_fit_config(cache_dir, out, anchors_per_seq=6, max_steps=3, checkpoint_every=100, **overrides))
        import json

        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    clean = losses(tmp_path / "clean")
    noisy = losses(tmp_path / "noisy", feature_noise=0.5)
    assert noisy[0] != clean[0]  # the first step already sees the noise
    assert losses(tmp_path / "again", feature_noise=0.5) == noisy  # drawn from (seed, step)
