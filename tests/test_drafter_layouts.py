"""Attention layouts in exported drafter configs: written as z-lab's reference and vLLM's DFlash
loader read them (layer_types, sliding_window, use_sliding_window, is_causal), read back by
load_exported, and the layouts of drafters users bring (built here by hand) read or refused
by name."""

import json

import numpy as np
import pytest
import torch

from dflash.testing.builders import drafter_config
from dflash.train.export import hf_config, write_export
from dflash.train.loading import drafter_config_from_hf, load_exported
from dflash.train.model import BlockLayout, DFlashDrafter, DrafterConfig, DrafterContextCache

H = 32
MIXED = ["sliding_attention", "sliding_attention", "full_attention"]


def make_config(**overrides) -> DrafterConfig:
    values = dict(num_hidden_layers=3, vocab_size=50, target_layer_ids=[1, 4, 7], num_target_layers=10,
                  num_drafts=3, mask_token_id=48, rope_theta=50_000.0)
    values.update(overrides)
    return drafter_config(**values)


def outputs(model: DFlashDrafter) -> tuple[torch.Tensor, torch.Tensor]:
    """(training forward, inference block) on fixed inputs longer than the tests' windows."""
    g = torch.Generator().manual_seed(5)
    layout = BlockLayout.build([(20, np.array([3, 9, 17]))], 4)
    with torch.no_grad():
        train = model(torch.randn(12, H, generator=g), torch.randn(20, 3 * H, generator=g), layout)
    cache = DrafterContextCache()
    model.append_context(cache, torch.randn(1, 13, 3 * H, generator=g))
    return train, model.forward_block(torch.randn(1, 4, H, generator=g), cache)


# -- export ---------------------------------------------------------------------------------


