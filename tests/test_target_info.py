"""TargetInfo: CACHE/target/target.json round-trips, and damaged or foreign files are refused
with a ValueError naming the file and the field."""

import json
import re

import pytest
import torch

from dflash.shards import TARGET_INFO_VERSION, TargetInfo
from dflash.train.mask_token import choose_mask_token_id
from dflash.train.model import DrafterConfig
from dflash.train.synthetic import write_synthetic_target

# What stage one wrote before target.json had a version (and before it had dtype).
V1_FILE = {
    "layer_ids": [1, 3], "num_layers": 4, "hidden_size": 32, "vocab_size": 50,
    "tie_word_embeddings": True, "model_type": "llama", "mask_token_id": None, "pad_token_id": 0,
    "eos_token_id": [2, 7], "bos_token_id": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000,
}
REQUIRED = ["layer_ids", "num_layers", "hidden_size", "vocab_size", "tie_word_embeddings", "model_type"]


def _write(target_dir, data):
    target_dir.mkdir(parents=True, exist_ok=True)
    (target_dir / "target.json").write_text(json.dumps(data))
    return target_dir / "target.json"


@pytest.mark.parametrize("fields", [
    {},
    {"mask_token_id": 49, "eos_token_id": 2, "dtype": "bfloat16", "rope_theta": 1e6},
    {"pad_token_id": None, "eos_token_id": None, "bos_token_id": None, "rms_norm_eps": None,
     "rope_theta": None, "dtype": None},
])
def test_round_trip(tmp_path, fields):
    info = TargetInfo(**{**V1_FILE, **fields})
    path = info.save(tmp_path)
    assert path == tmp_path / "target.json"
    assert TargetInfo.load(tmp_path) == info
    # The keys stage one always wrote, plus version; the values as given (10000 stays an int).
    assert json.loads(path.read_text()) == {"version": TARGET_INFO_VERSION, "dtype": None, "fingerprint": None,
                                            **V1_FILE, **fields}
    assert [p.name for p in tmp_path.iterdir()] == ["target.json"]


@pytest.mark.parametrize("drop_dtype", [False, True])
def test_a_v1_file_without_version_loads_as_version_1(tmp_path, drop_dtype):
    data = dict(V1_FILE) if drop_dtype else {**V1_FILE, "dtype": "float32"}
    _write(tmp_path, data)
    info = TargetInfo.load(tmp_path)
    assert info.version == 1
    assert info.eos_token_id == [2, 7] and info.rope_theta == 10000 and info.layer_ids == [1, 3]
    assert info.dtype == (None if drop_dtype else "float32")


@pytest.mark.parametrize("version", [0, 2, "1", None, 1.0, True])
@pytest.mark.parametrize("other_fields", [{}, {"head_dim": 8}])
def test_an_unknown_version_is_refused(tmp_path, version, other_fields):
    path = _write(tmp_path, {**V1_FILE, **other_fields, "version": version})
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: TargetInfo\.version is "
                                         rf"{re.escape(repr(version))}; this dflash reads version\(s\) 1"):
        TargetInfo.load(tmp_path)


@pytest.mark.parametrize("field", REQUIRED)
def test_a_missing_field_is_named(tmp_path, field):
    path = _write(tmp_path, {k: v for k, v in V1_FILE.items() if k != field})
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: target info field\(s\) '{field}' missing"):
        TargetInfo.load(tmp_path)


@pytest.mark.parametrize("field,value", [
    ("layer_ids", []), ("layer_ids", [1, "3"]), ("layer_ids", [-1]), ("layer_ids", 3),
    ("num_layers", 0), ("hidden_size", 32.0), ("vocab_size", "50"), ("vocab_size", True),
    ("tie_word_embeddings", 1), ("model_type", None), ("mask_token_id", 1.5),
    ("pad_token_id", "0"), ("bos_token_id", False), ("eos_token_id", [2, None]), ("eos_token_id", "2"),
    ("rms_norm_eps", "1e-5"), ("rope_theta", False), ("dtype", 16), ("fingerprint", 7),
])
def test_a_mistyped_field_is_named(tmp_path, field, value):
    path = _write(tmp_path, {**V1_FILE, field: value})
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: TargetInfo\.{field} must be"):
        TargetInfo.load(tmp_path)


@pytest.mark.parametrize("content,message", [
    (None, "target.json is missing: is this a complete dflash cache's target/ folder"),
    ("{", "target.json is not valid JSON"),
    ("[1, 2]", "target.json: target info must be a JSON object, got list"),
    (json.dumps({**V1_FILE, "head_dim": 8}), r"target.json: target info has fields this dflash does not "
                                             r"know: \['head_dim'\]"),
])
def test_an_unreadable_file_is_named(tmp_path, content, message):
    if content is not None:
        (tmp_path / "target.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        TargetInfo.load(tmp_path)


@pytest.mark.parametrize("fields,expected", [
    ({"mask_token_id": 49}, 49), ({}, 49), ({"mask_token_id": 2}, 49),
    ({"eos_token_id": [49, 2], "pad_token_id": 48}, 47),
])
def test_the_mask_token_follows_target_json(fields, expected):
    """Without tokenizer files: target.json's mask token unless it is a stop, pad or bos token,
    else the highest row that is none of them (tests/test_mask_token.py has the full rule)."""
    assert choose_mask_token_id(TargetInfo(**{**V1_FILE, **fields})) == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_synthetic_target_writes_a_complete_target_json(tmp_path, dtype):
    write_synthetic_target(tmp_path / "target", vocab_size=64, hidden_size=32, num_layers=6,
                           layer_ids=[0, 2, 4], num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, intermediate_size=64, dtype=dtype)
    info = TargetInfo.load(tmp_path / "target")
    assert info.dtype == str(dtype).removeprefix("torch.") and info.eos_token_id == 63
    config = DrafterConfig.from_target(tmp_path / "target", num_hidden_layers=1, num_drafts=3)
    assert (config.target_layer_ids, config.num_target_layers, config.mask_token_id) == ([0, 2, 4], 6, 62)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
