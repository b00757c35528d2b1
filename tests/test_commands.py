"""Every command builds its flags from its config dataclass (dflash.common.options): each
flag's help is its field's docstring with its default, each `Literal` field is a choice that a
bad value meets once, with the list of choices, and the fields a resumed run may change are
the ones declared so."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

import click
import pytest
from click.testing import CliRunner

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import demo.out_of_domain
import demo.run
from dflash.common.options import FLAG, NONE_WORD, SEPARATOR, field_docs, resumable
from dflash.precompute import cli as precompute_cli, regenerate_cli
from dflash.precompute.config import PrecomputeConfig
from dflash.precompute.regenerate import RegenerateConfig
from dflash.shards import cli as shards_cli
from dflash.train import cli as train_cli
from dflash.train.config import RESUMABLE_CHANGES, FitConfig
from dflash.train.evaluate import EvalConfig
from dflash.train.export import ExportConfig

# name -> (the command's words before its flags, the click command they reach, its config class,
# fields that have no flag: set from Python only).
COMMANDS: dict[str, tuple[click.Command, list[str], click.Command, type, set[str]]] = {
    "dflash-precompute": (precompute_cli.main, [], precompute_cli.main, PrecomputeConfig, {"dist_timeout_s"}),
    "dflash-regenerate": (regenerate_cli.main, [], regenerate_cli.main, RegenerateConfig, {"backoff_s"}),
    **{f"dflash-train {name}": (train_cli.main, [name], train_cli.main.commands[name], cls, set())
       for name, cls in (("fit", FitConfig), ("eval", EvalConfig), ("export", ExportConfig))},
    **{f"dflash-shards {name}": (shards_cli.main, [name], shards_cli.main.commands[name], cls, set())
       for name, cls in (("info", shards_cli.CacheConfig), ("show", shards_cli.ShowConfig),
                         ("stats", shards_cli.StatsConfig), ("verify", shards_cli.CacheConfig))},
    "python -m demo.run": (demo.run.main, [], demo.run.main, demo.run.DemoConfig, set()),
    "python -m demo.out_of_domain": (demo.out_of_domain.main, [], demo.out_of_domain.main,
                                     demo.out_of_domain.OutOfDomainConfig, set()),
}
# Parameters that are no config field: the output switch, fit's TOML file and its deprecated
# --block-size (read as --num-drafts), the shared ones.
NOT_FIELDS = {"as_json", "config_file", "block_size", "debug", "version", "help"}
# Required fields of the configs whose choices are checked from Python.
REQUIRED = {PrecomputeConfig: {"target": "t", "data": ["d"], "out": "o"}, ExportConfig: {"run": "r", "out": "o"},
            FitConfig: {"cache": ["c"], "out": "o"}}


def _leaves(cls: type) -> list[tuple[type, dataclasses.Field, Any]]:
    """(owner class, field, resolved type) of every leaf field; a component's fields in its place."""
    hints = typing.get_type_hints(cls)
    found = []
    for spec in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[spec.name]):
            found += _leaves(hints[spec.name])
        else:
            found.append((cls, spec, hints[spec.name]))
    return found


def _expected_help(owner: type, spec: dataclasses.Field) -> str:
    doc = field_docs(owner)[spec.name]
    default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
    if default is dataclasses.MISSING or (default is None and NONE_WORD not in spec.metadata):
        return doc
    if isinstance(default, list) and SEPARATOR in spec.metadata:  # shown as the flag takes it: 0,1,2
        return f"{doc} [{spec.metadata[SEPARATOR].join(map(str, default))}]"
    shown = (spec.metadata[NONE_WORD] if default is None else ("on" if default else "off")
             if isinstance(default, bool) else str(default))
    return f"{doc} [{shown}]"


def _choices(hint: Any) -> tuple[str, ...] | None:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


def _flag(spec: dataclasses.Field) -> str:
    return spec.metadata.get(FLAG) or "--" + spec.name.replace("_", "-")


