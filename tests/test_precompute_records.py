"""Stage one's record contract and single-pass basis fit: prompt-only records are taken with
--regenerate (one reply generated, as dflash-regenerate does) and refused without it with a
reason that says so; an all-rejected input gives the same error whatever the feature codec;
with a basis codec every record goes through the target forward exactly once, and a killed
regenerating run resumes to the same shards."""

from __future__ import annotations

import json
import signal
from collections import Counter

import numpy as np
import pytest

from dflash.precompute.pipeline import NO_REPLY
from dflash.precompute.run import run_precompute
from dflash.precompute.target import Target
from dflash.shards import open_cache
from dflash.shards.reader import shard_checksum
from dflash.testing.builders import (
    RECORDS,
    build_target,
    killed_precompute,
    precompute_config as config,
    write_jsonl,
)

PROMPTS = [{"messages": [{"role": "user", "content": "Hello there!"}]},
           {"prompt": "What is the capital of France?"}]
# The same prompts with replies: regeneration replaces the replies, so both give one cache.
WITH_REPLIES = [RECORDS[0], {"prompt": "What is the capital of France?", "response": "Paris is the capital."}]
BASIS = dict(feature_codec="basis-fp8", feature_rank=24, basis_sample_tokens=200, shard_max_rows=2)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target("qwen3", tmp_path_factory.mktemp("target") / "qwen3")


def test_regenerate_takes_prompt_only_records(target, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    replies = write_jsonl(tmp_path / "replies.jsonl", WITH_REPLIES)
    summary = run_precompute(config(target, prompts, tmp_path / "a", regenerate=True, max_new_tokens=6))
    run_precompute(config(target, replies, tmp_path / "b", regenerate=True, max_new_tokens=6))
    assert summary.num_sequences == 2 and summary.regenerated_replies == 2 and not summary.rejected
    a, b = open_cache(tmp_path / "a"), open_cache(tmp_path / "b")
    by_index = {b.source(i)["index"]: b[i] for i in range(len(b))}
    for i in range(len(a)):
        expected = by_index[a.source(i)["index"]]
        np.testing.assert_array_equal(a[i].input_ids, expected.input_ids)
        np.testing.assert_array_equal(a[i].loss_mask, expected.loss_mask)
        assert a[i].loss_mask.sum() >= 1


@pytest.mark.parametrize("codec", [{}, BASIS], ids=["bf16", "basis-fp8"])
def test_prompt_only_without_regenerate_is_one_error_whatever_the_codec(target, tmp_path, codec):
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    out = tmp_path / "cache"
    with pytest.raises(ValueError) as error:
        run_precompute(config(target, data, out, **codec))
    assert str(error.value) == (f"no sequence was written: 2 records read from --data {data}, all rejected "
                                f"(2 x {NO_REPLY}); each record's reason is in {out / 'rejected.jsonl'}")
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [(r["index"], r["reason"]) for r in rejected] == [(0, NO_REPLY), (1, NO_REPLY)]


@pytest.mark.parametrize("regenerate", [False, True], ids=["replies", "regenerate"])
def test_basis_fit_runs_each_record_through_the_target_once(target, tmp_path, monkeypatch, regenerate):
    data = write_jsonl(tmp_path / "chat.jsonl", RECORDS)
    calls: Counter[str] = Counter()
    forward = Target.forward

    def counting(self, sequences, names, **options):
        calls.update(names)
        return forward(self, sequences, names, **options)

    monkeypatch.setattr(Target, "forward", counting)
    summary = run_precompute(config(target, data, tmp_path / "cache", regenerate=regenerate, max_new_tokens=6,
                                    **BASIS))
    cache = open_cache(tmp_path / "cache")
    assert 100 < cache.load_feature_basis().num_tokens < cache.num_tokens  # a sample of several records
    assert summary.num_sequences == len(RECORDS) == len(calls)
    assert set(calls.values()) == {1}


def test_regenerated_basis_run_killed_then_resumed_writes_the_same_shards(target, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", RECORDS)
    settings = dict(regenerate=True, max_new_tokens=6, **BASIS)
    run_precompute(config(target, data, tmp_path / "whole", **settings))
    killed = killed_precompute(config(target, data, tmp_path / "cache", **settings), 3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_precompute(config(target, data, tmp_path / "cache", **settings))
    assert resumed.resumed_sequences >= 2  # the first shard survived the kill
    whole, cache = open_cache(tmp_path / "whole"), open_cache(tmp_path / "cache")
    assert cache.feature_basis_sha256 == whole.feature_basis_sha256
    assert [shard_checksum(s) for s in cache.manifest["shards"]] == \
        [shard_checksum(s) for s in whole.manifest["shards"]]
