"""What fit, eval and export refuse, each with an error that says what to do: a target that
is not a causal LM, caches and targets of another target, empty results, flags without effect,
two writers on a run, an --out that is not a run, relative paths; and that every user error is
one `Error:` line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash.common.fingerprint import target_fingerprint
from dflash.shards.target_info import TargetInfo
from dflash.testing.builders import tiny_causal_lm, tiny_fit_config
from dflash.train.cli import main as train_main
from dflash.train.config import FitConfig, load_toml, resolve
from dflash.train.identity import caches_fingerprint, check_same_target
from dflash.train.runlock import RunLock, check_out_folder

FIT = ["--num-layers", "1", "--num-drafts", "3", "--anchors-per-seq", "6", "--epochs", "1",
       "--max-steps", "2", "--tokens-per-step", "96", "--eval-every", "0", "--no-wandb"]


def first_line(output: str) -> str:
    return output.strip().splitlines()[0] if output.strip() else ""


def fingerprinted_copy(cache: Path, dest: Path, fingerprint: str | None) -> Path:
    """A copy of `cache` whose target.json records `fingerprint`."""
    shutil.copytree(cache, dest)
    info = TargetInfo.load(dest / "target")
    info.fingerprint = fingerprint
    info.save(dest / "target")
    return dest


def assert_one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    line = first_line(result.output)
    assert line.startswith("Error: "), result.output
    for needle in needles:
        assert needle in line, line


# --------------------------------------------------------------------------- 1. causal LM


def test_a_model_without_a_causal_lm_head_is_refused(tmp_path):
    from transformers import BertConfig, Qwen3Config

    from dflash.precompute.target import check_target_dir

    bert = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64)
    bert.architectures = ["BertModel"]
    bert.save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match=r"BertModel.*causal language model \(\*ForCausalLM\) is required"):
        check_target_dir(tmp_path / "bert", trust_remote_code=False)
    qwen = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, intermediate_size=64)
    qwen.architectures = ["Qwen3ForCausalLM"]
    qwen.save_pretrained(tmp_path / "qwen")
    assert check_target_dir(tmp_path / "qwen", trust_remote_code=False).model_type == "qwen3"


# --------------------------------------------------------------------------- 2. target identity


def test_fingerprint_tells_weights_apart_and_is_stable(tmp_path):
    a = tiny_causal_lm("qwen3")
    a.save_pretrained(tmp_path / "a")
    a.save_pretrained(tmp_path / "a2", max_shard_size="20KB")  # the same weights over several files
    b = tiny_causal_lm("qwen3")
    import torch

    with torch.no_grad():
        b.model.layers[3].mlp.down_proj.weight.add_(1e-3)
    b.save_pretrained(tmp_path / "b")
    fa, fa2, fb = (target_fingerprint(tmp_path / n) for n in ("a", "a2", "b"))
    assert fa is not None and fa.startswith("st-sample-v1:")
    assert fa == fa2 and fa == target_fingerprint(tmp_path / "a")
    assert fb != fa
    assert target_fingerprint(tmp_path) is None  # no safetensors file: no fingerprint


def test_check_same_target():
    assert check_same_target("--cache c", "x", "x", allow=False) is None
    with pytest.raises(ValueError, match="another target.*--allow-target-mismatch"):
        check_same_target("--cache c", "x", "y", allow=False)
    assert "evaluated anyway" in check_same_target("--cache c", "x", "y", allow=True)
    assert "not checked" in check_same_target("--cache c", None, "y", allow=False)


def test_fit_refuses_caches_of_two_targets(synthetic_training_cache, tmp_path):
    a = fingerprinted_copy(synthetic_training_cache, tmp_path / "a", "st-sample-v1:" + "a" * 64)
    b = fingerprinted_copy(synthetic_training_cache, tmp_path / "b", "st-sample-v1:" + "b" * 64)
    result = CliRunner().invoke(train_main, ["fit", "--cache", str(a), "--cache", str(b),
                                             "--out", str(tmp_path / "run"), *FIT])
    assert_one_line_error(result, "another target", str(b))
    assert not (tmp_path / "run").exists()  # failed before its first step: no folder left
    from dflash.shards import open_cache

    assert caches_fingerprint([open_cache(a), open_cache(a)])[0] == "st-sample-v1:" + "a" * 64
    fingerprint, warnings = caches_fingerprint([open_cache(a), open_cache(synthetic_training_cache)])
    assert fingerprint.endswith("a" * 64) and len(warnings) == 1 and "cannot be checked" in warnings[0]


def test_eval_refuses_a_cache_of_another_target(synthetic_training_cache, tmp_path):
    a = fingerprinted_copy(synthetic_training_cache, tmp_path / "a", "st-sample-v1:" + "a" * 64)
    b = fingerprinted_copy(synthetic_training_cache, tmp_path / "b", "st-sample-v1:" + "b" * 64)
    runner = CliRunner()
    result = runner.invoke(train_main, ["fit", "--cache", str(a), "--out", str(tmp_path / "run"), *FIT,
                                        "--eval-fraction", "0.25"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "run.json").read_text())["target_fingerprint"].endswith("a" * 64)
    result = runner.invoke(train_main, ["eval", "--run", str(tmp_path / "run"), "--cache", str(b), "--json"])
    assert_one_line_error(result, "another target", "--allow-target-mismatch")
    result = runner.invoke(train_main, ["eval", "--run", str(tmp_path / "run"), "--cache", str(b),
                                        "--allow-target-mismatch", "--no-save", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.strip().splitlines()[-1])
    assert len(figures["warnings"]) == 1 and "another target" in figures["warnings"][0]
    assert "warning: --cache" in result.output
    result = runner.invoke(train_main, ["eval", "--run", str(tmp_path / "run"), "--no-save", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["warnings"] == []


# --------------------------------------------------------------------------- 4. flags without effect


def test_eval_target_and_prompts_need_online(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("{}\n")
    result = CliRunner().invoke(train_main, ["eval", "--run", str(tmp_path), "--prompts", str(prompts)])
    assert_one_line_error(result, "--online")


def test_eval_every_without_held_out_set_warns(synthetic_training_cache, tmp_path):
    result = CliRunner().invoke(train_main, [
        "fit", "--cache", str(synthetic_training_cache), "--out", str(tmp_path / "run"), *FIT[:-3],
        "--eval-every", "1", "--eval-fraction", "0", "--no-wandb"])
    assert result.exit_code == 0, result.output
    assert "--eval-every 1 has no effect: --eval-fraction is 0" in result.stderr


# --------------------------------------------------------------------------- 5. one writer


def test_a_second_fit_on_a_held_run_folder_exits_naming_the_holder(synthetic_training_cache, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run):
        holder = json.loads((run / ".lock").read_text())
        assert holder["pid"] == os.getpid()
        result = CliRunner().invoke(train_main, ["fit", "--cache", str(synthetic_training_cache),
                                                 "--out", str(run), *FIT])
        assert_one_line_error(result, f"pid {os.getpid()}", "in use")
        assert not (run / "config.json").exists()
    with RunLock(run):  # released: taken again
        pass


# --------------------------------------------------------------------------- 6. --out


def test_out_must_be_empty_absent_or_a_run(synthetic_training_cache, tmp_path):
    runner = CliRunner()
    cache_copy = shutil.copytree(synthetic_training_cache, tmp_path / "cache")
    before = sorted(p.name for p in cache_copy.iterdir())
    result = runner.invoke(train_main, ["fit", "--cache", str(synthetic_training_cache), "--out", str(cache_copy),
                                        *FIT])
    assert_one_line_error(result, "not a dflash run folder", "a dflash cache")
    assert sorted(p.name for p in cache_copy.iterdir()) == before
    model = tmp_path / "model"
    tiny_causal_lm("qwen3").save_pretrained(model)
    result = runner.invoke(train_main, ["fit", "--cache", str(synthetic_training_cache), "--out", str(model), *FIT])
    assert_one_line_error(result, "a model folder")
    assert not (model / "anchor_index.npz").exists()
    assert check_out_folder(tmp_path / "absent") is False
    (tmp_path / "empty").mkdir()
    assert check_out_folder(tmp_path / "empty") is True
    # A failure before the first step removes the folder fit created.
    result = runner.invoke(train_main, ["fit", "--cache", str(tmp_path / "no-cache"), "--out",
                                        str(tmp_path / "new" / "run"), *FIT])
    assert result.exit_code == 1 and not (tmp_path / "new" / "run").exists()


# --------------------------------------------------------------------------- 7. paths


def test_paths_are_stored_resolved_and_toml_paths_are_relative_to_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = FitConfig.from_dict({"cache": ["cq"], "out": "run"})
    assert config.cache == [str(tmp_path / "cq")] and config.out == str(tmp_path / "run")
    (tmp_path / "conf").mkdir()
    toml = tmp_path / "conf" / "fit.toml"
    toml.write_text('cache = ["../data/cq"]\nout = "runs/a"\n[model]\nnum_layers = 2\n')
    monkeypatch.chdir(tmp_path / "conf" / "..")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    values = load_toml(toml)
    assert values["cache"] == [str(tmp_path / "data" / "cq")]
    assert values["out"] == str(tmp_path / "conf" / "runs" / "a")
    config = resolve(toml, {"out": "here"})
    assert config.out == str(tmp_path / "elsewhere" / "here") and config.model.num_layers == 2


# --------------------------------------------------------------------------- 8. one-line errors


def test_fit_user_errors_are_one_line(synthetic_training_cache, tmp_path):
    runner = CliRunner()
    cache = str(synthetic_training_cache)
    result = runner.invoke(train_main, ["fit", "--cache", str(tmp_path / "missing"), "--out", str(tmp_path / "r1"),
                                        *FIT])
    assert_one_line_error(result, "missing")
    toml = tmp_path / "bad.toml"
    toml.write_text('num_layers = "one"\n')
    result = runner.invoke(train_main, ["fit", "--config", str(toml), "--cache", cache, "--out", str(tmp_path / "r2")])
    assert_one_line_error(result, str(toml), "num_layers must be an integer", "'one'")
    result = runner.invoke(train_main, ["fit", "--cache", cache, "--out", str(tmp_path / "r3"), *FIT])
    assert result.exit_code == 0, result.output
    result = runner.invoke(train_main, ["fit", "--cache", cache, "--out", str(tmp_path / "r3"), *FIT, "--lr", "1e-3"])
    assert_one_line_error(result, "lr", "new --out")
    import torch

    if not torch.cuda.is_available():
        result = runner.invoke(train_main, ["fit", "--cache", cache, "--out", str(tmp_path / "r4"), *FIT,
                                            "--device", "cuda"])
        assert_one_line_error(result, "--device cuda")
    # --debug (or DFLASH_DEBUG=1) lets the traceback through.
    result = runner.invoke(train_main, ["--debug", "fit", "--config", str(toml), "--cache", cache,
                                        "--out", str(tmp_path / "r5")])
    assert isinstance(result.exception, ValueError)


def test_resume_says_from_which_checkpoint(synthetic_training_cache, tmp_path):
    runner = CliRunner()
    args = ["fit", "--cache", str(synthetic_training_cache), "--out", str(tmp_path / "run"), *FIT]
    assert runner.invoke(train_main, args).exit_code == 0
    result = runner.invoke(train_main, args)  # the run is complete: it resumes at its last step
    assert result.exit_code == 0, result.output
    assert "resuming from" in result.output and "(step 2)" in result.output


# --------------------------------------------------------------------------- 9. export, Ctrl-C


def test_export_card_and_unwritable_out(synthetic_training_cache, tmp_path):
    from dflash.train.export import _evaluation_lines

    runner = CliRunner()
    run = tmp_path / "run"
    result = runner.invoke(train_main, ["fit", "--cache", str(synthetic_training_cache), "--out", str(run),
                                        *FIT[:-3], "--eval-every", "1", "--eval-fraction", "0.25", "--no-wandb"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(train_main, ["export", "--run", str(run), "--out", str(tmp_path / "export")])
    assert result.exit_code == 0, result.output
    card = (tmp_path / "export" / "README.md").read_text()
    assert "Shape: 1 Qwen3-style layer," in card
    assert "Not measured" not in card and "Held-out tau during training" in card and "at step 2" in card
    lines = "\n".join(_evaluation_lines({"acceptance_length": 1.5, "num_anchors": 6, "num_sequences": 1}))
    assert "6 anchors of 1 sequence |" in lines
    result = runner.invoke(train_main, ["export", "--run", str(run), "--out", "/proc/x"])
    assert_one_line_error(result, "/proc")


def test_ctrl_c_says_where_to_resume(synthetic_training_cache, tmp_path, monkeypatch, capsys):
    from dflash.train import fit as fit_module

    log_step = fit_module._log_step

    def interrupt_at_step_3(run, record, always_print):
        log_step(run, record, always_print)
        if run.step == 3:  # after step 3's line, before its checkpoint's write starts
            raise KeyboardInterrupt

    monkeypatch.setattr(fit_module, "_log_step", interrupt_at_step_3)
    config = tiny_fit_config(synthetic_training_cache, tmp_path / "run", anchors_per_seq=6, epochs=1,
                             max_steps=4, checkpoint_every=1)
    with pytest.raises(KeyboardInterrupt):
        fit_module.fit(config)
    err = capsys.readouterr().err
    assert "interrupted after step 3" in err and "resume from step-00000002" in err
    assert (tmp_path / "run" / "config.json").exists()  # a run that made steps is kept
    with RunLock(tmp_path / "run"):  # and its lock was released
        pass
