"""A drafter kind registered from this one file (train/drafters/): DFlash under its own export
architecture, run through `fit`, `eval` offline and online, and `export` by their commands,
with no other file touched: the registry is the one place a kind plugs in."""

import json
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from dflash.testing.builders import char_chat_target, char_tokenizer
from dflash.train import drafters
from dflash.train.cli import main
from dflash.train.drafters.dflash import DFlashKind
from dflash.train.loading import load_drafter, load_exported
from dflash.train.model import DrafterConfig
from tests.test_eval_cli import last_json, regenerated_cache


@dataclass(kw_only=True)
class ToyConfig(DrafterConfig):
    kind: ClassVar[str | None] = "toy"


class ToyKind(DFlashKind):
    """DFlash, exported as "ToyDraftModel"."""

    name = "toy"
    title = "Toy"
    architecture = "ToyDraftModel"
    config_class = ToyConfig


drafters.register(ToyKind())


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    tokenizer = char_tokenizer()
    target = char_chat_target(tokenizer)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    words = ["hello", "how are you", "tell me a story", "what is this", "ok", "fine thanks", "why", "no"]
    prompts = root / "chat.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": words[(i * 5) % 8] + "?"}]})
                               + "\n" for i in range(8)))
    regenerated_cache(target, tokenizer, prompts, root / "cache", max_new_tokens=16)
    result = CliRunner().invoke(main, [
        "fit", "--cache", str(root / "cache"), "--out", str(root / "run"), "--drafter", "toy", "--num-layers", "1",
        "--num-drafts", "3", "--tokens-per-step", "96", "--anchors-per-seq", "8", "--max-steps", "3",
        "--checkpoint-every", "3", "--eval-every", "0", "--eval-fraction", "0.3", "--no-wandb"])
    assert result.exit_code == 0, result.output
    return root


def test_fit_trains_the_registered_kind(toy_run):
    loaded = load_drafter(toy_run / "run")
    assert type(loaded.drafter.config) is ToyConfig and loaded.step == 3
    assert '"kind": "toy"' in (toy_run / "run" / "drafter_config.json").read_text()


def test_eval_offline_and_online(toy_run):
    result = CliRunner().invoke(main, [
        "eval", "--online", "--run", str(toy_run / "run"), "--cache", str(toy_run / "cache"),
        "--target", str(toy_run / "target"), "--prompts", str(toy_run / "chat.jsonl"), "--max-new-tokens", "16",
        "--json"])
    assert result.exit_code == 0, result.output
    figures = last_json(result.output)
    online = figures["online"]
    assert online["lossless"] is True and 1.0 <= online["acceptance_length"] <= 4.0
    steps = [n for p in online["per_prompt"] for n in p["acceptance_lengths"]]
    assert np.mean(steps) == pytest.approx(online["acceptance_length"])
    # offline, decoding replayed along the cached greedy replies commits what online decoding does
    assert figures["replay_acceptance_length"] == pytest.approx(online["acceptance_length"], abs=1e-12)


def test_export_writes_the_kind_and_loads_back(toy_run):
    out = toy_run / "toy-export"
    result = CliRunner().invoke(main, ["export", "--run", str(toy_run / "run"), "--out", str(out),
                                       "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    config = (out / "config.json").read_text()
    assert '"architectures": [\n    "ToyDraftModel"\n  ]' in config
    assert "# Toy drafter for tiny-chat" in (out / "README.md").read_text().splitlines()
    drafter = load_exported(out)
    assert type(drafter.config) is ToyConfig
    trained = load_file(str(load_drafter(toy_run / "run").checkpoint / "model.safetensors"))
    assert all(torch.equal(drafter.state_dict()[name], tensor) for name, tensor in trained.items())
