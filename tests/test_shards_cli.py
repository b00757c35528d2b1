"""`dflash-shards` on a synthetic cache: info, show, stats --plot, verify."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from dflash.shards import CacheSpec, open_cache
from dflash.shards.cli import main
from dflash.shards.synthetic import write_synthetic_cache

LENGTHS = [12, 40, 7, 25, 3]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    spec = CacheSpec(
        vocab_size=500, hidden_size=16, layer_ids=[1, 3], top_k=6, max_length=64, shard_max_rows=2,
        target={"name": "tiny", "model_type": "llama", "num_layers": 6, "dtype": "bfloat16"},
    )
    write_synthetic_cache(path, spec, LENGTHS, zipf=True)
    return path


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result.output


def test_info_json(cache_dir):
    info = json.loads(run("info", cache_dir, "--json"))
    assert {k: info[k] for k in ("format_version", "num_shards", "num_sequences", "num_tokens", "top_k",
                                 "feature_layers", "hidden_size", "vocab_size", "feature_codec")} == {
        "format_version": 1, "num_shards": 3, "num_sequences": 5, "num_tokens": sum(LENGTHS), "top_k": 6,
        "feature_layers": [1, 3], "hidden_size": 16, "vocab_size": 500, "feature_codec": "bf16"}
    assert info["target"]["name"] == "tiny"
    bpt = info["bytes_per_token"]
    assert bpt["features"] == 2 * 16 * 2  # L x H bf16
    assert bpt["topk"] == 13  # packed: 16 + 8 + 5 * 5 + 6 * ceil(log2 500) = 103 bits
    assert bpt["total"] > bpt["features"] + bpt["topk"]


def test_info_text(cache_dir):
    text = run("info", cache_dir)
    assert "5 in 3 shards" in text and "layers [1, 3] x hidden 16, bf16" in text


def test_show_positions_json(cache_dir):
    shown = json.loads(run("show", cache_dir, 1, "--positions", "2:5", "--top", "3", "--json"))
    cache = open_cache(cache_dir)
    seq = cache[1]
    assert [p["position"] for p in shown["positions"]] == [2, 3, 4]
    assert shown["source"] == cache.source(1) and shown["tokenizer"] is False
    first = shown["positions"][0]
    assert first["token_id"] == seq.input_ids[2] and first["next_token_id"] == seq.input_ids[3]
    assert [c["id"] for c in first["topk"]] == list(seq.topk_ids[2, :3])
    np.testing.assert_allclose([c["prob"] for c in first["topk"]], np.exp(seq.topk_logprobs[2, :3]), rtol=1e-6)
    assert first["tail_mass"] == pytest.approx(float(seq.tail_mass[2]))


def test_show_text_without_tokenizer(cache_dir):
    text = run("show", cache_dir, 0, "--positions", ":3")
    lines = text.splitlines()
    assert "ids shown" in lines[0] and len(lines) == 3 + 3


def test_show_decodes_with_the_cache_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {f"w{i}": i for i in range(500)}
    model = tokenizers.models.WordLevel(vocab, unk_token="w0")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model))
    spec = CacheSpec(vocab_size=500, hidden_size=8, layer_ids=[1], top_k=4, max_length=16)
    cache = write_synthetic_cache(tmp_path, spec, [6])
    fast.save_pretrained(tmp_path / "target")
    shown = json.loads(run("show", tmp_path, 0, "--json"))
    seq = cache[0]
    assert shown["tokenizer"] is True
    assert [p["token"] for p in shown["positions"]] == [f"w{i}" for i in seq.input_ids]
    assert "'w" in run("show", tmp_path, 0)


def test_show_out_of_range_row_fails_cleanly(cache_dir):
    result = CliRunner().invoke(main, ["show", str(cache_dir), "9"])
    assert result.exit_code == 1 and "sequence 9 out of range for a cache of 5" in result.output


def test_stats_json_and_plot(cache_dir, tmp_path):
    png = tmp_path / "stats.png"
    stats = json.loads(run("stats", cache_dir, "--plot", png, "--json"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sum(stats["length"]["histogram"]["counts"]) == len(LENGTHS)
    assert stats["length"]["max"] == max(LENGTHS) and stats["num_sampled_tokens"] == sum(LENGTHS)
    assert 0 < stats["topk_mass"]["mean"] <= 1 and 0 < stats["top1_prob"]["mean"] <= 1
    assert stats["entropy_nats"]["mean"] > 0
    assert "features" in stats["bytes_per_token"]["columns"]


def test_stats_text(cache_dir):
    text = run("stats", cache_dir)
    assert "top-k mass" in text and "entropy" in text and "top-1 prob" in text


def test_verify_ok_and_damaged(cache_dir, tmp_path):
    assert run("verify", cache_dir).startswith("ok: 3 shards, 5 sequences")
    assert json.loads(run("verify", cache_dir, "--json")) == {
        "ok": True, "problems": [], "num_shards": 3, "num_sequences": 5}
    damaged = tmp_path / "damaged"
    spec = CacheSpec(vocab_size=50, hidden_size=8, layer_ids=[1], top_k=4, max_length=16, shard_max_rows=1)
    write_synthetic_cache(damaged, spec, [5, 6])
    shard = damaged / "shards" / "rank00000-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:-7])
    report = json.loads(run("verify", damaged, "--json", code=1))
    assert report["ok"] is False
    assert {p["shard"] for p in report["problems"]} == {"shards/rank00000-00001.arrow"}
    assert "FAILED" in run("verify", damaged, code=1)


def test_missing_manifest_is_a_clean_error(tmp_path):
    result = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert result.exit_code == 1 and "manifest.json does not exist" in result.output