def test_a_sliding_export_writes_the_layout_as_the_loaders_read_it(tmp_path):
    model = DFlashDrafter(make_config(layer_types=MIXED, sliding_window=6)).eval()
    out = write_export(model, tmp_path / "draft", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert (config["layer_types"], config["sliding_window"], config["use_sliding_window"]) == (MIXED, 6, True)
    # No causal field anywhere: vLLM and z-lab's reference then apply the layer rule
    # (sliding causal, full bidirectional), which is this drafter's.
    assert "is_causal" not in config and "causal" not in config["dflash_config"]
    assert config["dflash_config"]["use_swa"] is False
    reloaded = load_exported(out).eval()
    assert reloaded.config == model.config
    for ours, theirs in zip(outputs(reloaded), outputs(model), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_transformers_keeps_the_window(tmp_path):
    """transformers' Qwen3Config drops sliding_window unless use_sliding_window is true."""
    from transformers import AutoConfig

    out = write_export(DFlashDrafter(make_config(layer_types=MIXED, sliding_window=6)), tmp_path / "draft")
    config = AutoConfig.from_pretrained(out)
    assert (config.sliding_window, config.layer_types) == (6, MIXED)


@pytest.mark.parametrize("is_causal", [True, False])
def test_an_explicit_is_causal_is_written_for_both_readers(tmp_path, is_causal):
    model = DFlashDrafter(make_config(layer_types=MIXED, sliding_window=6, is_causal=is_causal)).eval()
    out = write_export(model, tmp_path / "draft", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert (config["is_causal"], config["dflash_config"]["causal"]) == (is_causal, is_causal)
    assert load_exported(out).config == model.config


def test_a_full_export_is_written_as_before():
    config = hf_config(make_config(), dtype="float32")
    assert config["layer_types"] == ["full_attention"] * 3
    assert (config["use_sliding_window"], config["sliding_window"]) == (False, None)
    assert config["dflash_config"]["causal"] is False and "is_causal" not in config


def test_the_model_card_states_the_layout():
    from dflash.train import drafters
    from dflash.train.export import _attention_sentence

    _serving_lines = drafters.get(drafters.DEFAULT).serving_lines

    assert _attention_sentence(make_config()) == ""
    assert _attention_sentence(make_config(layer_types=MIXED, sliding_window=6)) == (
        " Attention by layer: sliding window 6, causal; sliding window 6, causal; full, bidirectional inside the "
        "block.")
    v2 = "set `VLLM_USE_V2_MODEL_RUNNER=1`"
    assert any(v2 in line for line in _serving_lines(make_config(layer_types=MIXED, sliding_window=6), None))
    only_sliding = make_config(layer_types=["sliding_attention"] * 3, sliding_window=6)
    assert not any(v2 in line for line in _serving_lines(only_sliding, None) + _serving_lines(make_config(), None))


# -- layouts users bring, built by hand -----------------------------------------------------


def zlab_config(num_layers: int = 5, **changes) -> dict:
    """A config.json in z-lab's layout (tiny shapes); `changes` updates it, a None value deletes."""
    data = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
            "num_target_layers": 12, "dflash_config": {"mask_token_id": 48, "target_layer_ids": [1, 4, 7]},
            "hidden_size": H, "intermediate_size": 48, "num_hidden_layers": num_layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10_000_000,
            "vocab_size": 50, "max_position_embeddings": 262144, "attention_bias": False, "hidden_act": "silu"}
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return data


QWEN36_LAYOUT = dict(layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048,
                     use_sliding_window=True)


def test_z_labs_qwen3_6_27b_layout_is_read():
    """z-lab's Qwen3.6-27B drafter: 4 sliding_attention + 1 full_attention, window 2048, no
    is_causal: the sliding layers causal, the full one bidirectional."""
    config = drafter_config_from_hf(zlab_config(**QWEN36_LAYOUT), "config.json")
    assert [config.layer_attention(i) for i in range(5)] == [(2048, True)] * 4 + [(None, False)]
    assert drafter_config_from_hf(hf_config(config, dtype="bfloat16"), "x") == config


@pytest.mark.parametrize("changes,expected", [
    # vLLM: top-level is_causal first, then dflash_config.causal, then the layer rule.
    (dict(is_causal=False), [(2048, False)] * 4 + [(None, False)]),
    (dict(is_causal=True), [(2048, True)] * 4 + [(None, True)]),
    (dict(dflash_config={"mask_token_id": 48, "target_layer_ids": [1, 4, 7], "causal": False}),
     [(2048, False)] * 4 + [(None, False)]),
    (dict(is_causal=True, dflash_config={"mask_token_id": 48, "target_layer_ids": [1, 4, 7], "causal": False}),
     [(2048, True)] * 4 + [(None, True)]),
    # dflash_config.swa_window_size wins over the top-level window (vLLM).
    (dict(dflash_config={"mask_token_id": 48, "target_layer_ids": [1, 4, 7], "swa_window_size": 512}),
     [(512, True)] * 4 + [(None, False)]),
])
def test_causality_and_window_follow_vllms_precedence(changes, expected):
    config = drafter_config_from_hf(zlab_config(**{**QWEN36_LAYOUT, **changes}), "config.json")
    assert [config.layer_attention(i) for i in range(5)] == expected


def test_use_swa_without_layer_types_slides_every_layer():
    """MiMo's style (vLLM's table): dflash_config.use_swa and causal false, no layer_types:
    every layer sliding and bidirectional."""
    data = zlab_config(layer_types=None, sliding_window=64, use_sliding_window=True,
                       dflash_config={"mask_token_id": 48, "target_layer_ids": [1, 4, 7], "use_swa": True,
                                      "causal": False})
    config = drafter_config_from_hf(data, "config.json")
    assert [config.layer_attention(i) for i in range(5)] == [(64, False)] * 5


DFLASH2 = {"mask_token_id": 48, "target_layer_ids": [1, 4, 7], "conv_kernel_size": 2, "conv_group_size": 16,
           "selector_rank": 256, "selector_top_k": 16}


@pytest.mark.parametrize("changes,message", [
    (dict(dflash_config={**DFLASH2, "selector_rank": None, "selector_top_k": None}),  # under DFlash's architecture
     r"sets \['dflash_config.conv_kernel_size', 'dflash_config.conv_group_size'\], DFlash2's fields, under "
     r"architectures \['DFlashDraftModel'\]: a DFlash2 drafter's architectures is \['DFlash2DraftModel'\]"),
    (dict(architectures=["DFlash2DraftModel"]),
     r"a DFlash2 drafter's config needs \['dflash_config.conv_kernel_size', 'dflash_config.conv_group_size', "
     r"'dflash_config.selector_rank', 'dflash_config.selector_top_k'\] \(vLLM's loader reads them\)"),
    (dict(architectures=["DFlash2DraftModel"], dflash_config=DFLASH2, draft_vocab_size=24),
     r"draft_vocab_size 24: a DFlash2 drafter scores the whole vocabulary"),
    (dict(architectures=["DFlashDraftModel2"]),
     r"architectures is \['DFlashDraftModel2'\], not \['DFlashDraftModel'\] or \['Qwen3DSparkModel'\] or "
     r"\['DFlash2DraftModel'\]"),
    (dict(dflash_config={"mask_token_id": 48, "target_layer_ids": [1, 4, 7], "attention_sink_bias": True}),
     r"the checkpoint sets \['dflash_config.attention_sink_bias'\]"),
    (dict(add_swa_attention_sink_bias=True), r"\['dflash_config.attention_sink_bias'\]"),
    (dict(dflash_config={"mask_token_id": 48, "target_layer_ids": [1, 4, 7], "attention_value_scale": 0.5}),
     r"\['dflash_config.attention_value_scale'\]"),
    (dict(dflash_config={"mask_token_id": 48, "target_layer_ids": [1, 4, 7], "input_embedding_scale": 2.0}),
     r"\['dflash_config.input_embedding_scale'\]"),
    (dict(output_multiplier=0.5, final_logit_softcapping=30.0),
     r"\['dflash_config.output_multiplier', 'dflash_config.final_logit_softcapping'\]"),
    (dict(dflash_config={"mask_token_id": 48, "target_layer_ids": [1, 4, 7], "sample_from_anchor": True}),
     r"\['dflash_config.sample_from_anchor'\]"),
    (dict(is_neox_style=False), r"\['is_neox_style'\]"),
    (dict(target_hidden_size=64), r"\['target_hidden_size'\]"),
    (dict(use_sliding_window=False), r"layer_types has sliding_attention layers but no window: set sliding_window "
                                     r"with use_sliding_window true"),
    (dict(use_sliding_window=None), r"layer_types has sliding_attention layers but no window"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention", "full_attention",
                       "full_attention"]),
     r"layer_types .* is not one of 'full_attention' or 'sliding_attention' per layer \(5 layers\)"),
    (dict(layer_types=["sliding_attention"] * 3), r"per layer \(5 layers\)"),
])
def test_what_cannot_be_honoured_is_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        drafter_config_from_hf(zlab_config(**{**QWEN36_LAYOUT, **changes}), "config.json")


