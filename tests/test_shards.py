"""Writer and reader tests: round trips, validation, resume, atomicity, damage, refusals."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dflash.shards import (
    FORMAT_VERSION,
    CacheSpec,
    CacheWriter,
    codecs,
    finalize_cache,
    open_cache,
    verify_cache,
)
from dflash.shards.rows import encode_row
from dflash.shards.spec import READ_VERSIONS
from dflash.shards.synthetic import synthetic_row, write_synthetic_cache

LENGTHS = [5, 17, 1, 32, 9, 12, 3, 30, 8]


def make_spec(**overrides) -> CacheSpec:
    fields = dict(
        vocab_size=1000,
        hidden_size=24,
        layer_ids=[1, 4, 7],
        top_k=8,
        max_length=32,
        shard_max_rows=3,
        target={"name": "tiny", "model_type": "llama", "num_layers": 9},
        inputs=[{"path": "data.jsonl", "sha256": "0" * 64}],
    )
    fields.update(overrides)
    return CacheSpec(**fields)


def make_rows(spec: CacheSpec, lengths=LENGTHS, seed=0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = [synthetic_row(rng, spec, n) for n in lengths]
    for row in rows:
        # bf16-representable features, so that the bf16 codec must return them exactly
        row["features"] = codecs.bf16_to_f32(codecs.f32_to_bf16(row["features"]))
    return rows


def write(cache_dir, spec, rows, world_size=1, **writer_kwargs):
    for rank in range(world_size):
        with CacheWriter(cache_dir, spec, rank=rank, world_size=world_size, **writer_kwargs) as writer:
            for index in range(rank, len(rows), world_size):
                writer.add(**rows[index], source={"file": "data.jsonl", "index": index})
    return finalize_cache(cache_dir, spec, world_size)


def shard_digests(cache_dir) -> dict[str, str]:
    manifest = json.loads((Path(cache_dir) / "manifest.json").read_text())
    return {s["path"]: s["sha256"] for s in manifest["shards"]}


# ------------------------------------------------------------------------- spec


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vocab_size": 1}, "vocab_size"),
        ({"layer_ids": []}, "layer_ids"),
        ({"layer_ids": [1, 1]}, "repeats"),
        ({"top_k": 0}, "top_k"),
        ({"feature_codec": "fp16"}, "feature_codec"),
        ({"topk_codec": "zip"}, "topk_codec"),
        ({"generation_temperature": 0.7}, "regenerated"),
        ({"inputs": ["data.jsonl"]}, "inputs"),
    ],
)
def test_spec_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_spec(**overrides)


def test_spec_identity_ignores_options():
    a, b = make_spec(options={"batch_size": 8}), make_spec(options={"batch_size": 64})
    assert a.identity() == b.identity() and a.identity_diff(b) == []
    assert make_spec(top_k=4).identity_diff(a) == ["top_k"]
    assert CacheSpec.from_dict(a.to_dict()) == a


# ------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("world_size", [1, 2])
def test_round_trip_bf16_raw_is_exact(tmp_path, world_size):
    spec = make_spec(topk_codec="raw")
    rows = make_rows(spec)
    cache = write(tmp_path, spec, rows, world_size=world_size)
    assert len(cache) == len(rows) and cache.num_tokens == sum(LENGTHS)
    assert cache.spec == spec
    order = [cache.source(i)["index"] for i in range(len(cache))]
    assert sorted(order) == list(range(len(rows)))
    for i, index in enumerate(order):
        row, seq = rows[index], cache[i]
        assert cache.lengths[i] == len(row["input_ids"])
        assert seq.source == {"file": "data.jsonl", "index": index}
        np.testing.assert_array_equal(seq.input_ids, row["input_ids"])
        np.testing.assert_array_equal(seq.loss_mask, row["loss_mask"])
        np.testing.assert_array_equal(seq.features, row["features"])
        np.testing.assert_array_equal(seq.topk_ids, row["topk_ids"])
        np.testing.assert_array_equal(seq.topk_logprobs, row["topk_logprobs"])
        np.testing.assert_allclose(seq.tail_mass, codecs.tail_from_logprobs(row["topk_logprobs"]))
        assert (seq.input_ids.dtype, seq.loss_mask.dtype, seq.features.dtype, seq.topk_ids.dtype,
                seq.topk_logprobs.dtype, seq.tail_mass.dtype) == (
            np.int32, np.bool_, np.float32, np.int32, np.float32, np.float32)


def test_round_trip_fp8_packed_within_bounds(tmp_path):
    spec = make_spec(feature_codec="fp8", topk_codec="packed")
    rows = make_rows(spec)
    cache = write(tmp_path, spec, rows)
    for i in range(len(cache)):
        row, seq = rows[cache.source(i)["index"]], cache[i]
        features = row["features"]
        scale = np.abs(features).max(-1, keepdims=True) / 448
        bound = np.maximum(2.0**-4 * np.abs(features), 2.0**-10 * scale) * (1 + 1e-6)
        assert (np.abs(seq.features - features) <= bound).all()
        order = np.argsort(-row["topk_logprobs"], axis=1, kind="stable")
        np.testing.assert_array_equal(seq.topk_ids, np.take_along_axis(row["topk_ids"], order, 1))
        kl = codecs.topk_kl(np.take_along_axis(row["topk_logprobs"], order, 1),
                            codecs.tail_from_logprobs(row["topk_logprobs"]),
                            seq.topk_logprobs, seq.tail_mass)
        assert kl.mean() <= 1e-3
        raw = cache.raw(i)
        assert raw.features.dtype == np.uint8 and raw.feature_scales.shape == (len(seq.input_ids), 3)


def test_uint16_bf16_features_are_stored_bit_exact(tmp_path):
    spec = make_spec()
    rows = make_rows(spec, lengths=[6])
    bits = codecs.f32_to_bf16(rows[0]["features"])
    rows[0]["features"] = bits
    cache = write(tmp_path, spec, rows)
    np.testing.assert_array_equal(cache.raw(0).features, bits)


def test_tail_mass_given_explicitly_is_kept(tmp_path):
    spec = make_spec(topk_codec="raw")
    rows = make_rows(spec, lengths=[4])
    rows[0]["tail_mass"] = np.full(4, 0.25, np.float32)
    cache = write(tmp_path, spec, rows)
    np.testing.assert_array_equal(cache[0].tail_mass, 0.25)


def test_shard_boundaries_follow_rows_and_bytes(tmp_path):
    spec = make_spec(shard_max_rows=100, shard_max_bytes=4000)
    rows = make_rows(spec)
    cache = write(tmp_path, spec, rows)
    # reference: a shard closes once its rows' encoded bytes reach shard_max_bytes
    expected, count, size = [], 0, 0
    for index, row in enumerate(rows):
        tail = codecs.tail_from_logprobs(row["topk_logprobs"])
        batch = encode_row(spec, **row, tail_mass=tail, source={"file": "data.jsonl", "index": index})
        count, size = count + 1, size + batch.nbytes
        if size >= spec.shard_max_bytes:
            expected.append(count)
            count, size = 0, 0
    expected += [count] if count else []
    assert len(expected) > 2
    assert [s["num_sequences"] for s in cache.manifest["shards"]] == expected


def test_locate_and_negative_index(tmp_path):
    spec = make_spec()
    cache = write(tmp_path, spec, make_rows(spec))
    assert cache.locate(4) == (tmp_path / "shards" / "rank00000-00001.arrow", 1)
    assert cache[-1].source == cache.source(len(cache) - 1)
    with pytest.raises(IndexError):
        cache[len(cache)]


def test_open_reads_no_shard(tmp_path):
    spec = make_spec()
    write(tmp_path, spec, make_rows(spec))
    for path in (tmp_path / "shards").glob("*.arrow"):
        path.write_bytes(b"")  # any shard read would now fail
    cache = open_cache(tmp_path)
    assert len(cache) == len(LENGTHS) and list(cache.lengths) == LENGTHS
    assert cache.source(3) == {"file": "data.jsonl", "index": 3}
    assert cache.target_dir == tmp_path / "target"


def test_raw_is_zero_copy(tmp_path):
    spec = make_spec()
    cache = write(tmp_path, spec, make_rows(spec))
    cache.raw(0)  # open the first shard
    before = pa.total_allocated_bytes()
    views = [cache.raw(i) for i in range(3)]  # rows of the (already mapped) first shard
    assert pa.total_allocated_bytes() == before
    for raw in views:
        assert raw.features.dtype == np.uint16 and not raw.features.flags.writeable
        assert raw.input_ids.dtype == np.int32 and raw.loss_mask.dtype == np.bool_
    np.testing.assert_array_equal(codecs.bf16_to_f32(views[1].features), cache[1].features)


@pytest.mark.parametrize("feature_codec, topk_codec", [("bf16", "packed"), ("fp8", "raw")])
def test_loss_mask_reads_only_the_mask(tmp_path, feature_codec, topk_codec):
    spec = make_spec(feature_codec=feature_codec, topk_codec=topk_codec)
    rows = make_rows(spec)
    cache = write(tmp_path, spec, rows)
    for i in range(-1, len(cache)):
        mask = cache.loss_mask(i)
        assert mask.dtype == np.bool_ and not mask.flags.writeable
        np.testing.assert_array_equal(mask, rows[cache.source(i)["index"]]["loss_mask"])
    before = pa.total_allocated_bytes()
    cache.loss_mask(1)
    assert pa.total_allocated_bytes() == before
    with pytest.raises(IndexError, match="out of range"):
        cache.loss_mask(len(cache))


# ------------------------------------------------------------------------- validation


def _corrupt(name, value):
    def apply(row):
        row[name] = value(row)
    return apply


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_corrupt("input_ids", lambda r: r["input_ids"] + 1000), r"input_ids has values in \[\d+, \d+\], outside"),
        (_corrupt("topk_ids", lambda r: -r["topk_ids"]), "topk_ids has values"),
        (_corrupt("loss_mask", lambda r: r["loss_mask"][:-1]), "loss_mask has shape"),
        (_corrupt("features", lambda r: r["features"][:, :2]), "features has shape"),
        (_corrupt("features", lambda r: np.where(r["features"] > 1, np.nan, r["features"])), "inf or NaN"),
        (_corrupt("features", lambda r: np.full(r["features"].shape, 0x7FC0, np.uint16)),
         r"features \(bf16 bits\) hold inf or NaN"),
        (_corrupt("features", lambda r: np.full(r["features"].shape, 3.39e38, np.float32)), "bf16 range"),
        (_corrupt("features", lambda r: r["features"].astype(np.int32)), "must be float or uint16"),
        (_corrupt("topk_logprobs", lambda r: r["topk_logprobs"] + 5), "<= 0"),
        (_corrupt("topk_logprobs", lambda r: r["topk_logprobs"] - r["topk_logprobs"].max() - 0.01),
         "sum to .* > 1"),
        (_corrupt("topk_ids", lambda r: np.repeat(r["topk_ids"][:, :1], 8, 1)), "repeat an id"),
        (_corrupt("topk_logprobs", lambda r: r["topk_logprobs"] - 1000), "sum to 0 at position 0"),
        (_corrupt("input_ids", lambda r: np.zeros(33, np.int64)), "exceed max_length 32"),
        (_corrupt("loss_mask", lambda r: np.full(len(r["input_ids"]), 2)), "loss_mask must be bool"),
        (_corrupt("input_ids", lambda r: r["input_ids"].astype(np.float32)), "must hold integers"),
        (_corrupt("tail_mass", lambda r: np.full(len(r["input_ids"]), 1.5)),
         r"tail_mass must be finite and in \[0, 1\]"),
    ],
)
def test_bad_rows_are_refused_naming_the_source(tmp_path, change, message):
    spec = make_spec()
    row = make_rows(spec, lengths=[10])[0]
    change(row)
    writer = CacheWriter(tmp_path, spec)
    with pytest.raises(ValueError, match=f"row from data.jsonl record 17: .*{message}"):
        writer.add(**row, source={"file": "data.jsonl", "index": 17})


def test_duplicate_source_is_refused(tmp_path):
    spec = make_spec()
    row = make_rows(spec, lengths=[4])[0]
    writer = CacheWriter(tmp_path, spec)
    writer.add(**row, source={"file": "a.jsonl", "index": 0})
    with pytest.raises(ValueError, match="record 0 of a.jsonl was already written"):
        writer.reject(source={"file": "a.jsonl", "index": 0}, reason="too long")


def test_rejects_are_listed_sorted(tmp_path):
    spec = make_spec()
    rows = make_rows(spec, lengths=[4, 4])
    with CacheWriter(tmp_path, spec) as writer:
        writer.reject(source={"file": "b.jsonl", "index": 3}, reason="empty reply")
        writer.add(**rows[0], source={"file": "a.jsonl", "index": 0})
        writer.reject(source={"file": "a.jsonl", "index": 9}, reason="too long")
    cache = finalize_cache(tmp_path, spec, 1)
    lines = [json.loads(line) for line in cache.rejected_path.read_text().splitlines()]
    assert lines == [
        {"file": "a.jsonl", "index": 9, "reason": "too long"},
        {"file": "b.jsonl", "index": 3, "reason": "empty reply"},
    ]
    assert cache.manifest["num_rejected"] == 2
    assert CacheWriter(tmp_path, spec).done_sources == {("a.jsonl", 0), ("a.jsonl", 9), ("b.jsonl", 3)}


# ------------------------------------------------------------------------- resume


@pytest.mark.parametrize("stop_after", [2, 3, 7])
def test_resume_after_a_crash_writes_identical_shards(tmp_path, stop_after):
    spec = make_spec()
    rows = make_rows(spec)
    reference = tmp_path / "reference"
    write(reference, spec, rows)

    resumed = tmp_path / "resumed"
    writer = CacheWriter(resumed, spec)
    for index in range(stop_after):
        writer.add(**rows[index], source={"file": "data.jsonl", "index": index})
    del writer  # a crash: no close, the open shard stays a temporary

    writer = CacheWriter(resumed, spec)
    complete = stop_after // spec.shard_max_rows * spec.shard_max_rows
    assert writer.done_sources == {("data.jsonl", i) for i in range(complete)}
    for index in range(len(rows)):
        if ("data.jsonl", index) not in writer.done_sources:
            writer.add(**rows[index], source={"file": "data.jsonl", "index": index})
    writer.close()
    finalize_cache(resumed, spec, 1)
    assert shard_digests(resumed) == shard_digests(reference)
    assert not list((resumed / "shards").glob("*.tmp"))


def test_resume_refuses_another_configuration(tmp_path):
    CacheWriter(tmp_path, make_spec()).close()
    with pytest.raises(ValueError, match=r"different configuration \(fields \['top_k'\] differ\)"):
        CacheWriter(tmp_path, make_spec(top_k=4))
    CacheWriter(tmp_path, make_spec(options={"batch_size": 3})).close()  # options may change


def test_resume_refuses_another_world_size(tmp_path):
    CacheWriter(tmp_path, make_spec(), rank=0, world_size=2).close()
    with pytest.raises(ValueError, match="started with world_size 2"):
        CacheWriter(tmp_path, make_spec(), rank=0, world_size=1)


def test_finalize_needs_every_rank_closed(tmp_path):
    spec = make_spec()
    CacheWriter(tmp_path, spec, rank=0, world_size=2).close()
    CacheWriter(tmp_path, spec, rank=1, world_size=2)
    with pytest.raises(ValueError, match="rank 1 has not closed its writer"):
        finalize_cache(tmp_path, spec, 2)


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from dflash.shards import CacheSpec, CacheWriter
    from dflash.shards.synthetic import synthetic_row
    spec = CacheSpec(**{spec})
    writer = CacheWriter(sys.argv[1], spec)
    for index in range({start}, {stop}):
        row = synthetic_row(np.random.default_rng(index), spec, 16)
        writer.add(**row, source={{"file": "data.jsonl", "index": index}})
    print("ready", flush=True)
    time.sleep(60)
""")


