"""Export to z-lab's DFlash draft format and back: config fields, parameter names, logits."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash.shards import CacheSpec
from dflash.shards.synthetic import write_synthetic_cache
from dflash.testing.builders import drafter_config
from dflash.train.export import export_run, hf_config, write_export
from dflash.train.loading import drafter_config_from_hf, load_drafter, load_exported
from dflash.train.model import BlockLayout, DFlashDrafter, DrafterConfig, DrafterContextCache

H, V, LAYERS = 32, 50, 3  # H: the hidden size of dflash.testing.builders.drafter_config


def make_config(**overrides) -> DrafterConfig:
    """Every field away from its default, so that a field lost on the way shows."""
    values = dict(num_hidden_layers=LAYERS, vocab_size=V, target_layer_ids=[1, 4, 7], num_target_layers=10,
                  num_drafts=7, mask_token_id=V - 2, rms_norm_eps=1e-5, rope_theta=50_000.0,
                  max_position_embeddings=2048, initializer_range=0.3)
    values.update(overrides)
    return drafter_config(**values)


@pytest.fixture
def drafter(seed) -> DFlashDrafter:
    model = DFlashDrafter(make_config(), attention="dense")
    with torch.no_grad():  # norms away from 1 so that a norm weight lost on the way shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model.eval()


def zlab_parameter_names(num_layers: int) -> set[str]:
    """The tensor names of z-lab's DFlashDraftModel for a given depth (from its module tree:
    fc, hidden_norm, norm, and per layer self_attn.{q,k,v,o}_proj, q_norm, k_norm,
    mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm)."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        prefix = f"layers.{i}."
        names |= {f"{prefix}self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                               "q_norm", "k_norm")}
        names |= {f"{prefix}mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        names |= {f"{prefix}input_layernorm.weight", f"{prefix}post_attention_layernorm.weight"}
    return names


def block_logits(model: DFlashDrafter, seed: int) -> torch.Tensor:
    """Inference-path hidden states of one block after 11 context positions: [1, B, H]."""
    g = torch.Generator().manual_seed(seed)
    cache = DrafterContextCache()
    model.append_context(cache, torch.randn(1, 11, 3 * H, generator=g))
    return model.forward_block(torch.randn(1, model.config.num_drafts + 1, H, generator=g), cache)


def train_forward(model: DFlashDrafter, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    B = model.config.num_drafts + 1
    layout = BlockLayout.build([(20, np.array([3, 9, 17]))], B)
    with torch.no_grad():
        return model(torch.randn(3 * B, H, generator=g), torch.randn(20, 3 * H, generator=g), layout)


def test_config_has_the_dflash_and_qwen3_fields(drafter, tmp_path):
    out = write_export(drafter, tmp_path / "draft", dtype=torch.float32,
                       token_ids={"eos_token_id": 2, "pad_token_id": None})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 8
    assert config["num_target_layers"] == 10
    assert config["dflash_config"] == {"target_layer_ids": [1, 4, 7], "mask_token_id": V - 2, "block_size": 8,
                                       "causal": False, "use_swa": False}
    expected = {"hidden_size": H, "intermediate_size": 48, "num_hidden_layers": LAYERS,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": V,
                "rms_norm_eps": 1e-5, "rope_theta": 50_000.0, "max_position_embeddings": 2048,
                "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
                "dtype": "float32", "eos_token_id": 2}
    assert {key: config[key] for key in expected} == expected
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 50_000.0}
    assert config["layer_types"] == ["full_attention"] * LAYERS
    assert "pad_token_id" not in config
    assert not (out / "README.md").exists()


def test_transformers_reads_the_config_as_qwen3(drafter, tmp_path):
    from transformers import AutoConfig

    out = write_export(drafter, tmp_path / "draft")
    config = AutoConfig.from_pretrained(out)
    assert type(config).__name__ == "Qwen3Config"
    assert (config.hidden_size, config.head_dim, config.num_key_value_heads) == (H, 8, 2)
    assert config.rope_parameters["rope_theta"] == 50_000.0
    assert config.dflash_config["target_layer_ids"] == [1, 4, 7]
    assert config.block_size == 8  # the drafter rows of a block of 7 drafts


def test_weights_carry_zlab_names_and_no_embedding(drafter, tmp_path):
    out = write_export(drafter, tmp_path / "draft")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("fc.weight").shape == (H, 3 * H)
    assert names == zlab_parameter_names(LAYERS)


@pytest.mark.parametrize("forward", [block_logits, train_forward])
def test_round_trip_gives_identical_outputs(drafter, tmp_path, forward):
    out = write_export(drafter, tmp_path / "draft", dtype=torch.float32)
    reloaded = load_exported(out).eval()
    assert reloaded.config == drafter.config
    torch.testing.assert_close(forward(reloaded, 5), forward(drafter, 5), rtol=0, atol=0)


def test_bfloat16_export_is_close(drafter, tmp_path):
    out = write_export(drafter, tmp_path / "draft")  # bfloat16 by default: what engines serve
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("layers.0.mlp.up_proj.weight").dtype == torch.bfloat16
    reloaded = load_exported(out).eval()
    # bf16 weights keep 8 bits of mantissa: outputs of these O(1) activations agree to ~1e-2.
    torch.testing.assert_close(block_logits(reloaded, 6), block_logits(drafter, 6), rtol=0.05, atol=0.05)


def test_existing_folder_is_refused(drafter, tmp_path):
    (tmp_path / "draft").mkdir()
    with pytest.raises(ValueError, match="already exists"):
        write_export(drafter, tmp_path / "draft")


def test_a_failed_weights_write_names_the_file_and_leaves_nothing(drafter, tmp_path, monkeypatch):
    import safetensors.torch

    def full_disk(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError, match=r"\.draft\.tmp/model\.safetensors: cannot write the drafter's weights: "
                                      r".*No space left on device"):
        write_export(drafter, tmp_path / "draft")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_zlab_style_config_is_read(tmp_path):
    """A config as z-lab publishes it (rope_theta top level, block_size top level, no
    rope_parameters) loads into the same DrafterConfig."""
    data = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
            "num_target_layers": 36, "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
            "vocab_size": 151936, "max_position_embeddings": 40960}
    config = drafter_config_from_hf(data, "config.json")
    assert (config.num_drafts, config.mask_token_id, config.rope_theta) == (15, 151669, 1e6)
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert drafter_config_from_hf(hf_config(config, dtype="bfloat16"), "x") == config


@pytest.mark.parametrize("change, field", [
    ({"layer_types": ["sliding_attention"] * 5}, "layer_types"),
    ({"attention_bias": True}, "attention_bias"),
    ({"dflash_config": {"target_layer_ids": [1], "mask_token_id": 3, "attention_sink_bias": True}},
     "attention_sink_bias"),
    ({"architectures": ["DFlash3DraftModel"]}, "architectures"),
    ({"architectures": ["DFlash2DraftModel"]}, "conv_kernel_size"),
])
def test_unsupported_checkpoints_are_refused(change, field):
    data = hf_config(make_config(num_hidden_layers=5), dtype="float32")
    data.update(change)
    with pytest.raises(ValueError, match=field):
        drafter_config_from_hf(data, "config.json")


def fake_run(tmp_path, drafter: DFlashDrafter, *, with_eval: bool):
    """A run folder as dflash-train fit leaves it, with one synthetic cache."""
    spec = CacheSpec(vocab_size=V, hidden_size=H, layer_ids=[1, 4, 7], top_k=4, max_length=64,
                     target={"name": "tiny-target"})
    write_synthetic_cache(tmp_path / "cache", spec, [20, 30])
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-00000042"
    step.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"cache": [str(tmp_path / "cache")], "seed": 3, "lr": 6e-4}))
    (run / "drafter_config.json").write_text(json.dumps(drafter.config.to_dict()))
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(step / "model.safetensors"))
    (step / "state.json").write_text(json.dumps({"version": 1, "step": 42}))
    if with_eval:
        (run / "eval").mkdir()
        (run / "eval" / "step-00000042.json").write_text(json.dumps({
            "acceptance_length": 3.25, "num_anchors": 100, "num_sequences": 2, "block_size": 8,
            "replay_acceptance_length": 3.5, "num_replay_verifications": 10,
            "online": {"acceptance_length": 3.4, "num_prompts": 20, "lossless": True,
                       "tokens_per_s": 50.0, "baseline_tokens_per_s": 30.0, "device": "cpu"}}))
    return run


@pytest.mark.parametrize("with_eval", [True, False])
def test_export_run_writes_card_and_reloads(drafter, tmp_path, with_eval):
    run = fake_run(tmp_path, drafter, with_eval=with_eval)
    out = export_run(run, tmp_path / "export", dtype="float32")
    card = (out / "README.md").read_text()
    assert "tiny-target" in card and '"seed": 3' in card and "step 42" in card
    if with_eval:
        assert "| 3.250 |" in card and "| 3.400 |" in card and "lossless: True" in card
    else:
        assert "Not measured" in card
    torch.testing.assert_close(block_logits(load_exported(out), 7), block_logits(drafter, 7), rtol=0, atol=0)
    loaded = load_drafter(run)
    assert loaded.step == 42 and loaded.checkpoint.name == "step-00000042"


def test_load_drafter_explains_a_missing_run(tmp_path):
    with pytest.raises(ValueError, match="dflash-train fit"):
        load_drafter(tmp_path / "nowhere")
