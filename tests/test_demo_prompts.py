"""The demo's prompts files: written with the asked range of conversations, reused when they
hold the asked number of records, refused naming the file when they hold another number (the
caches and run beside them came from them)."""

from __future__ import annotations

import json

import pytest

import demo.run
from demo.run import prompts_file
from dflash.testing.builders import read_jsonl


def _record(i):
    return {"id": str(i), "messages": [{"role": "user", "content": f"hi {i}"},
                                       {"role": "assistant", "content": "hello"}]}


def _write(path, count):
    path.write_text("".join(json.dumps(_record(i)) + "\n" for i in range(count)) + "\n")


def test_a_file_with_the_asked_number_is_reused(tmp_path):
    _write(tmp_path / "chitchat.jsonl", 3)
    before = (tmp_path / "chitchat.jsonl").read_bytes()
    assert prompts_file(tmp_path / "chitchat.jsonl", first=0, count=3, flag="--n") == tmp_path / "chitchat.jsonl"
    assert (tmp_path / "chitchat.jsonl").read_bytes() == before


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\u0085"])
def test_a_prompt_holding_a_line_separator_is_one_record(tmp_path, separator):
    """The demo writes its prompts with ensure_ascii=False, so a prompt's U+2028 (U+2029, U+0085)
    is in the file raw; `str.splitlines` splits there, and the rerun then refused its own file."""
    records = [_record(0), {"id": "1", "messages": [{"role": "user", "content": f"one{separator}two"},
                                                   {"role": "assistant", "content": "hello"}]}, _record(2)]
    path = tmp_path / "chitchat.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert separator in path.read_text(encoding="utf-8")
    assert prompts_file(path, first=0, count=3, flag="--num-conversations") == path


def test_a_file_with_another_number_is_refused_by_name(tmp_path):
    _write(tmp_path / "chitchat.jsonl", 3)
    with pytest.raises(SystemExit) as raised:
        prompts_file(tmp_path / "chitchat.jsonl", first=0, count=5, flag="--num-conversations")
    message = str(raised.value)
    assert str(tmp_path / "chitchat.jsonl") in message
    assert "holds 3 conversations" in message and "--num-conversations asks for 5" in message


def test_a_new_file_holds_the_conversations_after_the_first(tmp_path, monkeypatch):
    asked = []

    def records(limit, max_turns):
        asked.append((limit, max_turns))
        return [_record(i) for i in range(min(limit, 10))]

    monkeypatch.setattr(demo.run, "chitchat_records", records)
    path = prompts_file(tmp_path / "human.jsonl", first=4, count=3, flag="--human-conversations")
    written = read_jsonl(path)
    assert [r["id"] for r in written] == ["4", "5", "6"] and written[0] == _record(4)
    assert asked == [(7, 2)]  # the first exchange of the first 7 conversations
    with pytest.raises(SystemExit, match="has only 10 usable conversations, 2 after the first 8"):
        prompts_file(tmp_path / "more.jsonl", first=8, count=5, flag="--human-conversations")
    assert not (tmp_path / "more.jsonl").exists()
