"""The demo's prompts file: reused when it holds --num-conversations records, refused naming
the file when it holds another number (the cache and run beside it came from it)."""

from __future__ import annotations

import json

import pytest

from demo.run import prompts_file


def _write(path, count):
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text("".join(json.dumps({**record, "id": str(i)}) + "\n" for i in range(count)) + "\n")


def test_a_file_with_the_asked_number_is_reused(tmp_path):
    _write(tmp_path / "chitchat.jsonl", 3)
    before = (tmp_path / "chitchat.jsonl").read_bytes()
    assert prompts_file(tmp_path, 3) == tmp_path / "chitchat.jsonl"
    assert (tmp_path / "chitchat.jsonl").read_bytes() == before


def test_a_file_with_another_number_is_refused_by_name(tmp_path):
    _write(tmp_path / "chitchat.jsonl", 3)
    with pytest.raises(SystemExit) as raised:
        prompts_file(tmp_path, 5)
    message = str(raised.value)
    assert str(tmp_path / "chitchat.jsonl") in message
    assert "holds 3 conversations" in message and "asks for 5" in message