CHOICE_FIELDS = [(name, owner, spec, _choices(hint)) for name, (_, _, _, cls, _) in COMMANDS.items()
                 for owner, spec, hint in _leaves(cls) if _choices(hint)]


def test_every_command_is_listed():
    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    names = {f"python -m demo.{path.stem}" for path in (Path(__file__).parents[1] / "demo").glob("*.py")
             if "__main__" in path.read_text()}
    for script in scripts:
        command = {"dflash-precompute": precompute_cli.main, "dflash-regenerate": regenerate_cli.main,
                   "dflash-train": train_cli.main, "dflash-shards": shards_cli.main}[script]
        names |= ({f"{script} {sub}" for sub in command.commands} if isinstance(command, click.Group)
                  else {script})
    assert names == set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_each_flag_is_its_field_with_its_docstring_and_default(name):
    _, _, command, cls, no_flag = COMMANDS[name]
    params = {param.name: param for param in command.params}
    assert set(params) - NOT_FIELDS <= {spec.name for _, spec, _ in _leaves(cls)}, "a flag that is no field"
    for owner, spec, hint in _leaves(cls):
        if spec.name in no_flag:
            assert spec.name not in params
            continue
        param = params[spec.name]
        assert field_docs(owner)[spec.name], f"{owner.__name__}.{spec.name} has no docstring"
        if isinstance(param, click.Argument):
            assert param.required
            continue
        assert param.help == _expected_help(owner, spec), spec.name
        assert _flag(spec) in param.opts and param.default in (None, ())  # not given: the field's default
        if _choices(hint):
            assert isinstance(param.type, click.Choice) and tuple(param.type.choices) == _choices(hint)
        if hint is bool:
            assert param.is_flag


@pytest.mark.parametrize("name", COMMANDS)
def test_help_lists_every_flag(name):
    group, words, command, cls, no_flag = COMMANDS[name]
    result = CliRunner().invoke(group, [*words, "--help"])
    assert result.exit_code == 0, result.output
    for param in command.params:
        if isinstance(param, click.Option) and param.name not in NOT_FIELDS:
            assert param.opts[0] in result.output


@pytest.mark.parametrize("name, owner, spec, choices", CHOICE_FIELDS,
                         ids=[f"{name}:{spec.name}" for name, _, spec, _ in CHOICE_FIELDS])
def test_a_bad_choice_is_refused_once_with_the_choices(name, owner, spec, choices):
    group, words, _, _, _ = COMMANDS[name]
    result = CliRunner().invoke(group, [*words, _flag(spec), "bogus"])
    listed = ", ".join(map(repr, choices))
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{_flag(spec)}': 'bogus' is not one of {listed}." in result.output
    assert result.output.count(listed) == 1 and result.output.count("Error") == 1


@pytest.mark.parametrize("name, owner, spec, choices", CHOICE_FIELDS,
                         ids=[f"{name}:{spec.name}" for name, _, spec, _ in CHOICE_FIELDS])
def test_a_bad_choice_from_python_is_refused_with_the_choices(name, owner, spec, choices):
    with pytest.raises(ValueError) as refused:
        owner(**REQUIRED.get(owner, {}), **{spec.name: "bogus"})
    assert str(refused.value) == f"{_flag(spec)} must be one of {', '.join(choices)}, got 'bogus'"


def test_the_fields_a_resume_may_change():
    # Pinned: stage one stores the other options in the cache's spec, so a change here makes
    # existing caches refuse to resume; stage two compares the others with RUN/config.json.
    assert resumable(PrecomputeConfig) == {"progress", "overwrite", "nproc", "dist_timeout_s", "writer_thread",
                                           "shard_checksum"}
    assert RESUMABLE_CHANGES == resumable(FitConfig) == {
        "checkpoint_every", "keep_checkpoints", "eval_every", "log_every", "wandb", "wandb_project",
        "max_consecutive_skips", "attention", "save_initial", "parallel", "init_from"}
