"""Benchmark suites by name (`eval --online --prompts gsm8k`): z-lab's prompt formats, local
copies in each suite's own column layout (JSONL and a `datasets` folder), the one-line error
when the hub cannot be reached, and MT-Bench's second turn asked after the first turn's own
decoded reply. The suite rows are a few that the tests write themselves, in the hub
datasets' columns (no suite data ships with dflash).
"""

import json

import pytest
import torch

from dflash.testing.builders import char_chat_target, char_tokenizer, write_jsonl
from dflash.train.online import ChatRenderer, evaluate_online, suite_prompts
from dflash.train.speculative import DrafterProposer
from dflash.train.suites import MATH_SUFFIX, SUITES, load_suite, suite_specs

# Two rows per suite in the hub dataset's columns, and the first row's user turns as z-lab's
# benchmark formats them.
ROWS = {
    "gsm8k": ([{"question": "Tom has 3 apples and buys 2. How many?", "answer": "5"},
               {"question": "What is 6 times 7?", "answer": "42"}],
              ["Tom has 3 apples and buys 2. How many?" + MATH_SUFFIX]),
    "math500": ([{"problem": "Solve $x + 1 = 3$.", "solution": "x = 2", "answer": "2"},
                 {"problem": "Compute $2^5$.", "solution": "32", "answer": "32"}],
                ["Solve $x + 1 = 3$.\nPlease reason step by step, and put your final answer within \\boxed{}."]),
    "humaneval": ([{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n"},
                   {"task_id": "HumanEval/1", "prompt": "def neg(a):\n"}],
                  ["Write a solution to the following problem and make sure that it passes the tests:\n"
                   "```python\ndef add(a, b):\n    \"\"\"Add.\"\"\"\n\n```"]),
    "mbpp": ([{"task_id": 2, "prompt": "Write a function to add two numbers.", "code": "", "test_list": []},
              {"task_id": 3, "prompt": "Write a function to negate a number.", "code": "", "test_list": []}],
             ["Write a function to add two numbers."]),
    "mt-bench": ([{"prompt_id": 1, "category": "writing", "prompt": ["Write a poem.", "Now shorter."]},
                  {"prompt_id": 2, "category": "math", "prompt": ["What is 2+2?", "And 3+3?"]}],
                 ["Write a poem.", "Now shorter."]),
}


@pytest.mark.parametrize("name", list(SUITES))
def test_a_local_jsonl_copy_gives_zlabs_prompt_format(tmp_path, name):
    rows, first = ROWS[name]
    path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    items = load_suite(name, path)
    assert [item.turns for item in items][0] == first and len(items) == 2
    assert items[1].source == {"file": str(path), "index": 1}
    assert len(load_suite(name, path, limit=1)) == 1


@pytest.mark.parametrize("name", ["gsm8k", "mt-bench"])
def test_a_datasets_folder_reads_the_suites_split(tmp_path, name):
    import datasets

    rows, first = ROWS[name]
    split = SUITES[name].split
    datasets.DatasetDict({split: datasets.Dataset.from_list(rows),
                          "other": datasets.Dataset.from_list(rows[1:])}).save_to_disk(str(tmp_path / name))
    items = load_suite(name, tmp_path / name)
    assert items[0].turns == first and len(items) == 2


def test_zlabs_cached_turns_are_used_as_they_are(tmp_path):
    path = write_jsonl(tmp_path / "cached.jsonl", [{"turns": ["already formatted", "second"]}])
    assert load_suite("mt-bench", path)[0].turns == ["already formatted", "second"]


def test_a_row_without_the_suites_column_is_refused_by_name(tmp_path):
    path = write_jsonl(tmp_path / "wrong.jsonl", [{"problem": "a math500 row"}])
    with pytest.raises(ValueError, match=r"wrong.jsonl record 1: a gsm8k row needs column 'question'"):
        load_suite("gsm8k", path)


def test_offline_the_hub_error_is_one_line_that_says_how_to_pass_a_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # conftest sets it too: no test reaches the network
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty local cache
    with pytest.raises(ValueError) as error:
        load_suite("gsm8k")
    message = str(error.value)
    assert "\n" not in message and "openai/gsm8k" in message
    assert "--prompts gsm8k=PATH" in message and "'question'" in message


def test_prompts_names_suites_or_a_file(tmp_path):
    records = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "hi"}])
    assert suite_specs(str(records)) is None
    assert suite_specs(f"gsm8k,mt-bench={records}") == [("gsm8k", None), ("mt-bench", str(records))]
    with pytest.raises(ValueError, match="'gsm9k' is not a suite"):
        suite_specs("gsm9k")
    with pytest.raises(ValueError, match="does not exist"):
        suite_specs(f"gsm8k={tmp_path / 'missing.jsonl'}")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mt_benchs_second_turn_follows_the_first_turns_decoded_reply(tmp_path, monkeypatch, temperature):
    import dflash.train.online as online
    from dflash.testing.builders import drafter_config
    from dflash.train.model import DFlashDrafter, TargetHead

    tokenizer = char_tokenizer()
    target = char_chat_target(tokenizer)
    renderer = ChatRenderer(tokenizer)
    path = write_jsonl(tmp_path / "mt.jsonl", ROWS["mt-bench"][0])
    prompts = suite_prompts(load_suite("mt-bench", path), renderer)
    torch.manual_seed(1)
    config = drafter_config(num_hidden_layers=1, vocab_size=len(tokenizer), target_layer_ids=[1, 3],
                            num_target_layers=6, num_drafts=3, mask_token_id=len(tokenizer) - 1)
    head = TargetHead(embed_tokens=target.get_input_embeddings().weight.detach(),
                      lm_head=target.get_output_embeddings().weight.detach())
    decoded = []  # (prompt ids, output tokens) of every speculative call
    real = online.speculative_generate

    def recording(target, proposer, prompt_ids, **kwargs):
        out = real(target, proposer, prompt_ids, **kwargs)
        decoded.append((list(prompt_ids), out.tokens))
        return out

    monkeypatch.setattr(online, "speculative_generate", recording)
    result = evaluate_online(target, DrafterProposer(DFlashDrafter(config, attention="dense"), head), prompts,
                             max_new_tokens=12, verify_size=4, layer_ids=[1, 3], stop_token_ids={2}, warmup=False,
                             temperature=temperature, renderer=renderer)
    assert result["num_prompts"] == 2 and result["num_turns"] == 4
    assert [(p["index"], p["turn"]) for p in result["per_prompt"]] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for row, (first, second) in zip(ROWS["mt-bench"][0], [decoded[0:2], decoded[2:4]]):
        turn1, turn2 = row["prompt"]
        assert first[0] == renderer.ids([{"role": "user", "content": turn1}])
        reply = tokenizer.decode(first[1], skip_special_tokens=True)
        assert second[0] == renderer.ids([{"role": "user", "content": turn1},
                                          {"role": "assistant", "content": reply},
                                          {"role": "user", "content": turn2}])
    assert result["lossless"] is (True if temperature == 0 else None)
    assert len(result["per_position_acceptance"]) == 3
    json.dumps(result)  # the report is JSON
