"""The block named once: `num_drafts` (drafts per verify, vLLM's num_speculative_tokens) and the
verify size (num_drafts + 1); each kind converts them to its drafter rows (train/drafters/).

Run folders written before the rename hold `block_size`, the kind's rows per block (a DFlash
block of 4 drafted 3 tokens, a DSpark block of 4 drafted 4): they load, resume and evaluate
as the same drafter. The old folders are built here from a fresh run by writing its JSON
exactly as the code before the rename wrote it (`block_size` in RUN/config.json, the
checkpoint's state.json and RUN/drafter_config.json, no `kind`).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from dflash.testing.builders import fit_cache, tiny_fit_config
from dflash.train.checkpoint import latest_checkpoint, list_checkpoints
from dflash.train.cli import main
from dflash.train.config import FitConfig
from dflash.train.evaluate import EvalConfig, run_eval
from dflash.train.export import export_run, write_export
from dflash.train.fit import fit
from dflash.train.loading import load_drafter, load_exported
from dflash.train.run_folder import eval_results_path

# kind: (drafts, the rows its block had under `block_size`, its fit options)
KINDS = {"dflash": (3, 4, {}), "dspark": (4, 4, {"markov_rank": 8})}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return fit_cache(tmp_path_factory)


def written_before_the_rename(run: Path, rows: int) -> None:
    """Rewrite a run folder's JSON as the code before the rename wrote it."""
    for path in [run / "config.json", *(c / "state.json" for c in list_checkpoints(run))]:
        data = json.loads(path.read_text())
        config = data["config"] if "config" in data else data
        del config["num_drafts"]
        config["block_size"] = rows
        path.write_text(json.dumps(data, indent=1, sort_keys=path.name == "state.json"))
    drafter = json.loads((run / "drafter_config.json").read_text())
    del drafter["num_drafts"]
    drafter.pop("kind", None)
    drafter["block_size"] = rows
    (run / "drafter_config.json").write_text(json.dumps(drafter, indent=1))


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_folder_written_before_the_rename_loads_resumes_and_evaluates(cache_dir, tmp_path, kind):
    drafts, rows, options = KINDS[kind]
    run = tmp_path / "run"
    values = dict(drafter=kind, num_drafts=drafts, max_steps=6, checkpoint_every=3, **options)
    fit(tiny_fit_config(cache_dir, run, **values))
    straight = load_file(str(latest_checkpoint(run) / "model.safetensors"))
    shutil.rmtree(latest_checkpoint(run))  # the run as it stood at step 3
    written_before_the_rename(run, rows)
    assert '"num_drafts"' not in (run / "drafter_config.json").read_text()

    loaded = load_drafter(run)
    assert loaded.step == 3 and loaded.drafter.config.num_drafts == drafts
    assert type(loaded.drafter).__name__ == ("DSparkDrafter" if kind == "dspark" else "DFlashDrafter")
    figures = run_eval(EvalConfig(run=str(run), cache=str(cache_dir), save=False), show_progress=False)
    assert (figures["num_drafts"], figures["verify_size"]) == (drafts, drafts + 1)
    assert len(figures["per_position_acceptance"]) == drafts

    fit(tiny_fit_config(cache_dir, run, **values))  # resumes it (check_resume reads the old config.json)
    resumed = load_file(str(latest_checkpoint(run) / "model.safetensors"))
    assert latest_checkpoint(run).name == "step-00000006"
    assert all(torch.equal(resumed[name], tensor) for name, tensor in straight.items())
    assert json.loads((latest_checkpoint(run) / "state.json").read_text())["config"]["num_drafts"] == drafts


@pytest.mark.parametrize("kind", KINDS)
def test_block_size_is_a_deprecated_alias_of_the_kinds_rows(kind, capsys):
    drafts, rows, _ = KINDS[kind]
    config = FitConfig.from_dict({"cache": ["c"], "out": "o", "drafter": kind, "block_size": rows})
    assert config.model.num_drafts == drafts and config.block_rows == rows
    assert f"for --drafter {kind} it means --num-drafts {drafts}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="disagree"):
        FitConfig.from_dict({"cache": ["c"], "out": "o", "drafter": kind, "block_size": rows, "num_drafts": 9})


def test_fit_takes_block_size_on_the_command_line(cache_dir, tmp_path):
    result = CliRunner().invoke(main, ["fit", "--cache", str(cache_dir), "--out", str(tmp_path / "run"),
                                       "--block-size", "4", "--num-layers", "1", "--tokens-per-step", "96",
                                       "--max-steps", "1", "--eval-every", "0", "--no-wandb"])
    assert result.exit_code == 0, result.output
    assert "it means --num-drafts 3" in result.output
    assert json.loads((tmp_path / "run" / "config.json").read_text())["num_drafts"] == 3


@pytest.mark.parametrize("kind", KINDS)
def test_an_export_keeps_vllms_block_size(cache_dir, tmp_path, kind):
    """The exported config.json's `block_size` is vLLM's field (the block's rows), as before
    the rename; a folder exported then loads as the same drafts per verify."""
    drafts, rows, options = KINDS[kind]
    run = tmp_path / "run"
    fit(tiny_fit_config(cache_dir, run, drafter=kind, num_drafts=drafts, max_steps=1, **options))
    out = write_export(load_drafter(run).drafter, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["block_size"] == config["dflash_config"]["block_size"] == rows
    assert load_exported(out).config.num_drafts == drafts


@pytest.mark.parametrize("key", ["verify_size", "block_size"])
def test_the_model_card_reads_an_eval_saved_before_the_rename(cache_dir, tmp_path, key):
    """RUN/eval/<checkpoint>.json written before the rename states the verify size as
    `block_size` (eval's offline figures: the anchor and its drafts); the export's card reads
    either key as the verify size."""
    run = tmp_path / "run"
    fit(tiny_fit_config(cache_dir, run, num_drafts=3, max_steps=1))
    saved = eval_results_path(run, latest_checkpoint(run))
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps({"acceptance_length": 2.5, "num_anchors": 40, "num_sequences": 2, key: 4,
                                 "replay_acceptance_length": 2.25, "num_replay_verifications": 8}))
    card = (export_run(run, tmp_path / "export", dtype="float32") / "README.md").read_text()
    assert "| 2.500 |" in card
    assert "Verify size 4 (3 drafts and the target's bonus token)" in card
