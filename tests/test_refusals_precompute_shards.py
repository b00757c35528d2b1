"""What `dflash-precompute` and `dflash-shards` refuse or report: the fingerprint stage one
records, empty results, flags without effect, one-line errors, `-h`/`--version`, and the small
ones (info's size, the histogram's last bin, stats' arguments, verify's advice, the model card)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash.common.commands import dflash_version
from dflash.common.fingerprint import target_fingerprint
from dflash.precompute.cli import main as precompute_main
from dflash.precompute.run import run_precompute
from dflash.shards import CacheSpec, open_cache
from dflash.shards.cli import main as shards_main
from dflash.shards.synthetic import write_synthetic_cache
from dflash.shards.target_info import TargetInfo
from dflash.testing.builders import RECORDS, build_target, precompute_config, write_jsonl
from dflash.train.cli import main as train_main


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_target("qwen3", tmp_path_factory.mktemp("target") / "qwen3")


def first_line(output: str) -> str:
    return output.strip().splitlines()[0] if output.strip() else ""


# --------------------------------------------------------------------------- 2. the recorded fingerprint


def test_stage_one_records_the_targets_fingerprint(target, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", RECORDS[:2])
    run_precompute(precompute_config(target, data, tmp_path / "cache"))
    expected = target_fingerprint(target)
    assert expected is not None
    assert TargetInfo.load(tmp_path / "cache" / "target").fingerprint == expected
    assert open_cache(tmp_path / "cache").spec.target["fingerprint"] == expected


# --------------------------------------------------------------------------- 3. empty results


@pytest.mark.parametrize("records, match", [
    ([], "no record was read from --data"),
    (["{broken", {"nothing": 1}], r"no sequence was written: 2 records read .* all rejected.*rejected.jsonl"),
])
def test_an_empty_result_is_an_error(target, tmp_path, records, match):
    data = write_jsonl(tmp_path / "in.jsonl", records)
    with pytest.raises(ValueError, match=match):
        run_precompute(precompute_config(target, data, tmp_path / "cache"))
    # ... and the cache left behind does not pass verify.
    result = CliRunner().invoke(shards_main, ["verify", str(tmp_path / "cache")])
    assert result.exit_code == 1 and "holds no sequence" in result.output


def test_precompute_cli_empty_input_is_one_line_and_ignored_flags_warn(target, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [])
    result = CliRunner().invoke(precompute_main, [
        "--target", str(target), "--data", str(data), "--out", str(tmp_path / "cache"), "--device", "cpu",
        "--num-feature-layers", "3", "--temperature", "0.7", "--no-progress"])
    assert result.exit_code == 1
    assert "--temperature has no effect without --regenerate" in result.stderr
    assert "Error: no record was read" in result.stderr and "Traceback" not in result.stderr


# --------------------------------------------------------------------------- 8/9. every command


def test_help_and_version_everywhere():
    runner = CliRunner()
    for main, args in ((train_main, []), (train_main, ["fit"]), (train_main, ["eval"]), (train_main, ["export"]),
                       (shards_main, []), (shards_main, ["stats"]), (precompute_main, [])):
        result = runner.invoke(main, [*args, "-h"])
        assert result.exit_code == 0 and "Usage:" in result.output, (args, result.output)
    for main in (train_main, shards_main, precompute_main):
        result = runner.invoke(main, ["--version"])
        assert result.exit_code == 0 and result.output.strip() == f"dflash {dflash_version()}"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache") / "cache"
    spec = CacheSpec(vocab_size=500, hidden_size=16, layer_ids=[1, 3], top_k=6, max_length=64, shard_max_rows=2)
    write_synthetic_cache(path, spec, [12, 40, 7, 25, 3], zipf=True)
    return path


@pytest.mark.parametrize("args, needle", [
    (["stats", "{cache}", "--plot", "{tmp}/missing_dir/x.png"], "missing_dir does not exist"),
    (["stats", "{cache}", "--max-sequences", "-3"], "--max-sequences"),
    (["stats", "{cache}", "--max-sequences", "0"], "--max-sequences"),
])
def test_stats_argument_errors_are_clean(cache_dir, tmp_path, args, needle):
    args = [a.format(cache=cache_dir, tmp=tmp_path) for a in args]
    result = CliRunner().invoke(shards_main, args)
    assert result.exit_code in (1, 2) and needle in result.output and "Traceback" not in result.output
    assert not result.exception or isinstance(result.exception, SystemExit)


def test_info_size_counts_target_and_histogram_closes_its_last_bin(cache_dir, tmp_path):
    import shutil

    cache = shutil.copytree(cache_dir, tmp_path / "cache")
    (cache / "target").mkdir(exist_ok=True)
    (cache / "target" / "head.safetensors").write_bytes(b"\0" * 3 * 2**20)
    info = json.loads(CliRunner().invoke(shards_main, ["info", str(cache), "--json"]).output)
    assert info["target_dir_bytes"] >= 3 * 2**20
    text = CliRunner().invoke(shards_main, ["info", str(cache)]).output
    size_line = next(line for line in text.splitlines() if line.startswith("size"))
    shown = float(size_line.split()[1].replace(",", ""))
    assert shown == pytest.approx((info["total_bytes"] + info["target_dir_bytes"]) / 2**20, abs=0.1)
    stats = CliRunner().invoke(shards_main, ["stats", str(cache)]).output
    bins = [line for line in stats.splitlines() if line.strip().startswith("[")]
    assert bins[-1].split("]")[0].strip().endswith("40") and all(")" in b for b in bins[:-1])


def test_verify_on_a_corrupt_shard_does_not_advise_verify(tmp_path):
    spec = CacheSpec(vocab_size=50, hidden_size=8, layer_ids=[1], top_k=4, max_length=16, shard_max_rows=1)
    write_synthetic_cache(tmp_path / "c", spec, [5, 6])
    shard = tmp_path / "c" / "shards" / "rank00000-00001.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = CliRunner().invoke(shards_main, ["verify", str(tmp_path / "c")])
    assert result.exit_code == 1 and "FAILED" in result.output
    assert "dflash-shards verify" not in result.output


@pytest.mark.parametrize("layers, match", [
    ([1, 3, 3], "must list distinct layer ids"),
    ([5, 1, 3], r"must be ascending \(serving engines sort target_layer_ids.*give 1,3,5"),
])
def test_feature_layers_that_an_engine_would_reorder_are_refused(tmp_path, layers, match):
    from dflash.precompute.config import PrecomputeConfig

    with pytest.raises(ValueError, match=match):
        PrecomputeConfig(target=str(tmp_path), data=[str(tmp_path / "d.jsonl")], out=str(tmp_path / "c"),
                         feature_layers=layers)