# -- vLLM's own reading ---------------------------------------------------------------------

RESOLVE = """
import json, sys
from unittest import mock
from transformers import Qwen3Config
import vllm.model_executor.models.qwen3_dflash as q
out = {}
for path in sys.argv[1:]:
    cfg = Qwen3Config(**json.load(open(path)))
    # Mixed layouts need the V2 runner (vLLM refuses them under V1): resolve as it would.
    with mock.patch.object(q, "get_current_vllm_config", lambda: mock.Mock(use_v2_model_runner=True)):
        out[path] = [list(q._resolve_layer_attention(cfg, i)) for i in range(cfg.num_hidden_layers)]
print(json.dumps(out))
"""

LAYOUTS = {"full": {}, "mixed": dict(layer_types=MIXED, sliding_window=6),
           "mixed-bidirectional": dict(layer_types=MIXED, sliding_window=6, is_causal=False),
           "sliding-causal": dict(layer_types=["sliding_attention"] * 3, sliding_window=6, is_causal=True),
           "full-causal": dict(is_causal=True)}


@pytest.mark.engine
@pytest.mark.e2e
def test_vllms_loader_reads_each_exported_layout_as_the_drafter_computes_it(tmp_path, engine_venv):
    """vLLM's `_resolve_layer_attention` (its DFlash loader, imported, no engine started) gives
    every layer of each export the (window, causal) the drafter trained with."""
    import subprocess

    paths = {}
    for name, layout in LAYOUTS.items():
        config = hf_config(make_config(**layout), dtype="float32")
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(config))
    script = tmp_path / "resolve.py"
    script.write_text(RESOLVE)
    done = subprocess.run([str(engine_venv / "bin" / "python"), str(script), *map(str, paths.values())],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    resolved = json.loads(done.stdout.strip().splitlines()[-1])
    for name, layout in LAYOUTS.items():
        c = make_config(**layout)
        assert resolved[str(paths[name])] == [list(c.layer_attention(i)) for i in range(3)], name