def _row(spec, index):
    return synthetic_row(np.random.default_rng(index), spec, 16)


def _write_then_get_killed(cache_dir, spec, start, stop):
    """Run a writer in a subprocess that adds records [start, stop), then SIGKILL it."""
    script = KILLED_WRITER.format(spec=repr(spec.to_dict()), start=start, stop=stop)
    proc = subprocess.Popen([sys.executable, "-c", script, str(cache_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.e2e  # SIGKILLed writer subprocesses
def test_killed_writer_leaves_no_readable_partial_shard(tmp_path):
    spec = make_spec(shard_max_rows=2)
    # A finalized cache of records 0-3 (two shards), then a later run adds 4-8 and is killed
    # while its third shard (record 8) is open.
    with CacheWriter(tmp_path, spec) as writer:
        for index in range(4):
            writer.add(**_row(spec, index), source={"file": "data.jsonl", "index": index})
    finalize_cache(tmp_path, spec, 1)
    _write_then_get_killed(tmp_path, spec, 4, 9)

    shards = tmp_path / "shards"
    assert sorted(p.name for p in shards.glob("*.arrow")) == [f"rank00000-0000{i}.arrow" for i in range(4)]
    partial = shards / "rank00000-00004.arrow.tmp"
    assert partial.exists()
    with pytest.raises(pa.ArrowInvalid):
        pa.ipc.open_file(pa.memory_map(str(partial)))
    # The finalized cache still opens and reads, untouched by the killed run.
    cache = open_cache(tmp_path)
    assert len(cache) == 4
    np.testing.assert_array_equal(cache[3].input_ids, _row(spec, 3)["input_ids"])
    assert verify_cache(tmp_path)["ok"]

    writer = CacheWriter(tmp_path, spec)
    assert writer.done_sources == {("data.jsonl", i) for i in range(8)}
    assert not partial.exists()
    writer.add(**_row(spec, 8), source={"file": "data.jsonl", "index": 8})
    writer.close()
    cache = finalize_cache(tmp_path, spec, 1)
    assert [cache.source(i)["index"] for i in range(len(cache))] == list(range(9))
    np.testing.assert_array_equal(cache[8].input_ids, _row(spec, 8)["input_ids"])
    assert verify_cache(tmp_path)["ok"]


@pytest.mark.e2e  # a SIGKILLed writer subprocess
def test_killed_first_writer_leaves_no_cache(tmp_path):
    spec = make_spec(shard_max_rows=2)
    _write_then_get_killed(tmp_path, spec, 0, 3)
    assert [p.name for p in (tmp_path / "shards").glob("*.arrow*")] != []
    with pytest.raises(ValueError, match="manifest.json does not exist"):
        open_cache(tmp_path)


# ------------------------------------------------------------------------- background writes


def test_background_writer_matches_synchronous(tmp_path):
    spec = make_spec()
    rows = make_rows(spec)
    write(tmp_path / "sync", spec, rows)
    write(tmp_path / "background", spec, rows, background=True)
    assert shard_digests(tmp_path / "sync") == shard_digests(tmp_path / "background")


def test_background_writer_reraises_in_the_caller(tmp_path, monkeypatch):
    spec = make_spec()
    rows = make_rows(spec)

    def failing_encode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("dflash.shards.rows.encode_row", failing_encode)
    writer = CacheWriter(tmp_path, spec, background=True)
    with pytest.raises(OSError, match="disk full") as info:
        for index, row in enumerate(rows):
            writer.add(**row, source={"file": "data.jsonl", "index": index})
        writer.close()
    if sys.version_info >= (3, 11):  # exception notes
        assert any("background thread" in note for note in info.value.__notes__)
    assert not (tmp_path / "shards" / "rank00000.done.json").exists()


# ------------------------------------------------------------------------- refusals and damage


def _edit_manifest(cache_dir: Path, edit) -> None:
    path = cache_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def test_unknown_format_version_is_refused(tmp_path):
    spec = make_spec()
    write(tmp_path, spec, make_rows(spec, lengths=[3]))
    _edit_manifest(tmp_path, lambda m: m.update(format_version=FORMAT_VERSION + 98))
    with pytest.raises(ValueError, match=rf"version {FORMAT_VERSION + 98}; this dflash reads version\(s\) "
                                         rf"{', '.join(map(str, READ_VERSIONS))}\. "
                                         r"Upgrade dflash .* re-run dflash-precompute"):
        open_cache(tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("shards", "../../etc/passwd", "points outside the cache directory"),
        ("shards", "/etc/passwd", "must be a relative path"),
        ("rejected", "../rejected.jsonl", "points outside the cache directory"),
        ("target_dir", "shards/../../x", "points outside the cache directory"),
    ],
)
def test_paths_leaving_the_cache_are_refused(tmp_path, field, value, message):
    spec = make_spec()
    write(tmp_path, spec, make_rows(spec, lengths=[3]))

    def edit(manifest):
        if field == "shards":
            manifest["shards"][0]["path"] = value
        else:
            manifest[field] = value

    _edit_manifest(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        open_cache(tmp_path)


def _pop(path: str):
    """An edit removing the manifest field at a dotted path (an int part indexes a list)."""
    def edit(manifest):
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        holder = manifest
        for part in parents:
            holder = holder[part]
        del holder[last]
    return edit


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_pop("sequences"), "field sequences is missing"),
        (_pop("sequences.source_index"), "field sequences.source_index is missing"),
        (_pop("source_files"), "field source_files is missing"),
        (_pop("spec.max_length"), r"field spec is not a valid cache spec \(.*max_length"),
        (lambda m: m["spec"].update(oppions=m["spec"].pop("options")), r"field spec .*\['oppions'\]"),
        (_pop("shards.0.sha256"), r"field shards\[0\]\.sha256 is missing"),
        (_pop("shards.0.num_bytes"), r"field shards\[0\]\.num_bytes is missing"),
        (lambda m: m["shards"][0].update(num_sequences="3"), r"field shards\[0\]\.num_sequences must be a int"),
        (lambda m: m["sequences"]["length"].pop(), "the sequences columns have different lengths"),
        (lambda m: m["sequences"]["source_file"].__setitem__(0, 7), "field sequences.source_file points outside"),
    ],
)
def test_damaged_manifest_field_is_named(tmp_path, edit, field):
    """A missing or mistyped manifest field: a ValueError naming manifest.json and the field and
    saying what to do, from open_cache and as a problem from verify (fault F6)."""
    spec = make_spec()
    write(tmp_path, spec, make_rows(spec))
    _edit_manifest(tmp_path, edit)
    message = rf"manifest\.json: {field}.*rebuild the cache .* or restore manifest\.json"
    with pytest.raises(ValueError, match=message):
        open_cache(tmp_path)
    report = verify_cache(tmp_path)
    assert not report["ok"] and re.search(message, report["problems"][0]["problem"])


