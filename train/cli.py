"""`dflash-train`: the click group. `fit` is here; `eval` and `export` register themselves
from train/evaluate.py and train/export.py through `main.command()` / `main.add_command`.

Commands stay thin: build the config, call one plain function (which tests call directly).
`fit`'s options are generated from FitConfig's fields (train/config.py): one flag per field,
its help the field's docstring and default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

import click

from dflash.shards.commands import DflashGroup, version_option
from dflash.train.config import FieldInfo, describe_fields, resolve

# Fields that name folders: click checks that they are not files.
_FOLDER_FIELDS = ("cache", "out")


@click.group(cls=DflashGroup)
@version_option
def main() -> None:
    """Train, evaluate and export a DFlash drafter from dflash caches.

    A user error (a bad flag, file or input) prints one `Error: ...` line; --debug (before
    the command) or DFLASH_DEBUG=1 shows its traceback.
    """


class _OrNone(click.ParamType):
    """A number, or the field's none word (kept as the word: `resolve` maps it to None after
    the config file, so that the flag overrides a value given there)."""

    def __init__(self, base: type, word: str) -> None:
        self.base, self.word = base, word
        self.name = f"{base.__name__}|{word}"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == self.word or isinstance(value, self.base):
            return value
        try:
            return self.base(value)
        except ValueError:
            self.fail(f"{value!r} is neither {self.word!r} nor a number", param, ctx)


def _option(info: FieldInfo):
    """The click option of one config field: --name-with-dashes, typed, help with default."""
    flag = "--" + info.name.replace("_", "-")
    kind = info.type
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `X | None`: the X
        kind = next(a for a in args if a is not type(None))
    kwargs: dict[str, Any] = {"default": None, "help": _help(info)}
    if kind is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", info.name, **kwargs)
    if info.name in _FOLDER_FIELDS:
        kwargs["type"] = click.Path(file_okay=False)
    elif typing.get_origin(kind) is Literal:
        kwargs["type"] = click.Choice(typing.get_args(kind))
    elif info.none_word is not None:
        kwargs["type"] = _OrNone(kind, info.none_word)
    elif typing.get_origin(kind) is list:
        kwargs["type"] = typing.get_args(kind)[0]
    else:
        kwargs["type"] = kind
    if typing.get_origin(kind) is list:
        kwargs["multiple"] = True
        kwargs["default"] = ()
    return click.option(flag, info.name, **kwargs)


def _help(info: FieldInfo) -> str:
    default = info.default
    if default is dataclasses.MISSING or (default is None and info.none_word is None):
        shown = ""
    elif default is None:
        shown = info.none_word
    elif isinstance(default, bool):
        shown = "on" if default else "off"
    else:
        shown = str(default)
    return f"{info.doc} [{shown}]" if shown else info.doc


def _fit_options(command):
    """Decorate `command` with --cache, --out, --config, then one option per config field."""
    config_file = click.option(
        "--config", "config_file", type=click.Path(dir_okay=False, exists=True),
        help="TOML file with the same fields (top level, or in [section] tables); flags override it.")
    fields = [_option(info) for info in describe_fields()]
    for decorate in reversed([*fields[:2], config_file, *fields[2:]]):  # the first decorator is listed last
        command = decorate(command)
    return command


@main.command()
@_fit_options
def fit(config_file, **options) -> None:
    """Train the drafter from one or more caches (resumes when RUN holds a checkpoint)."""
    from dflash.train.fit import SpikeStop, fit as run_fit

    options = {name: list(value) or None if isinstance(value, tuple) else value
               for name, value in options.items()}
    # ValueError (config, inputs, a busy run folder) and OSError (a full disk, a file-size
    # limit) are one-line errors (DflashGroup); so is a stop on persistent spikes.
    config = resolve(config_file, options)
    try:
        result = run_fit(config)
    except SpikeStop as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"done: {result.step}/{result.total_steps} steps; checkpoint {result.checkpoint}")


# eval and export live with their code (train/evaluate.py, train/export.py).
from dflash.train.evaluate import eval_command  # noqa: E402
from dflash.train.export import export_command  # noqa: E402

main.add_command(eval_command)
main.add_command(export_command)
