"""5. `bad-input`: random mixes of good and malformed records in one input file.

Malformed: invalid JSON, deep nesting, wrong types, missing roles, empty turns, huge lines,
invalid UTF-8, lone surrogates. The run does not crash, processed + rejected = input,
every good record is processed, every malformed one that must be refused is in
rejected.jsonl with its file, line and a reason. Token-id overflow in pre-tokenised input
is not applicable: stage one reads no pre-tokenised records; one with `input_ids` is
rejected like any unknown shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.faults.workspace import Outcome, Workspace, describe, quiet

# Each kind: (must it be rejected?, a generator of one JSONL line as bytes).
# "either": processed or rejected are both right (the text is usable as it is, or not).


def _good(rng: np.random.Generator) -> bytes:
    from dflash.testing.builders import CONVERSATIONS

    conversation = CONVERSATIONS[int(rng.integers(0, len(CONVERSATIONS)))]
    shape = int(rng.integers(0, 3))
    if shape == 0:
        record: dict = {"messages": conversation}
    elif shape == 1:
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        record = {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in conversation]}
    else:
        record = {"prompt": conversation[-2]["content"], "response": conversation[-1]["content"]}
    return json.dumps(record).encode()


def _pick(rng: np.random.Generator, options: list) -> Any:
    return options[int(rng.integers(0, len(options)))]


def _reply(rng: np.random.Generator) -> dict:
    return {"role": "assistant", "content": "Paris is the capital."}


BAD_INPUT_KINDS: dict[str, tuple[str, Callable[[np.random.Generator], bytes]]] = {
    "invalid JSON": ("reject", lambda rng: _pick(rng, [
        "{broken", '{"messages": [}', "{'messages': []}", '{"text": "a"} trailing', "[1, 2,", '{"a":1,}',
        "nul\x00l"]).encode()),
    "deeply nested JSON": ("reject", lambda rng: b"[" * int(rng.integers(10_000, 200_000))),
    "not an object": ("reject", lambda rng: _pick(rng, ['"a string"', "42", "null", "[1, 2]", "true"]).encode()),
    "wrong types": ("reject", lambda rng: json.dumps(_pick(rng, [
        {"messages": "hello"}, {"messages": {"role": "user"}}, {"messages": [1, 2]},
        {"messages": [{"role": "user", "content": 5}, _reply(rng)]},
        {"messages": [{"role": ["user"], "content": "hi"}, _reply(rng)]},
        {"prompt": ["q"], "response": "a"}, {"prompt": "q", "response": {"x": 1}},
        {"text": 3.5}, {"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "a"}]},
    ])).encode()),
    "missing roles": ("reject", lambda rng: json.dumps(_pick(rng, [
        {"messages": [{"content": "hi"}, {"content": "there"}]},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "a"}]},
        {"conversations": [{"value": "hi"}]}, {"prompt": "q"}, {"response": "a"},
        {"unrelated": "field"},
    ])).encode()),
    "empty turns": ("reject", lambda rng: json.dumps(_pick(rng, [
        {"messages": []}, {"conversations": []}, {"text": ""}, {"messages": [{}]},
    ])).encode()),
    "empty reply": ("either", lambda rng: json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}).encode()),
    "huge line": ("either", lambda rng: json.dumps(
        {"messages": [{"role": "user", "content": "hello " * int(rng.integers(1, 40_000))},
                      {"role": "assistant", "content": "fine " * int(rng.integers(1, 40_000))}]}).encode()),
    "invalid UTF-8": ("reject", lambda rng: b'{"messages": [{"role": "user", "content": "caf'
                      + rng.bytes(3).replace(b'"', b"\xff").replace(b"\\", b"\xfe").replace(b"\n", b"\xfd")
                      + b'\xff"}, {"role": "assistant", "content": "ok"}]}'),
    "lone surrogate": ("reject", lambda rng: json.dumps(_pick(rng, [
        {"messages": [{"role": "user", "content": "a\ud800b"}, _reply(rng)]},
        {"text": "x\udfffy"}, {"prompt": "\ud83d", "response": "ok"},
    ])).encode()),
    "pre-tokenised ids": ("reject", lambda rng: json.dumps(
        {"input_ids": [1, 2, int(rng.integers(2**31, 2**62))], "loss_mask": [0, 1, 1]}).encode()),
}


def trial_bad_input(ws: Workspace, rng: np.random.Generator, trial: int,
                    kinds: list[str] | None = None) -> list[Outcome]:
    """One input file of good and malformed records (every kind at least once), one run."""
    from dflash.precompute.config import PrecomputeConfig
    from dflash.precompute.run import run_precompute

    kinds = list(BAD_INPUT_KINDS) if kinds is None else kinds
    # Every kind once, a few kinds twice, between good records, in a random order.
    chosen = kinds + [_pick(rng, kinds) for _ in range(int(rng.integers(0, 4)))]
    lines = [("good", _good(rng)) for _ in range(int(rng.integers(4, 10)))]
    lines += [(kind, BAD_INPUT_KINDS[kind][1](rng)) for kind in chosen]
    lines = [lines[i] for i in rng.permutation(len(lines))]
    root = ws.trial_dir("bad-input", trial)
    data = root / "input.jsonl"
    data.write_bytes(b"".join(line + b"\n" for _, line in lines))
    outcome = Outcome(case="mixed file", notes=[f"{len(lines)} records, kinds {sorted(set(kinds))}"])
    try:
        with quiet():
            run_precompute(PrecomputeConfig(target=ws.target, data=[data], out=root / "cache", top_k=4,
                                            num_feature_layers=3, max_length=256, batch_tokens=2048,
                                            device="cpu", progress=False))
    except Exception as error:  # noqa: BLE001 - a crash is the finding
        outcome.problems.append(f"the run crashed: {describe(error)}")
        return [outcome]
    outcome.problems += _account(root / "cache", data, lines)
    outcome.counts["records"] = len(lines)
    outcome.counts["malformed records"] = sum(kind != "good" for kind, _ in lines)
    outcome.counts["rejected"] = len((root / "cache" / "rejected.jsonl").read_text().splitlines())
    return [outcome]


def _account(cache_dir: Path, data: Path, lines: list[tuple[str, bytes]]) -> list[str]:
    """processed + rejected = input; good records processed; must-reject ones rejected with a reason."""
    from dflash.shards import open_cache

    cache = open_cache(cache_dir)
    processed = {cache.source(i)["index"] for i in range(len(cache))}
    rejected = [json.loads(line) for line in (cache_dir / "rejected.jsonl").read_text().splitlines()]
    problems = []
    if len(processed) + len(rejected) != len(lines) or processed & {r["index"] for r in rejected}:
        problems.append(f"processed ({len(processed)}) + rejected ({len(rejected)}) != input ({len(lines)})")
    for entry in rejected:
        if entry.get("file") != str(data) or not isinstance(entry.get("index"), int) or not entry.get("reason"):
            problems.append(f"rejection without location or reason: {entry}")
    for index, (kind, _) in enumerate(lines):
        if kind == "good" and index not in processed:
            problems.append(f"good record at line {index} was not processed")
        elif kind != "good" and BAD_INPUT_KINDS[kind][0] == "reject" and index in processed:
            problems.append(f"{kind} record at line {index} was trained on instead of rejected")
    return problems
