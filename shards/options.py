"""Command-line options generated from config dataclasses, for every dflash command.

Each config field's default and one-line docstring exist once, in its dataclass; the flag
(`--name-with-dashes`), its type and its help (`docstring [default]`) are derived here.
Generated options default to None, meaning "not given": the command keeps only the given
ones (`given`), so the dataclass default applies, and `fit` can layer its TOML file under
the flags. A field whose metadata holds `NONE_WORD` also accepts that word for None.

Docstrings are read from the class's source with `ast` (`field_docs`), so this works
wherever the .py file is installed; a bytecode-only install gets empty help texts.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import click

# A field whose metadata holds NONE_WORD also accepts that word (flag or TOML) for None.
NONE_WORD = "none_word"


@dataclass(frozen=True)
class FieldInfo:
    """One leaf field as the command line shows it."""

    name: str
    type: Any
    """The resolved annotation (`int`, `float | None`, `Literal[...]`, `list[str]`, ...)."""
    default: Any
    """The default value (dataclasses.MISSING when the field is required)."""
    doc: str
    """The field's docstring on one line ('' when the source cannot be read)."""
    none_word: str | None
    """The word that stands for None (flag or TOML), if any."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring on one line}: the string literal under each annotated field."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def field_info(cls: type, spec: dataclasses.Field) -> FieldInfo:
    """The FieldInfo of one field `spec` of dataclass `cls`."""
    default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
    return FieldInfo(name=spec.name, type=typing.get_type_hints(cls)[spec.name], default=default,
                     doc=field_docs(cls).get(spec.name, ""), none_word=spec.metadata.get(NONE_WORD))


def describe(cls: type, *, skip: Iterable[str] = ()) -> list[FieldInfo]:
    """Every init field of dataclass `cls` in declaration order, less `skip`."""
    skipped = set(skip)
    return [field_info(cls, spec) for spec in dataclasses.fields(cls) if spec.init and spec.name not in skipped]


class OrNone(click.ParamType):
    """A number, or the field's none word (kept as the word: the caller maps it to None after
    any config file, so that the flag overrides a value given there)."""

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


def help_text(info: FieldInfo) -> str:
    """The field's docstring with its default in brackets (none shown for a None default
    without a none word)."""
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


def option(info: FieldInfo, *, folder: bool = False, **overrides: Any) -> Callable:
    """The click option of one config field: --name-with-dashes, typed, help with default.

    folder: the value names a folder (click refuses a file). overrides: click.option
    keywords that replace the derived ones (e.g. `required`, `callback`, `type`)."""
    flag = "--" + info.name.replace("_", "-")
    kind = info.type
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `X | None`: the X
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    kwargs: dict[str, Any] = {"default": None, "help": help_text(info)}
    if kind is bool:
        kwargs.update(overrides)
        return click.option(f"{flag}/--no-{flag[2:]}", info.name, **kwargs)
    if folder:
        kwargs["type"] = click.Path(file_okay=False)
    elif typing.get_origin(kind) is Literal:
        kwargs["type"] = click.Choice(typing.get_args(kind))
    elif info.none_word is not None:
        kwargs["type"] = OrNone(kind, info.none_word)
    elif typing.get_origin(kind) is list:
        kwargs["type"] = typing.get_args(kind)[0]
    else:
        kwargs["type"] = kind
    if typing.get_origin(kind) is list:
        kwargs["multiple"] = True
        kwargs["default"] = ()
    kwargs.update(overrides)
    return click.option(flag, info.name, **kwargs)


def config_options(cls: type, *, skip: Iterable[str] = (), folders: Iterable[str] = (),
                   overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Callable:
    """A decorator adding one option per field of `cls` (less `skip`), in field order.

    folders: fields whose value is a folder. overrides: {field: click.option keywords}."""
    folder_names, extra = set(folders), dict(overrides or {})
    decorators = [option(info, folder=info.name in folder_names, **extra.get(info.name, {}))
                  for info in describe(cls, skip=skip)]

    def decorate(command: Callable) -> Callable:
        for add in reversed(decorators):  # the first decorator applied is listed last
            command = add(command)
        return command

    return decorate


def given(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options the user gave: None (not given) and empty `multiple` tuples dropped,
    other tuples as lists."""
    return {name: list(value) if isinstance(value, tuple) else value
            for name, value in options.items() if value is not None and value != ()}


__all__ = ["FieldInfo", "NONE_WORD", "OrNone", "config_options", "describe", "field_docs", "field_info",
           "given", "help_text", "option"]