def test_shard_from_another_cache_of_the_same_spec_is_refused(tmp_path):
    """Same spec, sizes and sources, other values (crc32 valid in each row): the manifest's
    rows_sha256 tells them apart when the shard is opened (fault F5)."""
    spec = make_spec()
    write(tmp_path / "a", spec, make_rows(spec, seed=0))
    write(tmp_path / "b", spec, make_rows(spec, seed=1))
    name = "shards/rank00000-00001.arrow"
    assert (tmp_path / "a" / name).stat().st_size == (tmp_path / "b" / name).stat().st_size
    (tmp_path / "a" / name).write_bytes((tmp_path / "b" / name).read_bytes())
    cache = open_cache(tmp_path / "a")
    cache[0]  # other shards still read
    with pytest.raises(ValueError, match=r"rank00000-00001\.arrow: its rows .* do not match the manifest's "
                                         r"rows_sha256: the shard belongs to another cache"):
        cache[3]
    report = verify_cache(tmp_path / "a")
    assert {p["shard"] for p in report["problems"]} == {name}


def test_symlink_out_of_the_cache_is_refused(tmp_path):
    spec = make_spec()
    write(tmp_path / "cache", spec, make_rows(spec, lengths=[3]))
    shard = tmp_path / "cache" / "shards" / "rank00000-00000.arrow"
    shard.rename(tmp_path / "elsewhere.arrow")
    shard.symlink_to(tmp_path / "elsewhere.arrow")
    cache = open_cache(tmp_path / "cache")
    with pytest.raises(ValueError, match="outside the cache directory"):
        cache[0]


