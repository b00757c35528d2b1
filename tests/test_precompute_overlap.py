"""Stage one with the writer behind the forward (issue 41): the same shard bytes with and
without the writer thread and device-side encoding, across a kill and resume; a writer
thread's error reaches the main loop; the summary reports where the time went."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

import dflash.precompute.target as target_module
from dflash.common.files import file_digest, file_sha256
from dflash.precompute.run import run_precompute
from dflash.shards import open_cache, verify_cache
from dflash.shards.reader import shard_checksum
from dflash.testing.builders import RECORDS, build_target, killed_precompute, precompute_config, write_jsonl

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target("qwen3", tmp_path_factory.mktemp("target") / "qwen3")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", RECORDS * 2)


def digests(cache) -> dict[str, str]:
    """sha256 of every shard file, by name: what 'the same cache' means here."""
    return {p.name: file_sha256(p) for p in sorted((cache / "shards").glob("*.arrow"))}


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def reference(request, target, data, tmp_path_factory):
    """The cache as stage one wrote it before issue 41: no writer thread, features encoded on the host."""
    out = tmp_path_factory.mktemp("reference") / "cache"
    run_precompute(precompute_config(target, data, out, feature_codec=request.param, writer_thread="off"))
    return request.param, out


@pytest.mark.parametrize("on_device", [False, True])
def test_writer_thread_and_device_encoding_keep_the_bytes(reference, target, data, tmp_path, monkeypatch, on_device):
    codec, expected = reference
    if on_device:  # the CUDA path (torch encoders, encoded rows, `ready`) run on the CPU
        monkeypatch.setattr(target_module, "ENCODE_ON_DEVICE_TYPES", ("cuda", "cpu"))
    summary = run_precompute(precompute_config(target, data, tmp_path / "cache", feature_codec=codec,
                                               writer_thread="on"))
    assert digests(tmp_path / "cache") == digests(expected)
    assert [shard_checksum(s) for s in open_cache(tmp_path / "cache").manifest["shards"]] == \
        [shard_checksum(s) for s in open_cache(expected).manifest["shards"]]
    assert (summary.encode_s > 0) == on_device


# The two kill-and-resume tests take one codec each (a killed stage one is a subprocess that
# loads torch and the target: the slow part of this file); both codecs are killed and resumed.
@pytest.mark.parametrize("reference", ["fp8"], indirect=True)
def test_kill_and_resume_with_the_writer_thread_keeps_the_bytes(reference, target, data, tmp_path):
    codec, expected = reference
    config = precompute_config(target, data, tmp_path / "cache", feature_codec=codec, writer_thread="on")
    killed = killed_precompute(config, 4)  # SIGKILL in the main loop while the writer thread works
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (tmp_path / "cache" / "manifest.json").exists()
    run_precompute(config)
    assert digests(tmp_path / "cache") == digests(expected)


def test_a_writer_thread_error_is_raised_in_the_main_loop(target, data, tmp_path, monkeypatch):
    def failing_encode(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("dflash.shards.rows.encode_row", failing_encode)
    with pytest.raises(OSError, match="No space left on device"):
        run_precompute(precompute_config(target, data, tmp_path / "cache", writer_thread="on"))
    assert not (tmp_path / "cache" / "manifest.json").exists()
    assert not list((tmp_path / "cache" / "shards").glob("*.done.json"))


def test_the_summary_reports_the_split(target, data, tmp_path):
    summary = run_precompute(precompute_config(target, data, tmp_path / "cache", feature_codec="fp8",
                                               writer_thread="on"))
    split = json.loads(json.dumps(summary.to_dict()))
    assert split["forward_s"] > 0 and split["host_s"] > 0 and split["writer_wait_s"] >= 0
    parts = {"validate", "topk", "host_encode", "crc32", "rows", "write", "shard_checksum", "fsync"}
    assert parts <= set(split["host_parts_s"])
    assert split["host_s"] == pytest.approx(sum(split["host_parts_s"].values()))
    assert "waiting on the writer" in summary.format()


def test_xxh3_shard_checksums_keep_the_shards_and_make_manifest_version_3(reference, target, data, tmp_path,
                                                                          monkeypatch):
    codec, expected = reference
    out = tmp_path / "cache"
    run_precompute(precompute_config(target, data, out, feature_codec=codec, writer_thread="on",
                                     shard_checksum="xxh3-128"))
    assert digests(out) == digests(expected)  # the shards themselves are the same bytes
    manifest = open_cache(out).manifest
    assert manifest["format_version"] == 3
    assert all("xxh3_128" in s and "sha256" not in s for s in manifest["shards"])
    assert verify_cache(out)["ok"]
    shard = sorted((out / "shards").glob("*.arrow"))[0]
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    problems = [p["problem"] for p in verify_cache(out)["problems"]]
    assert any(p.startswith("xxh3-128 ") and "does not match the manifest's" in p for p in problems)
    monkeypatch.setattr("dflash.shards.spec.READ_VERSIONS", (1, 2))  # a reader from before version 3
    with pytest.raises(ValueError, match="format version 3"):
        open_cache(out)


@pytest.mark.parametrize("reference", ["bf16"], indirect=True)
def test_an_old_sha256_cache_resumes_under_the_xxh3_default(reference, target, data, tmp_path):
    """A cache killed while a version before the xxh3-128 default wrote it (sha256, the same
    bytes as `--shard-checksum sha256` today) resumes with the default: the sealed shards keep
    their sha256, the rest get xxh3-128, and the mixed manifest (version 3) verifies."""
    codec, expected = reference
    out = tmp_path / "cache"
    killed = killed_precompute(precompute_config(target, data, out, feature_codec=codec, shard_checksum="sha256"), 4)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    sealed = {p.stem: json.loads(p.read_text())["sha256"] for p in (out / "shards").glob("rank00000-?????.json")}
    config = precompute_config(target, data, out, feature_codec=codec)
    assert config.shard_checksum == "xxh3-128"  # the default
    summary = run_precompute(config)
    assert summary.resumed_sequences > 0
    assert digests(out) == digests(expected)
    manifest = open_cache(out).manifest
    checksums = [shard_checksum(s) for s in manifest["shards"]]
    assert 0 < len(sealed) < len(checksums)
    assert [a for a, _ in checksums] == ["sha256"] * len(sealed) + ["xxh3-128"] * (len(checksums) - len(sealed))
    for (algorithm, digest), entry in zip(checksums, manifest["shards"]):
        assert file_digest(out / entry["path"], algorithm) == digest
        if algorithm == "sha256":  # kept from the killed run's records, not recomputed
            assert sealed[Path(entry["path"]).stem] == digest
    assert manifest["format_version"] == 3
    assert verify_cache(out)["ok"]


def test_a_finished_sha256_cache_is_left_as_it_is_under_the_default(target, data, tmp_path):
    out = tmp_path / "cache"
    run_precompute(precompute_config(target, data, out, feature_codec="fp8", shard_checksum="sha256"))
    before = (out / "manifest.json").read_bytes()
    manifest = json.loads(before)
    assert manifest["format_version"] == 1
    assert all(shard_checksum(s) == ("sha256", file_sha256(out / s["path"])) for s in manifest["shards"])
    assert run_precompute(precompute_config(target, data, out, feature_codec="fp8")).already_complete
    assert (out / "manifest.json").read_bytes() == before
