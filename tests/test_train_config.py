"""train/config.py: TOML then flags, errors that name the field, resume checks on a changed
field, flat keys, and the generated `fit` flags with their docstrings and defaults."""

import dataclasses
import json

import pytest

from dflash.train.config import FitConfig, check_resume, describe_fields, resolve


def test_toml_then_flags(tmp_path):
    path = tmp_path / "fit.toml"
    path.write_text('cache = ["a", "b"]\nout = "run"\nnum-drafts = 7\nlr = 1e-3\ndecay_gamma = "auto"\n')
    config = resolve(path, {"lr": 2e-3, "epochs": None})
    # Paths in the file are relative to the file.
    assert config.cache == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert config.model.num_drafts == 7 and config.optimizer.lr == 2e-3
    assert config.data.epochs == 6 and config.loss.decay_gamma is None


@pytest.mark.parametrize("text,message", [
    ('cache = ["a"]\nout = "r"\nlearning_rate = 1\n', "unknown field"),
    ('cache = ["a"]\nout = "r"\nnum_drafts = 0\n', "num_drafts must be >= 1"),
    ('cache = ["a"]\nout = "r"\ntokens_per_step = 100\n', "multiple of the block's 16 drafter rows"),
    ('cache = ["a"]\nout = "r"\nloss = "mse"\n', "loss must be one of"),
    ('out = "r"\n', "cache"),
    ('cache = [\n', "not valid TOML"),
])
def test_config_errors_name_the_field(tmp_path, text, message):
    path = tmp_path / "fit.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        resolve(path, {})


def test_resume_refuses_a_changed_numeric_field(tmp_path):
    saved = FitConfig.from_dict({"cache": ["c"], "out": str(tmp_path), "lr": 1e-3})
    (tmp_path / "config.json").write_text(json.dumps(saved.to_dict()))
    check_resume(tmp_path / "config.json", FitConfig.from_dict({"cache": ["c"], "out": str(tmp_path), "lr": 1e-3,
                                                              "eval_every": 7}))
    with pytest.raises(ValueError, match="lr = 0.001"):
        check_resume(tmp_path / "config.json", FitConfig.from_dict({"cache": ["c"], "out": str(tmp_path), "lr": 2e-3}))


def test_resume_ignores_the_markov_rank_of_a_dflash_run_only(tmp_path):
    base = {"cache": ["c"], "out": str(tmp_path)}
    (tmp_path / "config.json").write_text(json.dumps(FitConfig.from_dict(base).to_dict()))
    check_resume(tmp_path / "config.json", FitConfig.from_dict({**base, "markov_rank": 64}))  # no Markov head
    (tmp_path / "config.json").write_text(json.dumps(FitConfig.from_dict({**base, "drafter": "dspark"}).to_dict()))
    with pytest.raises(ValueError, match="markov_rank = 256"):
        check_resume(tmp_path / "config.json", FitConfig.from_dict({**base, "drafter": "dspark", "markov_rank": 64}))
    with pytest.raises(ValueError, match="drafter = 'dspark'"):
        check_resume(tmp_path / "config.json", FitConfig.from_dict(base))


def test_toml_section_tables_and_top_level_keys_mix(tmp_path):
    path = tmp_path / "fit.toml"
    path.write_text('cache = ["a"]\nout = "run"\nepochs = 2\n[optimizer]\nlr = 1e-3\n'
                    '[gating]\nspike-factor = 4.0\n')
    config = resolve(path, {})
    assert config.optimizer.lr == 1e-3 and config.gating.spike_factor == 4.0 and config.data.epochs == 2
    path.write_text('cache = ["a"]\nout = "run"\n[optimizer]\nspike_factor = 4.0\n')
    with pytest.raises(ValueError, match=r"\[optimizer\] has no field 'spike_factor'"):
        resolve(path, {})


@pytest.mark.parametrize("name,value", [("loss", "mse"), ("device", "tpu"), ("dtype", "float16"),
                                        ("attention", "sdpa"), ("parallel", "zero3")])
def test_every_choice_field_is_checked(name, value):
    with pytest.raises(ValueError, match=f"{name} must be one of"):
        FitConfig.from_dict({"cache": ["c"], "out": "r", name: value})


def test_flat_keys_round_trip_and_stay_unique():
    config = FitConfig.from_dict({"cache": ["c"], "out": "r", "lr": 1e-3, "spike_factor": 4.0,
                                  "decay_gamma": "auto", "mask_token_id": 7})
    flat = config.to_dict()
    assert flat["lr"] == 1e-3 and flat["spike_factor"] == 4.0 and flat["decay_gamma"] is None
    assert config.model.mask_token_id == 7 and FitConfig.from_dict(flat) == config
    assert set(flat) == {info.name for info in describe_fields()}


def test_every_flag_has_the_field_docstring_and_default():
    from click.testing import CliRunner

    from dflash.train.cli import main

    options = {param.opts[0]: param for param in main.commands["fit"].params}
    for info in describe_fields():
        assert info.doc, f"{info.name} has no docstring"
        option = options["--" + info.name.replace("_", "-")]
        assert option.name == info.name and option.help.startswith(info.doc)
        if info.default not in (dataclasses.MISSING, None):
            shown = ("on" if info.default else "off") if isinstance(info.default, bool) else str(info.default)
            assert option.help.endswith(f"[{shown}]"), option.help
    assert options["--lr"].help.endswith("[0.0006]") and options["--decay-gamma"].help.endswith("[auto]")
    result = CliRunner().invoke(main, ["fit", "--help"])
    assert result.exit_code == 0 and "--spike-factor" in result.output and "--max-consecutive-skips" in result.output



@pytest.mark.parametrize("args,message", [
    (["--decay-gamma", "banana"], "'banana' is neither 'auto' nor a number"),
    (["--loss", "mse"], "'mse' is not one of"),
    (["--lr", "fast"], "'fast' is not a valid float"),
])
def test_bad_flag_values_are_usage_errors(tmp_path, args, message):
    from click.testing import CliRunner

    from dflash.train.cli import main

    result = CliRunner().invoke(main, ["fit", "--cache", str(tmp_path), "--out", str(tmp_path / "r"), *args])
    assert result.exit_code == 2 and message in result.output, result.output

def test_resume_accepts_a_config_json_without_newer_fields(tmp_path):
    config = FitConfig.from_dict({"cache": ["c"], "out": str(tmp_path)})
    old = {k: v for k, v in config.to_dict().items() if k != "spike_ema_decay"}  # written before it existed
    (tmp_path / "config.json").write_text(json.dumps(old))
    check_resume(tmp_path / "config.json", config)
    with pytest.raises(ValueError, match="spike_ema_decay = 0.99"):
        check_resume(tmp_path / "config.json", FitConfig.from_dict({**old, "spike_ema_decay": 0.9}))
