"""Stage one's input side: readers, record normalisation, chat rendering and the assistant
loss mask (against ChatML and Llama-3 templates on tiny in-code tokenizers), and the plan
(rank assignment, batching)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash.common.records import RecordError, input_sha256, iter_records, normalize_record
from dflash.precompute.data import ChatEncoder
from dflash.precompute.plan import assign_ranks, plan_batches
from dflash.testing.builders import CONVERSATIONS, build_tokenizer, write_jsonl

EOT = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def tokenizer(request):
    tok = build_tokenizer(request.param)
    tok.style = request.param
    return tok


def masked_runs(tokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The decoded text of each maximal run of masked tokens."""
    runs, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(tokenizer.decode(ids[start:i].tolist()))
            start = None
    return runs


# ----------------------------------------------------------------------------- readers

def test_jsonl_reader_indexes_lines_and_reports_bad_json(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}, "{not json", {"text": "b"}])
    with open(path, "a") as f:
        f.write("\n" + json.dumps({"text": "c"}) + "\n")  # a blank line is not a record
    records = list(iter_records([path]))
    assert [(r.index, r.data, r.error is None) for r in records] == [
        (0, {"text": "a"}, True), (1, None, False), (2, {"text": "b"}, True), (4, {"text": "c"}, True)]
    assert records[1].error.startswith("invalid JSON")
    assert records[0].source == {"file": str(path), "index": 0}


def test_jsonl_reader_rejects_lines_it_cannot_parse(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "caf\xff"}\n' + b"[" * 200_000 + b'\n{"text": "ok"}\n')
    records = list(iter_records([path]))
    assert [(r.index, r.error) for r in records] == [
        (0, "invalid UTF-8 at byte 13"), (1, "invalid JSON: nested too deeply to parse"), (2, None)]


def test_json_parquet_and_datasets_readers_agree(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "p0", "response": "r0"}, {"prompt": "p1", "response": "r1"}]
    (tmp_path / "list.json").write_text(json.dumps(rows))
    (tmp_path / "map.json").write_text(json.dumps({"x": rows[0], "y": rows[1]}))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    for name in ["list.json", "map.json", "t.parquet", "ds", "dd"]:
        records = list(iter_records([tmp_path / name]))
        assert [r.data for r in records] == rows, name
        assert [r.index for r in records] == [0, 1]
    assert list(iter_records([tmp_path / "dd"]))[0].file == str(tmp_path / "dd" / "train")


def test_limit_counts_records_across_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}, {"text": "b"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "c"}, {"text": "d"}])
    records = list(iter_records([a, b], limit=3))
    assert [(r.file, r.index) for r in records] == [(str(a), 0), (str(a), 1), (str(b), 0)]


@pytest.mark.parametrize("name", ["missing.jsonl", "data.csv"])
def test_unknown_inputs_are_user_errors(tmp_path, name):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=name):
        list(iter_records([tmp_path / name]))


def write_records(path, rows):
    """`rows` in the format that `path`'s name asks for."""
    if path.name.endswith((".parquet", ".pq")):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.name.endswith(".json"):
        path.write_text(json.dumps(rows))
    else:
        data = "".join(json.dumps(row) + "\n" for row in rows).encode()
        if path.name.endswith(".zst"):
            import zstandard

            data = zstandard.ZstdCompressor().compress(data)
        path.write_bytes(data)


@pytest.mark.parametrize("suffix", [".jsonl", ".ndjson", ".jsonl.zst", ".ndjson.zst", ".json", ".parquet", ".pq"])
def test_every_accepted_suffix_is_read_and_named_by_the_unknown_format_error(tmp_path, suffix):
    rows = [{"prompt": "p0", "response": "r0"}, {"prompt": "p1", "response": "r1"}]
    path = tmp_path / f"records{suffix}"
    write_records(path, rows)
    assert [r.data for r in iter_records([path])] == rows
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown format '.csv'") as error:
        list(iter_records([tmp_path / "data.csv"]))
    assert suffix in {word.strip(",") for word in str(error.value).split()}


def test_input_sha256_covers_directory_contents(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("1")
    before = input_sha256(tmp_path / "d")
    (tmp_path / "d" / "x").write_text("2")
    assert input_sha256(tmp_path / "d") != before


# ----------------------------------------------------------------------------- records

@pytest.mark.parametrize("record, expected", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}, {"type": "text", "text": "2"}]},
                   {"role": "assistant", "content": "a"}]},
     [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a"}]),
    ({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                        {"from": "gpt", "value": "a"}]},
     [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
      {"role": "assistant", "content": "a"}]),
    ({"prompt": "q", "response": "a", "system": "s"},
     [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
      {"role": "assistant", "content": "a"}]),
    ({"text": "plain"}, "plain"),
])
def test_normalize_record_shapes(record, expected):
    assert normalize_record(record) == expected


