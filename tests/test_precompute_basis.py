"""Stage one with a basis codec: the basis is fitted before any row from the run's first
records, reused on resume, and the same (to float rounding) on two ranks as on one."""

from __future__ import annotations

import dataclasses
import signal

import numpy as np
import pytest

from dflash.precompute.basis import sample_positions
from dflash.precompute.run import run_precompute
from dflash.shards import open_cache, verify_cache
from dflash.shards.basis import BASIS_FILE
from dflash.shards.reader import shard_checksum
from dflash.testing.builders import (
    RECORDS,
    build_target,
    killed_precompute,
    precompute_config as config,
    write_jsonl,
)

pytestmark = pytest.mark.e2e

CODEC = dict(feature_codec="basis-fp8", feature_rank=24, basis_sample_tokens=200, shard_max_rows=2)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target("qwen3", tmp_path_factory.mktemp("target") / "qwen3")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", RECORDS)


@pytest.fixture(scope="module")
def one_rank(target, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "cache"
    run_precompute(config(target, data, out, **CODEC))
    return open_cache(out)


def test_sample_is_the_first_records():
    assert sample_positions([(5, 10), (0, 50), (2, 100), (7, 1)], 120) == {0, 2}
    assert sample_positions([(3, 10)], 1000) == {3}


def test_basis_cache_is_fitted_and_verifies(one_rank):
    cache = one_rank
    basis = cache.load_feature_basis()
    assert cache.spec.feature_codec == "basis-fp8" and cache.spec.feature_rank == 24 == basis.rank
    assert basis.input_width == cache.spec.num_layers * cache.spec.hidden_size
    assert 200 <= basis.num_tokens < cache.num_tokens  # the sample, not the whole cache
    assert cache.manifest["feature_basis"]["sha256"] == cache.feature_basis_sha256
    assert cache[0].features.shape == (cache.lengths[0], 1, 24)
    assert verify_cache(cache.path)["ok"]


def projector(cache) -> np.ndarray:
    p = cache.load_feature_basis().projection.astype(np.float64)
    return p @ p.T


def test_two_ranks_fit_the_same_basis(target, data, tmp_path, one_rank):
    run_precompute(config(target, data, tmp_path / "cache", nproc=2, **CODEC))
    two = open_cache(tmp_path / "cache")
    assert two.manifest["world_size"] == 2
    ours, theirs = two.load_feature_basis(), one_rank.load_feature_basis()
    assert ours.num_tokens == theirs.num_tokens
    np.testing.assert_allclose(ours.eigenvalues, theirs.eigenvalues, rtol=1e-5, atol=1e-9 * theirs.eigenvalues[0])
    np.testing.assert_allclose(projector(two), projector(one_rank), atol=1e-4)
    by_source = {(two.source(i)["file"], two.source(i)["index"]): two[i] for i in range(len(two))}
    for i in range(len(one_rank)):
        seq = one_rank[i]
        other = by_source[(one_rank.source(i)["file"], one_rank.source(i)["index"])]
        scale = np.abs(seq.features).max()
        np.testing.assert_allclose(other.features, seq.features, atol=2**-3 * scale)


def test_kill_then_resume_reuses_the_basis(target, data, tmp_path, one_rank):
    killed = killed_precompute(config(target, data, tmp_path / "cache", **CODEC), 3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    written = (tmp_path / "cache" / BASIS_FILE).read_bytes()
    run_precompute(config(target, data, tmp_path / "cache", **CODEC))
    cache = open_cache(tmp_path / "cache")
    assert (tmp_path / "cache" / BASIS_FILE).read_bytes() == written
    assert cache.feature_basis_sha256 == one_rank.feature_basis_sha256
    assert [shard_checksum(s) for s in cache.manifest["shards"]] == \
        [shard_checksum(s) for s in one_rank.manifest["shards"]]


def test_overwrite_refits_and_a_foreign_basis_is_refused(target, data, tmp_path, one_rank):
    out = tmp_path / "cache"
    run_precompute(config(target, data, out, **CODEC))
    (out / BASIS_FILE).write_bytes((one_rank.path / BASIS_FILE).read_bytes())  # same basis: fine
    other = config(target, data, out, **{**CODEC, "basis_sample_tokens": 50})
    run_precompute(dataclasses.replace(other, overwrite=True))
    assert open_cache(out).load_feature_basis().num_tokens < one_rank.load_feature_basis().num_tokens


def test_regenerated_sample_is_reused_not_regenerated(target, data, tmp_path):
    options = dict(regenerate=True, max_new_tokens=6, limit=5)
    raw = run_precompute(config(target, data, tmp_path / "raw", **options))
    summary = run_precompute(config(target, data, tmp_path / "basis", **options, **CODEC))
    assert summary.regenerated_replies == raw.regenerated_replies  # each reply generated once
    a, b = open_cache(tmp_path / "raw"), open_cache(tmp_path / "basis")
    assert a.manifest["sequences"] == b.manifest["sequences"]
    for i in range(len(a)):
        np.testing.assert_array_equal(a[i].input_ids, b[i].input_ids)
        np.testing.assert_array_equal(a[i].loss_mask, b[i].loss_mask)


def test_feature_basis_reuses_another_caches_basis_so_fit_trains_on_both(target, data, tmp_path, one_rank):
    from dflash.testing.builders import tiny_fit_config
    from dflash.train.fit import fit

    other_data = write_jsonl(tmp_path / "other.jsonl", RECORDS[::-1][:4])
    out = tmp_path / "other"
    run_precompute(config(target, other_data, out, feature_basis=one_rank.path, **CODEC))  # a cache folder
    other = open_cache(out)
    assert (out / BASIS_FILE).read_bytes() == (one_rank.path / BASIS_FILE).read_bytes()
    assert other.feature_basis_sha256 == one_rank.feature_basis_sha256
    # a record in both caches is encoded alike (same basis; the forwards differ only by their
    # batches' float rounding)
    mine = {tuple(one_rank[i].input_ids.tolist()): one_rank[i] for i in range(len(one_rank))}
    common = [other[i] for i in range(len(other)) if tuple(other[i].input_ids.tolist()) in mine]
    assert common
    for seq in common:
        np.testing.assert_allclose(seq.features, mine[tuple(seq.input_ids.tolist())].features, rtol=1e-5, atol=1e-5)
    run = tmp_path / "run"
    fit(tiny_fit_config(one_rank.path, run, cache=[str(one_rank.path), str(out)], max_steps=2, anchors_per_seq=4))
    assert (run / "checkpoints").is_dir()


def test_feature_basis_is_refused_without_a_basis_codec_or_a_file(target, data, tmp_path, one_rank):
    with pytest.raises(ValueError, match="--feature-basis goes with a basis codec"):
        config(target, data, tmp_path / "a", feature_basis=one_rank.path)
    with pytest.raises(ValueError, match="no such file"):
        config(target, data, tmp_path / "b", feature_basis=tmp_path / "missing.safetensors", **CODEC)


def test_the_progress_bar_says_whether_a_basis_is_fitted_or_reused(target, data, tmp_path, one_rank, capsys):
    run_precompute(config(target, data, tmp_path / "fitted", progress=True, **CODEC))
    fitted = capsys.readouterr().err
    run_precompute(config(target, data, tmp_path / "reused", feature_basis=one_rank.path, progress=True, **CODEC))
    reused = capsys.readouterr().err
    assert "basis sample" in fitted and "basis reused" not in fitted
    assert "sample (basis reused)" in reused and "basis sample" not in reused