def test_truncated_shard_is_caught(tmp_path):
    spec = make_spec()
    write(tmp_path, spec, make_rows(spec))
    shard = tmp_path / "shards" / "rank00000-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:-100])
    report = verify_cache(tmp_path)
    assert not report["ok"]
    assert {p["shard"] for p in report["problems"]} == {"shards/rank00000-00001.arrow"}
    cache = open_cache(tmp_path)
    cache[0]  # other shards still read
    with pytest.raises(ValueError, match=r"rank00000-00001\.arrow is \d+ bytes, the manifest records \d+"):
        cache[3]


@pytest.mark.parametrize("where", [0.3, 0.5, 0.8])
def test_flipped_byte_is_caught(tmp_path, where):
    spec = make_spec(shard_max_rows=100)
    write(tmp_path, spec, make_rows(spec))
    shard = tmp_path / "shards" / "rank00000-00000.arrow"
    data = bytearray(shard.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    shard.write_bytes(bytes(data))
    report = verify_cache(tmp_path)
    assert not report["ok"]
    assert report["problems"][0]["shard"] == "shards/rank00000-00000.arrow"
    assert "sha256" in report["problems"][0]["problem"]
    cache = open_cache(tmp_path)
    errors = []
    for i in range(len(cache)):
        try:
            cache[i]
        except ValueError as error:
            errors.append(str(error))
    assert errors and all("rank00000-00000.arrow" in e for e in errors)


def _stored_and_reference_checksums(cache_dir, spec) -> list[tuple[int, int]]:
    """(stored checksum, zlib.crc32 of the row's list values in schema order) per row."""
    from dflash.shards.rows import list_columns, list_values

    pairs = []
    for shard in sorted((cache_dir / "shards").glob("*.arrow")):
        with pa.memory_map(str(shard)) as source:
            reader = pa.ipc.open_file(source)
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                data = b"".join(list_values(batch.column(name)).tobytes() for name, _ in list_columns(spec))
                pairs.append((batch.column("checksum")[0].as_py(), zlib.crc32(data)))
    return pairs


@pytest.mark.parametrize("feature_codec", ["bf16", "fp8"])
def test_row_checksum_is_zlibs_crc32_with_isal_or_without(tmp_path, monkeypatch, feature_codec):
    """isal (a dependency) computes the rows' crc32; zlib is the fallback where it is missing.
    Both must store zlib.crc32 of the concatenated list values (FORMAT.md), so a cache written
    with either reads, checked, with the other."""
    from dflash.shards import rows as rows_module

    assert rows_module.CRC32_IMPL == "isal"  # the dependency is installed and in use
    isal_crc = rows_module.crc32
    for name in ("isal", "isal.isal_zlib"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails, as on a machine without it
    zlib_crc, impl = rows_module._crc32_function()
    assert impl == "zlib" and zlib_crc is zlib.crc32
    spec = make_spec(feature_codec=feature_codec, shard_max_rows=4)
    data = make_rows(spec)
    stored = {}
    for impl, crc in (("isal", isal_crc), ("zlib", zlib_crc)):
        monkeypatch.setattr(rows_module, "crc32", crc)
        write(tmp_path / impl, spec, data)
        stored[impl] = _stored_and_reference_checksums(tmp_path / impl, spec)
        assert len(stored[impl]) == len(LENGTHS) and all(a == b for a, b in stored[impl])
    assert stored["isal"] == stored["zlib"]
    # each cache read, every row checked, with the other implementation
    for written, crc in (("isal", zlib_crc), ("zlib", isal_crc)):
        monkeypatch.setattr(rows_module, "crc32", crc)
        cache = open_cache(tmp_path / written)
        assert [cache.raw(i).input_ids.size for i in range(len(cache))] == LENGTHS


def test_verify_passes_on_a_good_cache(tmp_path):
    spec = make_spec(feature_codec="fp8")
    write_synthetic_cache(tmp_path, spec, LENGTHS, world_size=2)
    report = verify_cache(tmp_path)
    assert report == {"ok": True, "problems": [], "num_shards": 4, "num_sequences": len(LENGTHS)}


@pytest.mark.e2e  # a fresh interpreter
def test_shards_imports_no_torch_or_models(tmp_path):
    spec = make_spec()
    write(tmp_path, spec, make_rows(spec, lengths=[3]))
    script = textwrap.dedent(f"""
        import sys
        import dflash.shards, dflash.shards.cli, dflash.shards.report
        cache = dflash.shards.open_cache({str(tmp_path)!r})
        cache[0], cache.raw(0)
        heavy = {{"torch", "transformers", "pandas", "pyarrow.compute", "matplotlib"}} & set(sys.modules)
        assert not heavy, heavy
    """)
    subprocess.run([sys.executable, "-c", script], check=True)