@pytest.mark.parametrize("record, reason", [
    ([1, 2], "not an object"),
    ({"other": 1}, "none of the fields"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user", "content": "q"}]}, "no assistant turn"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}, r"messages\[0\].content' is missing"),
    ({"messages": [{"content": "q"}]}, "has no 'role'"),
    ({"conversations": [{"from": "alien", "value": "q"}]}, "alien"),
    ({"prompt": "q"}, "'response' is missing"),
    ({"prompt": "q", "response": 3}, "must be a string"),
    ({"text": ""}, "empty"),
    ({"text": "x\udfffy"}, r"'text' holds invalid Unicode \(a lone surrogate at character 1\)"),
    ({"messages": [{"role": "user\ud800", "content": "q"}]}, "invalid Unicode"),
    ({"prompt": "\ud83d", "response": "ok"}, "invalid Unicode"),
])
def test_normalize_record_rejects_with_reason(record, reason):
    with pytest.raises(RecordError, match=reason):
        normalize_record(record)


# ----------------------------------------------------------------------------- loss mask

@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_mask_covers_assistant_content_and_end_of_turn(tokenizer, conversation):
    messages = CONVERSATIONS[conversation]
    encoded = ChatEncoder(tokenizer, max_length=1024).encode(messages)
    # The tokens are the template's rendering, exactly.
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(encoded.input_ids.tolist()) == rendered
    # Llama 3's template trims the content; ChatML keeps it verbatim.
    strip = str.strip if tokenizer.style == "llama3" else (lambda s: s)
    expected = [strip(m["content"]) + EOT[tokenizer.style] for m in messages if m["role"] == "assistant"]
    assert masked_runs(tokenizer, encoded.input_ids, encoded.loss_mask) == expected
    assert not encoded.truncated


def test_reply_that_repeats_the_prompt_is_found_after_the_prompt(tokenizer):
    messages = [{"role": "user", "content": "Paris."}, {"role": "assistant", "content": "Paris."}]
    encoder = ChatEncoder(tokenizer, max_length=1024)
    encoded = encoder.encode(messages)
    assert masked_runs(tokenizer, encoded.input_ids, encoded.loss_mask) == ["Paris." + EOT[tokenizer.style]]
    # The reply starts right after the generation prompt, not at the user's copy.
    assert np.flatnonzero(encoded.loss_mask)[0] == len(encoder.prompt_ids(messages[:1]))


def test_empty_reply_trains_only_the_end_of_turn(tokenizer):
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": ""}]
    encoded = ChatEncoder(tokenizer, max_length=1024).encode(messages)
    assert masked_runs(tokenizer, encoded.input_ids, encoded.loss_mask) == [EOT[tokenizer.style]]


def test_text_records_train_every_token(tokenizer):
    encoded = ChatEncoder(tokenizer, max_length=1024).encode("The quick brown fox.")
    assert tokenizer.decode(encoded.input_ids.tolist()) == "The quick brown fox."
    assert encoded.loss_mask.all()


def test_truncation_cuts_and_counts(tokenizer):
    full = ChatEncoder(tokenizer, max_length=1024).encode(CONVERSATIONS[1])
    first_masked = int(np.flatnonzero(full.loss_mask)[0])
    cut = ChatEncoder(tokenizer, max_length=first_masked + 2).encode(CONVERSATIONS[1])
    assert cut.truncated and len(cut.input_ids) == first_masked + 2
    np.testing.assert_array_equal(cut.input_ids, full.input_ids[: first_masked + 2])
    np.testing.assert_array_equal(cut.loss_mask, full.loss_mask[: first_masked + 2])
    with pytest.raises(RecordError, match="--max-length"):
        ChatEncoder(tokenizer, max_length=first_masked).encode(CONVERSATIONS[1])


def test_template_errors_and_rewritten_content_are_record_errors(tokenizer):
    tokenizer = build_tokenizer(tokenizer.style)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(RecordError, match="roles must alternate"):
        ChatEncoder(tokenizer, 64).encode(CONVERSATIONS[0])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(RecordError, match="does not appear verbatim"):
        ChatEncoder(tokenizer, 64).encode(CONVERSATIONS[0])


def test_prompt_ids_end_with_the_generation_prompt(tokenizer):
    encoder = ChatEncoder(tokenizer, max_length=1024)
    ids = encoder.prompt_ids(CONVERSATIONS[0][:1])
    header = "<|im_start|>assistant\n" if tokenizer.style == "chatml" else \
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert tokenizer.decode(ids).endswith(header)


# ----------------------------------------------------------------------------- plan

@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_assign_ranks_is_a_balanced_partition(world_size):
    rng = np.random.default_rng(world_size)
    lengths = rng.integers(1, 3000, size=101).tolist()
    assigned = assign_ranks(lengths, world_size)
    assert sorted(i for rank in assigned for i in rank) == list(range(101))
    loads = [sum(lengths[i] for i in rank) for rank in assigned]
    assert max(loads) - min(loads) <= max(lengths)
    for rank in assigned:  # longest first
        assert [lengths[i] for i in rank] == sorted((lengths[i] for i in rank), reverse=True)
    assert assign_ranks(lengths, world_size) == assigned


def test_assign_ranks_reference():
    assert assign_ranks([5, 1, 4, 4, 2], 2) == [[0, 4, 1], [2, 3]]


@pytest.mark.parametrize("budget", [1, 7, 20, 1000])
def test_plan_batches_respects_the_padded_budget(budget):
    lengths = [3, 9, 4, 4, 1, 12, 5, 5]
    batches = plan_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        padded = len(batch) * max(lengths[i] for i in batch)
        assert padded <= budget or len(batch) == 1
    flat = [i for b in batches for i in b]
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)


def test_plan_batches_reference():
    assert plan_batches([3, 9, 4, 4, 1, 12], 12) == [[5], [1], [2, 3, 0], [4]]
