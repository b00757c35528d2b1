"""Basis feature codecs: the codec round trip, the exact fold into fc, the basis file's checks,
version-1 caches, refusing to mix bases, and training plus export on a basis cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dflash.shards import CacheSpec, open_cache, verify_cache
from dflash.shards.basis import BASIS_FILE, FeatureBasis, SecondMoment, fit_basis
from dflash.shards.cli import main as shards_main
from dflash.shards.rows import bytes_per_token
from dflash.shards.synthetic import synthetic_row, write_synthetic_cache
from dflash.testing import builders
from dflash.train.basis import fold_basis, match_features
from dflash.train.data import Corpus
from dflash.train.model import DFlashDrafter, DrafterConfig

LENGTHS = [9, 17, 5, 12]
LAYERS, HIDDEN = [0, 2, 3], 16


def spec(codec: str = "bf16", rank: int | None = None) -> CacheSpec:
    return CacheSpec(vocab_size=50, hidden_size=HIDDEN, layer_ids=LAYERS, top_k=4, feature_codec=codec,
                     feature_rank=rank, max_length=32,
                     target={"name": "t", "num_layers": 4, "config_sha256": "x"})


def fitted_basis(rank: int, seed: int = 0) -> FeatureBasis:
    rng = np.random.default_rng(seed)
    moment = SecondMoment(len(LAYERS) * HIDDEN)
    for n in LENGTHS:
        moment.add(synthetic_row(rng, spec(), n)["features"])
    return fit_basis(moment.matrix, moment.num_tokens, rank)


def test_fit_is_deterministic_orthonormal_and_sign_fixed():
    a, b = fitted_basis(HIDDEN), fitted_basis(HIDDEN)
    assert a.to_bytes() == b.to_bytes()
    p = a.projection.astype(np.float64)
    np.testing.assert_allclose(p.T @ p, np.eye(HIDDEN), atol=1e-6)
    top = np.abs(p).argmax(axis=0)
    assert (p[top, np.arange(HIDDEN)] > 0).all()
    assert np.all(np.diff(a.eigenvalues) <= 0) and 0.5 < a.energy_captured < 1
    assert FeatureBasis.from_bytes(a.to_bytes(), "x").to_bytes() == a.to_bytes()


@pytest.mark.parametrize("codec,rank,feature_bytes,rtol", [
    ("basis-bf16", 8, 8 * 2, 2**-8), ("basis-fp8", 24, 24 + 4, 2**-3), ("basis-bf16", 48, 48 * 2, 2**-8)])
def test_basis_cache_round_trip(tmp_path, codec, rank, feature_bytes, rtol):
    cache = write_synthetic_cache(tmp_path / "c", spec(codec, rank), LENGTHS, seed=3)
    assert cache.manifest["format_version"] == 2 and cache.spec.format_version == 2
    basis = cache.load_feature_basis()
    assert cache.feature_basis_sha256 == basis.sha256() == cache.manifest["feature_basis"]["sha256"]
    assert cache.manifest["feature_basis"]["rank"] == rank
    per_token = bytes_per_token(cache.spec)
    assert per_token["features"] + per_token.get("feature_scales", 0) == feature_bytes
    rows = [synthetic_row(np.random.default_rng(3), cache.spec, n) for n in LENGTHS[:1]]
    coefficients = basis.encode(rows[0]["features"])  # [T, r]
    seq = cache[0]
    assert seq.features.shape == (LENGTHS[0], 1, rank)
    scale = np.abs(coefficients).max(axis=1, keepdims=True)
    assert np.abs(seq.features[:, 0] - coefficients).max() <= rtol * scale.max()
    raw = cache.raw(0)
    assert raw.features.shape == (LENGTHS[0], 1, rank) and raw.feature_codec == codec
    assert verify_cache(tmp_path / "c")["ok"]


def test_raw_codecs_stay_version_1(tmp_path):
    cache = write_synthetic_cache(tmp_path / "c", spec("fp8"), LENGTHS)
    assert cache.manifest["format_version"] == 1 and "feature_rank" not in cache.manifest["spec"]
    assert cache.feature_basis_sha256 is None
    with pytest.raises(ValueError, match="feature_rank"):
        spec("bf16", 8)
    with pytest.raises(ValueError, match="feature_rank must be in"):
        spec("basis-fp8", None)


@pytest.mark.parametrize("damage", ["missing", "flipped"])
def test_verify_names_a_damaged_or_missing_basis(tmp_path, damage):
    write_synthetic_cache(tmp_path / "c", spec("basis-fp8", 16), LENGTHS)
    path = tmp_path / "c" / BASIS_FILE
    if damage == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40
        path.write_bytes(bytes(data))
    report = verify_cache(tmp_path / "c")
    assert not report["ok"]
    problem = " ".join(p["problem"] for p in report["problems"])
    assert BASIS_FILE in problem and ("missing" if damage == "missing" else "sha256") in problem
    result = CliRunner().invoke(shards_main, ["verify", str(tmp_path / "c")])
    assert result.exit_code != 0 and BASIS_FILE in result.output


def test_info_reports_rank_and_bytes(tmp_path):
    write_synthetic_cache(tmp_path / "c", spec("basis-fp8", 16), LENGTHS)
    result = CliRunner().invoke(shards_main, ["info", "--json", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output.strip().splitlines()[-1])
    assert info["feature_rank"] == 16 and info["feature_basis"]["rank"] == 16
    assert info["bytes_per_token"]["features"] == pytest.approx(16 + 4)
    text = CliRunner().invoke(shards_main, ["info", str(tmp_path / "c")]).output
    assert "rank 16" in text and "x bf16" in text


def test_mixing_bases_is_refused(tmp_path):
    a = write_synthetic_cache(tmp_path / "a", spec("basis-bf16", 16), LENGTHS, seed=1)
    b = write_synthetic_cache(tmp_path / "b", spec("basis-bf16", 16), LENGTHS, seed=2)
    raw = write_synthetic_cache(tmp_path / "raw", spec("bf16"), LENGTHS, seed=2)
    assert a.feature_basis_sha256 != b.feature_basis_sha256
    for other in (b, raw):
        with pytest.raises(ValueError, match=rf"{tmp_path / 'a'}.*basis {a.feature_basis_sha256[:12]}.*"
                                             rf"but {other.path}"):
            Corpus([a, other])
    Corpus([a, open_cache(tmp_path / "a")])  # the same basis mixes


def drafter_config(**extra) -> DrafterConfig:
    return builders.drafter_config(hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=50,
                                   target_layer_ids=LAYERS, num_target_layers=4, num_drafts=3, mask_token_id=0,
                                   **extra)


@pytest.mark.parametrize("rank", [8, HIDDEN, 2 * HIDDEN])
def test_fold_is_exact(rank):
    basis = fitted_basis(rank)
    basis.scale = np.linspace(0.5, 2.0, basis.input_width).astype(np.float32)  # D folds as well
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config(feature_width=rank, feature_basis_sha256=basis.sha256()))
    folded = fold_basis(drafter, basis)
    assert folded.config.feature_width is None and folded.fc.weight.shape == (HIDDEN, len(LAYERS) * HIDDEN)
    x = synthetic_row(np.random.default_rng(7), spec(), 20)["features"].reshape(20, -1)  # [T, L*H]
    coefficients = torch.from_numpy(basis.encode(x))
    with torch.no_grad():
        trained = drafter.fuse_context(coefficients)
        exported = folded.fuse_context(torch.from_numpy(x))
    np.testing.assert_allclose(exported.numpy(), trained.numpy(), rtol=1e-4, atol=1e-4)
    state, folded_state = drafter.state_dict(), folded.state_dict()
    assert all(torch.equal(state[k], folded_state[k]) for k in state if k != "fc.weight")
    other = fitted_basis(rank, seed=1)
    with pytest.raises(ValueError, match="fold with the basis of the cache it was trained on"):
        fold_basis(drafter, other)


def test_match_features_refuses_a_foreign_basis(tmp_path):
    a = write_synthetic_cache(tmp_path / "a", spec("basis-bf16", 16), LENGTHS, seed=1)
    b = write_synthetic_cache(tmp_path / "b", spec("basis-bf16", 16), LENGTHS, seed=2)
    raw = write_synthetic_cache(tmp_path / "raw", spec("bf16"), LENGTHS)
    drafter = DFlashDrafter(drafter_config(feature_width=16, feature_basis_sha256=a.feature_basis_sha256))
    assert match_features(drafter, a, []) is drafter
    with pytest.raises(ValueError, match="evaluate it on a cache of its own basis"):
        match_features(drafter, b, [])
    folded = match_features(drafter, raw, [str(tmp_path / "a")])
    assert folded.config.feature_width is None
    with pytest.raises(ValueError, match="raw target features"):
        match_features(DFlashDrafter(drafter_config()), a, [])


@pytest.mark.e2e  # fit, export and eval
def test_fit_export_and_eval_on_a_basis_cache(tmp_path):
    from dflash.train.evaluate import EvalConfig, run_eval
    from dflash.train.export import export_run
    from dflash.train.fit import fit
    from dflash.train.loading import load_exported
    from dflash.train.synthetic import write_synthetic_training_cache

    lengths = [40, 56, 33, 71, 48, 64, 29, 52, 45, 60]
    basis_cache = write_synthetic_training_cache(tmp_path / "basis", lengths=lengths, seed=1,
                                                 feature_codec="basis-bf16", feature_rank=24)
    write_synthetic_training_cache(tmp_path / "raw", lengths=lengths, seed=1)
    run = tmp_path / "run"
    fit(builders.tiny_fit_config(tmp_path / "basis", run, anchors_per_seq=6, epochs=1, checkpoint_every=100,
                                 eval_fraction=0.2))
    config = json.loads((run / "drafter_config.json").read_text())
    assert config["feature_width"] == 24 and config["feature_basis_sha256"] == basis_cache.feature_basis_sha256
    offline = run_eval(EvalConfig(run=str(run), device="cpu", save=False), show_progress=False)
    assert offline["num_anchors"] > 0
    export = export_run(run, tmp_path / "export", dtype="float32")  # the fold is exact in float32
    exported = load_exported(export)
    assert exported.config.feature_width is None and exported.fc.weight.shape == (32, 3 * 32)
    assert "feature_width" not in json.loads((export / "config.json").read_text())
    on_raw = run_eval(EvalConfig(checkpoint=str(export), cache=str(tmp_path / "raw"), device="cpu", save=False),
                      show_progress=False)
    folded_on_raw = run_eval(EvalConfig(run=str(run), cache=str(tmp_path / "raw"), device="cpu", save=False),
                             show_progress=False)
    assert on_raw["acceptance_length"] == folded_on_raw["acceptance_length"]


def test_transcode_keeps_rows_and_changes_features(tmp_path):
    from dflash.shards.transcode import transcode_cache

    source = write_synthetic_cache(tmp_path / "src", spec("bf16"), LENGTHS, seed=5)
    transcode_cache(tmp_path / "src", tmp_path / "same", feature_codec="bf16")
    transcode_cache(tmp_path / "src", tmp_path / "basis", feature_codec="basis-fp8", feature_rank=48,
                    basis_sample_tokens=20)
    same, basis = open_cache(tmp_path / "same"), open_cache(tmp_path / "basis")
    assert basis.load_feature_basis().num_tokens == LENGTHS[0] + LENGTHS[1]  # the first records reach 20
    for i in range(len(source)):
        np.testing.assert_array_equal(same[i].features, source[i].features)
        np.testing.assert_array_equal(basis[i].input_ids, source[i].input_ids)
        np.testing.assert_array_equal(basis[i].topk_ids, same[i].topk_ids)
        full = basis.load_feature_basis()  # rank L*H: an orthonormal basis, so x = P c
        back = basis[i].features[:, 0] @ full.projection.T
        x = source[i].features.reshape(len(back), -1)
        assert np.abs(back - x).max() <= 0.1 * np.abs(x).max()
