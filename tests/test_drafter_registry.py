"""The drafter registry (train/drafters/): one place a kind plugs in.

Outside train/drafters/ no code in train/ asks which kind it holds: a grep for the kinds'
names finds only the lines on the allow-list below. Comments and docstrings are worded
kind-neutrally too (they point to train/drafters/); the one allowed prose line cites a paper.
"""

import re
from pathlib import Path

import click.testing
import pytest

from dflash.common.options import choices, field_info
from dflash.testing.builders import drafter_config
from dflash.train import drafters
from dflash.train.config import FitConfig, ModelConfig
from dflash.train.model import DrafterConfig

TRAIN = Path(__file__).resolve().parents[1] / "train"
# A kind's name as code would ask for it: the names (any case), `markov`, `selector`, `lattice`, and "dflash" as a
# string (not the package name `dflash.` nor the word DFlash in prose).
KIND_WORDS = re.compile(r"dspark|markov|dflash2|selector|lilicorr|lattice|[\"']dflash[\"']", re.IGNORECASE)
# (file, the line's text that may hold a kind word, why).
ALLOWED = {
    ("config.py", 'wandb_project: str = field(default="dflash", metadata=BOOKKEEPING)'): "the W&B project name",
    ("logging.py", 'wandb_project: str = "dflash", resume_step: int = 0):'): "the W&B project name",
    ("suites.py", "does (the DFlash paper's tables; DSpark's Table 1 runs the same suites at temperature 1)."):
        "prose citing a paper's table",
}


def kind_lines() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(TRAIN.rglob("*.py")):
        if "drafters" in path.relative_to(TRAIN).parts:
            continue
        for line in path.read_text().splitlines():
            if KIND_WORDS.search(line):
                found.add((str(path.relative_to(TRAIN)), line.strip()))
    return found


def test_no_code_outside_the_registry_asks_which_kind_it_holds():
    assert kind_lines() == set(ALLOWED)


def test_the_grep_finds_a_kind_test():
    assert KIND_WORDS.search('if model.drafter == "dflash":') and KIND_WORDS.search("config.markov_rank")
    assert KIND_WORDS.search("is_dspark(model)") and not KIND_WORDS.search("from dflash.train import fit")


def test_get_names_the_known_kinds():
    assert drafters.get("dspark").name == "dspark"
    with pytest.raises(ValueError, match="unknown drafter kind 'eagle3'; known kinds: dflash, dspark"):
        drafters.get("eagle3")


def test_drafter_choices_come_from_the_registry():
    info = field_info(ModelConfig, next(f for f in ModelConfig.__dataclass_fields__.values() if f.name == "drafter"))
    assert choices(info)[:2] == ("dflash", "dspark")
    with pytest.raises(ValueError, match="--drafter must be one of dflash, dspark"):
        FitConfig.from_dict({"cache": ["c"], "out": "o", "drafter": "eagle3"})
    from dflash.train.cli import main

    result = click.testing.CliRunner().invoke(main, ["fit", "--cache", "c", "--out", "o", "--drafter", "eagle3"])
    assert result.exit_code == 2 and "'eagle3' is not one of 'dflash', 'dspark'" in result.output


@pytest.mark.parametrize("kind, rows, drafts", [("dflash", 16, 15), ("dspark", 16, 16)])
def test_each_kind_converts_its_block(kind, rows, drafts):
    assert drafters.get(kind).num_drafts(rows) == drafts
    assert drafters.get(kind).block_rows(drafts) == rows


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_config_dict_names_its_kind_or_is_read_as_before(kind):
    fields = {"markov_rank": 4} if kind == "dspark" else {}
    config = drafter_config(kind, num_hidden_layers=1, vocab_size=40, target_layer_ids=[1], num_target_layers=3,
                            mask_token_id=0, **fields)
    data = config.to_dict()
    assert data.get("kind") == (None if kind == "dflash" else kind)  # a DFlash config is written as before
    assert drafters.config_from_dict(data) == config and drafters.of_config(config).name == kind
    assert type(drafters.config_from_dict({k: v for k, v in data.items() if k != "kind"})) is type(config)
    assert isinstance(config, DrafterConfig)


def test_register_refuses_a_taken_name():
    class Other(drafters.DrafterKind):
        name = "dspark"

    with pytest.raises(ValueError, match="'dspark' is registered already"):
        drafters.register(Other())
