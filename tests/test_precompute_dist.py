"""Stage one across processes: two gloo ranks (spawned, and under torchrun) write the same
sequences and values as one rank; one rank's failure is an error on every rank; a run
killed with SIGKILL and rerun equals an uninterrupted run byte for byte."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from dflash.precompute.run import run_precompute
from dflash.shards import open_cache
from dflash.shards.cli import main as shards_main
from dflash.shards.reader import shard_checksum
from dflash.testing.builders import (
    RECORDS,
    SUBPROCESS_ENV as ENV,
    build_target,
    killed_precompute,
    precompute_config,
    write_jsonl,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target("qwen3", tmp_path_factory.mktemp("target") / "qwen3")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    records = RECORDS[:4] + ["{broken"] + RECORDS[4:]
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", records)


@pytest.fixture(scope="module")
def one_rank(target, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "cache"
    run_precompute(precompute_config(target, data, out, shard_max_rows=2))
    return open_cache(out)


def by_source(cache) -> dict[tuple[str, int], object]:
    return {(cache.source(i)["file"], cache.source(i)["index"]): cache[i] for i in range(len(cache))}


def assert_same_values(cache, reference) -> None:
    """Same sequences, tokens and masks; values equal up to batch-dependent matmul rounding
    (features then stored in bf16: one bf16 step at most)."""
    ours, theirs = by_source(cache), by_source(reference)
    assert ours.keys() == theirs.keys()
    for key, seq in ours.items():
        ref = theirs[key]
        np.testing.assert_array_equal(seq.input_ids, ref.input_ids)
        np.testing.assert_array_equal(seq.loss_mask, ref.loss_mask)
        np.testing.assert_allclose(seq.features, ref.features, rtol=2**-7, atol=1e-5)
        np.testing.assert_array_equal(seq.topk_ids, ref.topk_ids)
        np.testing.assert_allclose(seq.topk_logprobs, ref.topk_logprobs, atol=1e-5)
    assert (cache.path / "rejected.jsonl").read_text() == (reference.path / "rejected.jsonl").read_text()


def test_two_spawned_ranks_equal_one_rank(target, data, tmp_path, one_rank):
    summary = run_precompute(precompute_config(target, data, tmp_path / "cache", shard_max_rows=2, nproc=2))
    cache = open_cache(tmp_path / "cache")
    assert summary.world_size == 2 and cache.manifest["world_size"] == 2
    assert {s["rank"] for s in cache.manifest["shards"]} == {0, 1}
    assert_same_values(cache, one_rank)
    assert summary.num_sequences == len(one_rank) == len(RECORDS)
    assert summary.rejected == {"invalid JSON: Expecting property name enclosed in double quotes": 1}


def test_two_torchrun_ranks_equal_one_rank(target, data, tmp_path, one_rank):
    cli = shutil.which("dflash-precompute") or os.path.join(os.path.dirname(sys.executable), "dflash-precompute")
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", cli,
            "--target", str(target), "--data", str(data), "--out", str(tmp_path / "cache"), "--top-k", "8",
            "--num-feature-layers", "3", "--batch-tokens", "300", "--shard-max-rows", "2",
            "--device", "cpu", "--no-progress"]
    done = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("dflash-precompute:") == 1  # rank 0 prints the summary
    assert_same_values(open_cache(tmp_path / "cache"), one_rank)


def test_one_ranks_failure_is_an_error_on_every_rank(target, data, tmp_path):
    # --strict: the broken record (position 4) is scanned by rank 0 of 2 and fails there;
    # rank 1 must not wait forever for it.
    with pytest.raises(ValueError, match=r"chat.jsonl record 4: invalid JSON.*--strict"):
        run_precompute(precompute_config(target, data, tmp_path / "cache", nproc=2, strict=True,
                                         dist_timeout_s=120))


def test_sigkill_then_rerun_equals_an_uninterrupted_run(target, data, tmp_path, one_rank):
    killed = killed_precompute(precompute_config(target, data, tmp_path / "cache", shard_max_rows=2), 5)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    shards = tmp_path / "cache" / "shards"
    assert not (tmp_path / "cache" / "manifest.json").exists()
    assert sorted(p.name for p in shards.glob("*.arrow")) == ["rank00000-00000.arrow", "rank00000-00001.arrow"]
    assert list(shards.glob("*.tmp"))  # the open shard died half-written

    summary = run_precompute(precompute_config(target, data, tmp_path / "cache", shard_max_rows=2))
    assert summary.resumed_sequences == 5  # 4 rows in sealed shards + the reject sealed with them
    assert summary.written_sequences == len(RECORDS) - 4
    cache = open_cache(tmp_path / "cache")
    assert [shard_checksum(s) for s in cache.manifest["shards"]] == \
        [shard_checksum(s) for s in one_rank.manifest["shards"]]
    assert cache.manifest["sequences"] == one_rank.manifest["sequences"]
    for i in range(len(cache)):
        a, b = cache[i], one_rank[i]
        for name in ("input_ids", "loss_mask", "features", "topk_ids", "topk_logprobs", "tail_mass"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    verified = CliRunner().invoke(shards_main, ["verify", str(tmp_path / "cache")])
    assert verified.exit_code == 0, verified.output
